"""A DCP step folder as a streamed-weights source: each chunk's raw bytes located on disk.

[Note: reading DCP chunks in place]
DCP's file-system writer stores each chunk of each tensor as one ``torch.save`` blob at the
``(file, offset, length)`` its ``.metadata`` records (``storage_data``). A ``torch.save``
blob is an uncompressed zip archive: ``<archive>/data.pkl`` (a small pickle saying
``_rebuild_tensor_v2(storage, storage_offset, size, stride)``) and ``<archive>/data/0``, the
storage's raw bytes. So the chunk's values are a plain byte range of the ``.distcp`` file:
we read the zip directory and ``data.pkl`` once per chunk (a few hundred bytes, when the
source is opened) and then ``preadv`` the storage bytes straight into the work buffer on
every pass, never ``torch.load``, never a copy of the blob. The pickle is read by a
restricted unpickler that builds nothing: it records the rebuild arguments and refuses any
global but the four a tensor blob uses. DCP keeps a chunk's memory format (it clones only
tensors whose storage is larger than they are), so strides may be a permutation of
row-major: the piece records it and the read copies through ``permute``. A chunk that is a
piece of the global tensor (ZeRO rows, tensor-parallel columns, any layout) fills its
region at ``chunk.offsets``; together the chunks cover the tensor, as DCP's own load needs.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.metadata import safe_load_metadata
from shardwise.inference.weights.layout import Piece, Source, TensorEntry

__all__ = ["dcp_source"]

_STORAGES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64,
             "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
             "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
             "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
             "Float8_e4m3fnStorage": torch.float8_e4m3fn,
             "Float8_e5m2Storage": torch.float8_e5m2}


class _Range(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a seekable file (zipfile)."""

    def __init__(self, f, offset: int, length: int) -> None:
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.offset + self.pos)
        data = self.f.read(max(n, 0))
        self.pos += len(data)
        return data


class _Recorder(pickle.Unpickler):
    """Reads a tensor blob's ``data.pkl`` into ``(dtype, storage_offset, size, stride)``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, offset, size, stride)
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise ValueError(f"a DCP tensor blob refers to {module}.{name}; expected a plain "
                         f"tensor (_rebuild_tensor_v2)")

    def persistent_load(self, pid: Any) -> Any:
        return pid  # ('storage', dtype, key, location, numel)


def _locate(f, path: str, offset: int, length: int) -> tuple[int, torch.dtype, int,
                                                               tuple, tuple]:
    """(absolute offset of the storage bytes, dtype, storage offset, size, stride)."""
    zf = zipfile.ZipFile(_Range(f, offset, length))
    infos = {i.filename.split("/", 1)[-1]: i for i in zf.infolist()}
    if "data.pkl" not in infos or "data/0" not in infos or len(
            [k for k in infos if k.startswith("data/")]) != 1:
        raise ValueError(f"{path} at {offset}: not a one-tensor torch.save blob "
                         f"({sorted(infos)})")
    storage, st_off, size, stride = _Recorder(io.BytesIO(zf.read(infos["data.pkl"]))).load()
    data = infos["data/0"]
    if data.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{path} at {offset}: the tensor's bytes are compressed")
    f.seek(offset + data.header_offset)
    local = f.read(30)
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    start = offset + data.header_offset + 30 + name_len + extra_len
    dtype, numel = storage[1], storage[4]
    if data.file_size != numel * torch.empty(0, dtype=dtype).element_size():
        raise ValueError(f"{path} at {offset}: storage of {data.file_size} bytes for {numel} "
                         f"{dtype} elements")
    return start, dtype, st_off, tuple(size), tuple(stride)


def _layout(size: tuple, stride: tuple, where: str) -> tuple[tuple, tuple | None]:
    """(stored shape, perm) of a dense chunk: ``region = stored.permute(perm)``."""
    order = sorted(range(len(size)), key=lambda d: (-stride[d], d))
    stored = tuple(size[d] for d in order)
    expect, acc = [0] * len(size), 1
    for d in reversed(order):
        expect[d] = acc
        acc *= size[d]
    if any(size[d] > 1 and stride[d] != expect[d] for d in range(len(size))):
        raise ValueError(f"{where}: chunk of size {size} has strides {stride}, which are not "
                         f"dense")
    if order == sorted(order):
        return tuple(size), None
    inverse = tuple(sorted(range(len(order)), key=lambda i: order[i]))
    return stored, inverse


def dcp_source(folder: str | Path) -> Source:
    """The model tensors (``model.*``) of a DCP step folder, located in place ([Note:
    reading DCP chunks in place]).

    Args:
        folder: a checkpoint step folder (``.metadata`` and ``__<rank>_<i>.distcp`` files).

    Returns:
        The :class:`Source` (its config from ``manifest.json`` when present).

    Raises:
        CheckpointError: an unreadable or unsafe ``.metadata``.
        ValueError: a chunk that is not a plain tensor blob.
    """
    import json

    folder = Path(folder)
    md = safe_load_metadata(folder / ".metadata")
    by_fqn: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in md.storage_data.items():
        by_fqn.setdefault(index.fqn, []).append((index, info))
    entries: dict[str, TensorEntry] = {}
    handles: dict[str, Any] = {}
    try:
        for key, tmd in md.state_dict_metadata.items():
            if not key.startswith("model.") or not hasattr(tmd, "chunks"):
                continue
            pieces = []
            for index, info in by_fqn.get(key, []):
                if getattr(info, "transform_descriptors", None):
                    raise ValueError(f"{folder}: {key} is stored with transforms "
                                     f"{info.transform_descriptors}; expected raw bytes")
                path = str(folder / info.relative_path)
                if path not in handles:
                    handles[path] = open(path, "rb")
                start, dtype, st_off, size, stride = _locate(handles[path], path, info.offset,
                                                             info.length)
                stored, perm = _layout(size, stride, f"{path} {key}")
                item = torch.empty(0, dtype=dtype).element_size()
                numel = 1
                for s in size:
                    numel *= s
                pieces.append(Piece(path, start + st_off * item, numel * item,
                                    tuple(index.offset), stored, perm))
            fqn = key[len("model."):]
            covered = sum(p.nbytes for p in pieces) // tmd.properties.dtype.itemsize
            if covered != tmd.size.numel():
                raise ValueError(f"{folder}: the chunks of {key} hold {covered} of its "
                                 f"{tmd.size.numel()} elements (a checkpoint missing a rank's "
                                 f"file?)")
            entries[fqn] = TensorEntry(fqn, tuple(tmd.size), tmd.properties.dtype,
                                       tuple(sorted(pieces, key=lambda p: p.dest)))
    finally:
        for f in handles.values():
            f.close()
    manifest = folder / "manifest.json"
    config = None
    if manifest.exists():
        config = (json.loads(manifest.read_text()).get("model") or {}).get("config")
    files = sorted({p.path for e in entries.values() for p in e.pieces})
    return Source("dcp", folder, entries, config, files)
