"""Reading DCP's ``.metadata`` without trusting it: a restricted unpickler.

[Note: unpickling DCP metadata]
``torch.distributed.checkpoint`` stores its global index (tensor names, shapes, dtypes, and
which byte range of which file holds each chunk) as a *pickle* in ``.metadata``, and its own
``FileSystemReader.read_metadata`` calls plain ``pickle.load`` on it: a crafted file would run
arbitrary code the moment a checkpoint is opened. Checksums alone do not fix that: the manifest
that holds them sits in the same folder and whoever can replace ``.metadata`` can replace it
too. So we do both, for different threats:

* **Malice**: :class:`SafeUnpickler` resolves only the globals a DCP index is made of (the
  dataclasses of ``torch.distributed.checkpoint.metadata``, ``filesystem._StorageInfo``,
  ``torch.Size``, torch dtypes and layouts, the memory-format enum, ``pathlib`` paths) and
  refuses anything else by name, before any object is built. Those classes only store
  fields; none runs code on construction. :class:`SafeReader` is DCP's reader with
  ``read_metadata`` replaced by it. Tensor data is read by DCP with
  ``torch.load(weights_only=True)`` (PyTorch's own restricted unpickler), and we never put
  pickled Python objects (DCP "bytes" entries, which DCP would load with
  ``weights_only=False``) in a checkpoint: all non-tensor state is JSON in
  ``manifest.json``; :func:`shardwise.checkpoint.load` refuses a checkpoint whose index
  holds bytes entries.
* **Accident** (truncation, bit rot, a half-copied folder): the manifest's sha256 of
  ``.metadata`` is checked before it is unpickled, so a damaged index is reported as such
  rather than as an unpickling error (see atomic.py).

The allow-list is the contract with DCP's format; a future DCP that pickles another class
makes loading fail loudly, naming the class, rather than silently trusting it.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from shardwise.checkpoint.errors import CheckpointError

__all__ = ["SafeUnpickler", "SafeReader", "safe_load_metadata", "METADATA_FILE"]

METADATA_FILE = ".metadata"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = frozenset({
    *((_DCP_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                    "ChunkStorageMetadata", "TensorProperties",
                                    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})


class SafeUnpickler(pickle.Unpickler):
    """Unpickles a DCP metadata index and nothing else (see [Note: unpickling DCP metadata]).

    Args:
        file: a binary file object.
        where: the file's name, for messages.
    """

    def __init__(self, file: io.BufferedIOBase, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        """Resolve an allowed global; refuse any other by name (nothing is built first)."""
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.where} refers to {module}.{name}, which is not part of a "
                              f"DCP metadata index; refusing to unpickle it",
                              file=os.path.basename(self.where))


def safe_load_metadata(path: str | os.PathLike) -> Metadata:
    """DCP's ``Metadata`` from the ``.metadata`` file at ``path`` via :class:`SafeUnpickler`.

    Raises:
        CheckpointError: the file is missing, unreadable, not a pickle of DCP metadata, or
            refers to a class outside the allow-list.
    """
    where = str(path)
    try:
        with open(path, "rb") as f:
            obj = SafeUnpickler(f, where).load()
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot read {where}: {exc.strerror or exc}",
                              file=METADATA_FILE) from None
    except Exception as exc:  # noqa: BLE001 - any malformed pickle
        raise CheckpointError(f"{where} is not a valid DCP metadata index: {exc}",
                              file=METADATA_FILE) from None
    if not isinstance(obj, Metadata):
        raise CheckpointError(f"{where} holds a {type(obj).__name__}, not DCP metadata",
                              file=METADATA_FILE)
    return obj


class SafeReader(FileSystemReader):
    """DCP's file-system reader, reading ``.metadata`` with :class:`SafeUnpickler` (once).

    Args:
        path: the checkpoint folder.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's index via :func:`safe_load_metadata`, read once and cached."""
        if self._metadata is None:
            self._metadata = safe_load_metadata(Path(self.path) / METADATA_FILE)
        md = self._metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
