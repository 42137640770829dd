"""Which device model prices a hardware entry.

    dev = device_model(get_hardware("h100"))     # GpuDevice
    dev = device_model(get_hardware("local"))    # CpuDevice (a calibration's [cpu] table)
"""

from __future__ import annotations

from shardwise.planner.devices.cpu.device import CpuDevice
from shardwise.planner.devices.gpu import GpuDevice

__all__ = ["device_model"]


def device_model(hw) -> GpuDevice | CpuDevice:
    """The device model of ``hw``: calibrated CPU ranks (an entry with the calibration's
    CPU costs, ``hw.cpu``) or the roofline of a GPU.

    Args:
        hw: a :class:`~shardwise.planner.hardware.Hardware` entry.

    Returns:
        A device model (the protocol of devices/base.py).
    """
    return CpuDevice(hw) if hw.cpu is not None else GpuDevice(hw)
