"""Closed forms of the named schedules, which the registry (schedules.py) carries with each:
the bubble the literature publishes, the bubble in seconds and the peak in-flight
micro-batches the planner ranks layouts by.

[Note: published bubbles] Under the same assumptions as the simulator's unit costs: every
stage costs F = 1, B = 2 (split: I = W = 1), messages are free, and the bubble is idle
rank-time / (p x step time) (see simulate.py). p = pp ranks, m = micro-batches, v = stages
per rank.

- GPipe, 1F1B: (p-1)/(m+p-1). Each rank idles (p-1)(F+B) (Huang et al. 2019; Narayanan et al.
  2021).
- Interleaved 1F1B, looped BFS: (p-1)/(v m + p-1), m >= p (Narayanan et al. 2021: bubble
  (p-1)(F+B)/v of a whole-rank F+B; our F, B are per stage, 1/v of a rank).
- ZB-H1: (p-1)/(3m+p-1), m >= p. Qi et al. 2024 (ICLR, arXiv 2401.10241), Table 2: bubble
  (p-1)(T_F + T_B - T_W) with T_B the input-gradient pass; rank 0 starts first and ends last,
  so this is every rank's idle time: (p-1)(1 + 1 - 1) = p-1 out of a step of 3m + p-1.
- ZB-V: (p-1)/(6m+p-1), m >= 2p-1. Qi et al. 2024, Section 6: with T_F = T_B = T_W, ZB-V has
  zero bubble in the paper's sense (each rank busy from its first action to its last); the
  ranks start p-1 apart (the first forward must cross p-1 stages to reach the last rank), so
  each idles p-1 out of a step of 2 x 3m + p-1.
- DualPipeV: (p-1)/(3m+p-1), m >= 2p. DeepSeek's DualPipe README (table "Pipeline Bubbles and
  Memory Usage Comparison", row DualPipeV): bubble (PP/2-1)(F&B + B - 3W) with PP = 2p
  stages, B a full backward chunk and F&B a forward and a backward chunk issued together. Our
  executor runs them one after the other, so F&B = F + B = 3: each rank idles
  (p-1)(3 + 2 - 3) = 2(p-1) out of a step of 6m + 2(p-1).

[Note: pipeline closed forms] The planner prices tens of thousands of layouts, too many to
simulate each, so it ranks them with closed forms in seconds. With per-rank costs ``f``
(forward of one micro-batch over a rank's layers), ``b`` (its backward), ``w`` (the weight-
gradient part of ``b``) and ``i = b - w``, they are read off the simulator's results for
equal stage costs and ``m >= 2p``; the looped ones and ZB-H1 are exact there, the V-shaped
two close approximations (tests/test_pp_simulate.py checks each against ``simulate``):

================  =====================================  ================================
schedule          bubble (step - busy time)              peak micro-batches of activations
================  =====================================  ================================
gpipe             (p - 1)(f + b)                         m
1f1b              (p - 1)(f + b)                         min(m, p)
interleaved_1f1b  (p - 1)(f + b) / v                     min(m, p) + (p - 1) / v
looped_bfs        (p - 1)(f + b) / v                     m
zb1 (ZB-H1)       (p - 1) max(f, i, f + i - w)           min(m, p)
zbv (ZB-V)        (p - 1) max(f, i, f + i - w) / 2       p
dualpipev         (p - 1) max(f, (f + i) / 2)            p + 1/2
================  =====================================  ================================
"""

from __future__ import annotations

from fractions import Fraction

__all__ = ["reference_bubble", "one_pass_bubble", "looped_bubble", "zero_bubble",
           "dualpipev_bubble"]


def one_pass_bubble(p: int, v: int, m: int, f: float, b: float, w: float) -> float:
    """GPipe's and 1F1B's bubble seconds ([Note: pipeline closed forms])."""
    return (p - 1) * (f + b)


def looped_bubble(p: int, v: int, m: int, f: float, b: float, w: float) -> float:
    """Bubble seconds of ``v`` looped stages per rank (interleaved 1F1B, looped BFS)."""
    return (p - 1) * (f + b) / v


def zero_bubble(p: int, v: int, m: int, f: float, b: float, w: float) -> float:
    """ZB-H1's bubble seconds (the input-gradient pass ``i = b - w`` fills it), halved by
    ZB-V's two stages per rank."""
    i = b - w
    return (p - 1) * max(f, i, f + i - w) / v


def dualpipev_bubble(p: int, v: int, m: int, f: float, b: float, w: float) -> float:
    """DualPipeV's bubble seconds (forward and backward chunks run one after the other)."""
    i = b - w
    return (p - 1) * max(f, (f + i) / 2)


def reference_bubble(name: str, pp: int, microbatches: int,
                     virtual: int) -> tuple[str, Fraction] | None:
    """The published bubble of a named schedule under F=1, B=2, I=W=1 and free messages
    ([Note: published bubbles]).

    Args:
        name: schedule name; pp, microbatches, virtual: its sizes (virtual already resolved).

    Returns:
        ``(formula text, value)``, or None where no closed form applies (e.g. m < p).
    """
    p, m, v = pp, microbatches, virtual
    if name in ("gpipe", "1f1b"):
        return "(p-1)/(m+p-1)", Fraction(p - 1, m + p - 1)
    if name in ("interleaved_1f1b", "looped_bfs") and m >= p:
        return "(p-1)/(v m+p-1)", Fraction(p - 1, v * m + p - 1)
    if name == "zb1" and m >= p:
        return "(p-1)/(3m+p-1) [Qi et al. 2024, ZB-H1]", Fraction(p - 1, 3 * m + p - 1)
    if name == "zbv" and m >= 2 * p - 1:
        return "(p-1)/(6m+p-1) [Qi et al. 2024, ZB-V]", Fraction(p - 1, 6 * m + p - 1)
    if name == "dualpipev" and m >= 2 * p:
        return "(p-1)/(3m+p-1) [DualPipe README, F&B=F+B]", Fraction(p - 1, 3 * m + p - 1)
    return None
