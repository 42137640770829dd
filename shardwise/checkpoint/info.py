"""``shardwise checkpoint inspect``: what a checkpoint holds, read without loading tensors.

:func:`describe` gives the text (a summary; every tensor with ``tensors=True``),
:func:`summarize` the same facts as JSON-able data for scripts (``inspect --json``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardwise.checkpoint import atomic

__all__ = ["describe", "summarize", "format_bytes"]


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _resolve(path: Path) -> tuple[Path, list[str]]:
    """A checkpoint folder, or the latest one under a folder of checkpoints (listed)."""
    if (path / atomic.MANIFEST).exists():
        return path, []
    found = atomic.list_checkpoints(path)
    if not found:
        atomic.read_manifest(path)  # raises the precise error
    lines = [f"{len(found)} checkpoint(s) under {path}: " + ", ".join(p.name for _, p in found),
             f"showing the latest, {found[-1][1].name}", ""]
    return found[-1][1], lines


def _header(path: Path, manifest: dict[str, Any]) -> list[str]:
    lay = manifest.get("layout", {})
    stage = lay.get("stage")
    where = (f"ZeRO stage {stage}, dp_shard {lay.get('dp_shard')} x dp_replicate "
             f"{lay.get('dp_replicate')}" if stage is not None else "not sharded")
    if lay.get("cp", 1) > 1:
        where += f", cp {lay['cp']}"
    if lay.get("tp", 1) > 1:
        where += f", tp {lay['tp']}"
    if lay.get("ep", 1) > 1:
        where += f", ep {lay['ep']}"
    model = manifest.get("model") or {}
    cfg = model.get("config") or {}
    shape = ", ".join(f"{k} {cfg[k]}" for k in ("dim", "n_layers", "n_heads", "n_kv_heads",
                                                  "vocab_size", "tie_embeddings") if k in cfg)
    lines = [f"checkpoint {path}",
             f"  step:      {manifest.get('step')}   (saved {manifest.get('created')}, torch "
             f"{manifest.get('torch')})",
             f"  layout:    {lay.get('world_size')} rank(s), {where}",
             f"  model:     {model.get('class')}" + (f" ({shape})" if shape else "")]
    opt = manifest.get("optimizer")
    if opt:
        hyper = opt["param_groups"][0]["hyper"] if opt["param_groups"] else {}
        lr = hyper.get("lr")
        lines.append(f"  optimizer: {opt['class']}, {len(opt['param_groups'])} param group(s)"
                     + (f", lr {lr:.6g}" if isinstance(lr, float) else ""))
    else:
        lines.append("  optimizer: none")
    extra = manifest.get("extra") or {}
    lines.append(f"  extra:     {', '.join(sorted(extra)) or 'none'}")
    return lines


def _tensors(md) -> list[dict[str, Any]]:
    """One entry per saved tensor: name, shape, dtype, bytes, chunks (None for byte items)."""
    out = []
    for key, tmd in md.state_dict_metadata.items():
        if not hasattr(tmd, "size"):
            out.append({"name": key, "shape": None, "dtype": None, "bytes": None,
                        "chunks": None})
            continue
        n = 1
        for s in tmd.size:
            n *= s
        out.append({"name": key, "shape": list(tmd.size),
                    "dtype": str(tmd.properties.dtype).removeprefix("torch."),
                    "bytes": n * tmd.properties.dtype.itemsize, "chunks": len(tmd.chunks)})
    return out


def _tensor_lines(tensors: list[dict[str, Any]]) -> list[str]:
    rows = [(t["name"], "(bytes)", "", "", "") if t["shape"] is None else
            (t["name"], str(tuple(t["shape"])), t["dtype"], format_bytes(t["bytes"]),
             f"{t['chunks']} chunk(s)") for t in tensors]
    width = max((len(r[0]) for r in rows), default=0)
    return [f"    {r[0]:<{width}}  {r[1]:<14} {r[2]:<9} {r[3]:>10}  {r[4]}" for r in rows]


def summarize(path: str | os.PathLike, verify_files: bool = False) -> dict[str, Any]:
    """What :func:`describe` shows, as JSON-able data (``shardwise checkpoint inspect --json``).

    Args:
        path: a checkpoint folder, or a folder of ``step_N`` checkpoints (the latest is used).
        verify_files: also check every file's checksums.

    Returns:
        ``{"path", "checkpoints" (the step_N folders beside it, when a folder of them was
        given), "step", "created", "torch", "layout", "model", "optimizer" (class, param
        groups, hyper-parameters; None), "extra" (names), "files" (count, bytes, verified),
        "tensors" ([{name, shape, dtype, bytes, chunks}])}``.

    Raises:
        CheckpointError: not a checkpoint, or (``verify_files``) a damaged one.
    """
    from shardwise.checkpoint.dcp import _read_index, verify

    given = Path(path)
    path, _ = _resolve(given)
    manifest = verify(path) if verify_files else atomic.read_manifest(path)
    files = manifest.get("files", {})
    opt = manifest.get("optimizer")
    return {
        "path": str(path),
        "checkpoints": ([str(p) for _, p in atomic.list_checkpoints(given)]
                        if path != given else []),
        "step": manifest.get("step"), "created": manifest.get("created"),
        "torch": manifest.get("torch"), "layout": manifest.get("layout", {}),
        "model": manifest.get("model") or {},
        "optimizer": None if not opt else {
            "class": opt["class"], "param_groups": [g.get("hyper", {})
                                                    for g in opt["param_groups"]]},
        "extra": sorted(manifest.get("extra") or {}),
        "files": {"count": len(files), "bytes": sum(f["size"] for f in files.values()),
                  "verified": verify_files},
        "tensors": _tensors(_read_index(path, manifest).read_metadata()),
    }


def describe(path: str | os.PathLike, verify_files: bool = False,
             tensors: bool = False) -> str:
    """A human-readable account of a checkpoint: step, layout, model, optimizer, extras,
    files, how many tensors, and with ``tensors`` every tensor with its shape, dtype, size
    and number of saved chunks.

    Args:
        path: a checkpoint folder, or a folder of ``step_N`` checkpoints (the latest is shown).
        verify_files: also check every file's checksums (default False).
        tensors: list every tensor (default False: a summary of a few lines).

    Returns:
        The text.

    Raises:
        CheckpointError: not a checkpoint, or (``verify_files``) a damaged one.
    """
    from shardwise.checkpoint.dcp import _read_index, verify

    path, lines = _resolve(Path(path))
    manifest = verify(path) if verify_files else atomic.read_manifest(path)
    lines += _header(path, manifest)
    files = manifest.get("files", {})
    total = sum(f["size"] for f in files.values())
    status = "checksums verified" if verify_files else "not verified (--verify to check)"
    lines.append(f"  files:     {len(files)} data file(s), {format_bytes(total)}; {status}")
    found = _tensors(_read_index(path, manifest).read_metadata())
    model = [t for t in found if t["name"].startswith("model.")]
    lines.append(f"  tensors:   {len(model)} model, {len(found) - len(model)} optimizer"
                 + ("" if tensors else " (--tensors lists them)"))
    if tensors:
        lines += _tensor_lines(found)
    return "\n".join(lines)
