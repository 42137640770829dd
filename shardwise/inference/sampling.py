"""Choosing the next token from logits: greedy, or sampled with temperature, top-k and top-p
from a seeded generator (the same seed gives the same tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Sampling", "Sampler"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.

    Attributes:
        temperature: 0 for greedy (the most likely token), else the logits are divided by it
            before the softmax (default 0).
        top_k: keep the ``top_k`` most likely tokens (0: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches
            ``top_p`` (1.0: all); applied after ``top_k``.
        seed: the seed of the sampling generator (the same seed, prompts and model give the
            same tokens).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"Sampling: temperature={self.temperature!r}, expected a number >= 0 "
                             f"(0: greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"Sampling: top_k={self.top_k!r}, expected an int >= 0 (0: all)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"Sampling: top_p={self.top_p!r}, expected a number in (0, 1]")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"Sampling: seed={self.seed!r}, expected an int")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Picks one token per row; holds the generator of a seeded :class:`Sampling`.

    Args:
        sampling: the rule.
        device: where the logits live (the generator lives there too).
    """

    def __init__(self, sampling: Sampling, device: torch.device) -> None:
        self.sampling = sampling
        self.generator = None
        if not sampling.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(sampling.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``(B, V)`` logits -> ``(B,)`` int64 tokens."""
        s = self.sampling
        if s.greedy:
            return logits.argmax(dim=-1)
        logits = logits.float() / s.temperature  # (B, V)
        if s.top_k and s.top_k < logits.shape[-1]:
            kth = logits.topk(s.top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if s.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
            probs = sorted_logits.softmax(dim=-1)
            # drop a token when the ones more likely than it already reach top_p
            drop = probs.cumsum(dim=-1) - probs >= s.top_p
            drop[:, 0] = False  # the most likely token always stays
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)  # (B,)
