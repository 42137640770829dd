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
"""

from __future__ import annotations

import re
from typing import Any

import torch

from shardwise.checkpoint.errors import CheckpointError

__all__ = ["hf_name", "our_name", "to_hf", "from_hf", "hf_rows", "hf_config",
           "config_from_hf", "permuted_heads"]

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
_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
_THEIRS = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_name(fqn: str) -> str | None:
    """Hugging Face's name for one of our parameter names (None if it has none)."""
    if fqn in _TOP:
        return _TOP[fqn]
    m = _OURS.match(fqn)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    return None


def our_name(name: str) -> str | None:
    """Our parameter name for a Hugging Face Llama tensor name (None if unknown)."""
    for ours, theirs in _TOP.items():
        if name == theirs:
            return ours
    m = _THEIRS.match(name)
    if m:
        for ours, theirs in _BLOCK.items():
            if m.group(2) == theirs:
                return f"layers.{m.group(1)}.{ours}"
    return None


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
    """A Hugging Face ``LlamaConfig`` (config.json) for our config (a dict of LlamaConfig)."""
    from shardwise.models import LlamaConfig

    cfg = LlamaConfig(**config)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_hidden_dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
            "initializer_range": cfg.init_std, "attention_bias": False, "mlp_bias": False,
            "torch_dtype": dtype}


_FROM_HF = {"dim": "hidden_size", "ffn_dim": "intermediate_size", "n_layers": "num_hidden_layers",
            "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
            "vocab_size": "vocab_size", "max_seq_len": "max_position_embeddings",
            "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
            "tie_embeddings": "tie_word_embeddings", "init_std": "initializer_range"}


def config_from_hf(hf: dict[str, Any], where: str = "config.json"):  # -> LlamaConfig
    """Our ``LlamaConfig`` from a Hugging Face Llama config.json.

    Raises:
        CheckpointError: not a Llama config, or a required field is missing.
    """
    from shardwise.models import LlamaConfig

    if hf.get("model_type", "llama") != "llama":
        raise CheckpointError(f"{where}: model_type {hf.get('model_type')!r}, expected 'llama'",
                              file=where)
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in required if k not in hf]
    if missing:
        raise CheckpointError(f"{where} lacks {missing}", file=where)
    values = {ours: hf[theirs] for ours, theirs in _FROM_HF.items() if theirs in hf}
    values.setdefault("n_kv_heads", values["n_heads"])
    if "max_seq_len" not in values:
        values["max_seq_len"] = 2048
    return LlamaConfig(**values)
