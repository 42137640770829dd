"""Small models that exercise every case a sharding engine must handle.

:class:`EdgeCaseModel` packs them into one network, so a parity run covers all at once:

* parameter shapes whose dim 0 is smaller than the world size or does not divide it
  (7, 5, 3, 2 rows), and a 0-d parameter;
* an embedding tied to the output head (one Parameter registered in two modules);
* frozen parameters (LoRA-style base weight) mixed into a trainable unit;
* buffers;
* a unit called twice in one forward;
* a parameter never used, and one used only when the batch holds token 0 (so some ranks
  use it and others do not in the same step);
* activation checkpointing inside a unit (non-reentrant);
* keyword arguments, nested dict inputs and dataclass outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["EdgeBlock", "EdgeCaseModel", "BlockOut"]


@dataclass
class BlockOut:
    """A dataclass output, as some user models return."""

    hidden: torch.Tensor
    aux: dict


class EdgeBlock(nn.Module):
    """A unit with odd shapes, a 0-d gate, a frozen base weight, an unused layer, a buffer."""

    def __init__(self, dim: int, hidden: int, use_checkpoint: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.gate = nn.Parameter(torch.tensor(0.75))
        self.base = nn.Linear(dim, dim, bias=False)
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(2, dim) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(dim, 2) * 0.1)
        self.unused = nn.Linear(dim, 3)
        self.register_buffer("scale", torch.tensor(0.5))
        self.use_checkpoint = use_checkpoint

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))

    def forward(self, inputs: dict, *, residual: bool = True) -> BlockOut:
        x = inputs["x"]                                      # (B, T, C)
        mlp = checkpoint(self._mlp, x, use_reentrant=False) if self.use_checkpoint else self._mlp(x)
        lora = (x @ self.lora_a.t()) @ self.lora_b.t()
        h = self.base(x) * self.scale + lora + self.gate * mlp
        return BlockOut(hidden=x + h if residual else h, aux={"norm": h.pow(2).mean()})


class EdgeCaseModel(nn.Module):
    """A toy language model combining every edge case (see the module docstring)."""

    def __init__(self, vocab: int = 11, dim: int = 7, hidden: int = 5, n_blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            EdgeBlock(dim, hidden, use_checkpoint=(i == n_blocks - 1)) for i in range(n_blocks))
        self.rare = nn.Linear(dim, dim, bias=False)          # used only when token 0 appears
        self.tiny = nn.Parameter(torch.randn(2) * 0.1)       # 2 rows: fewer than most worlds
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight                 # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)                               # (B, T, C)
        aux = 0.0
        for i, block in enumerate(self.blocks):
            out = block({"x": h}, residual=True)
            h, aux = out.hidden, aux + out.aux["norm"]
            if i == 1:                                       # the same unit called again
                h = block({"x": h}, residual=True).hidden
        zero = (tokens == 0)
        if bool(zero.any()):
            h = h + self.rare(h) * zero.unsqueeze(-1)
        h = h + self.tiny.sum() * 0.1
        logits = self.head(self.norm(h))                     # (B, T, vocab)
        return logits + 0.0 * aux
