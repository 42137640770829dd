"""Mixture-of-experts feed-forward: router -> experts on tokens sorted by expert -> combine.

Build, train and balance (single process; see docs/moe.md for data parallelism)::

    from shardwise.models import build_model, get_model_config
    from shardwise.models.moe import MoESettings, configure_moe, finish_moe_step, moe_aux_loss
    model = build_model(get_model_config("debug-moe"), seed=0)
    configure_moe(model, MoESettings(balance="bias"))          # [moe] section of the trainer
    loss = lm_loss(model(tokens))                              # the LM loss alone
    aux = moe_aux_loss(model)                                  # coef * aux + coef * z, or None
    (loss + aux).backward(); optimizer.step()
    stats = finish_moe_step(model)                 # per-layer counts; bias step if "bias"

[Note: MoE forward]
For ``N = B * T`` tokens: the router picks ``top_k`` experts per token ([Note: routing] in
router.py); :func:`~shardwise.models.router.sort_by_expert` lays the assignments out sorted
by expert, applying the capacity in capacity mode; the experts get the sorted token rows and
the per-expert counts and return one row per assignment in the same order
(:class:`~shardwise.models.experts.GroupedExperts`); each row is scaled by its routing weight
and copied back to its slot-major place in a ``(top_k, N, dim)`` buffer, which is summed
over the slots (a fixed summation order, no atomics); shared experts add their output for
every token. Expert parallelism later wraps ``self.experts`` as dispatch -> local experts ->
combine; nothing before or after that call changes.

[Note: global balance statistics]
In training mode each forward builds one float64 vector of local sums: assignments per
expert (before capacity), routing probabilities per expert, the squared log-sum-exp of the
logits, the number of tokens, 1, and the dropped assignments. ``stats_reducer`` (identity by
default; an all-reduce over the data-parallel ranks once ``shardwise.parallel.
apply_global_balance`` has run) turns it into global sums, from which come the token
fractions ``f_i = count_i / (T * top_k)`` and the balance values. The aux loss
``E * sum_i f_i * P_i`` (1.0 when perfectly balanced) is differentiated only through the
local probabilities: rank ``r`` backpropagates ``W * E * sum_i f_i * S_i^r / T``, where
``S_i^r`` sums its own tokens' probabilities, ``T`` is the global token count and ``W`` the
number of replicas in the reduction (the reduced 1). Averaging gradients over the ``W``
replicas, as data parallelism does, gives exactly the gradient of the aux loss of the whole
global batch; the z-loss ``mean(logsumexp(logits)^2)`` is handled the same way. Counts are
sums of integers in float64, hence identical on every replica, and so are the bias updates
computed from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.models.config import LlamaConfig
from shardwise.models.experts import GroupedExperts
from shardwise.models.layers import FeedForward
from shardwise.models.router import Router, expert_capacity, sort_by_expert

__all__ = ["MoE", "MoESettings", "MoEStepStats", "BALANCE_MODES", "STATS_REPLICAS",
           "moe_layers", "configure_moe", "set_stats_reducer", "set_capacity_groups",
           "moe_aux_loss", "finish_moe_step"]

BALANCE_MODES = ("aux", "bias", "none")
STATS_REPLICAS = -2
"""Index of the replica count ``W`` in the balance-statistics vector ([Note: global balance
statistics]): a reducer over ranks that split one replica's tokens (tensor ranks under
sequence parallelism) sets it to the number of replicas whose gradients are averaged."""


@dataclass(frozen=True)
class MoESettings:
    """How MoE layers route and balance during training (the trainer's ``[moe]`` section).

    Raises:
        ValueError: from ``__post_init__``, naming the field and the value.
    """

    capacity_factor: float | None = None
    """None: dropless (every token reaches its top_k experts). A number > 0: each expert
    keeps at most ceil(capacity_factor * tokens * top_k / num_experts) assignments per
    forward (one rank's micro-batch); the rest are dropped (later tokens' second choices
    first, see [Note: assignment order and capacity])."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch/GShard load-balancing loss in the objective (balance = "aux")."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE), any balance mode."""
    balance: str = "aux"
    """"aux": the auxiliary loss; "bias": DeepSeek-V3's auxiliary-loss-free bias, nudged after
    every optimizer step; "none": neither (the z-loss still applies if its coef > 0)."""
    bias_update_rate: float = 0.001
    """balance = "bias": the bias step per optimizer step (DeepSeek-V3: 0.001)."""

    def __post_init__(self) -> None:
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))
                               or not 0 < cf < math.inf):
            raise ValueError(f"MoESettings: capacity_factor={cf!r}, expected None (dropless) "
                             f"or a finite number > 0")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value < math.inf:
                raise ValueError(f"MoESettings: {name}={value!r}, expected a finite number "
                                 f">= 0")
        if self.balance not in BALANCE_MODES:
            raise ValueError(f"MoESettings: balance={self.balance!r}, expected one of "
                             f"{BALANCE_MODES}")


@dataclass
class MoEStepStats:
    """One MoE layer's statistics over an optimizer step (all micro-batches, global batch).

    Attributes:
        name: the layer's module name (``layers.3.feed_forward``).
        counts: ``(E,)`` float64 assignments routed to each expert (before capacity).
        dropped: assignments dropped by the capacity.
        assignments: all assignments (tokens x top_k).
        aux_loss: the aux loss value, averaged over the step's forwards.
        z_loss: the z-loss value, averaged over the step's forwards.
        forwards: training forwards in the step.
        capacity_factor: the layer's ``settings.capacity_factor`` (None: dropless).
    """

    name: str
    counts: torch.Tensor
    dropped: float
    assignments: float
    aux_loss: float
    z_loss: float
    forwards: int
    capacity_factor: float | None = None

    @property
    def tokens_min(self) -> float:
        """Fewest assignments any expert was routed."""
        return self.counts.min().item()

    @property
    def tokens_max(self) -> float:
        """Most assignments any expert was routed."""
        return self.counts.max().item()

    @property
    def tokens_cv(self) -> float:
        """Coefficient of variation of the counts (population std / mean; 0: balanced)."""
        mean = self.counts.mean()
        return (self.counts.std(correction=0) / mean).item() if mean > 0 else 0.0

    @property
    def dropped_frac(self) -> float:
        """Fraction of assignments dropped by the capacity (0 when dropless)."""
        return self.dropped / self.assignments if self.assignments else 0.0


def _identity(stats: torch.Tensor) -> torch.Tensor:
    return stats


class MoE(nn.Module):
    """The MoE feed-forward of one block ([Note: MoE forward]).

    Children: ``router`` (:class:`~shardwise.models.router.Router`), ``experts``
    (:class:`~shardwise.models.experts.GroupedExperts`) and, with ``num_shared_experts``,
    ``shared_experts`` (a :class:`~shardwise.models.layers.FeedForward` of width
    ``num_shared_experts * expert_hidden_dim``). Plain attributes: ``settings``
    (:class:`MoESettings`), ``stats_reducer`` (a callable on a float64 vector of local
    sums returning global sums; identity by default, see [Note: global balance statistics])
    and ``capacity_groups`` (1: the capacity applies to the whole input; ``g``: to each of
    ``g`` equal consecutive groups of sequences, see [Note: assignment order and capacity]).

    Args:
        config: the model shape (``num_experts > 0``).
        settings: routing and balancing behaviour (default ``MoESettings()``).
    """

    def __init__(self, config: LlamaConfig, settings: MoESettings | None = None) -> None:
        super().__init__()
        if config.num_experts <= 0:
            raise ValueError(f"MoE: num_experts={config.num_experts}, expected > 0")
        self.num_experts, self.top_k = config.num_experts, config.top_k
        std = config.init_std
        self.router = Router(config.dim, config.num_experts, config.top_k, config.router_score,
                             config.router_norm_topk, config.router_scale, std)
        self.experts = GroupedExperts(config.num_experts, config.dim, config.expert_hidden_dim,
                                      std, std / math.sqrt(2 * config.n_layers))
        self.shared_experts = None
        if config.num_shared_experts:
            self.shared_experts = FeedForward(
                config, hidden_dim=config.num_shared_experts * config.expert_hidden_dim)
        self.settings = settings if settings is not None else MoESettings()
        self.stats_reducer: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.capacity_groups = 1
        self.pending_loss: torch.Tensor | None = None
        self._step: dict[str, torch.Tensor] | None = None
        self._forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., dim) -> (..., dim)``; in training mode also records the balance losses
        (``pending_loss``) and the step statistics."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, C)
        n, k = x.shape[0], self.top_k
        route = self.router(x)
        cf, groups = self.settings.capacity_factor, self.capacity_groups
        capacity = None
        if cf is not None:
            if n % groups:
                raise ValueError(f"MoE: capacity_groups={groups} does not divide the {n} "
                                 f"tokens of the input {tuple(shape)}")
            capacity = expert_capacity(cf, n // groups, k, self.num_experts)
        dispatch = sort_by_expert(route.expert_ids, self.num_experts, capacity, groups)
        y = self.experts(x[dispatch.order % n], dispatch.counts)  # (M, C)
        w = route.weights.t().reshape(-1)[dispatch.order]  # (M,) weights of the kept rows
        slots = y.new_zeros(k * n, shape[-1]).index_copy(0, dispatch.order,
                                                          y * w.unsqueeze(-1).to(y.dtype))
        out = slots.view(k, n, -1).sum(dim=0)  # (N, C)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.training:
            self._balance(route, dispatch, n)
        else:
            self.pending_loss = None
        return out.view(shape)

    def _balance(self, route, dispatch, n: int) -> None:
        """Global statistics, the differentiable balance losses and the step accumulators
        ([Note: global balance statistics])."""
        e, k, s = self.num_experts, self.top_k, self.settings
        lse = torch.logsumexp(route.logits, dim=-1)  # (N,)
        extra = torch.stack([lse.detach().double().square().sum(),
                             lse.new_tensor(float(n), dtype=torch.float64),
                             lse.new_tensor(1.0, dtype=torch.float64),
                             dispatch.dropped.double()])
        local = torch.cat([dispatch.routed.double(),
                           route.probs.detach().sum(dim=0).double(), extra])
        glob = self.stats_reducer(local)
        counts, prob_sums = glob[:e], glob[e:2 * e]
        lse_sq, tokens, replicas, dropped = glob[2 * e:].unbind()
        frac = counts / (tokens * k)  # (E,) f_i
        aux_value = e * (frac * prob_sums).sum() / tokens
        z_value = lse_sq / tokens
        scale = (replicas / tokens).float()  # W / T: see the Note
        loss = None
        if s.balance == "aux" and s.aux_loss_coef:
            aux = e * scale * (frac.float() * route.probs.sum(dim=0)).sum()
            loss = s.aux_loss_coef * aux
        if s.z_loss_coef:
            z = s.z_loss_coef * scale * lse.square().sum()
            loss = z if loss is None else loss + z
        self.pending_loss = loss
        step = {"counts": counts, "dropped": dropped, "assignments": tokens * k,
                "aux_loss": aux_value, "z_loss": z_value}
        if self._step is None:
            self._step = {key: v.clone() for key, v in step.items()}
        else:
            for key, v in step.items():
                self._step[key] += v
        self._forwards += 1

    def finish_step(self, name: str = "", update_bias: bool = True) -> MoEStepStats | None:
        """The step's statistics (None if no training forward ran), the bias update when
        ``settings.balance == "bias"`` and ``update_bias``, and a reset of the accumulators.
        """
        if self._step is None:
            return None
        acc, forwards = self._step, self._forwards
        self._step, self._forwards = None, 0
        if self.settings.balance == "bias" and update_bias:
            self.router.update_bias(acc["counts"], self.settings.bias_update_rate)
        return MoEStepStats(name, acc["counts"].cpu(), acc["dropped"].item(),
                            acc["assignments"].item(), acc["aux_loss"].item() / forwards,
                            acc["z_loss"].item() / forwards, forwards,
                            self.settings.capacity_factor)

    def extra_repr(self) -> str:
        return f"settings={self.settings}"


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every :class:`MoE` in ``model`` with its module name, in ``named_modules()`` order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def configure_moe(model: nn.Module, settings: MoESettings) -> nn.Module:
    """Give every MoE layer of ``model`` these settings (in place; returns ``model``).

    Raises:
        ValueError: ``settings`` is not an :class:`MoESettings`.
    """
    if not isinstance(settings, MoESettings):
        raise ValueError(f"configure_moe: settings={settings!r}, expected an MoESettings")
    for _, layer in moe_layers(model):
        layer.settings = settings
    return model


def set_stats_reducer(model: nn.Module,
                      reducer: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """Set the balance-statistics reducer of every MoE layer (in place; returns ``model``).

    Args:
        reducer: takes a 1-D float64 tensor of this process's sums and returns the sums over
            the data-parallel ranks (same shape); must be called collectively (every rank,
            every MoE forward in training mode, same order), like any collective.
    """
    if not callable(reducer):
        raise ValueError(f"set_stats_reducer: reducer={reducer!r} is not callable")
    for _, layer in moe_layers(model):
        layer.stats_reducer = reducer
    return model


def set_capacity_groups(model: nn.Module, groups: int) -> nn.Module:
    """Route every MoE layer's input as ``groups`` equal groups of sequences for the
    capacity (in place; returns ``model``): a single process computing what ``groups``
    data-parallel ranks compute, each with its own micro-batch and capacity.

    Raises:
        ValueError: ``groups`` is not a positive int.
    """
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"set_capacity_groups: groups={groups!r}, expected an int >= 1")
    for _, layer in moe_layers(model):
        layer.capacity_groups = groups
    return model


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The weighted balance losses of the last training forward, summed over MoE layers.

    ``aux_loss_coef * aux + z_loss_coef * z`` per layer (only the terms the settings switch
    on), to add to the LM loss before ``backward``. Each layer's term is handed out once.

    Returns:
        A 0-d fp32 tensor, or None when there is nothing to add (no MoE layer, eval mode,
        all coefficients zero).
    """
    total = None
    for _, layer in moe_layers(model):
        if layer.pending_loss is not None:
            total = layer.pending_loss if total is None else total + layer.pending_loss
            layer.pending_loss = None
    return total


def finish_moe_step(model: nn.Module, update_bias: bool = True) -> list[MoEStepStats]:
    """End an optimizer step: per-layer statistics, bias updates, accumulators reset.

    Call once per optimizer step on every rank, after ``optimizer.step()`` (with
    ``update_bias=False`` when the step was skipped, e.g. a non-finite gradient).

    Returns:
        One :class:`MoEStepStats` per MoE layer that ran a training forward this step.
    """
    out = []
    for name, layer in moe_layers(model):
        stats = layer.finish_step(name, update_bias)
        if stats is not None:
            out.append(stats)
    return out
