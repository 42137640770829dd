"""Sharded save and load with resharding, on ``torch.distributed.checkpoint`` (DCP).

    shardwise.checkpoint.save("ckpt/step_100", model, optimizer, step=100,
                              extra={"schedule": schedule, "loader": loader})
    info = shardwise.checkpoint.load("ckpt/step_100", model, optimizer,
                                     extra={"schedule": schedule, "loader": loader})
    info.step                                            # 100

Each rank writes only its shards of the model and the optimizer state (DTensors, see
[Note: optimizer state by name] in state.py) and reads only the chunks that overlap its rows
on load, at any world size, stage or mesh; no rank ever holds a whole tensor it does not own.
Non-tensor state (hyper-parameters, ``extra``, every rank's RNG states) is JSON in the
manifest. Saves are atomic and verified (atomic.py); ``.metadata`` is read with a restricted
unpickler (metadata.py). Background saving is :class:`shardwise.checkpoint.Checkpointer`'s.
"""

from __future__ import annotations

import datetime
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from shardwise.checkpoint import atomic, runstate, state
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.metadata import SafeReader
from shardwise.distributed.comm import objects as comm_objects

__all__ = ["Snapshot", "SaveResult", "CheckpointInfo", "snapshot", "copy_tensors", "write", "save",
           "load", "verify"]


@dataclass
class Snapshot:
    """One rank's view of a checkpoint before it is written.

    Attributes:
        tensors: ``{"model": {...}, "optim": {fqn: {key: ...}}}`` for DCP.
        header: the manifest fields every rank agrees on (JSON).
        rng: this rank's RNG states (JSON).
        nbytes: bytes of this rank's local tensors (the snapshot's memory when copied).
        copied: whether the tensors are private copies (async) or live views (sync).
    """

    tensors: dict[str, Any]
    header: dict[str, Any]
    rng: dict[str, Any]
    nbytes: int
    copied: bool = False


@dataclass
class SaveResult:
    """A committed checkpoint.

    Attributes:
        path: its folder.
        step: the step given to the save (None if none).
        seconds: wall time of writing, hashing and committing.
        bytes_written: size of all its files.
        snapshot_bytes: this rank's bytes of copied state (0 for a synchronous save).
        pruned: older checkpoints deleted by ``keep_last``.
    """

    path: Path
    step: int | None
    seconds: float
    bytes_written: int
    snapshot_bytes: int = 0
    pruned: list[Path] = field(default_factory=list)


@dataclass
class CheckpointInfo:
    """What :func:`load` found.

    Attributes:
        path: the checkpoint folder.
        step: the saved step (None if none was given).
        extra: every saved extra value, decoded (state dicts for stateful objects).
        layout: the saving job's layout (world_size, stage, dp_shard, dp_replicate, tp,
            pp).
        resharded: the layout differs from this job's.
        rng_restored: every rank's RNG states were restored (same world size only).
    """

    path: Path
    step: int | None
    extra: dict[str, Any]
    layout: dict[str, Any]
    resharded: bool
    rng_restored: bool


def _rank_world(pg) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(pg), dist.get_world_size(pg)


def copy_tensors(obj: Any) -> Any:
    """A copy of a nested dict of (D)Tensors with private local storage."""
    if isinstance(obj, dict):
        return {k: copy_tensors(v) for k, v in obj.items()}
    if hasattr(obj, "to_local"):
        from torch.distributed.tensor import DTensor

        if obj.to_local().device.type != "cpu":
            # Host memory, as torch's own async stager does (_state_dict_utils): the device
            # keeps nothing, and the writer needs CPU tensors anyway.
            return obj.detach().to(device="cpu")
        return DTensor.from_local(obj.to_local().clone(), obj.device_mesh, obj.placements,
                                  run_check=False, shape=obj.shape, stride=obj.stride())
    return obj.detach().to("cpu", copy=True)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
             extra: dict[str, Any] | None = None, step: int | None = None,
             copy: bool = False) -> Snapshot:
    """Collect what a checkpoint holds (collective when the model has 0-d parameters).

    Args:
        model: the (sharded) model.
        optimizer: its optimizer, or None.
        extra: JSON-able values and stateful objects (``state_dict``/``load_state_dict``).
        step: the training step, recorded in the manifest.
        copy: copy every local tensor (for a background write while training goes on).

    Returns:
        The :class:`Snapshot`.

    Raises:
        ValueError: an extra value cannot be stored, or the optimizer holds a tensor that is
            not a parameter of the model.
    """
    tensors: dict[str, Any] = {"model": state.model_state(model, copy=False)}
    header = {"format": atomic.FORMAT, "version": atomic.VERSION, "step": step,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "torch": torch.__version__, "layout": state.layout_of(model),
              "model": state.model_info(model), "optimizer": None,
              "extra": runstate.encode_extra(extra)}
    if optimizer is not None:
        tensors["optim"], header["optimizer"] = state.optimizer_state(model, optimizer,
                                                                      copy=False)
    if copy:
        tensors = copy_tensors(tensors)
    return Snapshot(tensors, header, runstate.capture_rng(), state.tensor_nbytes(tensors),
                    copied=copy)


def _agree(error: str | None, pg) -> None:
    """Raise the first rank's error on every rank (collective)."""
    if not dist.is_initialized():
        if error:
            raise RuntimeError(error)
        return
    errors = comm_objects.all_gather_object(error, pg, label="checkpoint.errors")
    first = next(((r, e) for r, e in enumerate(errors) if e), None)
    if first:
        raise RuntimeError(f"rank {first[0]}: {first[1]}")


def _begin(staging: Path, root_cleanup: bool, pg) -> None:
    rank, _ = _rank_world(pg)
    error = None
    if rank == 0:
        try:
            if root_cleanup:
                atomic.remove_stale(staging.parent)
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        except OSError as exc:
            error = f"cannot create {staging}: {exc.strerror or exc}"
    _agree(error, pg)


def _commit(path: Path, staging: Path, snap: Snapshot, gathered: list, keep_last: int | None,
            ) -> list[Path]:
    """Rank 0: manifest, rename, prune (see [Note: atomic commit])."""
    files: dict[str, Any] = {}
    for rank_files, _ in gathered:
        files.update(rank_files)
    manifest = {**snap.header, "rng": [rng for _, rng in gathered],
                "metadata": atomic.hash_whole_file(staging / ".metadata"), "files": files}
    atomic.write_manifest(staging, manifest)
    atomic.commit(staging, path)
    return atomic.prune(path.parent, keep_last) if keep_last else []


def write(path: str | os.PathLike, snap: Snapshot, process_group=None,
          keep_last: int | None = None, clean_root: bool = False) -> SaveResult:
    """Write ``snap`` atomically to ``path`` (collective over ``process_group``).

    Args:
        path: the final checkpoint folder (replaced if it exists).
        snap: from :func:`snapshot`, on every rank.
        process_group: the group DCP coordinates over (default: the default group).
        keep_last: after committing, keep only this many ``step_N`` siblings (None: all).
        clean_root: remove stale ``.step_*.partial`` siblings first.

    Returns:
        The :class:`SaveResult`.

    Raises:
        RuntimeError: writing failed on some rank (named); nothing was committed.
    """
    start = time.perf_counter()
    path = Path(path)
    staging = atomic.staging_path(path)
    rank, _ = _rank_world(process_group)
    _begin(staging, clean_root, process_group)
    writer = dcp.FileSystemWriter(staging, sync_files=True, overwrite=False)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            md = dcp.save(snap.tensors, storage_writer=writer, process_group=process_group,
                          no_dist=not dist.is_initialized())
    except CheckpointException as exc:  # a BaseException: `except Exception` misses it
        raise RuntimeError(f"saving checkpoint {path} failed: {exc}") from None
    try:
        own = (atomic.hash_rank_files(staging, rank, md), snap.rng, None)
    except OSError as exc:  # every rank must still reach the gather below
        own = ({}, snap.rng, f"hashing the files of checkpoint {path} failed: {exc}")
    gathered = [own]
    if dist.is_initialized():
        gathered = comm_objects.all_gather_object(own, process_group,
                                                  label="checkpoint.hashes")
    failed = next(((r, g[2]) for r, g in enumerate(gathered) if g[2]), None)
    if failed:
        raise RuntimeError(f"rank {failed[0]}: {failed[1]}")
    gathered = [g[:2] for g in gathered]
    error, pruned = None, []
    if rank == 0:
        try:
            pruned = _commit(path, staging, snap, gathered, keep_last)
        except OSError as exc:
            error = f"committing checkpoint {path} failed: {exc.strerror or exc}"
    _agree(error, process_group)
    size = sum(rec["size"] for files, _ in gathered for rec in files.values())
    return SaveResult(path, snap.header["step"], time.perf_counter() - start, size,
                      snap.nbytes if snap.copied else 0, pruned)


def save(path: str | os.PathLike, model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None, *, extra: dict[str, Any] | None = None,
         step: int | None = None, process_group=None) -> SaveResult:
    """Save model, optimizer and ``extra`` to the folder ``path``, atomically (collective).

    Every rank writes its own shards; the folder appears only once complete, with a manifest
    of checksums. For background saves, see :class:`shardwise.checkpoint.Checkpointer`.

    Args:
        path: the checkpoint folder (replaced atomically if it exists).
        model: the model (sharded with ``shardwise.shard``, or plain).
        optimizer: its optimizer (any ``torch.optim`` one, offloaded ones too), or None.
        extra: values to keep beside the weights: JSON-able values, and objects with
            ``state_dict()`` / ``load_state_dict()`` (LR schedule, loss scaler, data loader).
        step: the training step, recorded in the manifest (default None).
        process_group: the group to coordinate over (default: the default group).

    Returns:
        The :class:`SaveResult`.

    Raises:
        ValueError: an extra value cannot be stored (named).
        RuntimeError: writing failed on some rank; nothing was committed.
    """
    return write(path, snapshot(model, optimizer, extra, step), process_group)


def verify(path: str | os.PathLike, process_group=None) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest (collective; the work is split
    over the ranks).

    Returns:
        The manifest.

    Raises:
        CheckpointError: naming the file (and tensor) of the first failure.
    """
    path = Path(path)
    manifest = atomic.read_manifest(path)
    rank, world = _rank_world(process_group)
    errors = atomic.verify_files(path, manifest, rank, world)
    if dist.is_initialized():
        everyone = comm_objects.all_gather_object(errors, process_group,
                                                  label="checkpoint.verify")
        errors = sorted(e for errs in everyone for e in errs)
    if errors:
        file, message = errors[0]
        more = f" (and {len(errors) - 1} more file(s))" if len(errors) > 1 else ""
        raise CheckpointError(message + more, path=path, file=file)
    atomic.verify_metadata_file(path, manifest)
    return manifest


def _same_layout(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    return all(saved.get(k) == now.get(k) for k in ("world_size", "stage", "dp_shard",
                                                     "dp_replicate")) \
        and all(saved.get(k, 1) == now.get(k, 1) for k in ("cp", "tp", "ep", "pp"))


def _read_index(path: Path, manifest: dict[str, Any]) -> SafeReader:
    """DCP's index, checksum-checked then unpickled safely; refuse pickled objects."""
    atomic.verify_metadata_file(path, manifest)
    reader = SafeReader(path)
    md = reader.read_metadata()
    pickled = [k for k, v in md.state_dict_metadata.items() if not hasattr(v, "chunks")]
    if pickled:
        raise CheckpointError(f"checkpoint {path} stores pickled Python objects ({pickled[0]}"
                              f"); shardwise never writes them and will not unpickle them",
                              path=path, file=".metadata", tensor=pickled[0])
    return reader


def load(path: str | os.PathLike, model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None, *, extra: dict[str, Any] | None = None,
         strict: bool = True, verify_files: bool = True, restore_rng: bool = True,
         process_group=None) -> CheckpointInfo:
    """Load a checkpoint into ``model`` (and ``optimizer``), resharding to this job's layout
    (collective).

    Args:
        path: a checkpoint folder written by :func:`save` (any world size, stage or mesh).
        model: the model, built and sharded as for training (its own init is overwritten).
        optimizer: its optimizer, fresh or not; None skips optimizer state.
        extra: stateful objects to restore (``{"schedule": schedule, ...}``): each gets
            ``load_state_dict`` of the value saved under its key.
        strict: refuse a checkpoint holding model tensors the model lacks (default True).
        verify_files: check every file's checksums first (default True; one read of the
            checkpoint, split over the ranks).
        restore_rng: restore each rank's RNG states when the world size is unchanged.
        process_group: the group to coordinate over (default: the default group).

    Returns:
        A :class:`CheckpointInfo` (``extra`` holds every saved extra value).

    Raises:
        CheckpointError: missing, incomplete, truncated or corrupted files, or a checkpoint
            of another model; naming the file and tensor. Nothing is loaded then.
    """
    path = Path(path)
    manifest = verify(path, process_group) if verify_files else atomic.read_manifest(path)
    reader = _read_index(path, manifest)
    md = reader.read_metadata()
    targets: dict[str, Any] = {"model": state.model_targets(model, md, path, strict)}
    if optimizer is not None:
        targets["optim"] = state.optimizer_targets(model, optimizer, md, manifest, path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=reader, process_group=process_group,
                     no_dist=not dist.is_initialized())
    except CheckpointException as exc:  # a BaseException: `except Exception` misses it
        raise CheckpointError(f"loading checkpoint {path} failed: {exc}", path=path) from None
    model.load_state_dict(targets["model"])  # also marks gathered copies stale
    if optimizer is not None:
        state.load_optimizer(model, optimizer, targets["optim"], manifest)
    extras = runstate.restore_extra(manifest.get("extra", {}), extra, path)
    rank, world = _rank_world(process_group)
    saved_layout = manifest.get("layout", {})
    rng_ok = restore_rng and saved_layout.get("world_size") == world
    if rng_ok:
        runstate.restore_rng(manifest["rng"][rank])
    return CheckpointInfo(path, manifest.get("step"), extras, saved_layout,
                          not _same_layout(saved_layout, state.layout_of(model)), rng_ok)
