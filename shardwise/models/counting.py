"""Exact parameter and FLOP counts of the model a :class:`LlamaConfig` describes.

Every count here is checked against the built model (``sum(p.numel())``) and against
``torch.utils.flop_counter`` by the tests, for dense, MoE and MLA shapes. Per block::

    attention   GQA: wq, wk, wv, wo            MLA: (wq | wq_a, q_norm, wq_b), wkv_a, kv_norm,
                                                    wkv_b, wo               (see mla.py)
    feed-forward  dense: w1, w2, w3 (ffn_hidden_dim)
                  MoE:   router gate (E x dim) + E routed experts + one shared SwiGLU of
                         num_shared_experts * moe_ffn_dim                   (see moe.py)
    norms       attention_norm, ffn_norm (dim each)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.models.config import LlamaConfig

__all__ = ["attention_params", "feed_forward_params", "expert_params", "num_params",
           "num_active_params", "flops_per_token"]


def attention_params(cfg: LlamaConfig) -> tuple[int, int]:
    """``(matmul weights, norm gains)`` of one attention module."""
    if cfg.attention == "mla":
        heads, qk = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            query, norms = cfg.dim * heads * qk, 0
        else:
            query, norms = cfg.q_lora_rank * (cfg.dim + heads * qk), cfg.q_lora_rank
        kv = (cfg.dim * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
              + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        out = heads * cfg.v_head_dim * cfg.dim
        return query + kv + out, norms + cfg.kv_lora_rank
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    return 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv_dim, 0  # wq, wo + wk, wv


def expert_params(cfg: LlamaConfig) -> int:
    """Weights of one routed expert (a SwiGLU of ``expert_hidden_dim``)."""
    return 3 * cfg.dim * cfg.expert_hidden_dim


def feed_forward_params(cfg: LlamaConfig, layer_id: int, active: bool = False) -> int:
    """Matmul weights of block ``layer_id``'s feed-forward (all of them, or, with ``active``,
    those one token multiplies by: router, ``top_k`` routed experts, shared experts)."""
    if not cfg.is_moe_layer(layer_id):
        return 3 * cfg.dim * cfg.ffn_hidden_dim
    routed = cfg.top_k if active else cfg.num_experts
    shared = cfg.num_shared_experts * expert_params(cfg)
    return cfg.num_experts * cfg.dim + routed * expert_params(cfg) + shared


def _matmul_params(cfg: LlamaConfig, active: bool) -> int:
    """Every matmul weight of the blocks (active or all) plus the output head."""
    attn, _ = attention_params(cfg)
    blocks = sum(attn + feed_forward_params(cfg, i, active) for i in range(cfg.n_layers))
    return blocks + cfg.vocab_size * cfg.dim


def _other_params(cfg: LlamaConfig) -> int:
    """Parameters outside matmuls: norm gains, and the input embedding unless tied."""
    _, attn_norms = attention_params(cfg)
    norms = cfg.n_layers * (2 * cfg.dim + attn_norms) + cfg.dim
    return norms + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)


def num_params(cfg: LlamaConfig) -> int:
    """See :meth:`LlamaConfig.num_params`."""
    return _matmul_params(cfg, active=False) + _other_params(cfg)


def num_active_params(cfg: LlamaConfig) -> int:
    """See :meth:`LlamaConfig.num_active_params`."""
    return _matmul_params(cfg, active=True) + _other_params(cfg)


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> int:
    """See :meth:`LlamaConfig.flops_per_token` (``seq_len`` already checked)."""
    if cfg.attention == "mla":
        qk = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        v = cfg.n_heads * cfg.v_head_dim
    else:
        qk = v = cfg.n_heads * cfg.head_dim
    return 6 * _matmul_params(cfg, active=True) + 6 * cfg.n_layers * seq_len * (qk + v)
