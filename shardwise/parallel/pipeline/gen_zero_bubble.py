"""Generators of the zero-bubble schedules of Qi et al. 2024 (ICLR), backward split into I and W.

"Zero Bubble Pipeline Parallelism", P. Qi, X. Wan, G. Huang, M. Lin, ICLR 2024
(arXiv 2401.10241). The input-gradient pass I of stage s depends only on I of stage s+1; the
weight-gradient pass W depends only on I of its own stage, so W can be moved to fill bubbles.

- ZB-H1 (Section 2.1): 1F1B's order with B replaced by I, and each rank's W passes delayed so that
  they fill the tail. Rank r's steady unit is (F_x, I_{x-(p-1-r)}, W_{x-(p-1)}): I lags F by
  1F1B's warm-up, W lags F by p-1 on every rank. Table 2: bubble (p-1)(T_F + T_B - T_W) (their
  T_B is our I), peak activations p M_B, the same as 1F1B.
- ZB-V (Section 6): 2p stages in a V (rank r holds stages r and 2p-1-r), so each micro-batch's
  forward and backward start and end on rank 0. Warm-up fills the V (2p-1 forwards on rank 0),
  then every rank repeats F, I, W on each of its two stages. With T_F = T_B = T_W every rank is
  busy from its first action to its last (zero bubble in the paper's sense), and the peak is
  p M_B (2p half-stage micro-batches), the same as 1F1B.
"""

from __future__ import annotations

from shardwise.parallel.pipeline.actions import Action, Kind

__all__ = ["zb1", "zbv"]

Ranks = list[list[Action]]


def zb1(pp: int, microbatches: int, virtual: int) -> Ranks:
    """ZB-H1: rank r's unit x is ``F_x, I_{x-(p-1-r)}, W_{x-(p-1)}`` (indices in range only)."""
    assert virtual == 1
    ranks = []
    for r in range(pp):
        acts = []
        for x in range(microbatches + pp - 1):
            for kind, mb in ((Kind.F, x), (Kind.I, x - (pp - 1 - r)), (Kind.W, x - (pp - 1))):
                if 0 <= mb < microbatches:
                    acts.append(Action(r, kind, mb))
        ranks.append(acts)
    return ranks


class _Rank:
    """Appends a stage's next F / I / W in micro-batch order; silent once all m are done."""

    def __init__(self, microbatches: int) -> None:
        self.m = microbatches
        self.next: dict[tuple[int, Kind], int] = {}
        self.actions: list[Action] = []

    def add(self, *steps: tuple[int, Kind]) -> None:
        for stage, kind in steps:
            mb = self.next.get((stage, kind), 0)
            if mb < self.m:
                self.actions.append(Action(stage, kind, mb))
                self.next[(stage, kind)] = mb + 1

    def count(self, stage: int, kind: Kind) -> int:
        return self.next.get((stage, kind), 0)


def zbv(pp: int, microbatches: int, virtual: int) -> Ranks:
    """ZB-V over the V placement (``virtual`` must be 2).

    Rank r with stages a = r (going down the V) and b = 2p-1-r (coming back up):

    1. warm-up: 2(p-r)-1 forwards of a, then r pairs (F b, F a): rank 0 has filled the V
       when the first micro-batch comes back to its stage b;
    2. p-r units (F b, I b, W b): the backward starts on the way up;
    3. steady: units (F a, I a, W a, F b, I b, W b) until every forward is done;
    4. cool-down: r pairs (I a, I b) with their W deferred, p-r pairs (I a, W a), then the
       deferred W of b and of a fill the tail.
    """
    assert virtual == 2
    ranks = []
    for r in range(pp):
        a, b = r, 2 * pp - 1 - r
        rk = _Rank(microbatches)
        for _ in range(2 * (pp - r) - 1):
            rk.add((a, Kind.F))
        for _ in range(r):
            rk.add((b, Kind.F), (a, Kind.F))
        for _ in range(pp - r):
            rk.add((b, Kind.F), (b, Kind.I), (b, Kind.W))
        while rk.count(a, Kind.F) < microbatches or rk.count(b, Kind.F) < microbatches:
            rk.add((a, Kind.F), (a, Kind.I), (a, Kind.W), (b, Kind.F), (b, Kind.I), (b, Kind.W))
        for _ in range(r):
            rk.add((a, Kind.I), (b, Kind.I))
        for _ in range(pp - r):
            rk.add((a, Kind.I), (a, Kind.W))
        for stage in (b, a):
            while rk.count(stage, Kind.W) < microbatches:
                rk.add((stage, Kind.I), (stage, Kind.W))
        ranks.append(rk.actions)
    return ranks
