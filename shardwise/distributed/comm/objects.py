"""Object collectives and barriers, counted and labelled like the tensor ones in ``comm``.

Every collective shardwise issues goes through :mod:`shardwise.distributed.comm` or this
module, so the watchdog sees it and ``comm_stats`` counts it (a test fails on any direct
``torch.distributed`` collective elsewhere). Object collectives pickle Python values; their
bytes are counted as the pickled size this rank sends. On NCCL groups torch moves the
pickled bytes through CUDA tensors on the current device, so call ``torch.cuda.set_device``
first (``shardwise.distributed.init`` does); host values that many ranks exchange often
belong on a dedicated Gloo group instead (the checkpoint manager keeps one).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch.distributed as dist

from shardwise.distributed import comm

__all__ = ["barrier", "all_gather_object", "broadcast_object"]


def _pickled(obj: Any) -> int:
    try:
        return len(pickle.dumps(obj))
    except Exception:  # noqa: BLE001 - only for the byte count; torch pickles it anyway
        return 0


def barrier(group=None, *, label: str = "") -> None:
    """Wait until every rank of ``group`` arrives (no-op for one rank), counted."""
    comm._RECORDER.record("barrier", group, label, 0, 0)
    if comm.group_size(group) > 1:
        comm._issue("barrier", group, label, None, False, dist.barrier, group=group)


def all_gather_object(obj: Any, group=None, *, label: str = "") -> list[Any]:
    """Every rank's ``obj``, indexed by rank in ``group`` (``[obj]`` for one rank)."""
    n = comm.group_size(group)
    size = _pickled(obj)
    comm._RECORDER.record("all_gather_object", group, label, (n - 1) * size, 0)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    comm._issue("all_gather_object", group, label, None, False, dist.all_gather_object, out,
                obj, group=group)
    return out


def broadcast_object(obj: Any, src: int, group=None, *, label: str = "") -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group``."""
    n = comm.group_size(group)
    is_src = not dist.is_initialized() or dist.get_rank() == src
    size = _pickled(obj) if is_src else 0
    comm._RECORDER.record("broadcast_object", group, label, (n - 1) * size if is_src else 0, 0)
    if n == 1:
        return obj
    box = [obj if is_src else None]
    comm._issue("broadcast_object", group, label, None, False, dist.broadcast_object_list, box,
                src=src, group=group)
    return box[0]
