"""Device models: how one device prices the planner's work (the protocol: base.py).

    gpu.py         GpuDevice: datasheet peaks, the fitted matrix-multiply curve, memory
                   bandwidth, alpha-beta links (comm_model.py)
    cpu/           CpuDevice: the calibration's kernels, update and Gloo collectives, the
                   cores' time-sharing and contention, the engine's buffers replayed
    registry.py    device_model(hw): the model of a hardware entry

This package's ``__init__`` imports nothing, so that the hardware catalogue can read the CPU
costs record (cpu/costs.py) without loading the models.
"""
