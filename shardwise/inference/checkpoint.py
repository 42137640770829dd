"""Finding a trained model on disk and loading it into one process for inference.

    from shardwise.inference.checkpoint import load_model
    loaded = load_model("runs/debug")             # the newest intact checkpoint of a run
    loaded.model(tokens)                          # eval mode, no gradients, fp32 on the CPU
    print(loaded.describe())     # "Transformer 3.28M params, step 150 (dcp) from runs/..."

Three kinds of path are accepted (:func:`resolve_checkpoint`): a run directory (its
``checkpoints/step_*``, the newest that passes its checksums), one checkpoint folder
(``manifest.json`` + DCP's ``.metadata``), or Hugging Face safetensors (a folder with
``config.json`` and ``*.safetensors``, as ``shardwise checkpoint export`` or transformers'
``save_pretrained`` write it, or one ``.safetensors`` file).

[Note: loading any layout into one process]
A DCP checkpoint holds global tensors (DTensors are saved with their global shape and each
rank's chunk offsets), whatever ZeRO stage, tensor, pipeline or expert degree wrote it, and
the parameter names are the unsplit model's (checkpoint/state.py, [Note: checkpoints of
pipeline parts]). So an unsharded model built from the manifest's config is a valid target:
DCP's planner reads, for every tensor, the chunks of every rank's file that cover it. The
read uses ``no_dist=True`` and no process group, so it works with or without an initialised
``torch.distributed`` (a tensor-parallel decoder may call it on one rank only), and only the
``model.*`` entries are read: optimizer state is never touched.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from shardwise.checkpoint import atomic
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.export import INDEX_FILE, import_safetensors
from shardwise.checkpoint.hf import config_from_hf
from shardwise.checkpoint.manager import newest_intact
from shardwise.checkpoint.metadata import SafeReader
from shardwise.checkpoint.state import model_targets
from shardwise.models import LlamaConfig, VLAConfig, build_model

__all__ = ["LoadedModel", "resolve_checkpoint", "read_model_config", "config_from_dict",
           "load_model"]

_EXPECTED = ("expected a run directory (with checkpoints/step_*), a checkpoint folder "
             "(manifest.json and .metadata) or Hugging Face safetensors (a folder with "
             "config.json and *.safetensors, or a .safetensors file)")


@dataclass
class LoadedModel:
    """A model loaded for inference and where it came from.

    Attributes:
        model: the module, on its device and dtype, in eval mode, ``requires_grad`` off.
        config: its :class:`~shardwise.models.LlamaConfig` or :class:`~shardwise.models.VLAConfig`.
        path: the checkpoint folder (``.../step_N``) or safetensors folder / file read (None
            for a module wrapped by a caller).
        format: ``"dcp"`` (a shardwise checkpoint), ``"safetensors"``, or ``"module"`` (a
            module wrapped by a caller, e.g. :func:`shardwise.inference.act.act`).
        step: the training step it was saved at (None when the files do not say).
        run_dir: the run directory above a checkpoint (holding ``config.toml``), or None.
    """

    model: nn.Module
    config: LlamaConfig | VLAConfig
    path: Path | None
    format: str
    step: int | None
    run_dir: Path | None

    @property
    def num_params(self) -> int:
        """Parameters of the loaded model (tied weights once)."""
        return sum(p.numel() for p in self.model.parameters())

    def describe(self) -> str:
        """One line for a command's header: class, size, step, format and path."""
        step = f"step {self.step}" if self.step is not None else "step unknown"
        return (f"{type(self.model).__name__} {self.num_params / 1e6:.2f}M params, {step} "
                f"({self.format}) from {self.path}")


def _is_safetensors_dir(path: Path) -> bool:
    return (path / "config.json").exists() and (
        (path / INDEX_FILE).exists() or any(path.glob("*.safetensors")))


def _checkpoint_dir(run: Path) -> Path | None:
    """A run's ``[checkpoint] dir`` from its config.toml (where the trainer saved instead of
    ``<run>/checkpoints``), or None."""
    from shardwise.compat import tomllib  # tomli on Python 3.10; only runs read it

    try:
        with open(run / "config.toml", "rb") as f:
            where = (tomllib.load(f).get("checkpoint") or {}).get("dir")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return Path(where).expanduser() if where else None


def _run_root(path: Path) -> Path | None:
    """The folder of step_* checkpoints of a run directory (or ``path`` itself if it is one)."""
    for root in (_checkpoint_dir(path), path / "checkpoints", path):
        if root is not None and root.is_dir() and any(root.glob("step_*")):
            return root
    return None


def _newest_of_run(path: Path) -> Path:
    root = _run_root(path)
    if root is None:
        where = path / "checkpoints"
        raise ValueError(f"checkpoint {path}: no checkpoints under {where} (the run saved none: "
                         f"checkpoint.interval 0?); train with --checkpoint.interval N to save "
                         f"one every N steps and at the last, or give a checkpoint folder; "
                         + _EXPECTED)
    found, damaged = newest_intact(root)
    for bad, why in damaged:
        warnings.warn(f"checkpoint {bad} is damaged ({why}); using the one before it",
                      stacklevel=3)
    if found is None and damaged:
        newest, why = damaged[0]
        raise ValueError(f"checkpoint {path}: every checkpoint under {root} is damaged "
                         f"({len(damaged)} checked; the newest, {newest.name}: {why}); "
                         f"expected an intact step_* folder")
    if found is None:
        raise ValueError(f"checkpoint {path}: no committed checkpoint under {root} (its "
                         f"step_* folders have no manifest.json: saves that did not finish)")
    return found


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint ``path`` points to.

    Args:
        path: a run directory (the newest checkpoint under ``<run>/checkpoints``, or the
            ``[checkpoint] dir`` its config.toml names, whose files pass their checksums;
            damaged newer ones are skipped with a warning), a folder of ``step_*``
            checkpoints, a checkpoint folder, or Hugging Face safetensors (a folder with
            ``config.json`` + ``*.safetensors``, or one ``.safetensors`` file).

    Returns:
        The checkpoint folder, safetensors folder or safetensors file.

    Raises:
        ValueError: ``path`` does not exist, is a run without checkpoints (saying how to get
            one), has only damaged checkpoints, or is none of the kinds above.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"checkpoint {p} does not exist; " + _EXPECTED)
    if p.is_file():
        if p.suffix == ".safetensors":
            return p
        raise ValueError(f"checkpoint {p} is a file but not a .safetensors file; " + _EXPECTED)
    if (p / atomic.MANIFEST).exists():
        return p
    if _is_safetensors_dir(p):
        return p
    if _run_root(p) is not None or (p / "config.toml").exists() or (p / "checkpoints").exists():
        return _newest_of_run(p)
    raise ValueError(f"checkpoint {p} is neither a run, a checkpoint nor safetensors; "
                     + _EXPECTED)


def _format(path: Path) -> str:
    return "dcp" if (path / atomic.MANIFEST).exists() else "safetensors"


def config_from_dict(config: dict[str, Any], where: str) -> LlamaConfig | VLAConfig:
    """A model config from its ``dataclasses.asdict`` form (a checkpoint manifest's).

    Raises:
        ValueError: fields the config classes do not have, or values they refuse.
    """
    try:
        if "decoder" in config:  # a VLAConfig nests its decoder's LlamaConfig
            rest = {k: v for k, v in config.items() if k != "decoder"}
            return VLAConfig(decoder=LlamaConfig(**config["decoder"]), **rest)
        return LlamaConfig(**config)
    except TypeError as exc:  # an unknown field: a checkpoint of another version or model
        raise ValueError(f"{where}: model config {sorted(config)} does not fit a shardwise "
                         f"LlamaConfig or VLAConfig: {exc}") from None


def read_model_config(path: str | os.PathLike) -> LlamaConfig | VLAConfig:
    """The config of the model saved at ``path`` (anything :func:`resolve_checkpoint` takes).

    A shardwise checkpoint's ``manifest.json`` holds the whole config (``"model": {"class",
    "config"}``, a Transformer's LlamaConfig or a VisionLanguageAction's VLAConfig, also
    under a pipeline); safetensors have Hugging Face's ``config.json`` (Llama or Mixtral).

    Raises:
        ValueError: see :func:`resolve_checkpoint`; a manifest without a model config.
        CheckpointError: an unreadable manifest or config.json.
    """
    p = resolve_checkpoint(path)
    if _format(p) == "dcp":
        manifest = atomic.read_manifest(p)
        model = manifest.get("model") or {}
        if not model.get("config"):
            raise ValueError(f"checkpoint {p}: manifest.json has no model config (class "
                             f"{model.get('class')!r}); expected a shardwise Transformer or "
                             f"VisionLanguageAction checkpoint")
        return config_from_dict(model["config"], str(p / atomic.MANIFEST))
    file = (p if p.is_dir() else p.parent) / "config.json"
    if not file.exists():
        raise ValueError(f"safetensors {p}: no config.json beside it; expected the folder "
                         f"`shardwise checkpoint export` or save_pretrained writes")
    return config_from_hf(json.loads(file.read_text()), str(file))


def _materialise(config: LlamaConfig | VLAConfig, device: torch.device) -> nn.Module:
    """The model built on meta, allocated on ``device`` with no init of its weights (they are
    loaded next); non-persistent buffers (RoPE tables), which no checkpoint holds, are
    recomputed by their module."""
    model = build_model(config, device="meta")
    model.to_empty(device=device)
    for name, module in model.named_modules():
        if module._non_persistent_buffers_set:
            if not hasattr(module, "reset_parameters"):
                raise AssertionError(f"{name}: non-persistent buffers without reset_parameters")
            module.reset_parameters()
    return model


def _load_dcp(path: Path, model: nn.Module, verify: bool) -> int | None:
    """Read the model tensors of checkpoint ``path`` into ``model`` in this process
    ([Note: loading any layout into one process]); returns the step."""
    manifest = atomic.verify_checkpoint(path) if verify else atomic.read_manifest(path)
    atomic.verify_metadata_file(path, manifest)
    reader = SafeReader(path)
    md = reader.read_metadata()
    pickled = [k for k, v in md.state_dict_metadata.items() if not hasattr(v, "chunks")]
    if pickled:
        raise CheckpointError(f"checkpoint {path} stores pickled Python objects ({pickled[0]})"
                              f"; shardwise will not unpickle them", path=path, tensor=pickled[0])
    targets = model_targets(model, md, path, strict=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": targets}, storage_reader=reader, no_dist=True)
    model.load_state_dict(targets)
    return manifest.get("step")


def _safetensors_step(path: Path) -> int | None:
    index = (path if path.is_dir() else path.parent) / INDEX_FILE
    if not index.exists():
        return None
    return (json.loads(index.read_text()).get("metadata") or {}).get("step")


def _run_dir(path: Path) -> Path | None:
    run = path.parent.parent if path.parent.name == "checkpoints" else None
    return run if run is not None and (run / "config.toml").exists() else None


def load_model(path: str | os.PathLike, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, verify: bool = True) -> LoadedModel:
    """Load a trained model into this process for inference.

    Works for checkpoints saved under any layout (ZeRO stage, tp, pp, ep, cp, world size;
    [Note: loading any layout into one process]) and for Hugging Face safetensors of a
    Llama or Mixtral; needs no process group.

    Args:
        path: a run directory, a checkpoint folder or safetensors (see
            :func:`resolve_checkpoint`).
        device: where the model lives (default ``"cpu"``).
        dtype: the parameters' dtype (default fp32; floating buffers such as RoPE tables and
            routing biases stay fp32).
        verify: check a checkpoint folder's checksums first (default True; a run directory's
            newest checkpoint is always verified while it is chosen).

    Returns:
        A :class:`LoadedModel`: the model in eval mode with gradients off, and its config,
        step, format and path.

    Raises:
        ValueError: a path that is none of the accepted kinds (see
            :func:`resolve_checkpoint`), or a config no shardwise model has.
        CheckpointError: damaged files, or tensors that do not fit the config.
    """
    given = Path(path).expanduser()
    p = resolve_checkpoint(given)
    config = read_model_config(p)
    device = torch.device(device)
    model = _materialise(config, device)
    fmt = _format(p)
    if fmt == "dcp":
        step = _load_dcp(p, model, verify=verify and p == given)
    else:
        if not isinstance(config, LlamaConfig):
            raise ValueError(f"safetensors {p}: only Llama / Mixtral models have a safetensors "
                             f"layout, got {type(config).__name__}")
        import_safetensors(p, model)
        step = _safetensors_step(p)
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.to(dtype)
    model.eval().requires_grad_(False)
    return LoadedModel(model, config, p, fmt, step, _run_dir(p) if fmt == "dcp" else None)

