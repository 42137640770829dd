"""Tensor-parallel styles applied to single modules: parameters cut to this rank's piece
(each with its :class:`~shardwise.distributed.placement.Placement`) and the module's class
swapped for one whose forward adds Megatron's operators ([Note: f and g] in ops.py).

[Note: TP modules stay plain] A styled module is still an ``nn.Linear`` / ``nn.Embedding``
(its class becomes a subclass, as FSDP2 does) holding plain local tensors, not DTensors:
the ZeRO engine shards them like any parameter, and the engine's own swapping of gathered
parameters keeps working because the new forward reads ``self.weight`` at call time. The
communication is explicit autograd functions, as in Megatron.

[Note: low-bit under TP] A layer converted by ``apply_low_precision`` keeps its style; its
matmul goes through ``module_linear``, which casts this rank's piece with scales of its own
(per shard: a column-parallel weight's scale covers its output features, a row-parallel
one's its input features, and the row-parallel partial sums are summed after dequantising),
so no amax crosses the tp group. Under sequence parallelism the low-bit layer reads the
gathered input and saves it for its backward (``sequence_linear``'s re-gather is for
high-precision layers); the saved bytes are those of tensor parallelism without SP.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.distributed.mesh import split_axis
from shardwise.distributed.placement import Axis, Placement, placement_of, set_placement
from shardwise.parallel.lowbit.linear import lowbit_state, module_linear
from shardwise.shard.memory import MemoryTracker
from shardwise.parallel.tensor.ops import (SequenceInput, copy_to_region, gather_last_dim,
                                           reduce_from_region, scatter_sequence,
                                           sequence_linear)

__all__ = ["TPContext", "STYLES", "apply_style", "replicate_param", "copy_style"]

STYLES = ("colwise", "rowwise", "vocab", "colwise_output", "sequence", "colwise_gather")
"""Styles a plan may name; ``colwise_gather`` is a column-parallel layer whose output is
gathered whole (what Hugging Face calls ``colwise_rep`` / ``colwise_gather_output``)."""


@dataclass
class TPContext:
    """What every styled module of one ``apply_tp`` call shares.

    Attributes:
        tp: the tensor-parallel axis.
        sequence_parallel: activations between regions are split along the sequence.
        loss_parallel: the LM head returns vocab-sharded logits.
    """

    tp: Axis
    sequence_parallel: bool
    loss_parallel: bool
    kv_axes: dict = field(default_factory=dict)
    tracker: MemoryTracker = field(default_factory=MemoryTracker)
    _key: object = None
    _entry: tuple | None = None

    @property
    def group(self):
        return self.tp.group

    def region_input(self, x: torch.Tensor, label: str):
        """The input of the region ``x`` enters, made once per ``x``: ``(whole input,
        SequenceInput or None)``. Several linears reading one tensor (q, k, v) share one
        ``f`` or one sequence all-gather, so the backward reduces once for all of them."""
        # an inference tensor (torch.inference_mode: the KV-cache decoder) has no version
        # counter; it cannot change between the linears of one region anyway
        key = (None if x.is_inference() else x._version,)
        if self._entry is not None and self._key is not None and self._key() is x \
                and self._entry[0] == key:
            return self._entry[1], self._entry[2]
        self.clear()
        if self.sequence_parallel:
            src = SequenceInput(self.group, label, self.tracker)
            full = src.gather(x)
            if self.tp.size > 1:  # the gathered input is held until the next region
                self.tracker.add("tp_comm", full.numel() * full.element_size())
        else:
            src, full = None, copy_to_region(x, self.group, f"{label}.tp_f_all_reduce")
        self._key, self._entry = weakref.ref(x), (key, full, src)
        return full, src

    def leave_region(self, x: torch.Tensor, label: str) -> torch.Tensor:
        """Partial sums of a row-parallel output -> their sum (on this rank's sequence
        piece under sequence parallelism)."""
        if self.sequence_parallel:
            if x.dim() < 2 or x.shape[1] % self.tp.size:
                raise ValueError(f"{label}: sequence parallelism splits the sequence (dim 1 "
                                 f"of {tuple(x.shape)}) over tp={self.tp.size} ranks; expected "
                                 f"a sequence length divisible by {self.tp.size}")
            return scatter_sequence(x, self.group, f"{label}.sp_reduce_scatter",
                                    f"{label}.sp_all_gather")
        return reduce_from_region(x, self.group, f"{label}.tp_g_all_reduce")

    def clear(self) -> None:
        """Drop the cached region input (a new region, or the end of a forward pass)."""
        if self._entry is not None and self._entry[2] is not None and self.tp.size > 1:
            full = self._entry[1]
            self.tracker.sub("tp_comm", full.numel() * full.element_size())
        self._key, self._entry = None, None

    def kv_split(self, heads: int) -> tuple[Axis, Axis]:
        """(one rank per KV head, the ranks holding copies of this rank's head)."""
        if heads not in self.kv_axes:
            outer, og, inner, ig = split_axis(list(self.tp.ranks), heads)
            self.kv_axes[heads] = (Axis("tp_kv", tuple(outer), og),
                                   Axis("tp_kv_copies", tuple(inner), ig))
        return self.kv_axes[heads]


@dataclass
class ModuleTP:
    """Per-module state of a styled module."""

    ctx: TPContext
    label: str
    gather_output: bool = False


class ColwiseParallel:
    """Column-parallel forward: ``f`` (or the sequence all-gather), then this rank's output
    features; gathered whole again when ``gather_output``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp: ModuleTP = self._shardwise_tp
        full, src = tp.ctx.region_input(x, tp.label)
        weight, bias = self.weight, getattr(self, "bias", None)
        if src is not None and lowbit_state(self) is None:
            out = sequence_linear(full, x, src, weight, bias)  # (B, T, F/tp)
        else:  # a low-bit layer casts the gathered input itself ([Note: low-bit under TP])
            out = module_linear(self, full, weight, bias)  # (..., F/tp)
        if tp.gather_output:
            out = gather_last_dim(out, tp.ctx.group, f"{tp.label}.tp_all_gather_output")
        return out


class RowwiseParallel:
    """Row-parallel forward: this rank's input features -> partial sums -> ``g`` (or the
    sequence reduce-scatter); the bias is added once, after the reduction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp: ModuleTP = self._shardwise_tp
        out = tp.ctx.leave_region(module_linear(self, x, self.weight), tp.label)  # (B, T[/tp], C)
        return out if self.bias is None else out + self.bias


class VocabParallel:
    """Vocab-parallel embedding: this rank looks up the ids in its rows (zeros for the
    others), then ``g`` (or the sequence reduce-scatter) sums the pieces."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tp: ModuleTP = self._shardwise_tp
        rows = self.weight.shape[0]
        start = tp.ctx.tp.index * rows
        local = ids - start
        outside = (local < 0) | (local >= rows)
        pad = self.padding_idx
        pad = pad - start if pad is not None and 0 <= pad - start < rows else None
        out = F.embedding(local.masked_fill(outside, 0), self.weight, pad, self.max_norm,
                          self.norm_type, self.scale_grad_by_freq, self.sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C)
        return tp.ctx.leave_region(out, tp.label)


_MIXINS = {"colwise": ColwiseParallel, "colwise_gather": ColwiseParallel,
           "colwise_output": ColwiseParallel, "rowwise": RowwiseParallel,
           "vocab": VocabParallel}


@functools.lru_cache(maxsize=None)
def _styled_class(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin``'s forward (cached, so every styled Linear shares one class)."""
    return type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})


# --------------------------------------------------------------------------- parameters


def _cut(module: nn.Module, attr: str, placement: Placement) -> None:
    """Replace ``module.<attr>``'s data by this rank's piece and record its placement."""
    p = module._parameters[attr]
    if placement_of(p) is not None:
        raise ValueError(f"parameter {attr} of {type(module).__name__} is already laid out "
                         f"({placement_of(p).describe()}): a tied parameter cannot take two "
                         f"tensor-parallel styles")
    if p.is_meta:
        p.data = torch.empty(placement.local_shape(), dtype=p.dtype, device="meta")
    else:
        p.data = placement.local_piece(p.detach()).contiguous().clone()
    set_placement(p, placement)


def replicate_param(p: nn.Parameter, ctx: TPContext, summed: bool) -> None:
    """Record ``p`` as a whole copy on every tensor rank; ``summed``: its gradient is a
    partial sum over the tensor ranks (sequence-parallel regions)."""
    tp = ctx.tp
    set_placement(p, Placement(p.shape, replicas=(tp,), grad_reduce=(tp,) if summed else ()))


def _heads(module_name: str, count: int, tp: int, what: str) -> None:
    if count % tp and tp % count:
        raise ValueError(f"{module_name}: {what}={count} is not divisible by tp={tp} (and tp "
                         f"is not a multiple of it)")


def _cut_colwise(name: str, module: nn.Module, ctx: TPContext, head_dim: int | None,
                 q_heads: int | None) -> None:
    tp, out = ctx.tp, module.weight.shape[0]
    shape = module.weight.shape
    heads = out // head_dim if head_dim else None
    if heads is not None and heads < tp.size and q_heads is not None and heads < q_heads:
        _heads(name, heads, tp.size, "n_kv_heads")  # grouped-query: KV heads copied
        kv, copies = ctx.kv_split(heads)
        w = Placement(shape, splits=((0, kv),), replicas=(copies,), grad_reduce=(copies,),
                      norm_reduce=(kv,))
    else:
        if heads is not None and heads % tp.size:
            raise ValueError(f"{name}: {heads} heads are not divisible by tp={tp.size}")
        if out % tp.size:
            raise ValueError(f"{name}: out_features={out} is not divisible by tp={tp.size}")
        w = Placement(shape, splits=((0, tp),), norm_reduce=(tp,))
    _cut(module, "weight", w)
    if getattr(module, "bias", None) is not None:
        b = Placement(module.bias.shape, splits=tuple((0, a) for _, a in w.splits),
                      replicas=w.replicas, grad_reduce=w.grad_reduce, norm_reduce=w.norm_reduce)
        _cut(module, "bias", b)


def _cut_rowwise(name: str, module: nn.Module, ctx: TPContext, head_dim: int | None) -> None:
    tp, cols = ctx.tp, module.weight.shape[1]
    if head_dim and cols % head_dim == 0 and (cols // head_dim) % tp.size:
        raise ValueError(f"{name}: {cols // head_dim} heads are not divisible by tp={tp.size}")
    if cols % tp.size:
        raise ValueError(f"{name}: in_features={cols} is not divisible by tp={tp.size}")
    _cut(module, "weight", Placement(module.weight.shape, splits=((1, tp),), norm_reduce=(tp,)))
    if getattr(module, "bias", None) is not None:
        replicate_param(module.bias, ctx, summed=ctx.sequence_parallel)


def _cut_vocab(name: str, weight_owner: nn.Module, ctx: TPContext) -> None:
    tp, rows = ctx.tp, weight_owner.weight.shape[0]
    if rows % tp.size:
        raise ValueError(f"{name}: vocabulary of {rows} is not divisible by tp={tp.size}")
    _cut(weight_owner, "weight", Placement(weight_owner.weight.shape, splits=((0, tp),),
                                           norm_reduce=(tp,)))


def apply_style(name: str, module: nn.Module, style: str, ctx: TPContext,
                head_dim: int | None = None, q_heads: int | None = None) -> None:
    """Apply one style to one module in place (see layers' module doc).

    Args:
        name: the module's path (for labels and errors).
        module: the module.
        style: one of :data:`STYLES`.
        ctx: the shared context of this ``apply_tp`` call.
        head_dim: features per attention head when ``module`` projects heads (query, key,
            value or output projection), so heads are never cut apart.
        q_heads: query heads of the attention (tells KV projections from query ones).

    Raises:
        ValueError: a style that does not fit the module, naming both; sizes not divisible
            by the tensor-parallel degree.
    """
    if style not in STYLES:
        raise ValueError(f"{name}: unknown tensor-parallel style {style!r}; expected one of "
                         f"{STYLES}")
    if style == "sequence":
        direct = [p for p in module._parameters.values() if p is not None]
        if not direct:
            raise ValueError(f"style 'sequence' does not fit module {name} "
                             f"({type(module).__name__}): it has no parameters of its own")
        for p in direct:
            replicate_param(p, ctx, summed=ctx.sequence_parallel)
        return
    is_linear = isinstance(module, nn.Linear)
    tied = style == "colwise_output" and "weight" not in module._parameters \
        and isinstance(getattr(module, "weight", None), nn.Parameter)
    if style == "vocab" and not isinstance(module, nn.Embedding):
        raise ValueError(f"style 'vocab' does not fit module {name} ({type(module).__name__}): "
                         f"it needs an nn.Embedding")
    if style in ("colwise", "colwise_gather", "rowwise") and not is_linear:
        raise ValueError(f"style {style!r} does not fit module {name} "
                         f"({type(module).__name__}): it needs an nn.Linear")
    if style == "colwise_output" and not (is_linear or tied):
        raise ValueError(f"style 'colwise_output' does not fit module {name} "
                         f"({type(module).__name__}): it needs an nn.Linear or a head that "
                         f"reads a tied embedding's weight")
    if style == "vocab":
        _cut_vocab(name, module, ctx)
    elif style == "rowwise":
        _cut_rowwise(name, module, ctx, head_dim)
    elif tied:
        owner = placement_of(module.weight)
        if owner is None or not owner.splits or owner.splits[0][1].name != "tp":
            raise ValueError(f"{name} reads a tied embedding weight that is not vocab-parallel: "
                             f"give the embedding the style 'vocab'")
    else:  # colwise, colwise_gather, an untied colwise_output (heads only for projections)
        _cut_colwise(name, module, ctx, head_dim, q_heads)
    gather = style == "colwise_gather" or (style == "colwise_output" and not ctx.loss_parallel)
    module._shardwise_tp = ModuleTP(ctx, name, gather_output=gather)
    module.__class__ = _styled_class(_MIXINS[style], type(module))


def copy_style(src: nn.Module, dst: nn.Module) -> None:
    """Give ``dst`` the tensor-parallel style of ``src``, in place: the same context, label
    and output gathering, its class swapped the same way, and each of its direct parameters
    the placement of ``src``'s parameter of the same name. A no-op when ``src`` has no style.

    Used for the last pipeline stage's mirror of a tied head ([Note: tied embeddings across
    stages] in pipeline/split.py): it must compute what the styled head computes.

    Raises:
        ValueError: ``dst`` has a parameter ``src`` lacks, or of another local shape.
    """
    tp: ModuleTP | None = getattr(src, "_shardwise_tp", None)
    if tp is None:
        return
    for attr, p in dst._parameters.items():
        mine = getattr(src, attr, None)
        if p is None or not isinstance(mine, torch.Tensor) or mine.shape != p.shape:
            raise ValueError(f"copy_style: {type(dst).__name__}.{attr} has no counterpart of "
                             f"shape {tuple(p.shape) if p is not None else None} in "
                             f"{type(src).__name__} ({tp.label})")
        set_placement(p, placement_of(mine))
    mixin = type(src).__bases__[0]  # _styled_class puts the style's mixin first
    dst._shardwise_tp = ModuleTP(tp.ctx, tp.label, gather_output=tp.gather_output)
    dst.__class__ = _styled_class(mixin, type(dst))
