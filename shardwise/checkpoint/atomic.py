"""Atomic, verified checkpoint folders: write aside, checksum, commit by rename.

[Note: atomic commit]
A checkpoint ``<root>/step_00000100`` is written into ``<root>/.step_00000100.partial``. Every
rank writes its own DCP data files there and hashes them; rank 0 gathers the hashes, writes
``manifest.json`` (the checksums, the layout, all non-tensor state) last, fsyncs files and
folder, and renames the folder to its final name. ``rename`` of a folder is atomic on POSIX
file systems, so the final name exists only for a complete checkpoint: a job killed at any
moment leaves either the previous checkpoints alone plus a ``.partial`` folder (ignored,
removed by the next save), or the new checkpoint complete. Replacing an existing checkpoint of
the same name moves the old one aside first (``.<name>.old``), so the only window without it
is between two renames, and older checkpoints stay intact throughout.

[Note: checksums]
The manifest records, per data file, its size and the sha256 of each *segment*: the byte
range DCP's index gives for each tensor chunk, and any bytes between them. A truncated file is
caught by its size, naming the first tensor cut off; a corrupted byte by its segment, naming
the tensor. ``.metadata`` (DCP's pickled index) has a whole-file sha256, checked before it is
unpickled (see [Note: unpickling DCP metadata] in metadata.py). Verification is spread over
the ranks (file ``i`` is checked by rank ``i % world``), so it costs one read of the
checkpoint in total, in parallel.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.metadata import METADATA_FILE

__all__ = ["MANIFEST", "FORMAT", "VERSION", "staging_path", "step_name", "hash_rank_files",
           "hash_whole_file", "write_manifest", "read_manifest", "commit", "verify_files",
           "verify_metadata_file", "list_checkpoints", "latest_checkpoint", "prune",
           "remove_stale"]

MANIFEST = "manifest.json"
FORMAT = "shardwise-checkpoint"
VERSION = 1
_BLOCK = 8 << 20
_STEP_DIR = re.compile(r"^step_(\d+)$")
_DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def step_name(step: int) -> str:
    """The folder name of the checkpoint of ``step`` (sorts by step)."""
    return f"step_{step:08d}"


def staging_path(final: Path) -> Path:
    """Where a checkpoint is written before it is committed to ``final``."""
    return final.parent / f".{final.name}.partial"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_range(f, offset: int, length: int) -> str:
    h = hashlib.sha256()
    f.seek(offset)
    left = length
    while left > 0:
        block = f.read(min(_BLOCK, left))
        if not block:
            break
        h.update(block)
        left -= len(block)
    return h.hexdigest()


def hash_whole_file(path: Path) -> dict[str, Any]:
    """``{"size", "sha256"}`` of one file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        return {"size": size, "sha256": _sha256_range(f, 0, size)}


def _segments(items: list[tuple[int, int, str, list[int]]], size: int) -> list[list[Any]]:
    """Tensor-chunk ranges sorted by offset, with the gaps between them, covering [0, size)."""
    out: list[list[Any]] = []
    pos = 0
    for offset, length, fqn, chunk in sorted(items):
        if offset > pos:
            out.append([pos, offset - pos, None, None])
        out.append([offset, length, fqn, chunk])
        pos = max(pos, offset + length)
    if size > pos:
        out.append([pos, size - pos, None, None])
    return out


def file_items(metadata) -> dict[str, list[tuple[int, int, str, list[int]]]]:
    """``{file: [(offset, length, tensor, chunk offsets)]}`` from DCP's index."""
    items: dict[str, list] = {}
    for index, info in (metadata.storage_data or {}).items():
        chunk = list(index.offset) if index.offset is not None else []
        items.setdefault(info.relative_path, []).append(
            (info.offset, info.length, index.fqn, chunk))
    return items


def hash_rank_files(folder: Path, rank: int, metadata) -> dict[str, dict[str, Any]]:
    """Size and per-segment sha256 of the data files ``rank`` wrote (``__<rank>_*.distcp``)."""
    items = file_items(metadata)
    out = {}
    for path in sorted(folder.iterdir()):
        m = _DATA_FILE.match(path.name)
        if not m or int(m.group(1)) != rank:
            continue
        size = path.stat().st_size
        segs = _segments(items.get(path.name, []), size)
        with open(path, "rb") as f:
            for seg in segs:
                seg.insert(2, _sha256_range(f, seg[0], seg[1]))
        out[path.name] = {"size": size, "segments": segs}
    return out


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` durably (temporary name, fsync, rename)."""
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="ascii") as f:
        json.dump(manifest, f, indent=1, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    _fsync_dir(folder)


def commit(staging: Path, final: Path) -> None:
    """Make ``staging`` visible as ``final`` (see [Note: atomic commit])."""
    old = final.parent / f".{final.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``.

    Raises:
        CheckpointError: no folder, no manifest (an incomplete or foreign folder), or a
            manifest that is not ours.
    """
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (expected a folder written "
                              f"by shardwise.checkpoint.save)", path=path)
    if path.name.endswith(".partial"):
        raise CheckpointError(f"checkpoint {path} is a save that was never committed: it may "
                              f"be incomplete (see [Note: atomic commit])", path=path)
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="ascii"))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete or not a "
                              f"shardwise checkpoint", path=path, file=MANIFEST) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable: {exc}",
                              path=path, file=MANIFEST) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a {FORMAT} manifest",
                              path=path, file=MANIFEST)
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {manifest['version']}; "
                              f"this shardwise reads up to {VERSION}", path=path, file=MANIFEST)
    return manifest


def _writer_of(name: str, manifest: dict[str, Any]) -> str:
    m = _DATA_FILE.match(name)
    world = manifest.get("layout", {}).get("world_size", "?")
    return f" (written by rank {m.group(1)} of {world})" if m else ""


def _check_file(path: Path, name: str, record: dict[str, Any], manifest: dict) -> str | None:
    file = path / name
    if not file.exists():
        return (f"checkpoint {path}: file {name} is missing{_writer_of(name, manifest)}; the "
                f"checkpoint is incomplete")
    size = file.stat().st_size
    segments = record["segments"]
    if size < record["size"]:
        cut = next((s for s in segments if s[0] + s[1] > size), None)
        what = f"; tensor {cut[3]} (bytes {cut[0]}..{cut[0] + cut[1]}) is cut off" if cut and \
            cut[3] else ""
        return (f"checkpoint {path}: file {name} is truncated: {size} bytes, the manifest says "
                f"{record['size']}{what}")
    if size > record["size"]:
        return (f"checkpoint {path}: file {name} has {size} bytes, the manifest says "
                f"{record['size']}: it was changed after the checkpoint was written")
    with open(file, "rb") as f:
        for offset, length, digest, fqn, chunk in segments:
            if _sha256_range(f, offset, length) != digest:
                what = (f"tensor {fqn} (chunk at offset {tuple(chunk)})" if fqn
                        else "bytes outside any tensor")
                return (f"checkpoint {path}: file {name} is corrupted: bytes {offset}.."
                        f"{offset + length}, {what}, fail their sha256 check")
    return None


def verify_files(path: Path, manifest: dict[str, Any], rank: int = 0,
                 world: int = 1) -> list[tuple[str, str]]:
    """Check this rank's share of the data files (file ``i`` if ``i % world == rank``).

    Returns:
        ``[(file, message)]`` for every file that fails (missing, truncated, corrupted).
    """
    errors = []
    for i, (name, record) in enumerate(sorted(manifest["files"].items())):
        if i % world == rank:
            message = _check_file(path, name, record, manifest)
            if message:
                errors.append((name, message))
    return errors


def verify_metadata_file(path: Path, manifest: dict[str, Any]) -> None:
    """Check ``.metadata`` against its manifest sha256 before anyone unpickles it.

    Raises:
        CheckpointError: missing, truncated or altered.
    """
    record = manifest.get("metadata")
    file = path / METADATA_FILE
    if not file.exists():
        raise CheckpointError(f"checkpoint {path}: {METADATA_FILE} (DCP's index) is missing",
                              path=path, file=METADATA_FILE)
    if record is None:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} has no checksum for "
                              f"{METADATA_FILE}", path=path, file=MANIFEST)
    actual = hash_whole_file(file)
    if actual != record:
        raise CheckpointError(f"checkpoint {path}: {METADATA_FILE} (DCP's index) is "
                              f"{'truncated' if actual['size'] < record['size'] else 'corrupted'}"
                              f": {actual['size']} bytes, sha256 {actual['sha256'][:12]}..., the "
                              f"manifest says {record['size']} bytes, {record['sha256'][:12]}...",
                              path=path, file=METADATA_FILE)


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check every file of the checkpoint at ``path`` in this process (no collective): the
    manifest, each data file's size and sha256, DCP's index.

    Returns:
        The manifest.

    Raises:
        CheckpointError: naming the file (and tensor) of the first failure.
    """
    manifest = read_manifest(path)
    errors = verify_files(path, manifest)
    if errors:
        file, message = errors[0]
        more = f" (and {len(errors) - 1} more file(s))" if len(errors) > 1 else ""
        raise CheckpointError(message + more, path=path, file=file)
    verify_metadata_file(path, manifest)
    return manifest


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints ``step_N`` under ``root`` (those with a manifest), by step."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / MANIFEST).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The committed checkpoint with the highest step under ``root``, or None."""
    found = list_checkpoints(Path(root))
    return found[-1][1] if found else None


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest committed checkpoints (0 keeps all).

    Returns:
        The folders removed.
    """
    found = list_checkpoints(root)
    if keep_last <= 0 or len(found) <= keep_last:
        return []
    removed = []
    for _, path in found[:-keep_last]:
        # Rename first: a kill during rmtree must not leave a half-deleted step_N that
        # still looks committed.
        doomed = path.parent / f".{path.name}.deleting"
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed


def remove_stale(root: Path) -> None:
    """Remove leftovers of saves or deletions that were killed (``.*.partial`` etc.)."""
    if not root.is_dir():
        return
    for child in root.iterdir():
        if child.name.startswith(".step_") and child.name.endswith((".partial", ".old",
                                                                    ".deleting")):
            shutil.rmtree(child, ignore_errors=True)
