"""Low-bit experts: every expert's three projections as low-bit linears with its own scales.

[Note: low-bit experts] Each expert's weights get their own scales (per expert, as in
torchao's MoE training and DeepSeek-V3), and each expert's rows of tokens their own
activation scales, so one expert with large activations does not flatten the codes of the
others. The experts run one after the other through the low-bit linear (what the ``loop``
compute of ``GroupedExperts`` does in high precision); a grouped low-bit kernel
(``scaled_grouped_mm``) would do the same arithmetic in one launch and is left for the GPU.
An expert with no rows computes nothing and its weights get zero gradients.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from shardwise.parallel.lowbit.linear import lowbit_linear

__all__ = ["LowBitExperts", "lowbit_expert_ffn"]


def lowbit_expert_ffn(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor,
                      w2: torch.Tensor, w3: torch.Tensor, state) -> torch.Tensor:  # noqa: ANN001
    """``expert_ffn`` with every projection of every expert a low-bit linear."""
    w1s, w2s, w3s = w1.unbind(0), w2.unbind(0), w3.unbind(0)
    outs = []
    for e, xe in enumerate(x.split(counts.tolist())):
        if xe.shape[0]:
            h = F.silu(lowbit_linear(xe, w1s[e].t(), None, state)) \
                * lowbit_linear(xe, w3s[e].t(), None, state)
            outs.append(lowbit_linear(h, w2s[e].t(), None, state))
    if not outs:  # keep the weights in the graph: zero, not missing, gradients
        return x.new_zeros(0, w2.shape[2]) + 0.0 * (w1.sum() + w2.sum() + w3.sum())
    return torch.cat(outs)  # unbind's backward gives experts without rows zero gradients


class LowBitExperts:
    """Mixin giving a ``GroupedExperts`` class the low-bit forward."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return lowbit_expert_ffn(x, counts, self.w1, self.w2, self.w3, self._shardwise_lowbit)

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def of(cls: type) -> type:
        """``cls`` with the low-bit forward (cached: one class per experts class)."""
        return type(f"LowBit{cls.__name__}", (LowBitExperts, cls),
                    {"__module__": cls.__module__})
