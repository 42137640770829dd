"""Tensor-parallel plans: which module gets which style.

A plan is data (docs/design.md, principle 4): ``{"module.name.glob": style}``, where ``*``
matches one dotted component (``"layers.*.attention.wq"``) and the styles are

==================  ==========================================================================
``colwise``         column-parallel ``nn.Linear``: output features split (q, k, v, gate, up)
``rowwise``         row-parallel ``nn.Linear``: input features split, output summed (o, down)
``vocab``           vocab-parallel ``nn.Embedding``: rows (token ids) split
``colwise_output``  the LM head: vocab-sharded logits with loss parallel, gathered without
``colwise_gather``  column-parallel with the output gathered whole
``sequence``        a module of a sequence-parallel region (norms): parameters replicated,
                    gradients summed over the tensor ranks under sequence parallelism
==================  ==========================================================================

Built in: the shardwise Llama (:data:`LLAMA_PLAN`, with :data:`MOE_PLAN` for its MoE
blocks), the vision-language-action model (the Llama plan of its decoder plus the plans its
modules declare, see :func:`declared_plans`), and any Hugging Face model whose config
carries ``base_model_tp_plan`` (HF's styles mapped by :data:`HF_STYLES`; the causal-LM
class's own ``_tp_plan`` adds its head).

[Note: MoE under tensor parallelism] Experts are not split over the tensor ranks: an MoE
block sits in a sequence-parallel region (after ``ffn_norm``), so with sequence parallelism
each tensor rank routes its own ``1/tp`` of the sequence through the router, the experts
(``apply_ep`` dispatches that shard over the ``ep`` ranks of its own tensor coordinate) and
the shared experts, all held whole (style ``sequence``: replicated, gradients summed over
the tensor ranks, as for a norm weight). Without sequence parallelism every tensor rank
routes the same tokens and the MoE block is computed redundantly.
"""

from __future__ import annotations

import re

from torch import nn

from shardwise.models.llama import Transformer
from shardwise.models.vla import VisionLanguageAction
from shardwise.parallel.tensor.layers import STYLES

__all__ = ["LLAMA_PLAN", "MOE_PLAN", "HF_STYLES", "PLAN_ATTR", "default_plan", "declared_plans",
           "resolve_plan", "hf_plan"]

PLAN_ATTR = "tp_plan"
"""A module class may declare its own plan as this class attribute: ``{"child.glob": style}``
relative to the module (e.g. ``VisionBlock.tp_plan``, ``Projector.tp_plan``);
:func:`declared_plans` prefixes it with each instance's name."""

LLAMA_PLAN: dict[str, str] = {
    "tok_embeddings": "vocab",
    "layers.*.attention_norm": "sequence",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "sequence",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "norm": "sequence",
    "output": "colwise_output",
}
"""The plan of :class:`shardwise.models.Transformer` (dense, grouped-query attention)."""

MOE_PLAN: dict[str, str] = {
    "layers.*.feed_forward.router.gate": "sequence",
    "layers.*.feed_forward.experts": "sequence",
}
"""The MoE blocks' part of the Llama plan ([Note: MoE under tensor parallelism])."""

HF_STYLES: dict[str, str] = {"colwise": "colwise", "rowwise": "rowwise",
                             "colwise_rep": "colwise_gather",
                             "colwise_gather_output": "colwise_gather"}
"""Hugging Face ``base_model_tp_plan`` styles and the shardwise style each maps to."""


def _llama_plan(cfg, tp: int) -> dict[str, str]:  # noqa: ANN001 - a LlamaConfig
    if cfg.attention == "mla":
        raise ValueError("the built-in tensor-parallel plan covers grouped-query attention; "
                         "attention='mla' (multi-head latent attention) has none yet: pass "
                         "plan={...} naming its modules")
    if cfg.n_heads % tp:
        raise ValueError(f"n_heads={cfg.n_heads} is not divisible by tp={tp}")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        raise ValueError(f"n_kv_heads={cfg.n_kv_heads} is not divisible by tp={tp}, and tp is "
                         f"not a multiple of it")
    if cfg.vocab_size % tp:
        raise ValueError(f"vocab_size={cfg.vocab_size} is not divisible by tp={tp}")
    dense = len(cfg.moe_layer_ids) < cfg.n_layers
    if dense and cfg.ffn_hidden_dim % tp:
        raise ValueError(f"the feed-forward width {cfg.ffn_hidden_dim} is not divisible by "
                         f"tp={tp}")
    plan = dict(LLAMA_PLAN)
    if not dense:  # every block is MoE: no dense feed-forward for the patterns to match
        for key in ("w1", "w2", "w3"):
            del plan[f"layers.*.feed_forward.{key}"]
    if cfg.is_moe:
        plan.update(MOE_PLAN)
        if cfg.num_shared_experts:
            plan.update({f"layers.*.feed_forward.shared_experts.{key}": "sequence"
                         for key in ("w1", "w2", "w3")})
    return plan


def hf_plan(model: nn.Module) -> dict[str, str] | None:
    """The plan of a Hugging Face model from its config's ``base_model_tp_plan`` (prefixed
    with the base model's attribute) and its class's ``_tp_plan``, in shardwise styles; None
    when the config carries no plan.

    Raises:
        ValueError: an HF style with no shardwise mapping, naming it and the module.
    """
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) \
        else ""
    raw = {prefix + k: v for k, v in base.items()}
    raw.update(getattr(type(model), "_tp_plan", None) or {})
    plan = {}
    for pattern, style in raw.items():
        if style not in HF_STYLES:
            raise ValueError(f"Hugging Face tensor-parallel style {style!r} (for {pattern}) has "
                             f"no shardwise mapping; mapped styles: {sorted(HF_STYLES)}")
        plan[pattern] = HF_STYLES[style]
    return plan


def declared_plans(model: nn.Module) -> dict[str, str]:
    """The plans ``model``'s modules declare (:data:`PLAN_ATTR` on their class), each
    pattern prefixed with the module's name, in ``named_modules()`` order."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        declared = getattr(type(module), PLAN_ATTR, None)
        if isinstance(declared, dict):
            plan.update({f"{name}.{k}" if name else k: v for k, v in declared.items()})
    return plan


def _vla_plan(model: VisionLanguageAction, tp: int) -> dict[str, str]:
    cfg = model.config
    if cfg.vision_heads % tp:
        raise ValueError(f"vision_heads={cfg.vision_heads} is not divisible by tp={tp}")
    hidden = int(cfg.vision_dim * cfg.vision_mlp_ratio)
    if hidden % tp or cfg.decoder.dim % tp:
        raise ValueError(f"the vision MLP width {hidden} or the projector width "
                         f"{cfg.decoder.dim} is not divisible by tp={tp}")
    return {**declared_plans(model), **_llama_plan(cfg.decoder, tp)}


def default_plan(model: nn.Module, tp: int) -> tuple[dict[str, str], str]:
    """The built-in plan of ``model`` and where it came from ("llama", "vla" or "hf").

    Raises:
        ValueError: a model with no built-in plan, or one the plan does not cover.
    """
    if isinstance(model, Transformer):
        return _llama_plan(model.config, tp), "llama"
    if isinstance(model, VisionLanguageAction):
        return _vla_plan(model, tp), "vla"
    plan = hf_plan(model)
    if plan is not None:
        return plan, "hf"
    raise ValueError(f"{type(model).__name__} has no built-in tensor-parallel plan (neither a "
                     f"shardwise Transformer nor a Hugging Face model whose config has "
                     f"base_model_tp_plan); pass plan={{'module.glob': style}}")


def _regex(pattern: str) -> re.Pattern:
    parts = pattern.split(".")
    return re.compile(r"\.".join(r"[^.]+" if p == "*" else re.escape(p) for p in parts))


def resolve_plan(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, nn.Module, str]]:
    """``[(module name, module, style)]`` in ``model.named_modules()`` order.

    Raises:
        ValueError: a plan that is not a dict of strings, an unknown style, a pattern that
            matches no module, or a module two patterns give different styles.
    """
    if not isinstance(plan, dict):
        raise ValueError(f"plan must be a dict {{'module.glob': style}}, got "
                         f"{type(plan).__name__}")
    modules = [(n, m) for n, m in model.named_modules() if n]
    chosen: dict[str, tuple[str, str]] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not isinstance(style, str):
            raise ValueError(f"plan entries must be str -> str, got {pattern!r}: {style!r}")
        if style not in STYLES:
            raise ValueError(f"plan entry {pattern!r}: unknown style {style!r}; expected one of "
                             f"{STYLES}")
        rx = _regex(pattern)
        hits = [n for n, _ in modules if rx.fullmatch(n)]
        if not hits:
            raise ValueError(f"plan entry {pattern!r} ({style}) matches no module of "
                             f"{type(model).__name__}")
        for n in hits:
            if n in chosen and chosen[n][1] != style:
                raise ValueError(f"module {n} gets style {chosen[n][1]!r} from {chosen[n][0]!r} "
                                 f"and {style!r} from {pattern!r}")
            chosen[n] = (pattern, style)
    return [(n, m, chosen[n][1]) for n, m in modules if n in chosen]
