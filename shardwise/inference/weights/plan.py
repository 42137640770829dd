"""What a streamed model reads, and where: its units, their work-buffer layout, the resident
tensors; everything checked against the source before the first forward.

[Note: streamed units]
A unit is a module whose hooks bring its weights in before it runs and send them back to
meta after: each ``model.layers[i]``, and the output head (``model.output``; for a tied head
the embedding matrix, installed on ``tok_embeddings`` for the head's call only). A unit's
streamed tensors are its parameters of two or more dims (the linears, stacked experts,
routers' gates); its 1-D tensors (norm gains, biases) and every buffer are resident, read
once (they are a few KiB per layer), as are the final norm's gain and any other parameter
outside a unit. Non-persistent buffers (the RoPE tables) are not in checkpoints: they are
allocated and recomputed once by their module's ``reset_parameters``. The embedding is not a
unit: its lookup reads only the rows of the batch's tokens (stream.py).

Inside a unit, each tensor is a view of one flat work buffer at a 64-byte aligned offset
(the alignment torch's allocator gives a tensor of its own, so kernels see the same pointer
alignment as for the resident model and the logits stay bitwise equal).
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.inference.weights.layout import Source, TensorEntry

__all__ = ["Slot", "Unit", "WorkBuffer", "plan_units", "check_model", "materialise_resident",
           "view_of"]

_ALIGN_ELEMS = 64  # bytes; divided by the element size below


@dataclass(frozen=True)
class Slot:
    """One streamed tensor of a unit: where it goes in the model and in the work buffer."""

    module: nn.Module
    attr: str
    name: str
    entry: TensorEntry
    offset: int  # elements into the work buffer
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Unit:
    """A streamed unit ([Note: streamed units])."""

    name: str
    module: nn.Module
    slots: tuple[Slot, ...]
    numel: int  # work-buffer elements, alignment included
    staging: int  # staging bytes (largest piece that cannot be read in place)

    @property
    def nbytes_read(self) -> int:
        """Bytes one load of the unit reads from disk."""
        return sum(s.entry.nbytes for s in self.slots)


def view_of(work: torch.Tensor, s: Slot) -> torch.Tensor:
    return work[s.offset:s.offset + math.prod(s.shape)].view(s.shape)


class WorkBuffer:
    """One of a stream's ``prefetch + 1`` slots: a flat work buffer the unit's tensors view,
    a staging buffer, the unit it holds (None: free) and its load in flight."""

    def __init__(self, numel: int, staging: int, dtype: torch.dtype) -> None:
        self.work = torch.empty(numel, dtype=dtype)
        # two halves: one is read into while the other is decoded
        self.staging = torch.empty(2, staging, dtype=torch.uint8) if staging else None
        self.unit: int | None = None
        self.future: Future | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the work and staging buffers."""
        return self.work.nbytes + (self.staging.nbytes if self.staging is not None else 0)


def check_model(model: nn.Module) -> None:
    """Refuse a model that is not a shardwise decoder on meta.

    Raises:
        ValueError: naming what is missing or not on meta.
    """
    for attr in ("tok_embeddings", "layers", "norm", "output", "rope"):
        if not hasattr(model, attr):
            raise ValueError(f"stream_weights needs a shardwise Transformer (tok_embeddings, "
                             f"layers, norm, output, rope); {type(model).__name__} has no "
                             f"{attr!r}")
    on = [n for n, p in model.named_parameters() if not p.is_meta]
    if on:
        raise ValueError(f"stream_weights needs a model built on the meta device "
                         f"(build_model(cfg, device='meta')); parameter {on[0]!r} is on "
                         f"{dict(model.named_parameters())[on[0]].device}")


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def _unit(model: nn.Module, name: str, module: nn.Module, names: list[str], source: Source,
          dtype: torch.dtype) -> Unit:
    align = max(1, _ALIGN_ELEMS // torch.empty(0, dtype=dtype).element_size())
    slots, offset, staging = [], 0, 0
    params = dict(model.named_parameters())
    for fqn in names:
        shape = tuple(params[fqn].shape)
        entry = source.entry(fqn, shape)
        owner, attr = _owner(model, fqn)
        slots.append(Slot(owner, attr, fqn, entry, offset, shape))
        offset += -(-math.prod(shape) // align) * align
        staging = max(staging, entry.staging_bytes(dtype))
    return Unit(name, module, tuple(slots), offset, staging)


def plan_units(model: nn.Module, source: Source) -> tuple[list[Unit], list[str], torch.dtype]:
    """The model's units, its resident tensor names, and the working dtype.

    Every parameter and persistent buffer is looked up in ``source`` here, so a missing or
    misshapen tensor fails before anything is read.

    Returns:
        ``(units in call order, resident names, working dtype)``.

    Raises:
        ValueError: a tensor the source lacks or holds in another shape (named), streamed
            weights of more than one dtype.
    """
    check_model(model)
    params = dict(model.named_parameters())
    tied = "tok_embeddings.weight" if "output.weight" not in params else None
    streamed = [n for n, p in params.items() if p.dim() >= 2 and n != "tok_embeddings.weight"]
    dtypes = {params[n].dtype for n in streamed} | {params["tok_embeddings.weight"].dtype}
    if len(dtypes) != 1:
        raise ValueError(f"stream_weights needs one dtype for the streamed weights, the model "
                         f"has {sorted(str(d) for d in dtypes)}")
    dtype = dtypes.pop()
    units = []
    for i, layer in enumerate(model.layers):
        prefix = f"layers.{i}."
        units.append(_unit(model, f"layers.{i}", layer,
                           [n for n in streamed if n.startswith(prefix)], source, dtype))
    head = [tied] if tied else [n for n in streamed if n.startswith("output.")]
    units.append(_unit(model, "head", model.output, head, source, dtype))
    in_units = {s.name for u in units for s in u.slots} | {"tok_embeddings.weight"}
    resident = [n for n in params if n not in in_units]
    persistent = {n for n, _ in model.named_buffers()} - _non_persistent(model)
    resident += sorted(persistent)
    for n in resident:
        t = params[n] if n in params else model.get_buffer(n)
        source.entry(n, tuple(t.shape))
    source.entry("tok_embeddings.weight", tuple(params["tok_embeddings.weight"].shape))
    return units, resident, dtype


def _non_persistent(model: nn.Module) -> set[str]:
    out = set()
    for mname, m in model.named_modules():
        for b in getattr(m, "_non_persistent_buffers_set", ()):
            out.add(f"{mname}.{b}" if mname else b)
    return out


def materialise_resident(model: nn.Module, source: Source, resident: list[str],
                         read) -> dict[str, torch.Tensor]:
    """Read the resident tensors into the model and recompute the non-persistent buffers.

    Args:
        read: ``read(entry, out)`` filling ``out``.

    Returns:
        name -> the meta tensor it replaced (to restore on close).

    Raises:
        ValueError: a module with non-persistent buffers and no ``reset_parameters``.
    """
    saved: dict[str, torch.Tensor] = {}
    for name in resident:
        owner, attr = _owner(model, name)
        is_param = attr in owner._parameters
        old = owner._parameters[attr] if is_param else owner._buffers[attr]
        saved[name] = old
        out = torch.empty(old.shape, dtype=old.dtype)
        read(source.entry(name, tuple(old.shape)), out)
        if is_param:
            owner._parameters[attr] = nn.Parameter(out, requires_grad=False)
        else:
            owner._buffers[attr] = out
    for name in sorted(_non_persistent(model)):
        owner, attr = _owner(model, name)
        saved[name] = owner._buffers[attr]
        owner._buffers[attr] = torch.empty_like(saved[name], device="cpu")
    for mname, m in model.named_modules():
        if getattr(m, "_non_persistent_buffers_set", None):
            if not hasattr(m, "reset_parameters"):
                raise ValueError(f"stream_weights: module {mname!r} has non-persistent buffers "
                                 f"and no reset_parameters() to compute them")
            m.reset_parameters()
    return saved
