"""Generators of the classic schedules (full backward B): GPipe, 1F1B, interleaved 1F1B, looped BFS.

Each returns, per rank, its compute actions in order; build_schedule() inserts the messages.
Stages are placed looped (stage s on rank s % pp).

- GPipe (Huang et al. 2019): all forwards, then all backwards. Bubble (p-1)/(m+p-1) of the step;
  every rank holds the activations of all m micro-batches at the peak.
- 1F1B (PipeDream-flush, Narayanan et al. 2021): rank r runs p-1-r warm-up forwards, then
  alternates one forward and one backward. Same bubble as GPipe, but rank r holds at most p-r
  micro-batches.
- Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): v stages per rank; micro-batches go
  through in groups of at least p, each group through all chunks of a rank in turn. Bubble
  (p-1)/(v m + p-1) when p divides m; more messages (v times as many).
- Looped BFS (Lamy-Poirier 2022, "Breadth-First Pipeline Parallelism"): v stages per rank,
  every micro-batch through chunk 0, then chunk 1, ...; backwards in reverse chunk order.
"""

from __future__ import annotations

from shardwise.parallel.pipeline.actions import Action, Kind

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "looped_bfs", "microbatch_groups"]

Ranks = list[list[Action]]


def gpipe(pp: int, microbatches: int, virtual: int) -> Ranks:
    """GPipe: forwards of all micro-batches, then their backwards (in the same order)."""
    assert virtual == 1
    return [[Action(r, Kind.F, mb) for mb in range(microbatches)]
            + [Action(r, Kind.B, mb) for mb in range(microbatches)] for r in range(pp)]


def one_f_one_b(pp: int, microbatches: int, virtual: int) -> Ranks:
    """1F1B: rank r's forward x pairs with backward ``x - (p-1-r)`` (warm-up p-1-r forwards)."""
    assert virtual == 1
    ranks = []
    for r in range(pp):
        lag = pp - 1 - r
        acts = []
        for x in range(microbatches + lag):
            if x < microbatches:
                acts.append(Action(r, Kind.F, x))
            if x - lag >= 0:
                acts.append(Action(r, Kind.B, x - lag))
        ranks.append(acts)
    return ranks


def microbatch_groups(pp: int, microbatches: int) -> list[list[int]]:
    """Split micro-batches into ``max(1, m // p)`` consecutive groups of near-equal size.

    Every group has at least p micro-batches when m >= p, so the first chunk's outputs of a
    group are ready before the rank loops back to them (no wait inside a group).
    """
    n = max(1, microbatches // pp)
    base, extra = divmod(microbatches, n)
    groups, start = [], 0
    for g in range(n):
        size = base + (1 if g < extra else 0)
        groups.append(list(range(start, start + size)))
        start += size
    return groups


def interleaved_1f1b(pp: int, microbatches: int, virtual: int) -> Ranks:
    """Interleaved 1F1B over ``virtual`` looped chunks per rank.

    The forward order is, per group of micro-batches, chunk 0 for the group, then chunk 1, ...;
    the backward order is the same with chunks reversed. Rank r warms up with
    ``(v-1) * g + 2 (p-1-r)`` forwards (g = first group size: the last rank must have filled
    every chunk but one before the first backward can come back), then alternates one forward
    and one backward, then drains the backwards.
    """
    groups = microbatch_groups(pp, microbatches)
    fwd = [(c, mb) for g in groups for c in range(virtual) for mb in g]
    bwd = [(c, mb) for g in groups for c in reversed(range(virtual)) for mb in g]
    ranks = []
    for r in range(pp):
        warmup = min(len(fwd), (virtual - 1) * len(groups[0]) + 2 * (pp - 1 - r))
        acts = [Action(c * pp + r, Kind.F, mb) for c, mb in fwd[:warmup]]
        for k in range(len(fwd) - warmup):
            c, mb = fwd[warmup + k]
            acts.append(Action(c * pp + r, Kind.F, mb))
            c, mb = bwd[k]
            acts.append(Action(c * pp + r, Kind.B, mb))
        acts += [Action(c * pp + r, Kind.B, mb) for c, mb in bwd[len(fwd) - warmup:]]
        ranks.append(acts)
    return ranks


def looped_bfs(pp: int, microbatches: int, virtual: int) -> Ranks:
    """Looped BFS: all micro-batches through each local chunk in turn, backwards in reverse."""
    ranks = []
    for r in range(pp):
        acts = [Action(c * pp + r, Kind.F, mb) for c in range(virtual)
                for mb in range(microbatches)]
        acts += [Action(c * pp + r, Kind.B, mb) for c in reversed(range(virtual))
                 for mb in range(microbatches)]
        ranks.append(acts)
    return ranks
