"""Multi-head latent attention (DeepSeek-V2/V3), as the ``attention = "mla"`` variant.

[Note: MLA as built]
Keys and values go through a shared low-rank latent: ``wkv_a`` maps ``x`` to a
``kv_lora_rank`` latent (RMS-normed by ``kv_norm``) plus one ``qk_rope_head_dim`` key part
shared by all heads; ``wkv_b`` expands the latent to per-head ``qk_nope_head_dim`` keys and
``v_head_dim`` values. Queries come from ``wq`` directly, or with ``q_lora_rank`` through
``wq_a`` -> ``q_norm`` -> ``wq_b``. The RoPE part of queries and keys is rotated (consecutive
pairs, as the rest of the model; the tables have ``qk_rope_head_dim`` features) and
concatenated after the non-rotated part; scores are scaled by
``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``; attention is causal. This is the
"naive" (training) form of DeepSeek's reference ``model.py``: the inference-time absorption
of ``wkv_b`` into the query and output, a cache of the latent (shardwise.inference caches the
expanded per-head keys and values) and the YaRN context extension
(DeepSeek-V3's ``rope_factor = 40`` beyond 4096 tokens, with its ``mscale`` on the softmax
scale) are not implemented: the registered ``deepseek-v3`` shape has ``max_seq_len = 4096``,
the pre-training context.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.config import LlamaConfig
from shardwise.models.layers import RMSNorm, apply_rotary, linear

__all__ = ["LatentAttention"]


class LatentAttention(nn.Module):
    """Causal multi-head latent attention ([Note: MLA as built]).

    Args:
        config: a model shape with ``attention == "mla"``.

    Raises:
        ValueError: ``config.attention`` is not "mla".
    """

    kv_cache = None  # set by shardwise.inference while it generates (inference/cache.py)

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if config.attention != "mla":
            raise ValueError(f"LatentAttention: config.attention={config.attention!r}, "
                             f"expected 'mla'")
        c, std, heads = config, config.init_std, config.n_heads
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_rank = c.kv_lora_rank
        qk = self.nope + self.rope
        if c.q_lora_rank is None:
            self.wq = linear(c.dim, heads * qk, std)
        else:
            self.wq_a = linear(c.dim, c.q_lora_rank, std)
            self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps)
            self.wq_b = linear(c.q_lora_rank, heads * qk, std)
        self.wkv_a = linear(c.dim, c.kv_lora_rank + self.rope, std)
        self.kv_norm = RMSNorm(c.kv_lora_rank, c.norm_eps)
        self.wkv_b = linear(c.kv_lora_rank, heads * (self.nope + self.v_dim), std)
        self.wo = linear(heads * self.v_dim, c.dim, std / math.sqrt(2 * c.n_layers))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(b, t, -1, self.nope + self.rope)  # (B, T, H, nope + rope)
        heads = q.shape[2]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        k_pe = apply_rotary(k_pe.unsqueeze(2), cos, sin)  # (B, T, 1, rope): shared by heads
        kv = self.wkv_b(self.kv_norm(latent)).view(b, t, heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary(q_pe, cos, sin)], dim=-1)  # (B, T, H, qk)
        k = torch.cat([k_nope, k_pe.expand(b, t, heads, self.rope)], dim=-1)  # (B, T, H, qk)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, .)
        scale = (self.nope + self.rope) ** -0.5
        if self.kv_cache is not None:  # generating: keys and values of earlier tokens too
            y = self.kv_cache.attend(q, k, v, scale=scale)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, C)
