"""The MoE router: scores, top-k selection with the balancing bias, and the sort by expert.

[Note: routing]
For ``N`` tokens and ``E`` experts the router computes fp32 logits ``x @ gate.T`` (N, E) and
scores: ``softmax`` over the experts (Mixtral) or a per-expert ``sigmoid`` (DeepSeek-V3).
Each token picks the ``top_k`` experts with the largest ``score + expert_bias``: the bias
(the auxiliary-loss-free balancing of DeepSeek-V3) only *selects*; the weights that scale
the experts' outputs are the unbiased scores of the chosen experts, optionally divided by
their sum (``router_norm_topk``) and multiplied by ``router_scale``. Balance statistics use
the scores normalised per token (softmax as is; sigmoid divided by its row sum).

[Note: assignment order and capacity]
The ``N * top_k`` (token, expert) assignments are laid out slot-major: index
``j = slot * N + token``, where ``slot`` is the rank of the choice (0: the token's first
choice) and ``token`` the position in the flattened ``(batch, seq)`` order. A stable sort by
expert then lists each expert's assignments first choices first, and within a slot in token
order. That is the priority order of capacity mode: an expert keeps its first
``capacity = ceil(capacity_factor * N * top_k / E)`` assignments and drops the rest, so
every first choice is served before any second choice (GShard's rule), and among equals the
earlier token wins. A dropped assignment contributes nothing (the token keeps its other
experts and the residual path); the kept weights are not renormalised. Dropless routing
(no capacity) keeps every assignment. The whole computation is a few tensor ops on N * top_k
integers: no per-token Python, deterministic on every device.

With ``groups > 1`` the ``N`` tokens are ``groups`` equal, consecutive groups (the
micro-batches of that many data-parallel ranks, concatenated along the batch) and the
capacity applies per group: ``ceil(capacity_factor * (N / groups) * top_k / E)`` per expert
and group, each group's assignments in the same priority order. A single process that
routes the global batch this way drops exactly the assignments the data-parallel ranks
drop, each routing its own micro-batch (the reference of the expert-parallel parity tests).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.layers import linear

__all__ = ["Router", "RouterOutput", "Dispatch", "sort_by_expert", "expert_capacity"]


@dataclass
class RouterOutput:
    """What the router decides for ``N`` tokens.

    Attributes:
        logits: ``(N, E)`` fp32 router logits (the z-loss reads them).
        probs: ``(N, E)`` fp32 scores normalised to sum to 1 per token (the aux loss).
        expert_ids: ``(N, top_k)`` int64 chosen experts, best first.
        weights: ``(N, top_k)`` fp32 weights of the chosen experts' outputs.
    """

    logits: torch.Tensor
    probs: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor


@dataclass
class Dispatch:
    """Assignments sorted by expert ([Note: assignment order and capacity]).

    Attributes:
        order: ``(M,)`` slot-major assignment indices (``slot * N + token``) that are kept,
            sorted by expert; ``order % N`` is the token of each row the experts see.
        counts: ``(E,)`` int64 assignments each expert receives (after capacity).
        routed: ``(E,)`` int64 assignments each expert was chosen for (before capacity).
        capacity: the per-expert capacity, or None (dropless).
    """

    order: torch.Tensor
    counts: torch.Tensor
    routed: torch.Tensor
    capacity: int | None

    @property
    def dropped(self) -> torch.Tensor:
        """Number of dropped assignments (0-d int64)."""
        return self.routed.sum() - self.counts.sum()


def expert_capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """``ceil(capacity_factor * tokens * top_k / num_experts)``: assignments one expert keeps
    per forward."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int,
                   capacity: int | None = None, groups: int = 1) -> Dispatch:
    """Sort the assignments by expert and apply the capacity.

    Args:
        expert_ids: ``(N, top_k)`` int64 chosen experts.
        num_experts: ``E``.
        capacity: assignments each expert keeps (None: dropless), per token group.
        groups: equal consecutive token groups the capacity applies to separately
            (default 1; see [Note: assignment order and capacity]).

    Returns:
        The :class:`Dispatch`.
    """
    flat = expert_ids.t().reshape(-1)  # (top_k * N,) slot-major
    routed = torch.bincount(flat, minlength=num_experts)  # (E,)
    experts, order = torch.sort(flat, stable=True)
    if capacity is None:
        return Dispatch(order, routed, routed, None)
    if groups == 1:
        starts = routed.cumsum(0) - routed  # (E,) first sorted row of each expert
        rank = torch.arange(order.numel(), device=order.device) - starts[experts]
        keep = rank < capacity
        return Dispatch(order[keep], routed.clamp(max=capacity), routed, capacity)
    n = expert_ids.shape[0]
    key = experts * groups + (order % n) // (n // groups)  # (M,) (expert, group) of each row
    per_key = torch.bincount(key, minlength=num_experts * groups)
    by_key = torch.sort(key, stable=True).indices  # keeps the priority order in each key
    rank = torch.empty_like(key)
    rank[by_key] = torch.arange(key.numel(), device=key.device) \
        - (per_key.cumsum(0) - per_key)[key[by_key]]
    keep = rank < capacity
    counts = per_key.clamp(max=capacity).view(num_experts, groups).sum(1)
    return Dispatch(order[keep], counts, routed, capacity)


class Router(nn.Module):
    """Linear gate, scores and top-k selection ([Note: routing]).

    Holds ``gate`` (``nn.Linear(dim, num_experts)``, weight ``(E, dim)``) and the persistent
    fp32 buffer ``expert_bias`` (``(E,)``, zeros at init), which is saved in checkpoints and
    kept fp32 through dtype casts of the model (the increments are ~1e-3).

    Args:
        dim: model width in features.
        num_experts: ``E``.
        top_k: experts per token.
        score: "softmax" or "sigmoid".
        norm_topk: divide the chosen scores by their sum.
        scale: factor on the chosen weights.
        init_std: std of the gate's normal init.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, score: str, norm_topk: bool,
                 scale: float, init_std: float) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.score, self.norm_topk, self.scale = score, norm_topk, scale
        self.gate = linear(dim, num_experts, init_std)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))

    def reset_parameters(self) -> None:
        """Zero the balancing bias (the gate is a child ``nn.Linear`` with ``init_std``)."""
        with torch.no_grad():
            self.expert_bias.zero_()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        old = self.expert_bias
        super()._apply(fn, recurse)
        new = self.expert_bias
        if new.dtype != torch.float32:  # a dtype cast: keep fp32, follow the device
            self.expert_bias = (torch.empty_like(new, dtype=torch.float32)
                                if old.is_meta or new.is_meta
                                else old.to(device=new.device, dtype=torch.float32))
        return self

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Route ``(N, dim)`` tokens; see :class:`RouterOutput`."""
        # fp32 logits whatever the compute dtype: the ranking of close scores decides routing.
        logits = F.linear(x.float(), self.gate.weight.float())  # (N, E)
        if self.score == "softmax":
            scores = probs = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        biased = scores.detach() + self.expert_bias  # selection only: no gradient path
        expert_ids = biased.topk(self.top_k, dim=-1).indices  # (N, k), best first
        weights = scores.gather(-1, expert_ids)  # (N, k)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        return RouterOutput(logits, probs, expert_ids, weights)

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's bias step: ``bias += rate * sign(mean(counts) - counts)``.

        Overloaded experts (more assignments than the mean) become less likely to be chosen,
        underloaded ones more. ``counts`` must be the global counts of the step, identical on
        every replica, so every replica applies the same update.

        Args:
            counts: ``(E,)`` assignments per expert over the step (any real dtype).
            rate: the step size (``bias_update_rate``).
        """
        counts = counts.to(torch.float64)
        step = torch.sign(counts.mean() - counts).to(self.expert_bias.dtype)
        self.expert_bias.add_(step.to(self.expert_bias.device), alpha=rate)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, score={self.score!r}, "
                f"norm_topk={self.norm_topk}, scale={self.scale}")
