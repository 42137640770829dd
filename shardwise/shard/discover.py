"""Which modules become units, and which unit owns each parameter.

A module matching ``wrap`` becomes a unit; the module passed to ``shard`` is always the root
unit. A parameter belongs to the unit of the module that registers it, or, when it is
registered in several modules of different units (tied or shared parameters), to their
lowest common ancestor unit, whose forward encloses every use. Subtrees already sharded by
an earlier ``shard`` call (composition) are left alone. A module whose parameters name their
own data axis (``apply_ep``'s experts, see [Note: expert placement]) is always a unit of its
own: a unit communicates over one group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from shardwise.shard.placed import own_data_axis
from shardwise.shard.registry import STATE_ATTR
from shardwise.shard.param import ParamEntry

__all__ = ["UnitPlan", "plan_units", "wrap_predicate"]



@dataclass
class UnitPlan:
    """A module that will become a unit, with the parameters it owns."""

    name: str
    module: nn.Module
    ancestors: tuple[int, ...]  # indices of enclosing unit plans, outermost first
    entries: list[ParamEntry] = field(default_factory=list)


def wrap_predicate(wrap) -> Callable[[str, nn.Module], bool]:
    """Turn ``wrap`` (None, a class, a set of classes, or a predicate) into a predicate.

    Raises:
        ValueError: for anything else.
    """
    if wrap is None:
        return lambda name, m: False
    if isinstance(wrap, type):
        wrap = {wrap}
    if isinstance(wrap, (set, frozenset, list, tuple)):
        classes = tuple(wrap)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise ValueError(f"wrap must hold nn.Module subclasses, got {bad!r}")
        return lambda name, m: isinstance(m, classes)
    if callable(wrap):
        return lambda name, m: bool(wrap(name, m))
    raise ValueError(f"wrap must be None, a module class, a set of classes or a "
                     f"callable(name, module) -> bool, got {type(wrap).__name__}")


def _walk(root: nn.Module, is_unit: Callable[[str, nn.Module], bool]):
    """Yield (path, module, unit index chain) for every registration path, skipping subtrees
    owned by an earlier shard call. Units get indices in first-visit (pre-)order."""
    unit_ids: dict[int, int] = {id(root): 0}
    plans = [UnitPlan("", root, ())]
    stack = [("", root, (0,))]
    visits = []
    while stack:
        path, mod, chain = stack.pop()
        visits.append((path, mod, chain))
        children = list(mod.named_children())
        for cname, child in reversed(children):
            cpath = f"{path}.{cname}" if path else cname
            if hasattr(child, STATE_ATTR):
                continue
            cchain = chain
            if is_unit(cpath, child):
                if id(child) not in unit_ids:
                    unit_ids[id(child)] = len(plans)
                    plans.append(UnitPlan(cpath, child, chain))
                cchain = chain + (unit_ids[id(child)],)
            stack.append((cpath, child, cchain))
    return plans, visits


def plan_units(root: nn.Module, wrap, split_data_axes: bool = True
               ) -> tuple[list[UnitPlan], set[int]]:
    """Group ``root``'s parameters into units.

    Args:
        split_data_axes: make every module whose parameters name their own data axis a
            unit (default True; False for stage 0's buckets, which need no units).

    Returns:
        The unit plans (root first, then in module order) and the ids of parameters owned
        by earlier ``shard`` calls on submodules.
    """
    wanted = wrap_predicate(wrap)
    if split_data_axes:
        def is_unit(name: str, m: nn.Module) -> bool:
            return wanted(name, m) or own_data_axis(m)
    else:
        is_unit = wanted
    plans, visits = _walk(root, is_unit)
    owned_elsewhere = {id(p) for m in root.modules() if m is not root and hasattr(m, STATE_ATTR)
                       for p in m.parameters()}
    chains: dict[int, list[tuple[int, ...]]] = {}
    entries: dict[int, ParamEntry] = {}
    for path, mod, chain in visits:
        for attr, p in mod._parameters.items():
            if p is None or id(p) in owned_elsewhere:
                continue
            fqn = f"{path}.{attr}" if path else attr
            e = entries.setdefault(id(p), ParamEntry(p, []))
            if fqn not in e.fqns:
                e.fqns.append(fqn)
            if not any(m2 is mod and a2 == attr for m2, a2 in e.registrations):
                e.registrations.append((mod, attr))
            chains.setdefault(id(p), []).append(chain)
    for pid, e in entries.items():
        cs = chains[pid]
        common = cs[0]
        for c in cs[1:]:
            k = 0
            while k < min(len(common), len(c)) and common[k] == c[k]:
                k += 1
            common = common[:k]
        plans[common[-1]].entries.append(e)
    return plans, owned_elsewhere
