"""ZeRO inside pipeline stages: ``shard_stages(part, stage=...)``, and the meta-device init.

    part = split_stages(build_model(cfg, device="meta"), mesh, virtual=2)
    torch.manual_seed(seed)
    shard_stages(part, stage=3, init_weights=init_module_weights)

Each piece this rank holds (the embedding, every block, the norm, the head) becomes its own
``shardwise.shard`` call over the stage's data axes (``part.groups.data_mesh``), the way
FSDP2 is applied per block (a block's attention and feed-forward are units inside it): a
stage is a few of them, and the executor drives them together with the engine's
per-micro-batch controls on the :class:`StageModule` that holds them. The pieces are
children of the part, so the engine's state dicts, ``clip_grad_norm_`` and
``memory_report`` see them under the unsplit model's names.

[Note: pipeline init] A meta model is materialised module by module, as the engine does for
one rank ([Note: module-by-module init] in materialize.py), but in the unsplit model's
order over *every* piece: a piece another rank holds is initialised into scratch tensors
that are dropped at once. Every rank thus draws the same random numbers in the same order as
``build_model(cfg, seed)`` on one process, and the pieces it keeps get exactly the unsplit
model's values, whatever the pp degree or the placement (so pp 1 and pp 4 start from the same
weights, bitwise). The cost is computing the init of the whole model on every rank, one
module at a time (no more memory than the largest module).

[Note: piece identity] Every parameter all-gather carries the identity of the ``shard``
call that made its unit ([Note: gather identity] in identity.py). Every block piece has the
same parameter names and shapes relative to itself, so each piece is sharded under its
name in the unsplit model (``layers.5``, ``tok_embeddings``): its gathers tell it from every
other piece, whichever pieces a rank holds and whatever it sharded before.
"""

from __future__ import annotations

import torch

from shardwise.models.layers import FeedForward
from shardwise.models.llama import Attention
from shardwise.models.mla import LatentAttention
from shardwise.models.moe import MoE
from shardwise.parallel.pipeline.split import PipelinePart
from shardwise.shard.api import shard
from shardwise.shard.materialize import materialize

__all__ = ["shard_stages"]

# A block's attention and feed-forward are units of their own inside its piece: at stage 3
# the engine frees them after their forward and gathers them again in backward (the piece's
# root, the two norms, stays gathered), which is what lets keep_gathered=False save memory.
_INNER_UNITS = (Attention, LatentAttention, FeedForward, MoE)


def shard_stages(part: PipelinePart, *, stage: int = 3, init_weights=None,
                 device: torch.device | str | None = None, **shard_kwargs) -> PipelinePart:
    """Shard every piece of this rank over its stage's data axes, in place.

    Args:
        part: from :func:`split_stages`.
        stage: ZeRO stage 0-3 inside each stage (default 3).
        init_weights: for a meta model, initialises one module's direct tensors (e.g.
            ``shardwise.models.init_module_weights``); see [Note: pipeline init].
        device: where a meta model is materialised (default: the CPU).
        **shard_kwargs: passed to every ``shardwise.shard`` call (``mixed_precision``,
            ``comm``, ``offload``, ``prefetch``, ...; not ``mesh`` or ``wrap``).

    Returns:
        ``part``.

    Raises:
        ValueError: ``mesh`` or ``wrap`` in ``shard_kwargs``, or anything ``shard`` refuses.
    """
    bad = [k for k in ("mesh", "wrap") if k in shard_kwargs]
    if bad:
        raise ValueError(f"shard_stages sets {bad} itself: each piece is one unit over the "
                         f"stage's data axes (part.groups.data_mesh)")
    target = torch.device(device) if device is not None else torch.device("cpu")
    mesh = part.groups.data_mesh
    for name, module, here in part.pieces:
        if here:  # [Note: piece identity]
            shard(module, stage=stage, mesh=mesh, init_weights=init_weights, device=device,
                  wrap=_INNER_UNITS, name=name, **shard_kwargs)
            continue
        if module is not None and any(p.is_meta for p in module.parameters()):
            # Another rank's piece: the same draws, into scratch ([Note: pipeline init]).
            materialize(module, target, init_weights, lambda param, full: None)
    _materialize_rest(part, target, init_weights)
    if part.mirror is not None:
        shard(part.mirror, stage=stage, mesh=mesh, device=device, name="output (tied mirror)",
              **shard_kwargs)
    part.release_pieces()
    return part


def _materialize_rest(part: PipelinePart, target: torch.device, init_weights) -> None:
    """Tensors outside every piece: the shared modules' (the RoPE tables: computed, not
    drawn) and the tied head's mirror (its value is copied from the embedding before every
    step)."""
    for _, module in part.shared:
        for sub in module.modules():  # the declaration's modules, one at a time
            if any(t.is_meta for t in (*sub.parameters(recurse=False),
                                       *sub.buffers(recurse=False))):
                sub.to_empty(device=target, recurse=False)
                (init_weights or (lambda m: m.reset_parameters()))(sub)
    mirror = part.mirror
    if mirror is not None and mirror.weight.is_meta:
        mirror.to_empty(device=target)
        with torch.no_grad():
            mirror.weight.zero_()
