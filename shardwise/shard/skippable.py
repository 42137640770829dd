"""Units that some ranks may skip in a forward (a text-only micro-batch never calls the vision
tower), and where the engine runs them *virtually* so every rank issues the same collectives.

[Note: skipped units] Collectives pair by issue order ([Note: gather identity]), and the
engine issues them in the order the rank's own modules run: a unit's gathers in its forward
pre-hook (and the prefetches it issues), again at stage 3 in its pre-backward, its reduction
in an order derived from this step's forward order ([Note: ordered reductions]), and at
stages 1/2 the gathers of the updated parameters lazily, in the first forward after the
optimizer step. A rank whose data makes a module not run (no ``pixel_values``: Hugging Face
VLMs do not call the vision tower) would issue a different sequence and stop at the first
gather with a ``GatherMismatch``, or pair reductions of different units.

So a unit that may be skipped is declared *skippable* (``shard(..., skippable=[...])``, a
module attribute ``shardwise_skippable = True``, or the rule for known multimodal layouts,
:func:`auto_skippable`); every unit inside a skippable module is skippable. When a rank
skips one, the engine runs the unit's engine side without compute (a *virtual call*) where
it would have run:

* forward: before a real unit's pre-hook gathers, every skippable unit registered before
  it (``module.modules()`` order, [Note: registration order]) that has not run in this
  pass, and is not one of its enclosing units, is virtually pre- and post-hooked (gathered
  with the same prefetch, then freed), nested as the modules nest, and recorded in the
  forward order as a real call would be; the root's post-hook does the same for skippable
  units still not run. The forward order, the next step's prefetch order, the backward
  order and the reduction order are then the same on every rank.
* backward: a trainable unit called virtually gets its backward at the same place too:
  before a real unit's pre-backward, every virtual unit before it in the backward order,
  and at the end of backward the rest: gathered (stage 3, with prefetch), freed, and its
  reduction launched in the launcher's fixed order with zero gradients. The averaged
  gradient is then the sum over the ranks that ran the unit divided by the data-parallel
  degree: the gradient of the mean loss over the global batch.
* a skippable unit with no trainable parameter (a frozen tower) has no backward on any
  rank: it is not expected in backward, not prefetched there, and where its outputs do
  need a gradient (its input did), stage 3 keeps it gathered from its forward until the
  end of backward instead of gathering it again, a gather the skipping rank could not
  match. Frozen parameters get no gradient buffer, reduction or optimizer state.
* a skippable unit holding other units (a tower wrapped whole, its layers wrapped too)
  is kept gathered from its forward to its backward the same way (its reduction still
  runs, in the fixed order): when its backward begins among its inner units' depends on
  which outputs the model reads (LLaVA reads an inner layer's hidden state, whose
  gradient reaches that layer before the tower), which a skipping rank cannot know. Only
  its own parameters stay (typically embeddings and norms); its inner units gather.

What the user promises: a skippable unit runs at most once per forward, and, when it runs,
before any unit registered after it (so a skipping rank can tell where it would have run).
A rank that breaks either raises naming the unit rather than mispairing.

[Note: registration order] Unit indices follow discovery (siblings in reverse), so the place
a skipped unit would have run is read from the modules' pre-order (``module.modules()``),
which for the layouts above (the tower registered before the language model) is also the
order they run in.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from shardwise.shard.unit import Phase, Unit

__all__ = ["SKIPPABLE_ATTR", "AUTO_NAMES", "auto_skippable", "resolve_skippable", "SkipPlan"]

SKIPPABLE_ATTR = "shardwise_skippable"
"""A module attribute: ``module.shardwise_skippable = True`` declares it skippable (model code
can set it without importing shardwise)."""

AUTO_NAMES = frozenset({"vision_tower", "vision_model", "visual", "multi_modal_projector",
                        "connector", "mm_projector", "vision_encoder", "image_encoder",
                        "audio_tower", "audio_model"})
"""Attribute names of the towers and projectors that multimodal models skip on text-only
inputs (LLaVA, Idefics3 / SmolVLM, Qwen-VL, audio LMs)."""

_CONFIG_TOWERS = ("vision_config", "audio_config")
_PLACEHOLDER_TOKENS = ("image_token_id", "image_token_index", "audio_token_id",
                       "audio_token_index", "video_token_id")


def _splices_features(module: nn.Module) -> bool:
    """Whether ``module`` carries a Hugging Face config of a model that splices tower features
    into a text sequence: a tower config and a placeholder token (so text-only inputs are
    normal; a contrastive CLIP has a tower config but no placeholder and runs both towers)."""
    cfg = getattr(module, "config", None)
    return (any(getattr(cfg, k, None) is not None for k in _CONFIG_TOWERS)
            and any(getattr(cfg, k, None) is not None for k in _PLACEHOLDER_TOKENS))


def auto_skippable(module: nn.Module) -> list[nn.Module]:
    """The modules of ``module`` found skippable without being declared.

    The rule: a module with ``shardwise_skippable = True``; and, in a module whose ``config``
    has a ``vision_config`` or ``audio_config`` and an image / audio placeholder token (a
    Hugging Face VLM or audio LM), each direct child whose attribute name is in
    :data:`AUTO_NAMES`.

    Args:
        module: the module passed to ``shard``.

    Returns:
        The modules found, in ``module.modules()`` order (nested ones included).
    """
    found: dict[int, nn.Module] = {}
    for m in module.modules():
        if getattr(m, SKIPPABLE_ATTR, False) is True and m is not module:
            found[id(m)] = m
        if _splices_features(m):
            for name, child in m.named_children():
                if name in AUTO_NAMES:
                    found[id(child)] = child
    return list(found.values())


def resolve_skippable(module: nn.Module, declared: Iterable[nn.Module] | None,
                      unit_modules: list[nn.Module] | None, auto: bool = True
                      ) -> list[nn.Module]:
    """Check the declared skippable modules and add the automatic ones.

    Args:
        module: the module passed to ``shard``.
        declared: the user's ``skippable`` modules (None: none).
        unit_modules: the modules that become units, the root first (None: stage 0's
            buckets, which need no units).
        auto: add :func:`auto_skippable`'s modules (default True).

    Returns:
        The skippable modules.

    Raises:
        ValueError: a declared entry that is not a module, not a submodule of ``module``,
            ``module`` itself, or (with units) neither a unit nor holding one, naming it.
    """
    names = {id(m): n for n, m in module.named_modules()}
    out: dict[int, nn.Module] = {}
    if isinstance(declared, nn.Module):
        declared = [declared]
    for m in declared if declared is not None else ():
        if not isinstance(m, nn.Module):
            raise ValueError(f"skippable must hold nn.Modules, got {type(m).__name__}: {m!r}")
        where = names.get(id(m))
        label = f"{type(m).__name__} at {where!r}" if where else type(m).__name__
        if where is None:
            raise ValueError(f"skippable module {label} is not a submodule of the sharded "
                             f"{type(module).__name__}")
        if m is module:
            raise ValueError(f"skippable module {label} is the sharded module itself; its "
                             f"forward always runs")
        if unit_modules is not None and not _holds_unit(m, unit_modules[1:]):
            raise ValueError(f"skippable module {label} is not a unit and holds none: its "
                             f"parameters belong to an enclosing unit, which runs anyway; "
                             f"make it a unit with wrap (or drop it from skippable)")
        out[id(m)] = m
    if auto:
        for m in auto_skippable(module):
            out.setdefault(id(m), m)
    return list(out.values())


def _holds_unit(m: nn.Module, unit_modules: list[nn.Module]) -> bool:
    inside = {id(x) for x in m.modules()}
    return any(id(u) in inside for u in unit_modules)


class SkipPlan:
    """Which units are skippable, and where a rank that skipped them runs them virtually
    ([Note: skipped units]).

    Args:
        module: the module passed to ``shard``.
        units: its units, the root first.
        skippable: the skippable modules (:func:`resolve_skippable`).
    """

    def __init__(self, module: nn.Module, units: list[Unit],
                 skippable: list[nn.Module]) -> None:
        inside = {id(x) for s in skippable for x in s.modules()}
        pos = {id(m): i for i, m in enumerate(module.modules())}
        self.units = sorted((u for u in units[1:] if id(u.module) in inside),
                            key=lambda u: pos[id(u.module)])
        self._ids = {id(u) for u in self.units}
        self._pos = {id(u): pos[id(u.module)] for u in units}
        # enclosing skippable units of every unit ([Note: skipped units]: nesting)
        within = {id(v): {id(x) for x in v.module.modules()} for v in self.units}
        self._outer = {id(u): {id(v) for v in self.units
                               if v is not u and id(u.module) in within[id(v)]}
                       for u in units}
        self._holders = {v for outer in self._outer.values() for v in outer}

    def __bool__(self) -> bool:
        return bool(self.units)

    def skippable(self, u: Unit) -> bool:
        """Whether ``u`` may be skipped on some ranks."""
        return id(u) in self._ids

    def no_backward(self, u: Unit) -> bool:
        """A skippable unit with nothing to train: no backward on any rank."""
        return id(u) in self._ids and not u.trainable

    def kept(self, u: Unit) -> bool:
        """A skippable unit that never gathers in backward: frozen, or holding other units
        (stage 3 keeps it gathered from its forward where its backward needs it)."""
        return id(u) in self._ids and (not u.trainable or id(u) in self._holders)

    def check_forward(self, u: Unit, seen: set[int]) -> None:
        """Refuse a skippable unit's forward after it ran (or ran virtually) in this pass."""
        if id(u) in self._ids and id(u) in seen:
            raise RuntimeError(
                f"skippable unit {u.label!r} started its forward after it had run, or been run "
                f"virtually because a unit registered after it ran first, in this forward pass: "
                f"a skippable unit runs at most once per forward, before the units registered "
                f"after it, so that ranks skipping it can issue its collectives at the same "
                f"place (docs/engine.md, 'Ranks that skip a module')")

    def check_backward(self, u: Unit, later: list[Unit]) -> None:
        """Refuse a skippable unit's backward after one of the ``later`` units' (those after
        it in the backward order) began: a skipping rank gathers them the other way round."""
        if id(u) not in self._ids:
            return
        late = [v for v in later if not self.kept(v)
                and v.phase in (Phase.BACKWARD, Phase.BACKWARD_DONE)]
        if late:
            raise RuntimeError(
                f"skippable unit {u.label!r} began its backward after unit {late[0].label!r}, "
                f"which follows it in the backward order (the reverse of the forward order); "
                f"a rank that skipped {u.label!r} could not issue its gathers at the same "
                f"place (docs/engine.md, 'Ranks that skip a module')")

    def due_before(self, u: Unit, seen: set[int]) -> list[Unit]:
        """Skippable units that would have run before ``u`` and have not run in this pass."""
        p, outer = self._pos[id(u)], self._outer[id(u)]
        return [v for v in self.units
                if self._pos[id(v)] < p and id(v) not in seen and id(v) not in outer]

    def due_at_end(self, seen: set[int]) -> list[Unit]:
        """Skippable units that have not run in this pass (the root's forward is ending)."""
        return [v for v in self.units if id(v) not in seen]

    def nested(self, todo: list[Unit]) -> list[tuple[bool, Unit]]:
        """``(is_pre, unit)`` events of calling ``todo`` (in registration order) as their
        modules nest: a unit's post follows the units inside it."""
        events: list[tuple[bool, Unit]] = []
        stack: list[Unit] = []
        for v in todo:
            while stack and id(stack[-1]) not in self._outer[id(v)]:
                events.append((False, stack.pop()))
            events.append((True, v))
            stack.append(v)
        events.extend((False, v) for v in reversed(stack))
        return events
