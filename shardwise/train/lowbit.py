"""The trainer's low-bit matmuls: ``precision.matmul`` applied first in the composition
order (before TP / EP / CP / AC / compile / shard, for the whole model and for pipeline
parts alike), and the start lines that say what it converted."""

from __future__ import annotations

from torch import nn

import shardwise
from shardwise.train.config import Config

__all__ = ["apply_matmul_precision", "describe_matmul"]


def apply_matmul_precision(model: nn.Module, cfg: Config) -> nn.Module:
    """Convert the blocks' linears to ``precision.matmul``'s low-bit recipe (nothing for
    "bf16"), skipping ``precision.matmul_skip``; :func:`describe_matmul` says what it did."""
    prec = cfg.precision
    if prec.matmul == "bf16":
        return model
    return shardwise.apply_low_precision(model, prec.matmul, skip=prec.matmul_skip)


def describe_matmul(model: nn.Module) -> str | None:
    """The start lines of a low-bit run (None without one): the recipe, how many layers it
    converted, and each layer kept in high precision with the reason (the recipe cannot
    take its shape, or a ``precision.matmul_skip`` pattern). A pipeline part answers for
    the whole model."""
    report = shardwise.low_precision_report(model)
    return None if report is None else report.summary()
