"""The CPU device model (device.py), the calibration record it reads (costs.py, fits.py), the
kernels it prices (kernels.py), how a step's parts combine on shared cores (step.py,
pipeline.py) and the engine's buffers replayed (engine_buffers.py). Imports nothing (see
devices/__init__.py).
"""
