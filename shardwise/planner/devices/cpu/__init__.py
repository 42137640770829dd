"""The CPU device model (device.py) and the calibration record it reads (costs.py, fits.py):

    costs.py           CpuCosts: the calibration's kernel, update and collective fits
    fits.py            Fit, Kernel, Crowd and the least squares they come from
    kernels.py         a layer's and the head's kernels, the update, the engine's copies
    step.py            how a step's parts combine on shared cores
    pipeline.py        a pipeline replayed on cores that slow each other
    engine_buffers.py  the engine's gathered parameters and buffers, replayed
    device.py          CpuDevice

Imports nothing (see devices/__init__.py).
"""
