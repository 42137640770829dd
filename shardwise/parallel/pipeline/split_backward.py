"""The backward of one stage micro-batch split into an input-gradient pass (``I``) and a
weight-gradient pass (``W``) that together do the work of one full backward, each part once.

    deferred = input_pass([out], [grad], x)        # x.grad is ready to send upstream
    ...                                            # other actions of the schedule
    weight_pass(deferred, pause=lambda: paused_backward_hooks(stage))

[Note: split backward]
Zero-bubble schedules (Qi et al. 2024) run a stage's input gradient early (the previous
stage waits for it) and its weight gradients later, in what would be idle time. Autograd
computes only what leads to the requested ``inputs=``, so a pass with ``inputs=[x]``
executes the nodes on the paths from the outputs to ``x`` and, inside each of them, only
the outputs that feed those paths: the weight-gradient GEMMs of a linear layer are skipped.
Those skipped outputs are the ``W`` work. In graph terms:

* ``D`` = the nodes from which the stage input ``x`` is reachable (the input path);
* a *weight edge* goes from a node ``N`` in ``D`` to a child ``M`` outside ``D`` whose
  subgraph reaches leaves that require grad (parameters: ``N`` is e.g. ``MmBackward`` and
  ``M`` the ``TBackward -> AccumulateGrad`` of its weight). ``M``'s subgraph cannot reach
  ``x`` (else ``M`` would be in ``D``);
* the ``I`` pass registers a pre-hook on every such ``N`` that keeps the gradients flowing
  into ``N`` (its ``grad_outputs``), computed anyway on the way to ``x``;
* the ``W`` pass runs, for each ``N``, ``torch.autograd.grad`` from ``N`` (a
  ``GradientEdge`` root with the kept gradients) to the leaves under ``N``'s weight edges.
  ``N``'s edges into ``D`` lead to no requested leaf, so autograd prunes them: only the
  weight-gradient part of ``N`` and the small subgraph ``M`` run. The returned gradients
  are then accumulated by one ``torch.autograd.backward`` whose roots are the leaves'
  ``AccumulateGrad`` edges: one ordinary backward pass for the ZeRO engine (its gradient
  hooks fire once per parameter; it reduces at the end when gradient sync is on), while the
  ``grad`` calls run under ``pause`` (the engine's ``paused_backward_hooks``: a root ``N``
  may be the ``grad_fn`` of a sharded unit's output, whose hook must not start a pass).

Some leaves get their whole gradient in the ``I`` pass instead (``inputs=[x, *early]``):

* a leaf under two weight-edge nodes (a weight used twice inside the stage): it may also be
  reachable from one of them through ``D``, and the pruning would then count a
  contribution twice;
* a leaf under a custom ``autograd.Function`` node (``BackwardCFunction``: tensor-parallel
  linears, a compiled region's backward). Such a node decides what it computes from
  ``ctx.needs_input_grad``, fixed at forward time, so it computes its weight gradients in
  the ``I`` pass anyway; and its backward may issue collectives (sequence parallelism
  re-gathers its input), which must run once, in the ``I`` pass, in the same order on
  every rank.

The ``W`` pass therefore runs only built-in autograd formulas, in a fixed order (reverse
creation order of the nodes), and issues no collective but the engine's reduction.
Activation-checkpointed stages are not split (``split=False``): non-reentrant
checkpointing recomputes a block once per autograd call that unpacks its tensors, and the
``W`` pass makes one call per weight-edge node; their ``W`` is the whole backward again,
restricted to the weights (``inputs=``), as before this split existed. The gradients equal
the unsplit backward's bit for bit (same kernels on the same operands, each weight used
once), which the parity tests check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["DeferredWeights", "input_pass", "weight_pass"]


@dataclass
class DeferredWeights:
    """What the ``I`` pass left for the ``W`` pass (see [Note: split backward])."""

    roots: list[tuple[object, list[torch.Tensor]]] = field(default_factory=list)
    """Per weight-edge node: the node and the leaves under its weight edges."""
    grads: dict[int, tuple] = field(default_factory=dict)
    """``id(node) -> grad_outputs`` kept by the pre-hooks."""
    whole: tuple | None = None
    """``(outputs, grads)`` when the ``W`` pass runs the whole backward (not split)."""


def _is_leaf(node) -> bool:
    return hasattr(node, "variable")  # AccumulateGrad: the node of a leaf requiring grad


def _input_path(roots: Sequence, target) -> set:
    """Nodes reachable from ``roots`` from which ``target`` is reachable (``target`` too)."""
    reaches: dict = {}
    for root in roots:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                reaches[node] = node is target or any(
                    child is not None and reaches.get(child, False)
                    for child, _ in node.next_functions)
            elif node not in reaches:
                reaches[node] = False  # visiting; completed when expanded
                stack.append((node, True))
                stack.extend((child, False) for child, _ in node.next_functions
                             if child is not None and child not in reaches)
    return {node for node, hit in reaches.items() if hit}


def _leaves_under(node, path: set) -> list[torch.Tensor]:
    """The leaves requiring grad in ``node``'s subgraph (which lies outside ``path``)."""
    found, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_leaf(n):
            found.append(n.variable)
        stack.extend(child for child, _ in n.next_functions
                     if child is not None and child not in path)
    return found


def _weight_roots(path: set, x_node) -> tuple[list, list[torch.Tensor]]:
    """(weight-edge nodes with their leaves, in reverse creation order; the leaves whose
    gradient the I pass computes whole), as [Note: split backward] defines them."""
    roots, counts, custom = [], {}, set()
    for node in sorted(path, key=lambda n: n._sequence_nr(), reverse=True):
        if node is x_node:
            continue
        leaves: list[torch.Tensor] = []
        for child, _ in node.next_functions:
            if child is not None and child not in path:
                leaves += _leaves_under(child, path)
        for leaf in leaves:
            counts[id(leaf)] = counts.get(id(leaf), 0) + 1
            if isinstance(node, BackwardCFunction):
                custom.add(id(leaf))
        if leaves:
            roots.append((node, leaves))
    early_ids = custom | {i for i, n in counts.items() if n > 1}
    early = list({id(t): t for _, leaves in roots for t in leaves
                  if id(t) in early_ids}.values())
    kept = [(n, [t for t in leaves if id(t) not in early_ids]) for n, leaves in roots]
    return [(n, leaves) for n, leaves in kept if leaves], early


def input_pass(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
               x: torch.Tensor, split: bool = True) -> DeferredWeights:
    """Backpropagate ``outputs`` to the stage input ``x`` only (``x.grad``), keeping what the
    weight-gradient pass needs.

    Args:
        outputs: the stage micro-batch's differentiable results (its output or loss, plus
            any extra loss terms).
        grads: their gradients (None for a scalar loss).
        x: the stage input, a leaf requiring grad.
        split: defer only the weight-gradient work (True); False: the ``W`` pass will run
            the whole backward again with ``inputs=`` the weights (checkpointed stages).

    Returns:
        The :class:`DeferredWeights` for :func:`weight_pass`.
    """
    outputs, grads = list(outputs), list(grads)
    x_node = get_gradient_edge(x).node
    path = _input_path([o.grad_fn for o in outputs if o.grad_fn is not None], x_node) \
        if split else set()
    if not path:  # not split, or the outputs do not depend on x: the W pass does it all
        torch.autograd.backward(outputs, grads, inputs=[x], retain_graph=True)
        if x.grad is None:  # the outputs do not depend on x
            x.grad = torch.zeros_like(x)
        return DeferredWeights(whole=(outputs, grads))
    roots, early = _weight_roots(path, x_node)
    deferred = DeferredWeights(roots=roots)
    handles = [node.register_prehook(_keeper(deferred.grads, node))
               for node, _ in deferred.roots]
    try:
        torch.autograd.backward(outputs, grads, inputs=[x, *early], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return deferred


def _keeper(store: dict, node) -> Callable:
    def hook(grad_outputs):
        store[id(node)] = grad_outputs
    return hook


def weight_pass(deferred: DeferredWeights, groups: Sequence[Sequence[torch.Tensor]] = (),
                pause: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
    """Compute and accumulate the weight gradients the ``I`` pass deferred, in one backward
    pass.

    Args:
        deferred: from :func:`input_pass`.
        groups: the stage's graph parameters, one list per engine state
            (``controls.graph_parameter_groups``; one list for an unsharded stage). The
            accumulating pass adds an exact zero to the first tensor of a group that gets
            no deferred gradient (its gradients all came in the ``I`` pass), so that every
            state runs the end of this backward pass, and reduces when gradient sync is on,
            as after an unsplit backward.
        pause: a context manager under which the engine ignores the ``grad`` calls
            (``controls.paused_backward_hooks``); None for an unsharded stage.
    """
    if deferred.whole is not None:
        outputs, grads = deferred.whole
        leaves = [t for group in groups for t in group]
        torch.autograd.backward(outputs, grads, inputs=leaves or None)
        return
    targets: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    with pause() if pause is not None else contextlib.nullcontext():
        for node, node_leaves in deferred.roots:
            kept = deferred.grads.get(id(node))
            if kept is None:  # no gradient reached this node in the I pass
                continue
            idx = [k for k, g in enumerate(kept) if g is not None]
            if not idx:
                continue
            got = torch.autograd.grad([GradientEdge(node, k) for k in idx], node_leaves,
                                      [kept[k] for k in idx], allow_unused=True)
            for leaf, g in zip(node_leaves, got):
                if g is not None:
                    targets.append(leaf)
                    values.append(g)
    deferred.roots, deferred.grads = [], {}
    hit = {id(t) for t in targets}
    for group in groups:
        if group and not any(id(t) in hit for t in group):
            first = group[0]
            targets.append(first)
            values.append(torch.zeros((), dtype=first.dtype, device=first.device)
                          .expand(first.shape))
    if targets:
        torch.autograd.backward([get_gradient_edge(t) for t in targets], values)
