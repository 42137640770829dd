"""Context parallelism for Hugging Face decoders (Llama, Qwen2, Mistral and any model whose
attention goes through transformers' ``AttentionInterface``)::

    model = LlamaForCausalLM(config)                     # or Qwen2ForCausalLM, Mistral...
    shardwise.apply_cp(model, mesh["cp"], impl="ring", load_balance="zigzag")
    cp = shardwise.cp_context(model)
    logits = model(cp.shard(input_ids)).logits           # this rank's tokens, (B, T / cp, V)
    loss = F.cross_entropy(logits.flatten(0, 1), cp.shard(labels).flatten())

``labels`` are the whole sequence's next tokens, shifted BEFORE sharding (HF's own
``labels=`` loss shifts the local tokens, which are not contiguous under zigzag: pass
``shift_labels=cp.shard(shifted)`` to it, or compute the loss as above). Packed documents:
give ``position_ids=cp.shard(position_ids)`` (HF's convention, positions restart at 0 per
document); RoPE uses them and each document attends only to itself. Padding masks,
caches (generation), attention dropout, soft-capping, sinks and a sliding window shorter
than the whole sequence are refused with a ValueError.

[Note: Hugging Face context parallelism] Three pieces, none copying a model's forward:

* an attention function registered as ``"shardwise_cp"`` with ``AttentionInterface`` and
  set as the model's attention implementation (``set_attn_implementation``, every
  sub-model). HF calls it with ``(B, H, T_local, hd)`` queries after RoPE and keys/values
  of ``KV`` heads (transformers >= 4.48 never repeats them before the call; a repeated pair
  is cut back to ``KV`` heads, whose gradient is then the copies' sum as before); it runs
  :func:`~shardwise.parallel.context.ops.cp_attention`, which masks from global positions;
* no mask function under that name (``AttentionMaskInterface``): transformers' mask
  creation then returns the caller's mask untouched (None) without building anything, so no
  ``T x T`` mask is ever made;
* a forward pre-hook on the model: without ``position_ids`` it passes this rank's GLOBAL
  positions (RoPE, and so the attention, sees where each token really is); with them it
  all-gathers them once per forward over the cp group and passes the whole sequence's
  document ids, with the runtime, as two keyword arguments that transformers forwards to
  every attention call (``TransformersKwargs``) -- through activation checkpointing too, so
  a recomputation sees the same documents.
"""

from __future__ import annotations

import inspect
import math
import sys

import torch
from torch import nn

from shardwise.parallel.context.ops import cp_attention
from shardwise.parallel.context.runtime import ContextParallel

__all__ = ["ATTN_IMPLEMENTATION", "is_hf_model", "check_hf_model", "install_hf",
           "hf_cp_attention"]

ATTN_IMPLEMENTATION = "shardwise_cp"
_KW_RUNTIME = "shardwise_cp"
_KW_DOCUMENTS = "shardwise_cp_documents"


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (never imports transformers:
    a model of it exists only once it is imported)."""
    tf = sys.modules.get("transformers")
    if tf is None:
        return False
    try:
        base = tf.PreTrainedModel
    except (AttributeError, ImportError):
        return False
    return isinstance(model, base)


def _attention_interface():
    try:
        from transformers import AttentionInterface
    except ImportError as e:  # transformers < 4.48
        import transformers
        raise ValueError(f"apply_cp on a Hugging Face model needs transformers' "
                         f"AttentionInterface (transformers >= 4.48); this is "
                         f"{transformers.__version__}") from e
    return AttentionInterface


def check_hf_model(model: nn.Module) -> None:
    """Refuse what context parallelism cannot run, before any collective.

    Raises:
        ValueError: transformers without ``AttentionInterface``, an encoder-decoder or a
            non-causal model, or one whose attention does not go through the interface.
    """
    _attention_interface()
    name = type(model).__name__
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False) or not getattr(cfg, "is_causal", True):
        raise ValueError(f"apply_cp: {name} is not a causal decoder; context parallelism "
                         f"covers causal self-attention only")
    can = getattr(model, "_can_set_attn_implementation", None)
    if callable(can) and not can():
        raise ValueError(f"apply_cp: {name} does not route its attention through "
                         f"transformers' AttentionInterface, so its attention cannot be "
                         f"replaced by context-parallel attention")


def install_hf(model: nn.Module, runtime: ContextParallel) -> None:
    """Give ``model`` (checked by :func:`check_hf_model`) context-parallel attention over
    ``runtime`` (see [Note: Hugging Face context parallelism])."""
    _attention_interface().register(ATTN_IMPLEMENTATION, hf_cp_attention)
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    if ATTN_IMPLEMENTATION in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        del ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[ATTN_IMPLEMENTATION]
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    left = sorted({type(m).__name__ for m in model.modules()
                   if getattr(getattr(m, "config", None), "_attn_implementation",
                              ATTN_IMPLEMENTATION) != ATTN_IMPLEMENTATION})
    if left:
        raise ValueError(f"apply_cp: transformers kept another attention implementation "
                         f"for {left} of {type(model).__name__}")
    model.register_forward_pre_hook(_positions_hook(model, runtime), with_kwargs=True)


def _positional_names(model: nn.Module) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(model.forward).parameters.values()
            if p.kind in kinds]


def _positions_hook(model: nn.Module, runtime: ContextParallel):
    names = _positional_names(model)
    label = type(model).__name__

    def hook(module, args, kwargs):
        if len(args) > len(names):
            raise ValueError(f"{label} under context parallelism: {len(args)} positional "
                             f"arguments, its forward takes {len(names)}")
        kwargs = {**dict(zip(names, args)), **kwargs}
        for key in ("cache", "past_key_values"):
            if kwargs.get(key) is not None:
                raise ValueError(f"{label} under context parallelism: {key}= (generation) is "
                                 f"not supported; every rank holds part of each sequence")
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all())):
                raise ValueError(f"{label} under context parallelism: attention_mask must be "
                                 f"None or all ones (no padding); pack documents with "
                                 f"position_ids instead")
            kwargs["attention_mask"] = None
        kwargs["use_cache"] = False
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None:
            raise ValueError(f"{label} under context parallelism: give input_ids or "
                             f"inputs_embeds")
        positions = kwargs.get("position_ids")
        if positions is None:
            kwargs["position_ids"] = runtime.positions(tokens.shape[1], tokens.device)[None]
        else:
            if positions.dim() == 1:
                positions = positions[None]
            kwargs[_KW_DOCUMENTS] = runtime.documents(positions)
        kwargs[_KW_RUNTIME] = runtime
        return (), kwargs

    return hook


def hf_cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask, scaling: float | None = None,
                    dropout: float = 0.0, **kwargs):
    """The ``"shardwise_cp"`` attention function (transformers' calling convention).

    Args:
        module: the attention layer; query: ``(B, H, T_local, hd)`` after RoPE; key, value:
            ``(B, KV, T_local, hd)`` (or repeated to ``H`` heads); attention_mask: None
            (see [Note: Hugging Face context parallelism]); scaling: the softmax scale;
            dropout: must be 0.
        kwargs: the runtime and documents the model's pre-hook added, and HF's extras
            (``sliding_window``, ``softcap``, ``s_aux``: refused when they would act).

    Returns:
        ``(out, None)``: ``(B, T_local, H, hd)`` and no attention weights.
    """
    runtime = kwargs.get(_KW_RUNTIME)
    where = type(module).__name__
    if runtime is None:
        raise ValueError(f"{where}: the shardwise_cp attention runs only inside the forward "
                         f"of the model given to apply_cp (its pre-hook passes the layout)")
    if getattr(module, "is_causal", True) is False:  # e.g. a vision tower's attention
        raise ValueError(f"{where} is bidirectional (is_causal=False); context parallelism "
                         f"covers causal self-attention only")
    if attention_mask is not None:
        raise ValueError(f"{where} under context parallelism got an attention mask; the "
                         f"context-parallel kernel masks from global positions")
    if dropout:
        raise ValueError(f"{where} under context parallelism: attention dropout {dropout} is "
                         f"not supported; set config.attention_dropout = 0")
    for extra in ("softcap", "s_aux", "sinks"):
        if kwargs.get(extra) is not None:
            raise ValueError(f"{where} under context parallelism: {extra} is not supported")
    seq_len = query.shape[2] * runtime.cp
    window = kwargs.get("sliding_window")
    if window is not None and window < seq_len:
        raise ValueError(f"{where} under context parallelism: sliding_window={window} is "
                         f"shorter than the sequence ({seq_len} tokens); only full causal "
                         f"attention is supported")
    hd = query.shape[-1]
    if value.shape[-1] != hd or key.shape[-1] != hd:
        raise ValueError(f"{where} under context parallelism: query, key and value head "
                         f"dims differ ({hd}, {key.shape[-1]}, {value.shape[-1]})")
    groups = getattr(module, "num_key_value_groups", 1)
    if key.shape[1] == query.shape[1] and isinstance(groups, int) and groups > 1:
        key, value = key[:, ::groups], value[:, ::groups]  # repeat_kv undone
    if scaling is not None and not math.isclose(scaling, hd ** -0.5, rel_tol=1e-12):
        query = query * (scaling * math.sqrt(hd))  # the kernel scales by hd ** -0.5
    out = cp_attention(runtime, query, key, value, kwargs.get(_KW_DOCUMENTS))
    return out.transpose(1, 2), None
