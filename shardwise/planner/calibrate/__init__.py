"""Calibration: measure the local machine as a device, and correct a device from measured
steps.

    shardwise plan --hardware local --calibrate        # measure, write the calibration file
    hw, err = calibrate(measurements, get_hardware("h100"))  # fit constants to measured steps

local.py writes the ``local`` entry from the micro-benchmarks of kernels.py (a CPU rank's
kernels, update, contention), gloo.py (its Gloo collectives) and blocks.py (composed
blocks); refit.py refits a device to measured steps with fit.py's optimiser.

[Note: calibration] ``measure_local`` runs short micro-benchmarks: matrix multiplies of
growing size as the trainer runs them (``F.linear`` forward and backward at linear shapes;
achieved FLOP/s by size, fitted to the efficiency curve of hardware.py), a large copy
(memory bandwidth), and all-reduces and all-gathers on real Gloo ranks for each group size
and several message sizes (latency and bandwidth fitted to the alpha-beta model of
comm_model.py through the byte formulas of ``shardwise.distributed.comm.byte_counts``), then the
CPU rank's kernels, update and collectives of [Note: CPU kernels] (kernels.py, gloo.py),
with a world beyond the cores its smaller groups crowded ([Note: crowded collectives]), and
the composed blocks, whole and tensor-parallel (blocks.py), whose factors are priced once
the fits are known. The result is written as a hardware-catalogue entry named ``local``
(so every later prediction reads it like any device), with the raw measurements beside it.

:func:`calibrate` is the self-correcting half: given steps measured on some device (step
time, and optionally the seconds the data-parallel collectives took), it refits the device's
constants (``matmul_max``, ``memory_efficiency``, ``intra_efficiency``,
``inter_efficiency``) so the cost model reproduces them, using the same optimiser that
fitted the catalogue on published runs (fit.py), along the combinations of constants the
measurements determine (two steps of the same mix of work fit one common speed, not each
part's).
"""

from shardwise.planner.calibrate.local import (LocalMeasurements, fit_alpha_beta,
                                               fit_matmul_curve, measure_collectives,
                                               measure_local, usable_cores, write_calibration)
from shardwise.planner.calibrate.refit import StepMeasurement, calibrate, constant

__all__ = ["StepMeasurement", "calibrate", "constant", "measure_local", "write_calibration",
           "fit_matmul_curve", "fit_alpha_beta", "usable_cores", "measure_collectives",
           "LocalMeasurements"]
