"""Device models: how one device prices the planner's work (protocol: base.py; GPUs: gpu.py;
calibrated CPU ranks: cpu/; ``registry.device_model`` picks one). Imports nothing, so that
the hardware catalogue can read the CPU costs record (cpu/costs.py) without the models.
"""
