"""Token dispatch and combine for expert parallelism: counts first, then an all-to-all of
uneven splits, the local experts, and the mirror all-to-all back.

[Note: expert dispatch] An MoE layer hands its experts the ``M`` assignment rows of its
``N`` tokens sorted by expert, with the count per expert (``experts(x_sorted, counts)``,
see shardwise/models/moe.py). Under expert parallelism the ``E`` experts are split into
``ep`` contiguous blocks of ``E / ep``, block ``j`` on ep rank ``j``, so the rows for rank
``j`` are one contiguous run of ``x_sorted``:

1. counts: an all-to-all of the ``(ep, E / ep)`` count matrix (``int64``) tells every rank
   how many rows each source sends for each of its local experts (one host read of the
   split sizes per layer and forward, the only one);
2. dispatch: ``all_to_all_single`` of the rows with those uneven splits; the received rows
   are grouped by source, then by local expert, and a stable permutation regroups them by
   local expert, then source (each expert's rows contiguous, sources in rank order);
3. the local experts run on their rows (``E / ep`` experts: no rank holds them all);
4. combine: the inverse permutation and the mirror all-to-all return every row to the rank
   and position it came from, so the caller sees ``experts(x_sorted, counts)``'s contract
   unchanged: one output row per input row, same order.

The backward is the same exchange mirrored (:class:`AllToAll`'s backward is the all-to-all
with the splits swapped; the permutations' backward is exact, each row moved once), so the
gradient of an expert's weights on its owner sums the contributions of every ep rank's
tokens, and the gradient reaching each source row is exactly the single-process one.

[Note: dispatch bytes] Per MoE layer and micro-batch, with ``s_r`` the rows rank ``r``
sends to other ranks and ``q_r`` the rows it receives from them (its own rows never leave
it), ``C`` features of ``b`` bytes: the forward moves ``(s_r + q_r) * C * b`` bytes out of
rank ``r`` (dispatch ``s_r``, combine ``q_r``) and as many in, the backward the same again,
and the counts exchange ``(ep - 1) * E / ep * 8`` bytes each way.
:func:`dispatch_bytes` computes it from the per-rank counts; ``comm_stats`` counts the
collectives under the labels ``ep_counts``, ``ep_dispatch``, ``ep_combine``,
``ep_dispatch_grad`` and ``ep_combine_grad``.

[Note: an idle expert rank] A rank whose experts receive no row this forward computes on
zero rows, and an experts forward may then return a tensor that does not depend on them
(``expert_ffn`` keeps only its weights in the graph). Autograd would then never reach the
dispatch's backward on that rank while its peers wait in theirs: a collective mismatch.
Adding the (empty) rows' sum keeps the dispatch in the graph, so every rank runs both
backward all-to-alls in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardwise.distributed import comm
from shardwise.distributed.placement import Axis

__all__ = ["AllToAll", "ExpertGroup", "dispatch_compute_combine", "dispatch_bytes",
           "EP_LABELS"]

EP_LABELS = ("ep_counts", "ep_dispatch", "ep_combine", "ep_dispatch_grad", "ep_combine_grad")
"""The label suffixes the expert-parallel collectives are counted under."""


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of dim-0 rows with uneven splits; the backward sends the
    gradient back along the same paths (the splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group,  # noqa: ANN001
                label: str, back_label: str) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.back_label = send, recv, group, back_label
        out = x.new_empty((sum(recv), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), recv, send, group, label=label)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001 - autograd ctx
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        comm.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, ctx.group,
                               label=ctx.back_label)
        return out, None, None, None, None, None


@dataclass(frozen=True)
class ExpertGroup:
    """The experts of one MoE layer spread over the ``ep`` ranks.

    Attributes:
        ep: the expert-parallel axis (rank ``j`` holds experts ``[j * E / ep, (j + 1) * E /
            ep)``).
        num_experts: ``E``, experts of the whole layer.
        label: prefix of the collectives' labels (the experts module's name).
    """

    ep: Axis
    num_experts: int
    label: str

    @property
    def num_local(self) -> int:
        """Experts on each rank (``E / ep``)."""
        return self.num_experts // self.ep.size

    @property
    def first(self) -> int:
        """Index of this rank's first expert."""
        return self.ep.index * self.num_local


def _exchange_counts(counts: torch.Tensor, g: ExpertGroup
                     ) -> tuple[list[int], list[int], torch.Tensor]:
    """(rows sent to each rank, rows received from each, ``(ep, E / ep)`` received counts
    per source and local expert) from this rank's ``(E,)`` counts."""
    n, local = g.ep.size, g.num_local
    received = torch.empty(n * local, dtype=torch.int64, device=counts.device)
    comm.all_to_all_single(received, counts.to(torch.int64).contiguous(), group=g.ep.group,
                           label=f"{g.label}.ep_counts")
    received = received.view(n, local)  # (source, local expert)
    sizes = torch.cat([counts.view(n, local).sum(1), received.sum(1)]).tolist()  # one read
    return sizes[:n], sizes[n:], received


def _regroup(received: torch.Tensor) -> torch.Tensor | None:
    """The permutation taking rows grouped (source, expert) to (expert, source), or None
    when they already are (one rank, or one local expert)."""
    n, local = received.shape
    if n == 1 or local == 1:
        return None
    segments = torch.arange(n * local, device=received.device)
    seg = torch.repeat_interleave(segments, received.reshape(-1))  # (R,) segment of each row
    key = (seg % local) * n + seg // local  # expert-major order
    return torch.sort(key, stable=True).indices


def dispatch_compute_combine(x: torch.Tensor, counts: torch.Tensor, g: ExpertGroup,
                             compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                             ) -> torch.Tensor:
    """Dispatch the sorted rows to the ranks holding their experts, run ``compute`` there,
    and bring the results back ([Note: expert dispatch]). Collective over ``g.ep``.

    Args:
        x: ``(M, C)`` rows sorted by (global) expert.
        counts: ``(E,)`` int64 rows per expert, summing to ``M``.
        g: the layer's expert group.
        compute: ``compute(rows, local_counts)``: ``(R, C)`` rows sorted by local expert and
            ``(E / ep,)`` counts -> ``(R, C')`` outputs in the same order.

    Returns:
        ``(M, C')``: the output of each row of ``x``, in ``x``'s order.
    """
    if counts.numel() != g.num_experts:
        raise ValueError(f"{g.label}: expected counts for {g.num_experts} experts, got "
                         f"{counts.numel()}")
    send, recv, received = _exchange_counts(counts, g)
    group, label = g.ep.group, g.label
    rows = AllToAll.apply(x, send, recv, group, f"{label}.ep_dispatch",
                          f"{label}.ep_dispatch_grad")  # (R, C) by source, then expert
    perm = _regroup(received)
    if perm is not None:
        rows = rows[perm]  # (R, C) by expert, then source
    out = compute(rows, received.sum(0))
    if rows.shape[0] == 0:  # [Note: an idle expert rank]
        out = out + rows.sum()
    if perm is not None:
        out = out[torch.argsort(perm)]  # back to (source, expert)
    return AllToAll.apply(out, recv, send, group, f"{label}.ep_combine",
                          f"{label}.ep_combine_grad")  # (M, C') in x's order


def dispatch_bytes(counts: torch.Tensor, row_bytes: int) -> list[tuple[int, int]]:
    """Bytes each rank sends and receives for the tokens of one MoE layer's forward plus
    backward ([Note: dispatch bytes]), from the counts every rank routed.

    Args:
        counts: ``(ep, E)``: row ``r`` holds the assignments rank ``r`` kept per expert (a
            rank's ``counts`` argument of the experts).
        row_bytes: bytes of one row (``dim * element size``).

    Returns:
        ``[(sent, received)]`` per ep rank (the counts exchange excluded: it is
        ``(ep - 1) * E / ep * 8`` bytes each way per forward).
    """
    n, e = counts.shape
    to = counts.view(n, n, e // n).sum(-1).to(torch.int64)  # (source, destination) rows
    off = to - torch.diag(torch.diag(to))
    sent, received = off.sum(1), off.sum(0)
    return [(int(2 * (s + q)) * row_bytes, int(2 * (s + q)) * row_bytes)
            for s, q in zip(sent.tolist(), received.tolist())]
