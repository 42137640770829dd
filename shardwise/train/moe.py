"""The trainer's side of mixture-of-experts models: the ``[moe]`` section, its checks, the
balance losses in the objective, the end-of-step bias update and the metrics.

Per optimizer step (see docs/moe.md)::

    loss = lm_loss / accum                                  # what metrics call "loss"
    (loss + moe_aux_loss(model) / accum).backward()         # per micro-batch: with_moe_loss
    optimizer.step()
    record.update(finish_moe_record(model, updated))        # bias step + metrics

``metrics.jsonl`` step records of an MoE model gain ``aux_loss`` and ``z_loss`` (summed over
MoE layers, averaged over micro-batches; logged whatever ``moe.balance`` is),
``moe_tokens_min`` / ``moe_tokens_max`` / ``moe_tokens_cv`` (one value per MoE layer: the
fewest / most assignments routed to one expert over the step's global batch, and their
coefficient of variation) and, in capacity mode, ``moe_dropped_frac`` (per layer: the
fraction of assignments dropped). The objective is ``loss + aux_loss_coef * aux_loss +
z_loss_coef * z_loss`` (the aux term with ``balance = "aux"`` only). In a pipeline the
executor adds each stage's balance losses per micro-batch, and the statistics of the layers
of every pipeline rank are gathered (``finish_pipeline_moe_step``), so the record describes
all the model's MoE layers whatever rank writes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from shardwise.models import MoESettings, configure_moe, finish_moe_step, moe_aux_loss
from shardwise.parallel import apply_global_balance
from shardwise.parallel.pipeline import PipelinePart, finish_pipeline_moe_step

__all__ = ["build_moe_settings", "check_moe", "apply_moe", "with_moe_loss", "finish_moe_record",
           "describe_moe"]


def build_moe_settings(cfg: Any) -> MoESettings:
    """The ``[moe]`` section as the models' :class:`~shardwise.models.MoESettings`.

    Raises:
        ValueError: a value the settings refuse, named as ``moe.<key>``.
    """
    m = cfg.moe
    try:
        return MoESettings(capacity_factor=m.capacity_factor, aux_loss_coef=m.aux_loss_coef,
                           z_loss_coef=m.z_loss_coef, balance=m.balance,
                           bias_update_rate=m.bias_update_rate)
    except ValueError as exc:
        raise ValueError(f"moe: {exc}") from None


def check_moe(cfg: Any, model_cfg: Any) -> None:
    """Refuse ``[moe]`` settings that cannot take effect, before any rank starts.

    Raises:
        ValueError: non-default ``[moe]`` values for a model without MoE layers, or
            ``balance = "bias"`` with a zero ``bias_update_rate`` (naming both).
    """
    settings = build_moe_settings(cfg)
    if not model_cfg.is_moe:
        changed = [f"moe.{f.name}={getattr(settings, f.name)!r}"
                   for f in dataclasses.fields(settings)
                   if getattr(settings, f.name) != f.default]
        if changed:
            raise ValueError(f"{', '.join(changed)} cannot take effect: model "
                             f"{cfg.model.name!r} has no MoE layers (num_experts="
                             f"{model_cfg.num_experts}); expected an MoE model (e.g. "
                             f"--model.name debug-moe) or the [moe] defaults")
    if settings.balance == "bias" and settings.bias_update_rate == 0:
        raise ValueError("moe.balance='bias' with moe.bias_update_rate=0 never moves the bias; "
                         "expected a rate > 0 (DeepSeek-V3: 0.001) or moe.balance='none'")


def apply_moe(model: nn.Module, cfg: Any, group=None,  # noqa: ANN001
              replicas: int | None = None) -> nn.Module:
    """Give the MoE layers the ``[moe]`` settings and global balance statistics over
    ``group``, the ranks whose tokens make the global batch (default: the world; a tuple
    of groups whose product they are, e.g. a pipeline stage's data and tensor ranks), with
    ``replicas`` data-parallel replicas when that is not its size (sequence parallelism).
    A dense model is returned unchanged."""
    configure_moe(model, build_moe_settings(cfg))
    return apply_global_balance(model, group, replicas)


def with_moe_loss(model: nn.Module, loss: torch.Tensor, accum: int) -> torch.Tensor:
    """``loss`` plus the last forward's weighted balance losses, scaled like the loss by
    ``1 / accum`` (the loss itself is returned for a dense model)."""
    aux = moe_aux_loss(model)
    return loss if aux is None else loss + aux / accum


def finish_moe_record(model: nn.Module, update_bias: bool) -> dict[str, Any]:
    """End the step's MoE bookkeeping on this rank and return its metrics.

    Args:
        model: the (sharded) model.
        update_bias: apply the ``balance = "bias"`` update (False when the step was skipped).

    Returns:
        The keys described in the module docstring, or ``{}`` for a dense model.
    """
    if isinstance(model, PipelinePart):  # every pipeline rank's layers (collective)
        stats = finish_pipeline_moe_step(model, update_bias=update_bias)
    else:
        stats = finish_moe_step(model, update_bias=update_bias)
    if not stats:
        return {}
    record = {"aux_loss": sum(s.aux_loss for s in stats),
              "z_loss": sum(s.z_loss for s in stats),
              "moe_tokens_min": [s.tokens_min for s in stats],
              "moe_tokens_max": [s.tokens_max for s in stats],
              "moe_tokens_cv": [round(s.tokens_cv, 6) for s in stats]}
    if any(s.capacity_factor is not None for s in stats):  # capacity mode
        record["moe_dropped_frac"] = [round(s.dropped_frac, 6) for s in stats]
    return record


def describe_moe(model_cfg: Any, cfg: Any) -> str | None:
    """One line for the run log (None for a dense model)."""
    if not model_cfg.is_moe:
        return None
    m = model_cfg
    routing = ("dropless" if cfg.moe.capacity_factor is None
               else f"capacity factor {cfg.moe.capacity_factor}")
    shared = f" + {m.num_shared_experts} shared" if m.num_shared_experts else ""
    return (f"MoE: {len(m.moe_layer_ids)} of {m.n_layers} blocks, {m.num_experts} experts"
            f"{shared} of width {m.expert_hidden_dim}, top-{m.top_k} {m.router_score}; "
            f"{m.num_active_params():,} active parameters per token; {routing}, balance "
            f"{cfg.moe.balance!r}")
