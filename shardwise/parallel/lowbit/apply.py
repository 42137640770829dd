"""``apply_low_precision``: convert a model's block linears (and experts) to low-bit matmuls.

Runs before ``apply_tp`` / ``apply_ep`` / ``shard`` in the fixed order of the orchestrator
(as torchtitan converts to float8 before its parallelisms): it only marks modules and swaps
the class of plain ``nn.Linear`` layers, so every later step sees ordinary modules with
ordinary high-precision parameters; the masters, the optimizer state and the checkpoints
never see a low-bit dtype.

Which layers: every ``nn.Linear`` inside a repeated block (a child of an ``nn.ModuleList``:
the built-in ``layers.N``, Hugging Face's ``model.layers.N``) and every stacked-experts module
of the built-in MoE; never the embedding, the output head, norms, or a router's gate (the
routing decision is where a low-bit error would change which expert a token visits). ``skip``
takes ``fnmatch`` patterns of module names to keep in high precision as well. A layer whose
shape the recipe cannot take is skipped and listed in the report, never an error; so are
experts stacked in 3-D parameters with a forward of their own (transformers 5.x's MoE
experts), which stay in high precision.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.models.experts import GroupedExperts
from shardwise.parallel.lowbit.experts import LowBitExperts
from shardwise.parallel.lowbit.gather import TensorwiseCodes
from shardwise.parallel.lowbit.linear import LowBitState, lowbit_state, module_linear
from shardwise.parallel.lowbit.recipes import Recipe, get_recipe
from shardwise.shard.scaled_gather import CODES_ATTR

__all__ = ["apply_low_precision", "LowPrecisionReport", "low_precision_report",
           "share_low_precision_report", "nonfinite_amax_layers", "lowbit_modules"]

REPORT_ATTR = "_shardwise_lowbit_report"
_ROUTER_NAMES = ("gate", "router", "gate_proj_router")


@dataclass
class LowPrecisionReport:
    """What :func:`apply_low_precision` did: the recipe, the converted module names, and the
    skipped ones with the reason for each."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """One line per skipped layer after a count of the converted ones."""
        lines = [f"low precision {self.recipe}: {len(self.converted)} layers converted, "
                 f"{len(self.skipped)} kept in high precision"]
        lines += [f"  {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


class LowBitLinearMixin:
    """A plain ``nn.Linear``'s forward through :func:`module_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return module_linear(self, x, self.weight, self.bias)


@functools.lru_cache(maxsize=None)
def _lowbit_class(cls: type) -> type:
    return type(f"LowBit{cls.__name__}", (LowBitLinearMixin, cls),
                {"__module__": cls.__module__})


def _in_block(name: str, lists: set[str]) -> bool:
    """Whether module ``name`` sits inside an element of one of the ModuleLists ``lists``."""
    parts = name.split(".")  # the list itself may be the root (name "")
    return any(".".join(parts[:i]) in lists for i in range(len(parts) - 1))


def _is_router(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf in _ROUTER_NAMES or type(parent).__name__ == "Router"


def _linear_kind(module: nn.Module) -> str | None:
    """"plain" (swap the class), "styled" (its forward already calls module_linear), or
    None (a Linear subclass with a forward of its own: left alone)."""
    forward = type(module).forward
    if forward is nn.Linear.forward:
        return "plain"
    if getattr(forward, "__module__", "").startswith("shardwise.parallel"):
        return "styled"
    return None


def apply_low_precision(model: nn.Module, recipe: str | Recipe = "fp8_tensorwise",
                        skip: Iterable[str] = ()) -> nn.Module:
    """Run the block linears (attention, MLP, experts) of ``model`` in low precision.

    Args:
        model: a module not yet sharded (``shard`` after this, in the fixed order).
        recipe: one of ``RECIPE_NAMES`` ("fp8_tensorwise", "fp8_rowwise",
            "fp8_rowwise_gw_hp", "fp8_blockwise", "mxfp8", "nvfp4").
        skip: ``fnmatch`` patterns of module names to keep in high precision.

    Returns:
        ``model``, converted in place; :func:`low_precision_report` says what was converted
        and what was skipped, and why.

    Raises:
        ValueError: an unknown recipe, a model already converted or already sharded, or a
            ``skip`` that is not an iterable of strings.
    """
    rec = get_recipe(recipe)
    patterns = () if isinstance(skip, str) else tuple(skip)
    if isinstance(skip, str) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"apply_low_precision: skip must be an iterable of name patterns, "
                         f"got {skip!r}")
    if getattr(model, REPORT_ATTR, None) is not None:
        raise ValueError(f"apply_low_precision: the model is already converted to "
                         f"{getattr(model, REPORT_ATTR).recipe}")
    if any(hasattr(m, "_shardwise_state") for m in model.modules()):
        raise ValueError("apply_low_precision must run before shard (the engine gathers "
                         "the weights the low-bit matmuls cast); call it first")
    report = LowPrecisionReport(rec.name)
    mods = dict(model.named_modules())
    lists = {n for n, m in mods.items() if isinstance(m, nn.ModuleList)}
    for name, module in mods.items():
        if _foreign_experts(module) and _in_block(name, lists):
            report.skipped[name] = ("stacked experts with a forward of their own (Hugging "
                                    "Face's): no low-bit forward, kept in high precision")
            continue
        if not isinstance(module, (nn.Linear, GroupedExperts)) or not _in_block(name, lists):
            continue
        parent = mods.get(name.rsplit(".", 1)[0]) if "." in name else model
        if isinstance(module, nn.Linear) and _is_router(name, module, parent):
            continue  # routers stay high precision by design, not listed as skipped
        pattern = next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)
        if pattern is not None:
            report.skipped[name] = f"matches skip pattern {pattern!r}"
            continue
        why = _problem(module, rec)
        if why is not None:
            report.skipped[name] = why
            continue
        _convert(module, rec, name)
        report.converted.append(name)
    setattr(model, REPORT_ATTR, report)
    return model


def _foreign_experts(module: nn.Module) -> bool:
    """Experts stacked in 3-D parameters whose forward is not ours (transformers 5.x's
    ``gate_up_proj`` / ``down_proj``): listed as kept, never silently left out."""
    return not isinstance(module, GroupedExperts) and any(
        p is not None and p.dim() == 3 for p in module._parameters.values())


def _problem(module: nn.Module, rec: Recipe) -> str | None:
    if isinstance(module, GroupedExperts):
        _, dim, hidden = module.w1.shape
        return rec.shape_problem(dim, hidden)
    if _linear_kind(module) is None:
        return f"{type(module).__name__} has a forward of its own"
    return rec.shape_problem(module.in_features, module.out_features)


def _convert(module: nn.Module, rec: Recipe, name: str) -> None:
    module._shardwise_lowbit = state = LowBitState(rec, name)
    if isinstance(module, GroupedExperts):
        if not isinstance(module, LowBitExperts):
            module.__class__ = LowBitExperts.of(type(module))
        return  # per-expert scales: gathered as any parameter ([Note: fp8 weight gathers])
    if _linear_kind(module) == "plain":
        module.__class__ = _lowbit_class(type(module))
    if rec.gathers_weight_codes:
        setattr(module, CODES_ATTR, TensorwiseCodes(state))


def low_precision_report(model: nn.Module) -> LowPrecisionReport | None:
    """What :func:`apply_low_precision` did to ``model`` (None: not converted)."""
    return getattr(model, REPORT_ATTR, None)


def share_low_precision_report(model: nn.Module, part: nn.Module) -> None:
    """Let ``part``, a piece of ``model`` run on its own (a pipeline rank's stages), answer
    :func:`low_precision_report` as ``model`` does; a no-op for a model not converted."""
    report = low_precision_report(model)
    if report is not None:
        setattr(part, REPORT_ATTR, report)


def lowbit_modules(model: nn.Module) -> list[tuple[str, nn.Module, LowBitState]]:
    """Every converted module of ``model``: ``(name, module, state)``."""
    return [(n, m, s) for n, m in model.named_modules() if (s := lowbit_state(m)) is not None]


def nonfinite_amax_layers(model: nn.Module, clear: bool = True) -> list[str]:
    """Names of the converted layers that cast a tensor with a non-finite amax since the
    last call (or :meth:`LowBitState.clear_flag`), where it most likely entered first:
    the layers whose forward casts saw one, in module order, then those only their backward
    casts saw, the last module first ([Note: non-finite flags under recompute] in
    linear.py).

    Args:
        model: a model converted by :func:`apply_low_precision` (any other: ``[]``).
        clear: reset the flags (default True).

    Returns:
        The layer names; ``[]`` without a host sync when no cast was flagged since the last
        clear, else after one host sync for all layers.
    """
    flagged = [(n, s) for n, _, s in lowbit_modules(model)
               if s.bad is not None or s.bad_backward is not None]
    if not flagged:
        return []
    device = next(f for _, s in flagged for f in (s.bad, s.bad_backward) if f is not None).device
    no = torch.zeros((), dtype=torch.bool, device=device)
    flags = torch.stack([torch.stack([no if f is None else f.to(device) for f in
                                      (s.bad, s.bad_backward)]) for _, s in flagged]).cpu()
    forward = [n for (n, _), (f, _) in zip(flagged, flags.tolist()) if f]
    backward = [n for (n, _), (f, b) in zip(flagged, flags.tolist()) if b and not f]
    if clear:
        for _, s in flagged:
            s.clear_flag()
    return forward + backward[::-1]
