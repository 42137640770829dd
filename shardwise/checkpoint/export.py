"""Consolidated safetensors in Hugging Face Llama (or, for MoE models, Mixtral) layout:
export from a sharded checkpoint, import into a sharded model at any world size.

    shardwise checkpoint export runs/x/checkpoints/step_00000150 out/hf
    export_safetensors("runs/x/checkpoints/step_00000150", "out/hf")   # the same, from Python
    import_safetensors("out/hf", model)      # every rank reads only its rows (collective-free)

[Note: streaming export]
Export never holds more than one tensor: the safetensors header (names, dtypes, shapes,
offsets) is known from DCP's index before any data is read, so each shard file is written
as header, then tensor after tensor, each read whole from the checkpoint (DCP gathers its
chunks from every rank's file), permuted to HF's layout ([Note: RoPE layouts] in hf.py),
written and dropped. Peak memory is about two copies of the largest tensor. Tied embeddings
are one tensor in our checkpoints and stay one in the export (``tie_word_embeddings``).
Import reads, per rank and per tensor, only the rows the rank owns (for ``wq``/``wk`` the
whole heads containing them), through ``safetensors.safe_open(...).get_slice``. A stacked
expert tensor ([Note: Mixtral layout] in hf.py) is read once and written as its ``E``
per-expert tensors, consecutively, so export still holds one of our tensors at a time;
import reads only the experts whose rows the rank owns.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from shardwise.checkpoint import hf
from shardwise.checkpoint.errors import CheckpointError

__all__ = ["export_safetensors", "import_safetensors", "write_safetensors", "INDEX_FILE",
           "DEFAULT_MAX_SHARD_BYTES"]

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default "5GB"
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty(0, dtype=dtype).element_size()


def write_safetensors(path: str | os.PathLike, entries: list[tuple[str, torch.dtype, tuple]],
                      produce, metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file one tensor at a time ([Note: streaming export]).

    Args:
        path: the file to write.
        entries: ``(name, dtype, shape)`` in file order.
        produce: ``produce(name) -> tensor`` called once per entry, in order.
        metadata: the header's ``__metadata__`` strings (default ``{"format": "pt"}``).

    Returns:
        Bytes of tensor data written.

    Raises:
        ValueError: a produced tensor does not have its entry's dtype and shape.
    """
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        size = _nbytes(shape, dtype)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, dtype, shape in entries:
            t = produce(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: produced {t.dtype} {tuple(t.shape)}, the header "
                                 f"says {dtype} {tuple(shape)}")
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    return offset


def _plan_shards(entries: list[tuple[str, torch.dtype, tuple]], max_bytes: int) -> list[list]:
    shards: list[list] = [[]]
    size = 0
    for e in entries:
        nbytes = _nbytes(e[2], e[1])
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    return shards


def _natural(name: str) -> list:
    """Sort key: "layers.10" after "layers.9"."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def _model_entries(src: Path, md) -> tuple[list[tuple[str, torch.dtype, tuple]], dict,
                                            list[str]]:
    """``[(hf name, dtype, shape)]`` of the model tensors in DCP's index, hf name -> (our
    name, expert index or None), and our routing biases (which have no HF name)."""
    entries, ours, biases = [], {}, []
    # DCP's index lists tensors in the order the ranks' plans were merged, which depends on
    # the layout (copies are saved by one rank); a natural sort of the names makes the file
    # the same from every layout.
    for key in sorted(md.state_dict_metadata, key=_natural):
        tmd = md.state_dict_metadata[key]
        if not key.startswith("model."):
            continue
        fqn = key[len("model."):]
        if hf.is_routing_bias(fqn):
            biases.append(fqn)
            continue
        tensors = hf.hf_tensors(fqn, tuple(tmd.size))
        if not tensors:
            raise CheckpointError(f"checkpoint {src}: tensor {key} has no Hugging Face Llama "
                                  f"name", path=src, tensor=key)
        expert = len(tensors) > 1 or hf.expert_source(tensors[0][0]) is not None
        for j, (name, shape) in enumerate(tensors):
            entries.append((name, tmd.properties.dtype, shape))
            ours[name] = (fqn, j if expert else None)
    return entries, ours, biases


def _read_whole(reader, md, fqn: str) -> torch.Tensor:
    tmd = md.state_dict_metadata["model." + fqn]
    full = torch.empty(tmd.size, dtype=tmd.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": {fqn: full}}, storage_reader=reader, no_dist=True)
    return full


def _producer(reader, md, ours: dict, config: dict[str, Any]):
    """``produce(hf name)``: one tensor read whole from the checkpoint, in HF layout; a
    stacked expert tensor is read once for its ``E`` consecutive entries."""
    last: dict[str, torch.Tensor] = {}

    def produce(name: str) -> torch.Tensor:
        fqn, expert = ours[name]
        if expert is None:
            return hf.to_hf(fqn, _read_whole(reader, md, fqn), config)
        if fqn not in last:
            last.clear()
            last[fqn] = _read_whole(reader, md, fqn)
        return last[fqn][expert].t().contiguous()  # (in, out) -> nn.Linear's (out, in)
    return produce


def _check_biases_zero(src: Path, reader, md, biases: list[str]) -> None:
    for fqn in biases:
        bias = _read_whole(reader, md, fqn)
        if bias.any():
            raise CheckpointError(f"checkpoint {src}: {fqn} is non-zero (max |bias| "
                                  f"{bias.abs().max().item():.3g}): Mixtral routing has no "
                                  f"selection bias, so the exported model would route "
                                  f"differently; expected a model trained with moe.balance "
                                  f"'aux' or 'none'", path=src, tensor="model." + fqn)


def export_safetensors(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       verify_files: bool = True) -> Path:
    """Write a checkpoint's model as Hugging Face Llama safetensors shards + index + config.

    Runs in one process, one tensor in memory at a time ([Note: streaming export]).

    Args:
        checkpoint: a checkpoint folder of a shardwise Llama (any layout).
        out: the output folder (created).
        max_shard_bytes: largest shard file (default 5 GB, as Hugging Face).
        verify_files: check the checkpoint's checksums first (default True).

    Returns:
        The path of ``model.safetensors.index.json``.

    Raises:
        CheckpointError: an unusable checkpoint, one that is not of a shardwise Llama, or an
            MoE model whose routing bias is not zero.
        ValueError: a model without a Hugging Face layout, naming the field (shared experts,
            latent attention, non-Mixtral routing; see hf.check_hf_layout).
    """
    from shardwise.checkpoint.atomic import read_manifest
    from shardwise.checkpoint.dcp import _read_index, verify

    src, out = Path(checkpoint), Path(out)
    manifest = verify(src) if verify_files else read_manifest(src)
    config = (manifest.get("model") or {}).get("config")
    if not config or "n_heads" not in config:
        raise CheckpointError(f"checkpoint {src} is not of a shardwise Llama model (no model "
                              f"config in its manifest); export needs the Llama shapes",
                              path=src, file="manifest.json")
    hf.check_hf_layout(config)  # before any file is written
    reader = _read_index(src, manifest)
    md = reader.read_metadata()
    entries, ours, biases = _model_entries(src, md)
    _check_biases_zero(src, reader, md, biases)
    produce = _producer(reader, md, ours, config)
    out.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(entries, max_shard_bytes)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out / file, shard, produce)
        weight_map.update({name: file for name, _, _ in shard})
    dtype = str(entries[0][1]).removeprefix("torch.") if entries else "float32"
    (out / "config.json").write_text(json.dumps(hf.hf_config(config, dtype), indent=2) + "\n")
    index = out / INDEX_FILE
    index.write_text(json.dumps({"metadata": {"total_size": total, "step": manifest.get("step")},
                                 "weight_map": weight_map}, indent=2) + "\n")
    return index


def _weight_map(src: Path) -> tuple[dict[str, Path], Path]:
    """``{hf name: file}`` and the file that said so (index, or the single file)."""
    from safetensors import safe_open

    if src.is_dir():
        index = src / INDEX_FILE
        if index.exists():
            wm = json.loads(index.read_text())["weight_map"]
            return {k: src / v for k, v in wm.items()}, index
        single = src / "model.safetensors"
        if not single.exists():
            raise CheckpointError(f"{src} holds neither {INDEX_FILE} nor model.safetensors",
                                  path=src)
        src = single
    if not src.exists():
        raise CheckpointError(f"safetensors source {src} does not exist", path=src)
    with safe_open(str(src), framework="pt") as f:
        return {k: src for k in f.keys()}, src  # noqa: SIM118 - not a dict


def _check_config(src: Path, model_config: dict[str, Any]) -> None:
    file = (src if src.is_dir() else src.parent) / "config.json"
    if not file.exists():
        return
    theirs = hf.config_from_hf(json.loads(file.read_text()), str(file))
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "tie_embeddings",
                "num_experts", "top_k"):
        if getattr(theirs, key) != model_config[key]:
            raise CheckpointError(f"{file}: {key} is {getattr(theirs, key)!r}, the model has "
                                  f"{model_config[key]!r}: the weights are of another model",
                                  path=src, file="config.json")


def import_safetensors(src: str | os.PathLike, model: nn.Module, *,
                       strict: bool = True) -> list[str]:
    """Load Hugging Face Llama (or Mixtral) safetensors into a (sharded) shardwise Llama, in
    place. Routing biases of an MoE model are set to zero (Mixtral has none).

    Each rank reads only the rows it owns ([Note: streaming export]); works at any world
    size and stage. Call it on every rank.

    Args:
        src: a folder with ``model.safetensors.index.json`` (or ``model.safetensors``), or
            one ``.safetensors`` file.
        model: a shardwise ``Transformer`` (sharded or not).
        strict: refuse files holding tensors the model lacks (default True).

    Returns:
        The model's parameter names that were loaded.

    Raises:
        CheckpointError: a missing or misshapen tensor (naming file and tensor), a config.json
            of another model, or tensors the model lacks (strict).
        ValueError: a model without a Hugging Face layout, naming the field.
    """
    import dataclasses

    from shardwise.shard import sharded_param_specs

    src = Path(src)
    cfg = getattr(model, "config", None)
    if not dataclasses.is_dataclass(cfg):
        raise CheckpointError(f"import_safetensors needs a shardwise Llama model, got "
                              f"{type(model).__name__}", path=src)
    config = dataclasses.asdict(cfg)
    hf.check_hf_layout(config)
    _check_config(src, config)
    files = _Files(src, *_weight_map(src))
    specs, sd = sharded_param_specs(model), model.state_dict()
    wanted = {fqn: [n for n, _ in hf.hf_tensors(fqn, _full_shape(specs.get(fqn), t))]
              for fqn, t in sd.items()}
    known = {n for names in wanted.values() for n in names}
    unknown = [n for n in files.weight_map if n not in known]
    if strict and unknown:
        raise CheckpointError(f"{files.listing} has tensor {unknown[0]}, which the model lacks "
                              f"({len(unknown)} such tensors)", path=src, tensor=unknown[0])
    new_sd = {}
    for fqn, names in wanted.items():
        if hf.is_routing_bias(fqn):
            new_sd[fqn] = torch.zeros_like(sd[fqn])
        elif len(names) > 1 or (names and hf.expert_source(names[0])):
            new_sd[fqn] = _read_experts(fqn, names, files, specs.get(fqn), sd[fqn])
        else:
            handle, file = files.open(names[0] if names else f"<{fqn}>", fqn)
            new_sd[fqn] = _read_local(handle, fqn, names[0], file, specs.get(fqn), sd[fqn],
                                      config)
    model.load_state_dict(new_sd)
    return list(new_sd)


class _Files:
    """The safetensors files of an import, each opened once, found by tensor name."""

    def __init__(self, src: Path, weight_map: dict[str, Path], listing: Path) -> None:
        self.src, self.weight_map, self.listing = src, weight_map, listing
        self.handles: dict[Path, Any] = {}

    def open(self, name: str, fqn: str) -> tuple[Any, Path]:
        """``(safe_open handle, file)`` holding tensor ``name`` (the model's ``fqn``)."""
        from safetensors import safe_open

        if name not in self.weight_map:
            raise CheckpointError(f"{self.listing} has no tensor {name} (the model's {fqn})",
                                  path=self.src, tensor=name)
        file = self.weight_map[name]
        if file not in self.handles:
            self.handles[file] = safe_open(str(file), framework="pt")
        return self.handles[file], file


def _full_shape(spec, current) -> tuple[int, ...]:
    return tuple(spec.shape) if spec is not None else tuple(current.shape)


def _read_experts(fqn: str, names: list[str], files: _Files, spec, current) -> torch.Tensor:
    """This rank's experts of a stacked expert tensor, each read from its HF tensor (in
    global expert numbers: expert parallelism and ZeRO cut dim 0 together)."""
    full = _full_shape(spec, current)
    start, stop = (0, full[0]) if spec is None else (spec.row_offset,
                                                      spec.row_offset + spec.local_rows)
    if spec is not None and spec.placement is not None:
        start, stop = {d: (a, b) for d, a, b in spec.placement.local_range()}.get(0, (start,
                                                                                    stop))
    rows = []
    for j in range(start, stop):
        handle, file = files.open(names[j], fqn)
        shape = tuple(handle.get_slice(names[j]).get_shape())
        if shape != (full[2], full[1]):
            raise CheckpointError(f"{file.name}: tensor {names[j]} has shape {shape}, expert "
                                  f"{j} of the model's {fqn} is {(full[2], full[1])}",
                                  path=file, file=file.name, tensor=names[j])
        rows.append(handle.get_tensor(names[j]).t())
    local = (torch.stack(rows) if rows
             else torch.empty(0, *full[1:], dtype=current.dtype))
    return local if spec is None else spec.to_dtensor(local)


def _read_local(handle, fqn: str, name: str, file: Path, spec, current, config
                ) -> torch.Tensor:
    """This rank's rows of one tensor, in our layout (a DTensor when sharded)."""
    sl = handle.get_slice(name)
    shape = tuple(sl.get_shape())
    full_shape = tuple(spec.shape) if spec is not None else tuple(current.shape)
    if shape != full_shape:
        raise CheckpointError(f"{file.name}: tensor {name} has shape {shape}, the model's {fqn} "
                              f"is {full_shape}", path=file, file=file.name, tensor=name)
    if spec is None or len(full_shape) == 0:
        return hf.from_hf(fqn, handle.get_tensor(name), config)
    # This rank's piece in global coordinates: the rows (and, for a row-parallel weight, the
    # columns) its placement gives it, tensor-parallel cuts and ZeRO rows together.
    bounds = {0: (spec.row_offset, spec.row_offset + spec.local_rows)}
    if spec.placement is not None:
        bounds = {d: (a, b) for d, a, b in spec.placement.local_range()}
    start, stop = bounds.get(0, (0, full_shape[0]))
    lo, hi = hf.hf_rows(fqn, start, stop, config)
    block = sl[lo:hi]
    local = hf.from_hf(fqn, block, config)[start - lo:stop - lo]
    if 1 in bounds:
        local = local[:, bounds[1][0]:bounds[1][1]]
    local = local.clone()
    return spec.to_dtensor(local)
