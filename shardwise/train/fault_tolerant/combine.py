"""The gradient of a step across replica groups, the same bits whichever groups took part
and whatever the transport.

[Note: a deterministic combine across groups] A ring all-reduce sums in an order set by the
ring's size and each member's place in it, and under fault tolerance both change with every
quorum: the same surviving gradients could sum to different bits depending on who else was
in the ring, and no reference run could reproduce a run that lost groups. So each rank
all-gathers its flat fp32 gradients (its shard of its group's model, the same layout in
every group) from the same rank of every group in the quorum, then adds the participants'
contributions in replica-group order and divides by their number. The result depends only on
the set of participants: a run that replays the same membership gets the same weights,
bitwise (bench/elastic_soak.py checks it). The price is bandwidth: each rank receives
``groups - 1`` copies of its gradient shard where a ring would move two; replica groups are
few (each one is a whole sharded model), and the shard is ``1 / dp_shard`` of the model.

Every contribution starts with a two-element header, ``(group id, taking part)``, so the
order is by group id, not by the transport's ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

__all__ = ["flatten_grads", "combine_contributions", "write_grads", "combine_gradients"]

_HEADER = 2


def flatten_grads(params: Sequence[torch.Tensor], group: int, taking_part: bool,
                  device: torch.device) -> torch.Tensor:
    """This rank's contribution: the header, then every parameter's gradient in fp32 (zeros
    for a parameter without one, so every group's layout is the same)."""
    sizes = [p.numel() for p in params]
    flat = torch.empty(_HEADER + sum(sizes), dtype=torch.float32, device=device)
    flat[0], flat[1] = float(group), float(taking_part)
    offset = _HEADER
    for p, n in zip(params, sizes):
        view = flat[offset: offset + n]
        if p.grad is None:
            view.zero_()
        else:
            view.copy_(p.grad.reshape(-1))
        offset += n
    return flat


def combine_contributions(gathered: Iterable[torch.Tensor],
                          participants: Iterable[int] | None = None
                          ) -> tuple[torch.Tensor, list[int]]:
    """The mean of the participants' gradients, summed in group order.

    Args:
        gathered: every group's contribution (:func:`flatten_grads`), in any order.
        participants: the groups whose gradients count (a replay's script); None: those
            whose header says they take part.

    Returns:
        ``(mean gradient without its header, the participating group ids, ascending)``.

    Raises:
        ValueError: no group takes part, a group appears twice, or a scripted participant
            sent nothing.
    """
    gathered = list(gathered)
    headers = torch.stack([t[:_HEADER] for t in gathered]).tolist()  # one host read
    by_group: dict[int, torch.Tensor] = {}
    taking_part = set()
    for (gid, part), t in zip(headers, gathered):
        gid = int(gid)
        if gid in by_group:
            raise ValueError(f"replica group {gid} contributed twice to one combine")
        by_group[gid] = t
        if part > 0:
            taking_part.add(gid)
    if participants is None:
        ids = sorted(taking_part)
    else:
        ids = sorted(set(participants))
        missing = [g for g in ids if g not in by_group]
        if missing:
            raise ValueError(f"replica groups {missing} take part in this step by the script "
                             f"but only groups {sorted(by_group)} contributed")
    if not ids:
        raise ValueError("no replica group takes part in this step")
    total = by_group[ids[0]][_HEADER:].clone()
    for g in ids[1:]:
        total.add_(by_group[g][_HEADER:])
    total.div_(len(ids))
    return total, ids


def write_grads(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Make ``flat`` (no header) every parameter's gradient, in its own dtype."""
    offset = 0
    for p in params:
        n = p.numel()
        view = flat[offset: offset + n].view(p.shape)
        if p.grad is None:
            p.grad = view.to(p.dtype, copy=True)
        else:
            p.grad.copy_(view)
        offset += n


def combine_gradients(params: Sequence[torch.Tensor], group: int, taking_part: bool,
                      all_gather: Callable[[torch.Tensor], list[torch.Tensor]],
                      participants: Iterable[int] | None = None) -> list[int]:
    """Replace every parameter's gradient by the participants' mean ([Note: a deterministic
    combine across groups]).

    Args:
        params: this rank's trainable parameters (the same list, in the same order, in
            every group).
        group: this rank's replica group id.
        taking_part: whether this group's gradient counts this step.
        all_gather: gathers one tensor from the same rank of every group in the quorum.
        participants: see :func:`combine_contributions`.

    Returns:
        The participating group ids, ascending.
    """
    device = params[0].device if params else torch.device("cpu")
    flat = flatten_grads(params, group, taking_part, device)
    total, ids = combine_contributions(all_gather(flat), participants)
    write_grads(params, total)
    return ids
