"""Non-finite losses and gradients, caught before the optimizer step and named.

    report = shardwise.find_nonfinite_grads(model, loss=loss.item())   # every rank, collective
    if report is not None:
        raise NonFiniteError(report.message(step))      # or skip: optimizer.zero_grad()

Each rank checks its own gradients (the shards it holds after a sharded backward, or whole
gradients) with one fused norm per dtype, then the ranks exchange one small record each (the
index of their first non-finite parameter in ``named_parameters()`` order, its kind, and
whether their loss is finite) in a single all-gather. Every rank therefore returns the same
report: the first offending parameter by name over all ranks, the ranks whose shard of it
is bad, and the ranks whose loss is not finite.

With fp16 loss scaling, overflowing gradients are expected and the loss scaler skips the
step by itself (``shardwise.LossScaler``); the trainer applies this check to fp32 / bf16 runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed import comm
from shardwise.distributed.watchdog.diagnosis import compact_ranks

__all__ = ["NonFiniteReport", "NonFiniteError", "find_nonfinite_grads", "POLICIES"]

POLICIES = ("stop", "skip")
_NONE = 2**62  # "no offending parameter on this rank"
_KINDS = {0: "finite", 1: "nan", 2: "inf", 3: "nan and inf"}


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient with the ``stop`` policy; the message names it."""


@dataclass(frozen=True)
class NonFiniteReport:
    """What was not finite, identical on every rank.

    Attributes:
        param: FQN of the first parameter (``named_parameters()`` order) whose gradient holds
            nan or inf on some rank; None when only the loss is not finite.
        param_ranks: ranks whose gradient (shard) of ``param`` is not finite.
        kind: "nan", "inf" or "nan and inf" (in ``param``'s gradient, over those ranks).
        bad_elements: non-finite elements of ``param``'s gradient, summed over ranks.
        loss_ranks: ranks whose local loss is not finite.
        losses: the loss of each rank in ``loss_ranks``.
    """

    param: str | None
    param_ranks: tuple[int, ...]
    kind: str
    bad_elements: int
    loss_ranks: tuple[int, ...]
    losses: tuple[float, ...]

    def message(self, step: int | None = None) -> str:
        """One line: the step, the loss, the first offending parameter and its ranks."""
        at = f" at step {step}" if step is not None else ""
        grad = ""
        if self.param is not None:
            n = self.bad_elements
            grad = (f"{self.param!r} ({self.kind}, {n} element{'s' if n != 1 else ''} on "
                    f"rank{'s' if len(self.param_ranks) > 1 else ''} "
                    f"{compact_ranks(self.param_ranks)})")
        if not self.loss_ranks:
            return f"non-finite gradient{at}: first offending parameter {grad}"
        text = (f"loss is {self.losses[0]} on rank {self.loss_ranks[0]}{at} (ranks with "
                f"non-finite loss: {list(self.loss_ranks)})")
        return text + (f"; first non-finite gradient: {grad}" if grad else "")


def _local_first_bad(params: list[tuple[str, torch.Tensor]]) -> tuple[int, int, int]:
    """(index of the first parameter with a non-finite gradient, kind code, bad elements)."""
    idx = [i for i, (_, p) in enumerate(params) if p.grad is not None and p.grad.numel()]
    if not idx:
        return _NONE, 0, 0
    grads = [params[i][1].grad for i in idx]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for j, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(j)
    first = None
    for members in by_dtype.values():
        # inf and nan both make the norm non-finite: one fused kernel and one host read per
        # dtype (this path runs only once a step's norm or loss is known to be non-finite).
        norms = torch.stack(torch._foreach_norm([grads[j] for j in members],
                                                dtype=torch.float32))
        bad = (~torch.isfinite(norms)).nonzero().cpu()
        if bad.numel():
            j = members[int(bad[0])]
            first = j if first is None else min(first, j)
    if first is None:
        return _NONE, 0, 0
    g = grads[first]
    nan, inf = bool(torch.isnan(g).any()), bool(torch.isinf(g).any())
    return idx[first], int(nan) + 2 * int(inf), int((~torch.isfinite(g)).sum())


def find_nonfinite_grads(model: nn.Module, loss: float | None = None,
                         group: dist.ProcessGroup | None = None) -> NonFiniteReport | None:
    """Find the first parameter whose gradient holds nan or inf, over all ranks.

    Collective over ``group`` (every rank must call it; one small all-gather) when a process
    group is initialised; a plain local check otherwise.

    Args:
        model: the (sharded or plain) model; names as ``named_parameters()`` gives them,
            which must list the same parameters in the same order on every rank.
        loss: this rank's loss for the step (None: not checked).
        group: the ranks that agree (default: the whole world).

    Returns:
        None when every gradient and loss is finite, else the same
        :class:`NonFiniteReport` on every rank.
    """
    params = list(model.named_parameters())
    index, kind, count = _local_first_bad(params)
    loss_bad = int(loss is not None and not math.isfinite(loss))
    device = comm.group_device(group)  # [Note: device check]
    mine = torch.tensor([index, kind, count, loss_bad], dtype=torch.int64, device=device)
    loss_t = torch.tensor([math.nan if loss is None else loss], dtype=torch.float64,
                          device=device)
    n = comm.group_size(group)
    if n > 1:
        table = torch.empty(n * 4, dtype=torch.int64, device=device)
        comm.all_gather_into_tensor(table, mine, group, label="nonfinite.check")
        table = table.view(n, 4).cpu()
        losses = torch.empty(n, dtype=torch.float64, device=device)
        if bool(table[:, 3].any()):  # only then: the losses, for the message
            comm.all_gather_into_tensor(losses, loss_t, group, label="nonfinite.losses")
        losses = losses.cpu()
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    else:
        table, losses, ranks = mine.view(1, 4).cpu(), loss_t.cpu(), [0]
    first = int(table[:, 0].min())
    loss_at = [i for i in range(n) if table[i, 3]]
    loss_ranks = tuple(ranks[i] for i in loss_at)
    loss_values = tuple(float(losses[i]) for i in loss_at)
    if first == _NONE and not loss_ranks:
        return None
    if first == _NONE:
        return NonFiniteReport(None, (), "finite", 0, loss_ranks, loss_values)
    holders = [i for i in range(n) if int(table[i, 0]) == first]
    code = 0
    for i in holders:
        code |= int(table[i, 1])
    return NonFiniteReport(params[first][0], tuple(ranks[i] for i in holders), _KINDS[code],
                           int(sum(int(table[i, 2]) for i in holders)), loss_ranks,
                           loss_values)
