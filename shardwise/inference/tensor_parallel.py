"""Tensor-parallel decoding: a built-in decoder split over the ranks of a tensor-parallel
group, each rank holding and reading only its own rows of the weights.

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    loaded = load_tp_model("runs/debug", mesh["tp"])            # this rank's pieces only
    out = generate(loaded.model, prompts, max_new_tokens=32,
                   choose=rank0_tokens(mesh["tp"].get_group(), loaded.device))

[Note: tensor-parallel decode]
The model is parallelised by :func:`shardwise.parallel.tensor.apply_tp` exactly as in
training, with ``sequence_parallel=False`` (a decode step has one token per row: there is
no sequence to split) and ``loss_parallel=False`` (the head's logits are gathered whole, so
every rank samples from the same ``(B, V)``). Each block then costs one all-reduce after
the row-parallel ``wo`` and one after ``w2``, plus one for the vocab-parallel embedding and
one all-gather of the logits per forward. The attention modules produce ``n_heads / tp``
query heads and ``max(n_kv_heads / tp, 1)`` KV heads, and the KV cache allocates from those
shapes, so it is split by heads with no change to it. An MoE block is held whole and run
redundantly on every rank ([Note: MoE under tensor parallelism] in parallel/tensor/plan.py).

[Note: one token choice for all ranks]
Every rank samples from the same gathered logits with the same seed, so the ranks should
pick the same tokens. "Should" is not enough: a logit that differs in its last bit (an
all-reduce that sums in another order on one rank, a kernel that is not deterministic on a
GPU) can flip an argmax or a sample on one rank only. That rank would then feed another
token, stop at another step, and either hang in a collective the others never enter or
pair its collectives with the wrong ones of the others. :func:`rank0_tokens` therefore
broadcasts rank 0's picks every step (``B`` int64 values: one tiny collective) and every
rank continues with those.

Loading: :func:`load_tp_model` builds the model on the meta device, parallelises it and
reads each rank's pieces only, from DCP or safetensors ([Note: loading only the local rows]
in local_pieces.py).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint import atomic
from shardwise.distributed import comm
from shardwise.distributed.placement import placement_of, set_placement
from shardwise.inference.checkpoint import LoadedModel, read_model_config, resolve_checkpoint
from shardwise.inference.local_pieces import read_local_pieces
from shardwise.models import LlamaConfig, build_model
from shardwise.parallel.tensor import apply_tp, default_plan

__all__ = ["check_tp_degree", "parallelize_for_decode", "rank0_tokens", "load_tp_model"]


def check_tp_degree(config: LlamaConfig, tp: int) -> None:
    """Refuse a tensor-parallel degree the model's plan cannot split, before any rank or
    collective exists (apply_tp's own rules, run on a meta-device build).

    Raises:
        ValueError: ``tp`` < 1, or heads / KV heads / vocabulary / feed-forward width not
            divisible by it, or a model with no built-in plan (multi-head latent attention),
            naming the value.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r}, expected an int >= 1")
    if not isinstance(config, LlamaConfig):
        raise ValueError(f"tensor-parallel decoding covers shardwise Transformers (a "
                         f"LlamaConfig), got a {type(config).__name__}")
    if tp > 1:
        default_plan(build_model(config, device="meta"), tp)


def parallelize_for_decode(model: nn.Module, tp_mesh) -> nn.Module:
    """``apply_tp`` for decoding ([Note: tensor-parallel decode]): no sequence parallelism,
    whole logits. In place; returns ``model``.

    Raises:
        ValueError: see :func:`shardwise.parallel.tensor.apply_tp` (raised before any
            collective).
    """
    return apply_tp(model, tp_mesh, sequence_parallel=False, loss_parallel=False)


def rank0_tokens(group, device: torch.device | str
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``choose=`` of :func:`~shardwise.inference.generate` for the ranks of ``group``:
    every rank continues with the tokens the group's rank 0 picked ([Note: one token choice
    for all ranks]).

    Args:
        group: the tensor-parallel process group.
        device: where the group's collectives run (the model's device: NCCL needs CUDA
            tensors, Gloo CPU ones).

    Returns:
        ``choose(tokens) -> tokens``: ``(B,)`` int64 in, rank 0's ``(B,)`` out.
    """
    src = dist.get_global_rank(group, 0)
    device = torch.device(device)

    def choose(tokens: torch.Tensor) -> torch.Tensor:
        picked = tokens.to(device=device, dtype=torch.int64).contiguous()
        comm.broadcast(picked, src, group, label="decode.tokens")
        return picked.to(tokens.device)

    return choose


def _materialise(model: nn.Module, device: torch.device) -> None:
    """Allocate a meta-device model on ``device``; recompute non-persistent buffers.
    ``to_empty`` makes new Parameter objects (meta tensors cannot take real data in place),
    so the placements recorded on the old ones are copied over by name."""
    placements = {n: placement_of(p) for n, p in model.named_parameters()}
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        set_placement(param, placements[name])
    for module in model.modules():
        if module._non_persistent_buffers_set and hasattr(module, "reset_parameters"):
            module.reset_parameters()


def load_tp_model(path: str | os.PathLike, tp_mesh, *, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a trained model parallelised over ``tp_mesh`` for decoding, each rank reading
    only its pieces of the checkpoint ([Note: loading only the local rows] in
    local_pieces.py). Call it on every rank of the mesh; it runs no collective.

    Args:
        path: a run directory, checkpoint folder or safetensors (see
            :func:`~shardwise.inference.checkpoint.resolve_checkpoint`).
        tp_mesh: the 1-D tensor-parallel DeviceMesh.
        device: this rank's device.
        dtype: the parameters' dtype (buffers stay as built).

    Returns:
        A :class:`~shardwise.inference.checkpoint.LoadedModel` whose model holds this rank's
        pieces, parallelised by :func:`parallelize_for_decode`, in eval mode.

    Raises:
        ValueError: a bad path, or a degree the model cannot be split by.
        CheckpointError: damaged files, or tensors that do not fit the config.
    """
    p = resolve_checkpoint(path)
    config = read_model_config(p)
    check_tp_degree(config, tp_mesh.size())
    device = torch.device(device)
    model = build_model(config, device="meta")
    parallelize_for_decode(model, tp_mesh)
    _materialise(model, device)
    step = read_local_pieces(p, model)
    fmt = "dcp" if (p / atomic.MANIFEST).exists() else "safetensors"
    run_dir = p.parent.parent if fmt == "dcp" and p.parent.name == "checkpoints" else None
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.to(dtype)
    model.eval().requires_grad_(False)
    return LoadedModel(model, config, p, fmt, step, run_dir)
