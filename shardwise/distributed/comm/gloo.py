"""How the Gloo backend runs the engine's all-gather and reduce-scatter without temporaries.

Used by :mod:`shardwise.distributed.comm` (see its [Note: all-gather on Gloo] and [Note:
reduce-scatter on Gloo]); these are only the mechanics, comm counts and labels the calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gather_by_sends", "SumAfterAllToAll", "AllDone"]


class AllDone:
    """One handle for several point-to-point works."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait()
        self.works = []
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def gather_by_sends(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool):
    """[Note: all-gather on Gloo] ``shard`` straight to every peer, each peer's straight into
    its row of ``output``."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    rows = output.view(n, -1)
    rows[me].copy_(shard.reshape(-1))
    ops = []
    for r in range(n):
        if r != me:
            peer = dist.get_global_rank(group, r) if group is not None else r
            ops.append(dist.P2POp(dist.isend, shard, peer, group))
            ops.append(dist.P2POp(dist.irecv, rows[r], peer, group))
    handle = AllDone(dist.batch_isend_irecv(ops))
    if async_op:
        return handle
    handle.wait()
    return None


class SumAfterAllToAll:
    """Work handle of a reduce-scatter done as all-to-all + local sum (see below)."""

    def __init__(self, work, received: torch.Tensor, output: torch.Tensor, n: int) -> None:
        self.work, self.received, self.output, self.n = work, received, output, n

    def wait(self, timeout=None) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            torch.sum(self.received.view(self.n, -1), dim=0, out=self.output.view(-1))
            self.received = None
        return True

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()
