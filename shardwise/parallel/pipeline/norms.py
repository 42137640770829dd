"""Gradient norms and clipping across pipeline ranks.

Each pipeline rank holds different parameters, so the global norm is the sum over the
pipeline group of every rank's part (itself summed over the stage's data axes by
``shardwise.get_total_norm``). A tied embedding counts once: its mirror on the last stage
is not a parameter of the part ([Note: tied embeddings across stages] in split.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardwise.distributed import comm
from shardwise.parallel.pipeline.split import PipelinePart
from shardwise.shard.grad import clip_grads_with_norm_, get_total_norm

__all__ = ["pipeline_grad_norm", "clip_pipeline_grad_norm_"]


def pipeline_grad_norm(part: PipelinePart, norm_type: float = 2.0) -> torch.Tensor:
    """The p-norm of the whole model's gradients, identical on every rank (collective over
    the pipeline and data groups; no host sync).

    Args:
        part: this rank's stages.
        norm_type: p (default 2.0; ``inf`` for the max norm).

    Returns:
        A 0-d float32 tensor: what ``torch.nn.utils.get_total_norm`` gives on the unsplit
        model.

    Raises:
        ValueError: for norm_type <= 0.
    """
    local = get_total_norm(part, norm_type)
    pp = part.groups.pp
    if pp is None or part.groups.pp_size == 1:
        return local
    if math.isinf(norm_type):
        comm.all_reduce(local, pp, label="pp.grad_norm", op=dist.ReduceOp.MAX)
        return local
    total = local.pow(norm_type)
    comm.all_reduce(total, pp, label="pp.grad_norm")
    return total.pow(1.0 / norm_type)


def clip_pipeline_grad_norm_(part: PipelinePart, max_norm: float,
                             norm_type: float = 2.0) -> torch.Tensor:
    """Clip every gradient of the model by the global norm (see :func:`pipeline_grad_norm`).

    Returns:
        The norm before clipping.

    Raises:
        ValueError: for max_norm <= 0 or norm_type <= 0.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    norm = pipeline_grad_norm(part, norm_type)
    clip_grads_with_norm_(part, max_norm, norm)
    return norm
