"""Reading only this rank's pieces of a checkpoint into a tensor-parallel model.

[Note: loading only the local rows]
The model is built on the meta device and parallelised (every parameter gets its
:class:`~shardwise.distributed.placement.Placement` and its local shape), then allocated.
A DCP checkpoint stores global tensors as chunks with offsets, so a load planner that asks
for each parameter's local range (``Placement.local_range``) makes every rank read only the
bytes of its rows (and, for a row-parallel weight, its columns). Hugging Face safetensors
are read by slices the same way: the rows of this rank (for ``wq`` / ``wk``, the whole heads
holding them: Hugging Face permutes the rows within each head, [Note: RoPE layouts] in
checkpoint/hf.py), then its columns. Neither runs a collective.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardwise.checkpoint import atomic, hf
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.export import INDEX_FILE
from shardwise.checkpoint.metadata import SafeReader
from shardwise.distributed.placement import placement_of

__all__ = ["read_local_pieces"]


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: parameter or buffer}`` of what a checkpoint holds (tied names included;
    non-persistent buffers, recomputed by their module, left out)."""
    persistent = set(model.state_dict())
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    return {n: t for n, t in tensors.items() if n in persistent}


def _whole_shape(t: torch.Tensor) -> tuple[int, ...]:
    pl = placement_of(t)
    return tuple(pl.shape if pl is not None else t.shape)


class _LocalPiecesPlanner(DefaultLoadPlanner):
    """Reads, for every target tensor, only the chunk ``chunks[fqn]`` of the saved global
    tensor ([Note: loading only the local rows]); the target holds exactly that chunk."""

    def __init__(self, chunks: dict[str, ChunkStorageMetadata]) -> None:
        super().__init__()
        self.chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn in self.state_dict:
            md = self.metadata.state_dict_metadata[fqn]
            items += create_read_items_for_chunk_list(fqn, md, [self.chunks[fqn]])
        return LoadPlan(items)

    def lookup_tensor(self, index) -> torch.Tensor:  # noqa: ANN001 - a MetadataIndex
        # The target is this rank's chunk itself (a plain tensor, which DCP would only
        # accept at offset 0); the read item's dest_offsets are relative to it.
        return self.state_dict[index.fqn]


def _chunk(tensor: torch.Tensor) -> ChunkStorageMetadata:
    """This rank's chunk of ``tensor`` in global coordinates (the whole tensor when it has
    no placement or a replicated one)."""
    pl = placement_of(tensor)
    if pl is None:
        return ChunkStorageMetadata(offsets=torch.Size([0] * tensor.dim()), sizes=tensor.shape)
    offsets = [0] * len(pl.shape)
    for dim, start, _ in pl.local_range():
        offsets[dim] = start
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=pl.local_shape())


def _read_dcp(path: Path, model: nn.Module) -> int | None:
    """Fill ``model``'s (local) parameters and persistent buffers from checkpoint ``path``;
    returns its step."""
    manifest = atomic.read_manifest(path)
    atomic.verify_metadata_file(path, manifest)
    reader = SafeReader(path)
    md = reader.read_metadata()
    targets: dict[str, torch.Tensor] = {}
    chunks: dict[str, ChunkStorageMetadata] = {}
    for name, t in _targets(model).items():
        key = f"model.{name}"
        saved = md.state_dict_metadata.get(key)
        if saved is None:
            raise CheckpointError(f"checkpoint {path} has no tensor {key}: it is from another "
                                  f"model", path=path, file=".metadata", tensor=key)
        whole = _whole_shape(t)
        if tuple(saved.size) != whole:
            raise CheckpointError(f"checkpoint {path}: {key} has shape {tuple(saved.size)}, the "
                                  f"model's is {whole}", path=path, tensor=key)
        targets[key], chunks[key] = t.data, _chunk(t)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(targets, storage_reader=reader, planner=_LocalPiecesPlanner(chunks),
                 no_dist=True)
    return manifest.get("step")


def _weight_map(src: Path) -> dict[str, Path]:
    """``{hf name: file}`` of a safetensors folder (index or one file) or file."""
    from safetensors import safe_open

    if src.is_dir() and (src / INDEX_FILE).exists():
        wm = json.loads((src / INDEX_FILE).read_text())["weight_map"]
        return {k: src / v for k, v in wm.items()}
    files = sorted(src.glob("*.safetensors")) if src.is_dir() else [src]
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update({k: file for k in f.keys()})  # noqa: SIM118 - not a dict
    return out


def _bounds(t: torch.Tensor) -> dict[int, tuple[int, int]]:
    pl = placement_of(t)
    return {d: (a, b) for d, a, b in pl.local_range()} if pl is not None else {}


def _read_safetensors(path: Path, model: nn.Module, config: dict) -> None:
    """Fill ``model``'s local pieces from Hugging Face safetensors at ``path``."""
    from safetensors import safe_open

    weight_map, handles = _weight_map(path), {}

    def slice_of(name: str, fqn: str):  # noqa: ANN202 - a safetensors slice
        if name not in weight_map:
            raise CheckpointError(f"safetensors {path} has no tensor {name} (the model's "
                                  f"{fqn})", path=path, tensor=name)
        file = weight_map[name]
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        return handles[file].get_slice(name)

    for fqn, t in _targets(model).items():
        shape = _whole_shape(t)
        names = hf.hf_tensors(fqn, shape)
        if hf.is_routing_bias(fqn):
            t.data.zero_()  # Mixtral has none: a zero bias routes as it does
        elif len(names) > 1 or (names and hf.expert_source(names[0][0])):
            # experts are held whole under tensor parallelism (replicated)
            t.data.copy_(torch.stack([slice_of(n, fqn)[:].t() for n, _ in names]))
        elif names:
            sl = slice_of(names[0][0], fqn)
            if tuple(sl.get_shape()) != shape:
                raise CheckpointError(f"safetensors {path}: {names[0][0]} has shape "
                                      f"{tuple(sl.get_shape())}, the model's {fqn} is {shape}",
                                      path=path, tensor=names[0][0])
            bounds = _bounds(t)
            start, stop = bounds.get(0, (0, shape[0]))
            lo, hi = hf.hf_rows(fqn, start, stop, config)
            local = hf.from_hf(fqn, sl[lo:hi], config)[start - lo:stop - lo]
            if 1 in bounds:
                local = local[:, bounds[1][0]:bounds[1][1]]
            t.data.copy_(local)
        else:
            raise CheckpointError(f"{fqn} has no Hugging Face name: the model has no "
                                  f"safetensors layout", path=path, tensor=fqn)


def read_local_pieces(path: Path, model: nn.Module) -> int | None:
    """Fill a tensor-parallel (or plain) model's parameters and persistent buffers with
    their local pieces of the checkpoint at ``path`` ([Note: loading only the local rows]).

    Args:
        path: a checkpoint folder (``manifest.json`` + DCP files) or Hugging Face
            safetensors (a folder or a file).
        model: a shardwise Transformer, allocated, parallelised or not, whose config is the
            checkpoint's.

    Returns:
        The step the checkpoint was saved at (None when the files do not say).

    Raises:
        CheckpointError: a tensor missing from the files, or of another whole shape.
    """
    import dataclasses

    path = Path(path)
    if (path / atomic.MANIFEST).exists():
        return _read_dcp(path, model)
    _read_safetensors(path, model, dataclasses.asdict(model.config))
    index = (path if path.is_dir() else path.parent) / INDEX_FILE
    return (json.loads(index.read_text()).get("metadata") or {}).get("step") \
        if index.exists() else None
