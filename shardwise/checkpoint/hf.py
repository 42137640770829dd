"""The built-in Llama in Hugging Face's layout: tensor names, the RoPE permutation, config.json.

[Note: RoPE layouts]
Our attention rotates *interleaved* pairs of each head's features, ``(x[2i], x[2i+1])``
(Meta's original layout). Hugging Face's ``LlamaAttention`` rotates *halves* (``rotate_half``:
``x[i]`` with ``x[i + head_dim/2]``). Both compute the same attention if the rows of ``wq``
and ``wk`` (one row per output feature) are reordered within each head: HF row
``s * head_dim/2 + p`` is our row ``2p + s``. That is exactly the ``permute`` of Hugging Face's
own ``convert_llama_weights_to_hf.py``::

    hf = w.view(heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(heads * head_dim, dim)

and its inverse swaps the two middle axes back. Both are pure index shuffles, so export then
import is bitwise. ``wk`` uses ``n_kv_heads``; ``wv``/``wo`` and the MLP need no change.

[Note: Mixtral layout]
An MoE model (``num_experts > 0``) is exported as Hugging Face's ``MixtralForCausalLM``:
attention and norms as for Llama, ``feed_forward.router.gate.weight`` (E, dim) as
``block_sparse_moe.gate.weight``, and each of our stacked expert tensors as ``E`` tensors in
``nn.Linear`` layout: ``experts.w1[j]`` (dim, ffn) is ``block_sparse_moe.experts.<j>.w1.weight``
(ffn, dim) transposed, likewise ``w3``, and ``w2[j]`` (ffn, dim) is ``experts.<j>.w2.weight``
(dim, ffn). Mixtral routes with a softmax over all experts, top-k, renormalised, in every
block, with no shared expert and no selection bias, so only such a model has this layout:
:func:`check_hf_layout` names the first field that differs (``num_shared_experts`` first), and
export refuses a non-zero ``expert_bias`` (import sets it to zero).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from shardwise.checkpoint.errors import CheckpointError

__all__ = ["hf_name", "our_name", "to_hf", "from_hf", "hf_rows", "hf_config",
           "config_from_hf", "permuted_heads", "check_hf_layout", "hf_tensors", "expert_source",
           "is_routing_bias"]

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attention_norm.weight": "input_layernorm.weight",
          "attention.wq.weight": "self_attn.q_proj.weight",
          "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight",
          "attention.wo.weight": "self_attn.o_proj.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight",
          "feed_forward.w2.weight": "mlp.down_proj.weight",
          "feed_forward.w3.weight": "mlp.up_proj.weight"}
_MOE = {"feed_forward.router.gate.weight": "block_sparse_moe.gate.weight"}
_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
_THEIRS = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
_THEIR_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\."
                           r"(w[123])\.weight$")


def hf_name(fqn: str) -> str | None:
    """Hugging Face's name for one of our parameter names (None if it has none)."""
    if fqn in _TOP:
        return _TOP[fqn]
    m = _OURS.match(fqn)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    if m and m.group(2) in _MOE:
        return f"model.layers.{m.group(1)}.{_MOE[m.group(2)]}"
    return None


def our_name(name: str) -> str | None:
    """Our parameter name for a Hugging Face Llama tensor name (None if unknown)."""
    for ours, theirs in _TOP.items():
        if name == theirs:
            return ours
    m = _THEIRS.match(name)
    if m:
        for ours, theirs in {**_BLOCK, **_MOE}.items():
            if m.group(2) == theirs:
                return f"layers.{m.group(1)}.{ours}"
    return None


def is_routing_bias(fqn: str) -> bool:
    """Whether ``fqn`` is a router's balancing bias (no place in Mixtral's layout)."""
    return fqn.endswith("feed_forward.router.expert_bias")


def hf_tensors(fqn: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The Hugging Face tensors holding our tensor ``fqn`` of ``shape``: one for most, ``E``
    for a stacked expert tensor ([Note: Mixtral layout]), none for a routing bias.

    Returns:
        ``[(hf name, hf shape)]``; ``[]`` also when ``fqn`` has no Hugging Face name.
    """
    m = _EXPERTS.match(fqn)
    if m:
        return [(f"model.layers.{m.group(1)}.block_sparse_moe.experts.{j}.{m.group(2)}.weight",
                 (shape[2], shape[1])) for j in range(shape[0])]
    name = hf_name(fqn)
    return [] if name is None or is_routing_bias(fqn) else [(name, tuple(shape))]


def expert_source(name: str) -> tuple[str, int] | None:
    """``(our stacked fqn, expert index)`` for a Mixtral expert tensor name, else None."""
    m = _THEIR_EXPERT.match(name)
    if m is None:
        return None
    return f"layers.{m.group(1)}.feed_forward.experts.{m.group(3)}", int(m.group(2))


def check_hf_layout(config: dict[str, Any]) -> None:
    """Refuse a model that Hugging Face's Llama / Mixtral layout cannot express ([Note:
    Mixtral layout]): multi-head latent attention, or MoE routing other than Mixtral's.

    Args:
        config: our model config as a dict (a checkpoint manifest's, or ``asdict``).

    Raises:
        ValueError: naming the first field that differs.
    """
    if config.get("attention", "gqa") != "gqa":
        raise ValueError(f"attention={config['attention']!r}: the model has no Hugging Face "
                         f"Llama / Mixtral layout (expected attention='gqa')")
    if not config.get("num_experts"):
        return
    mixtral = (("num_shared_experts", 0, "Mixtral has no shared experts"),
               ("moe_every", 1, "every Mixtral block is MoE"),
               ("moe_first_dense", 0, "every Mixtral block is MoE"),
               ("router_score", "softmax", "Mixtral routes with a softmax"),
               ("router_norm_topk", True, "Mixtral renormalises the top-k weights"),
               ("router_scale", 1.0, "Mixtral does not scale the routed weights"))
    for key, want, why in mixtral:
        if config.get(key, want) != want:
            raise ValueError(f"{key}={config[key]!r}: the model has no Hugging Face Mixtral "
                             f"layout ({why}; expected {key}={want!r}); export the shardwise "
                             f"checkpoint as is instead")


def permuted_heads(fqn: str, config: dict[str, Any]) -> int | None:
    """Heads whose rows are permuted between layouts (wq: n_heads, wk: n_kv_heads), or None."""
    if fqn.endswith("attention.wq.weight"):
        return config["n_heads"]
    if fqn.endswith("attention.wk.weight"):
        return config["n_kv_heads"]
    return None


def to_hf(fqn: str, t: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """One full tensor in Hugging Face's layout ([Note: RoPE layouts])."""
    heads = permuted_heads(fqn, config)
    if heads is None:
        return t
    rows, rest = t.shape[0], t.shape[1:]
    return t.view(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(t.shape)


def from_hf(fqn: str, t: torch.Tensor, config: dict[str, Any], heads: int | None = None
            ) -> torch.Tensor:
    """Inverse of :func:`to_hf`; ``t`` may be a block of whole heads (``heads`` of them)."""
    if permuted_heads(fqn, config) is None:
        return t
    hd = config["dim"] // config["n_heads"]
    heads = heads if heads is not None else t.shape[0] // hd
    return t.view(heads, 2, hd // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def hf_rows(fqn: str, start: int, stop: int, config: dict[str, Any]) -> tuple[int, int]:
    """HF rows to read for our rows ``[start, stop)``: the same rows, or for wq / wk the
    whole heads that contain them (the permutation stays within a head)."""
    if permuted_heads(fqn, config) is None or stop <= start:
        return start, stop
    hd = config["dim"] // config["n_heads"]
    return (start // hd) * hd, -(-stop // hd) * hd


def hf_config(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """A Hugging Face ``LlamaConfig`` (config.json) for our config (a dict of LlamaConfig), or
    a ``MixtralConfig`` for an MoE model ([Note: Mixtral layout])."""
    from shardwise.models import LlamaConfig

    cfg = LlamaConfig(**config)
    check_hf_layout(config)
    if cfg.num_experts:
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                **_hf_common(cfg, dtype), "intermediate_size": cfg.expert_hidden_dim,
                "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
                "output_router_logits": False, "sliding_window": None}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            **_hf_common(cfg, dtype), "intermediate_size": cfg.ffn_hidden_dim, "mlp_bias": False}


def _hf_common(cfg: Any, dtype: str) -> dict[str, Any]:
    return {"hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
            "initializer_range": cfg.init_std, "attention_bias": False, "torch_dtype": dtype}


_FROM_HF = {"dim": "hidden_size", "ffn_dim": "intermediate_size", "n_layers": "num_hidden_layers",
            "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
            "vocab_size": "vocab_size", "max_seq_len": "max_position_embeddings",
            "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
            "tie_embeddings": "tie_word_embeddings", "init_std": "initializer_range"}


def config_from_hf(hf: dict[str, Any], where: str = "config.json"):  # -> LlamaConfig
    """Our ``LlamaConfig`` from a Hugging Face Llama or Mixtral config.json.

    Raises:
        CheckpointError: not a Llama or Mixtral config, or a required field is missing.
    """
    from shardwise.models import LlamaConfig

    kind = hf.get("model_type", "llama")
    if kind not in ("llama", "mixtral"):
        raise CheckpointError(f"{where}: model_type {kind!r}, expected 'llama' or 'mixtral'",
                              file=where)
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in required if k not in hf]
    if missing:
        raise CheckpointError(f"{where} lacks {missing}", file=where)
    values = {ours: hf[theirs] for ours, theirs in _FROM_HF.items() if theirs in hf}
    values.setdefault("n_kv_heads", values["n_heads"])
    if "max_seq_len" not in values:
        values["max_seq_len"] = 2048
    if kind == "mixtral":
        values.update(num_experts=hf.get("num_local_experts", 8),
                      top_k=hf.get("num_experts_per_tok", 2), moe_ffn_dim=values.get("ffn_dim"))
    return LlamaConfig(**values)
