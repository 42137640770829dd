"""Building blocks of the decoder: linear layers with their init, RMSNorm, RoPE, SwiGLU.

Shared by the dense blocks (llama.py) and the MoE feed-forward (moe.py); each module here
knows nothing of parallelism.

[Note: RoPE tables stay fp32]
The cos/sin tables are non-persistent buffers (recomputed, never checkpointed). Cast to bf16
they would keep 8 significant bits (errors up to ~4e-3 in every rotation), and computed in
bf16 they would be useless (the angle of position 4096 is only known to +-16 radians). They
are computed in fp64, stored in fp32, and ``RotaryEmbedding._apply`` keeps them fp32 through
``model.to(torch.bfloat16)`` / ``.half()`` while still following device moves, and the
rotation itself is computed in fp32 and cast back to the activation dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.config import LlamaConfig

__all__ = ["FeedForward", "ModelBlock", "RMSNorm", "RotaryEmbedding", "apply_rotary",
           "document_ids", "document_mask", "linear", "repeat_kv", "rope_tables"]


class ModelBlock(nn.Module):
    """Base class of a model's repeated blocks (the decoder's ``TransformerBlock``, the
    vision tower's ``VisionBlock``).

    It adds nothing to ``nn.Module``: it is how the parallel code finds blocks without
    naming each model's classes. ``shardwise.shard(model, wrap={ModelBlock})`` makes every
    block of every tower a unit, and activation checkpointing and ``compile_blocks`` act on
    its subclasses by default.
    """


def linear(in_features: int, out_features: int, init_std: float) -> nn.Linear:
    """A bias-free ``nn.Linear`` that remembers the std of its normal init (``init_std``).
    """
    layer = nn.Linear(in_features, out_features, bias=False)
    # Read by init_module_weights: a bare nn.Linear does not know which init it needs.
    layer.init_std = init_std
    return layer


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned gain (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Set the gain to ones."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: the mean of squares of bf16 activations loses too much.
        xf = x.float()  # (..., C)
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin of the RoPE angles ``position * theta ** (-2i / head_dim)``.

    Args:
        head_dim: features per head (even).
        max_seq_len: number of positions.
        theta: RoPE base.
        device: where the fp32 tables go; they are always computed in fp64 on CPU, so
            every device gets bitwise the same values.

    Returns:
        ``(cos, sin)``, each fp32 of shape ``(max_seq_len, head_dim // 2)``.
    """
    device = torch.device(device)
    shape = (max_seq_len, head_dim // 2)
    if device.type == "meta":
        return (torch.empty(shape, dtype=torch.float32, device=device),
                torch.empty(shape, dtype=torch.float32, device=device))
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device="cpu"), freqs)
    return (angles.cos().to(device=device, dtype=torch.float32),
            angles.sin().to(device=device, dtype=torch.float32))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive feature pairs ``(x[2i], x[2i+1])`` of each head (Meta's layout).

    Args:
        x: ``(B, T, H, head_dim)`` queries or keys.
        cos: ``(T, head_dim // 2)`` fp32, or ``(B, T, head_dim // 2)`` (positions per
            sequence, e.g. packed documents).
        sin: the same shape as ``cos``.

    Returns:
        The rotated tensor, same shape and dtype as ``x`` (the rotation runs in fp32).
    """
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # (B, T, H, hd/2) each
    # (T, 1, hd/2) broadcast over B and H; per-sequence tables (B, T, hd/2) over H only
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # (B, T, H, hd/2, 2)
    return out.flatten(-2).type_as(x)


class RotaryEmbedding(nn.Module):
    """Holds the RoPE cos/sin tables as non-persistent fp32 buffers (see [Note: RoPE tables
    stay fp32])."""

    context_parallel = None  # the layout of apply_cp, which gives tokens global positions

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        cos, sin = rope_tables(head_dim, max_seq_len, theta, device=torch.empty(0).device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset_parameters(self) -> None:
        """Recompute the tables on the buffers' current device."""
        self.cos, self.sin = rope_tables(self.head_dim, self.max_seq_len, self.theta,
                                         device=self.cos.device)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        before = {name: buf for name, buf in self._buffers.items() if buf is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != torch.float32:  # a dtype cast: undo it, keep the device move
                if old.is_meta or new.is_meta:
                    self._buffers[name] = torch.empty_like(new, dtype=torch.float32)
                else:
                    self._buffers[name] = old.to(device=new.device, dtype=torch.float32)
        return self

    def forward(self, seq_len: int, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of ``seq_len`` tokens: at ``positions`` (``(B, T)`` ids) when given,
        else at the global positions of this rank's tokens under context parallelism
        (``context_parallel``, set by ``apply_cp``), else at ``0 .. seq_len - 1``."""
        if positions is not None:
            return self.cos[positions], self.sin[positions]  # (B, T, hd/2) each
        if self.context_parallel is not None:
            cp = self.context_parallel
            if seq_len * cp.cp > self.max_seq_len:
                raise ValueError(f"sequence length {seq_len} x cp {cp.cp} = "
                                 f"{seq_len * cp.cp} exceeds max_seq_len={self.max_seq_len}")
            at = cp.positions(seq_len, self.cos.device)
            return self.cos[at], self.sin[at]  # (T, hd/2) each
        return self.cos[:seq_len], self.sin[:seq_len]  # (T, hd/2) each

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}"


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """Per-token document index of packed sequences from their position ids.

    A document starts at the first token and wherever the position does not continue the
    previous token's (``positions[t] != positions[t - 1] + 1``, e.g. a reset to 0): the
    convention of packed data with per-document position ids.

    Args:
        positions: ``(B, T)`` integer position ids of whole sequences.

    Returns:
        ``(B, T)`` int64 document ids, 0 for each row's first document.

    Raises:
        ValueError: ``positions`` not a 2-D integer tensor.
    """
    if positions.dim() != 2 or positions.dtype.is_floating_point:
        raise ValueError(f"positions has shape {tuple(positions.shape)} and dtype "
                         f"{positions.dtype}, expected (batch, seq_len) integers")
    starts = torch.zeros(positions.shape, dtype=torch.int64, device=positions.device)
    starts[:, 1:] = (positions[:, 1:] != positions[:, :-1] + 1).to(torch.int64)
    return starts.cumsum(dim=1)


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """``(B, 1, T, T)`` boolean attention mask: causal, and within each token's document."""
    t = documents.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
    return (causal & (documents[:, :, None] == documents[:, None, :]))[:, None]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``(B, KV, T, hd) -> (B, KV * n_rep, T, hd)``; query head ``h`` reads kv head ``h // n_rep``.
    """
    if n_rep == 1:
        return x
    b, kv, t, hd = x.shape
    return x[:, :, None].expand(b, kv, n_rep, t, hd).reshape(b, kv * n_rep, t, hd)


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``.

    Args:
        config: the model shape (``dim``, ``init_std``, ``n_layers`` for the output init).
        hidden_dim: hidden width in features (default None: ``config.ffn_hidden_dim``); the
            MoE layer's shared experts pass ``num_shared_experts * moe_ffn_dim``.
    """

    def __init__(self, config: LlamaConfig, hidden_dim: int | None = None) -> None:
        super().__init__()
        hidden = config.ffn_hidden_dim if hidden_dim is None else hidden_dim
        std = config.init_std
        self.w1 = linear(config.dim, hidden, std)
        self.w2 = linear(hidden, config.dim, std / math.sqrt(2 * config.n_layers))
        self.w3 = linear(config.dim, hidden, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, F) -> (B, T, C)
