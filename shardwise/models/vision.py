"""A ViT patch encoder (the vision tower of vla.py), unaware of parallelism.

    encoder = VisionEncoder(image_size=56, patch_size=8, dim=128, n_layers=2, n_heads=4)
    patches = encoder(images)          # (N, 3, 56, 56) float -> (N, 49, 128); N may be 0

Frames are cut into non-overlapping ``patch_size`` squares, each flattened (channel-major,
as a stride-``patch_size`` convolution reads it) and projected by one linear layer, learned
position embeddings are added, then pre-norm blocks of non-causal attention (SDPA) and a
GELU MLP run, and a final norm closes the tower. Norms are RMSNorm (layers.py) rather than
the LayerNorm of the original ViT, so every norm of the model initialises and shards alike;
linear layers are bias-free for the same reason. Every module with parameters carries an
``init_std`` (or is an RMSNorm), so llama.py's ``init_module_weights`` initialises the tower
module by module, meta-device materialisation included ([Note: init order] in llama.py).

A :class:`VisionBlock` is a :class:`~shardwise.models.layers.ModelBlock`: the ZeRO engine's
``wrap={ModelBlock}``, activation checkpointing and ``compile_blocks`` find it as they find
the decoder's blocks, and :data:`VISION_BLOCK_PLAN` is its tensor-parallel plan.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.layers import ModelBlock, RMSNorm
from shardwise.models.layers import linear as _linear

__all__ = ["VisionAttention", "VisionMLP", "VisionBlock", "VisionEncoder", "VISION_BLOCK_PLAN"]

VISION_BLOCK_PLAN: dict[str, str] = {
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.wo": "rowwise",
    "mlp.fc1": "colwise",
    "mlp.fc2": "rowwise",
}
"""Tensor-parallel styles of a :class:`VisionBlock`'s linears, relative to the block (Megatron:
attention heads and MLP hidden features split; the norms stay whole). Data, read by
``shardwise.parallel.tensor.plan``."""


class VisionAttention(nn.Module):
    """Non-causal multi-head self-attention over a frame's patches.

    Args:
        dim: the tower's width, in features.
        n_heads: attention heads (``dim`` divisible by it).
        init_std: normal init std of ``wq``, ``wk``, ``wv``.
        out_std: normal init std of ``wo`` (depth-scaled).
    """

    def __init__(self, dim: int, n_heads: int, init_std: float, out_std: float) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = _linear(dim, dim, init_std)
        self.wk = _linear(dim, dim, init_std)
        self.wv = _linear(dim, dim, init_std)
        self.wo = _linear(dim, dim, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Head counts come from the projections' widths (-1): a tensor-parallel column split
        # leaves fewer local heads and needs no change here.
        # Sizes are spelled out (no -1): N may be 0.
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        n, p, width = q.shape
        heads = width // self.head_dim
        q, k, v = (t.view(n, p, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)  # (N, H, P, hd), every patch sees all
        return self.wo(y.transpose(1, 2).reshape(n, p, width))  # (N, P, D)


class VisionMLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with a hidden width of ``hidden`` features."""

    def __init__(self, dim: int, hidden: int, init_std: float, out_std: float) -> None:
        super().__init__()
        self.fc1 = _linear(dim, hidden, init_std)
        self.fc2 = _linear(hidden, dim, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionBlock(ModelBlock):
    """Pre-norm ViT block: ``h = x + attention(norm(x)); out = h + mlp(norm(h))``.

    ``tp_plan`` (:data:`VISION_BLOCK_PLAN`) is its tensor-parallel plan, relative to the block.

    Args:
        dim: width; n_heads: heads; mlp_hidden: MLP hidden width; n_layers: the tower's
        depth (scales the output projections' init); init_std: normal init std.
    """

    tp_plan = VISION_BLOCK_PLAN

    def __init__(self, dim: int, n_heads: int, mlp_hidden: int, n_layers: int,
                 init_std: float, norm_eps: float = 1e-6) -> None:
        super().__init__()
        out_std = init_std / math.sqrt(2 * n_layers)
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = VisionAttention(dim, n_heads, init_std, out_std)
        self.mlp_norm = RMSNorm(dim, norm_eps)
        self.mlp = VisionMLP(dim, mlp_hidden, init_std, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))  # (N, P, D)
        return h + self.mlp(self.mlp_norm(h))  # (N, P, D)


class VisionEncoder(nn.Module):
    """ViT patch encoder: ``(N, channels, H, W)`` frames -> ``(N, P, dim)`` patch features.

    Parameters (in data-flow order): ``patch_embed.weight`` (dim, channels * patch**2),
    ``pos_embed`` (1, P, dim), ``blocks.{i}.*`` (:class:`VisionBlock`), ``norm.weight``.

    Args:
        image_size: frame height and width, in pixels (a multiple of ``patch_size``).
        patch_size: patch side, in pixels.
        dim: width, in features; n_layers: blocks; n_heads: heads per block.
        mlp_ratio: MLP hidden width / ``dim`` (default 4).
        channels: input channels (default 3, RGB).
        init_std: normal init std of weights and position embeddings (default 0.02).

    Raises:
        ValueError: sizes that do not fit together, naming them.
    """

    def __init__(self, image_size: int, patch_size: int, dim: int, n_layers: int,
                 n_heads: int, mlp_ratio: float = 4.0, channels: int = 3,
                 init_std: float = 0.02) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"VisionEncoder: image_size={image_size} is not a multiple of "
                             f"patch_size={patch_size}")
        if dim % n_heads:
            raise ValueError(f"VisionEncoder: dim={dim} is not divisible by n_heads={n_heads}")
        self.image_size, self.patch_size, self.channels = image_size, patch_size, channels
        self.num_patches = (image_size // patch_size) ** 2
        self.init_std = init_std  # pos_embed, the module's own parameter
        self.patch_embed = _linear(channels * patch_size ** 2, dim, init_std)
        self.pos_embed = nn.Parameter(torch.empty(1, self.num_patches, dim))
        mlp_hidden = int(dim * mlp_ratio)
        self.blocks = nn.ModuleList(VisionBlock(dim, n_heads, mlp_hidden, n_layers, init_std)
                                    for _ in range(n_layers))
        self.norm = RMSNorm(dim, 1e-6)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Patch features of ``images``.

        Args:
            images: ``(N, channels, image_size, image_size)`` floats; ``N`` may be 0.

        Returns:
            ``(N, num_patches, dim)`` features.

        Raises:
            ValueError: an input of another shape, naming it.
        """
        want = (self.channels, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != want:
            raise ValueError(f"VisionEncoder: images of shape {tuple(images.shape)}, expected "
                             f"(N, {', '.join(map(str, want))})")
        n, ps = images.shape[0], self.patch_size
        g = self.image_size // ps
        # (N, C, g, ps, g, ps) -> (N, g, g, C, ps, ps): row-major patches, channel-major pixels
        patches = images.view(n, self.channels, g, ps, g, ps).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(n, g * g, self.channels * ps * ps)  # (N, P, C*ps*ps)
        patches = patches.to(self.patch_embed.weight.dtype)
        h = self.patch_embed(patches) + self.pos_embed  # (N, P, D)
        for block in self.blocks:
            h = block(h)
        return self.norm(h)  # (N, P, D)
