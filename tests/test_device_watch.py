"""Hang detection for GPU collectives ([Note: watchdog on NCCL]), exercised on the CPU.

No GPU here: the NCCL path is driven with fake completion probes (what ``work.is_completed``
or a CUDA event's ``query`` would answer). A collective whose probe never turns true is
named once it is older than the timeout; completed ones are dropped in issue order; CPU
tensors are never tracked (the host waits for them itself).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from shardwise.distributed.device_watch import DeviceWatch, probe_for
from shardwise.distributed.watchdog.rank import Watchdog
from shardwise.distributed.watchdog.config import WatchdogConfig

OP = ("0", 7, "all_reduce", "clip_grad_norm", torch.Size([]), torch.float32)


def test_completed_collectives_are_dropped_in_issue_order():
    watch = DeviceWatch()
    done = {"a": False}
    watch.add(("0", 1, "all_gather", "u1", None, None), lambda: True)
    watch.add(("0", 2, "all_gather", "u2", None, None), lambda: done["a"])
    watch.add(("0", 3, "all_gather", "u3", None, None), lambda: True)
    op, age = watch.oldest()
    assert op[1] == 2 and age >= 0 and len(watch) == 2  # u3 waits behind u2
    done["a"] = True
    assert watch.oldest() is None and len(watch) == 0


def test_a_probe_that_raises_counts_as_not_completed():
    watch = DeviceWatch()

    def broken():
        raise RuntimeError("NCCL communicator was aborted")

    watch.add(OP, broken)
    assert watch.oldest()[0] == OP


def test_cpu_tensors_get_no_probe():
    assert probe_for(None, torch.ones(2)) is None and probe_for(None, None) is None


def test_the_watchdog_names_a_gpu_collective_that_never_completes():
    store = dist.HashStore()
    wd = Watchdog(store, rank=0, world_size=1, config=WatchdogConfig(timeout_s=0.2))
    wd.tracker.device.add(OP, lambda: False)
    assert wd._check_blocked() is None  # not yet older than the timeout
    time.sleep(0.2 + wd.config.poll + 0.05)
    kind, detail = wd._check_blocked()
    assert kind == "timeout"
    assert detail.startswith("all_reduce 'clip_grad_norm' float32[] (seq 7 of group 0) has not "
                             "completed on the GPU"), detail
