"""Bytes of tensors: the one helper every part of the package counts with."""

from __future__ import annotations

import torch

__all__ = ["nbytes"]


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of ``t``'s elements (0 for None); a view counts its own elements, not its base's."""
    return 0 if t is None else t.numel() * t.element_size()
