"""The gradient of a step across replica groups, the same bits whichever groups took part
and whatever the transport.

[Note: a deterministic combine across groups] A ring all-reduce sums in an order set by the
ring's size and each member's place in it, and under fault tolerance both change with every
quorum: the same surviving gradients could sum to different bits depending on who else was
in the ring, and no reference run could reproduce a run that lost groups. So each rank
receives, from every other group in the quorum, that group's flat fp32 gradient over the
part of the model this rank holds (:mod:`~shardwise.train.fault_tolerant.exchange`, in any
two layouts), then adds the participants' contributions in replica-group order and divides
by their number. The result depends only on the set of participants: a run that replays the
same membership gets the same weights, bitwise (bench/elastic_soak.py checks it). The price
is bandwidth: each rank receives ``groups - 1`` copies of its gradient shard where a ring
would move two; replica groups are few (each one is a whole sharded model), and the shard is
``1 / dp_shard`` of the model.

Every contribution starts with a header, ``(group id, taking part, lineage, parameters)``,
so the order is by group id, not by the transport's ranks, then this rank's loss (the step's
loss is the participants' mean, as a run without fault tolerance logs it), then one flag per
parameter: whether it has a gradient. A parameter no participant computed a gradient for (a
module every group's batch skipped) keeps ``grad = None``, as without fault tolerance (no
weight decay, no moment update); one that some participants skipped counts zeros for them.

[Note: lineages] Two groups can commit the same step number apart: with two groups alive,
either is "half of the live groups" to torchft's quorum server, and a group that arrives while
the other is busy may get a quorum of its own (seen at start-up). Both then hold step ``s``
with different weights, and torchft heals only a group whose step is behind, so neither
would heal: the replicas would silently differ. Each group therefore carries a lineage, a
48-bit hash of its whole history of committed steps and their participants (healed along
with the state). A combine whose participants hold different lineages keeps the lineage
held by the most groups (ties: the one of the lowest group id); the others' gradients do not
count, they do not commit, and they step their count back so the next quorum heals them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["flatten_grads", "combine_contributions", "write_grads", "combine_gradients",
           "next_lineage", "Combined"]

_HEADER = 5
_HALF = 1 << 24  # fp32 holds integers below 2**24 exactly: the lineage travels in two halves


def next_lineage(lineage: int, step: int, participants: Iterable[int]) -> int:
    """The lineage after committing ``step`` with ``participants`` ([Note: lineages])."""
    import hashlib

    text = f"{lineage}:{step}:{','.join(map(str, sorted(participants)))}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "big")


@dataclass
class Combined:
    """What a combine decided: the groups whose gradients count (ascending), and whether this
    rank's group is among those that hold the kept lineage."""

    participants: list[int]
    kept: bool = True
    has_grad: list[bool] | None = None
    loss: torch.Tensor | None = None  # the participants' mean of this rank's loss


def flatten_grads(params: Sequence[torch.Tensor], group: int, taking_part: bool,
                  device: torch.device, lineage: int = 0,
                  loss: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's contribution: the header, then every parameter's gradient in fp32 (zeros
    for a parameter without one, so every group's layout is the same)."""
    sizes = [p.numel() for p in params]
    flat = torch.empty(_HEADER + 1 + len(params) + sum(sizes), dtype=torch.float32,
                       device=device)
    flat[:_HEADER] = torch.tensor([float(group), float(taking_part), float(lineage // _HALF),
                                   float(lineage % _HALF), float(len(params))])
    if loss is None:
        flat[_HEADER] = 0.0
    else:
        flat[_HEADER] = loss.detach().float()  # a device copy: no host read
    flat[_HEADER + 1:_HEADER + 1 + len(params)] = torch.tensor(
        [float(p.grad is not None) for p in params])
    offset = _HEADER + 1 + len(params)
    for p, n in zip(params, sizes):
        view = flat[offset: offset + n]
        if p.grad is None:
            view.zero_()
        else:
            view.copy_(p.grad.reshape(-1))
        offset += n
    return flat


def combine_contributions(gathered: Iterable[torch.Tensor],
                          participants: Iterable[int] | None = None, group: int | None = None,
                          n_params: int | None = None
                          ) -> tuple[torch.Tensor | None, Combined]:
    """The mean of the participants' gradients, summed in group order.

    Args:
        gathered: every group's contribution (:func:`flatten_grads`), in any order.
        participants: the groups whose gradients count (a replay's script); None: those
            whose header says they take part and that hold the kept lineage ([Note:
            lineages]).
        group: this rank's group (to say whether it holds the kept lineage).
        n_params: the parameters each contribution holds (default: read from a header).

    Returns:
        ``(mean gradient without its header and flags, or None where this group's lineage
        was not kept; the decision, with which parameters have a gradient)``.

    Raises:
        ValueError: no group takes part, a group appears twice, or a scripted participant
            sent nothing.
    """
    gathered = list(gathered)
    if n_params is None:  # a caller without the parameters: read the count first
        n_params = int(gathered[0][4].item())
    # Headers and gradient flags of every contribution in one host read, before any sum.
    prefix = torch.stack([t[:_HEADER + 1 + n_params] for t in gathered]).tolist()
    by_group: dict[int, torch.Tensor] = {}
    flags: dict[int, list[float]] = {}
    lineage: dict[int, int] = {}
    for row, t in zip(prefix, gathered):
        gid, part, hi, lo = int(row[0]), row[1], row[2], row[3]
        if gid in by_group:
            raise ValueError(f"replica group {gid} contributed twice to one combine")
        by_group[gid], flags[gid] = t, row[_HEADER + 1:]
        if part > 0:
            lineage[gid] = int(hi) * _HALF + int(lo)
    if participants is None:
        counts: dict[int, list[int]] = {}
        for gid in sorted(lineage):
            counts.setdefault(lineage[gid], []).append(gid)
        if not counts:
            raise ValueError("no replica group takes part in this step")
        # Most groups first, then the lineage of the lowest group id.
        ids = max(counts.values(), key=lambda gs: (len(gs), -gs[0]))
    else:
        ids = sorted(set(participants))
        missing = [g for g in ids if g not in by_group]
        if missing:
            raise ValueError(f"replica groups {missing} take part in this step by the script "
                             f"but only groups {sorted(by_group)} contributed")
    if not ids:
        raise ValueError("no replica group takes part in this step")
    decision = Combined(ids, kept=group is None or group in ids or participants is not None)
    if not decision.kept:
        return None, decision
    total = by_group[ids[0]][_HEADER:].clone()
    for g in ids[1:]:
        total.add_(by_group[g][_HEADER:])
    total.div_(len(ids))
    decision.loss = total[0]
    decision.has_grad = [any(flags[g][i] > 0 for g in ids) for i in range(n_params)]
    return total[1 + n_params:], decision


def write_grads(params: Sequence[torch.Tensor], flat: torch.Tensor,
                has_grad: Sequence[bool] | None = None) -> None:
    """Make ``flat`` (no header) every parameter's gradient, in its own dtype; a parameter
    ``has_grad`` says no participant had a gradient for is left (or set) to None."""
    offset = 0
    for i, p in enumerate(params):
        n = p.numel()
        view = flat[offset: offset + n].view(p.shape)
        if has_grad is not None and not has_grad[i]:
            p.grad = None
        elif p.grad is None:
            p.grad = view.to(p.dtype, copy=True)
        else:
            p.grad.copy_(view)
        offset += n


def combine_gradients(params: Sequence[torch.Tensor], group: int, taking_part: bool,
                      all_gather: Callable[[torch.Tensor], list[torch.Tensor]],
                      participants: Iterable[int] | None = None, lineage: int = 0,
                      loss: torch.Tensor | None = None) -> Combined:
    """Replace every parameter's gradient by the participants' mean ([Note: a deterministic
    combine across groups]).

    Args:
        params: this rank's trainable parameters (the same list, in the same order, in
            every group).
        group: this rank's replica group id.
        taking_part: whether this group's gradient counts this step.
        all_gather: every group's contribution over this rank's holding, its own among them
            (:class:`~shardwise.train.fault_tolerant.exchange.GradientExchange`).
        participants: see :func:`combine_contributions`.
        lineage: this group's lineage ([Note: lineages]).
        loss: this rank's loss of the step (its mean over participants comes back).

    Returns:
        The decision; where ``kept`` is False the gradients are left alone (this group must
        not commit).
    """
    device = params[0].device if params else torch.device("cpu")
    flat = flatten_grads(params, group, taking_part, device, lineage, loss)
    total, decision = combine_contributions(all_gather(flat), participants, group,
                                            len(params))
    if total is not None:
        write_grads(params, total, decision.has_grad)
    return decision
