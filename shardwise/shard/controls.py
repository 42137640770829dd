"""Per-micro-batch controls of a sharded model, with FSDP2's semantics.

[Note: per-micro-batch controls] A pipeline schedule (or expert parallelism, or a user's own
loop) runs several forwards and backward passes per optimizer step, in orders such as 1F1B
(forward 2 before backward 1) and, for zero-bubble schedules, a backward split into an
input-gradient pass and a later weight-gradient pass. The engine handles each backward
pass on its own ([Note: micro-batch passes] in state.py); these controls say what a pass
does at its end:

* :func:`set_gradient_sync` -- reduce the gradients at the end of the coming backward passes
  (True, the default) or only accumulate them unsharded (False: every micro-batch but the
  last; :func:`shardwise.no_sync` is the context-manager form);
* :func:`set_reshard_after_forward` / :func:`set_reshard_after_backward` -- stage 3 frees a
  unit's gathered parameters after its forward / its backward (True, the defaults) or keeps
  them (False: a pipeline stage running many micro-batches gathers once instead of once per
  micro-batch, holding the unit's full parameters meanwhile; and a zero-bubble schedule
  keeps them between the input-gradient and the weight-gradient pass of a micro-batch);
* :func:`unshard` / :func:`reshard` -- gather every unit now / free every unit now.

A weight-gradient pass (``torch.autograd.backward(..., inputs=params)`` after an
input-gradient pass with ``retain_graph=True``) is a backward pass like any other: with
gradient sync off it only accumulates, so the reduction happens once, at the end of the
last micro-batch's weight pass, which runs with sync on. The parameters must still be
gathered when it runs: keep them (``set_reshard_after_backward(model, False)``) or
:func:`unshard` first; and its ``inputs=`` are :func:`graph_parameters` (the gathered full
parameters, which the graph holds, not the sharded ones that ``model.parameters()`` yields).

A weight-gradient pass may also be computed piecewise (the pipeline executor's split
backward, [Note: split backward] in shardwise/parallel/pipeline/split_backward.py): several
``torch.autograd.grad`` calls that *return* the weights' gradients from gradients captured
during the input-gradient pass, then one ``torch.autograd.backward`` that accumulates them.
The ``grad`` calls are not backward passes of the model: inside
:func:`paused_backward_hooks` the engine's output hooks ignore them (no gather, no
end-of-backward, no reduction), and the accumulating call is the pass the engine sees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from shardwise.shard.registry import engine_states

__all__ = ["set_gradient_sync", "set_reshard_after_forward", "set_reshard_after_backward",
           "unshard", "reshard", "graph_parameters", "graph_parameter_groups",
           "paused_backward_hooks"]


def _states(model: nn.Module, what: str) -> list:
    states = engine_states(model)
    if not states:
        raise ValueError(f"{what} needs a module passed to shardwise.shard, got an unsharded "
                         f"{type(model).__name__}")
    return states


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Whether the coming backward passes reduce gradients (True) or only accumulate them
    unsharded on every rank (False), until set again. See [Note: per-micro-batch controls].

    Raises:
        ValueError: ``model`` is not sharded, or ``sync`` is not a bool.
    """
    if not isinstance(sync, bool):
        raise ValueError(f"sync must be True or False, got {sync!r}")
    for s in _states(model, "set_gradient_sync"):
        s.sync = sync


def set_reshard_after_forward(model: nn.Module, reshard: bool) -> None:
    """Stage 3: free each unit's gathered parameters after its forward (True, the default
    given to ``shard``) or keep them until its backward (False). No effect at stages 1/2.

    Raises:
        ValueError: ``model`` is not sharded, or ``reshard`` is not a bool.
    """
    if not isinstance(reshard, bool):
        raise ValueError(f"reshard must be True or False, got {reshard!r}")
    for s in _states(model, "set_reshard_after_forward"):
        s.reshard_after_forward = reshard and s.policy.shard_params


def set_reshard_after_backward(model: nn.Module, reshard: bool) -> None:
    """Stage 3: free each unit's gathered parameters at the end of its backward (True, the
    default) or keep them gathered for the next micro-batch or weight pass (False; call
    :func:`reshard` or set it back to True when done). No effect at stages 1/2.

    Raises:
        ValueError: ``model`` is not sharded, or ``reshard`` is not a bool.
    """
    if not isinstance(reshard, bool):
        raise ValueError(f"reshard must be True or False, got {reshard!r}")
    for s in _states(model, "set_reshard_after_backward"):
        s.reshard_after_backward = reshard and s.policy.shard_params


def unshard(model: nn.Module) -> None:
    """Gather every unit's parameters now (collective; every rank, same order). They stay
    gathered until a forward or backward frees them under the reshard settings, or
    :func:`reshard`.

    Raises:
        ValueError: ``model`` is not sharded.
    """
    for s in _states(model, "unshard"):
        s.unshard_all()


def reshard(model: nn.Module) -> None:
    """Free every unit's gathered parameters now (stage 3; a no-op at stages 0-2, which keep
    whole parameters by design).

    Raises:
        ValueError: ``model`` is not sharded.
    """
    for s in _states(model, "reshard"):
        s.reshard_all()


def graph_parameters(model: nn.Module) -> list:
    """The tensors through which this model's trainable parameters enter autograd graphs:
    for sharded units the gathered full parameters (the sharded ones never compute), for
    replicated (stage 0) parameters the parameters themselves. Pass them as ``inputs=`` of a
    weight-gradient pass (:func:`torch.autograd.backward`); the engine's gradient hooks are
    on them.

    Raises:
        ValueError: ``model`` is not sharded.
    """
    return [p for group in graph_parameter_groups(model) for p in group]


def graph_parameter_groups(model: nn.Module) -> list[list]:
    """:func:`graph_parameters`, one list per engine state (one ``shard`` call) of ``model``.
    A backward pass that accumulates into at least one tensor of a group is a backward
    pass of that state (its end reduces when gradient sync is on).

    Raises:
        ValueError: ``model`` is not sharded.
    """
    return [s.graph_parameters() for s in _states(model, "graph_parameters")]


@contextlib.contextmanager
def paused_backward_hooks(model: nn.Module) -> Iterator[None]:
    """Autograd calls made inside are not backward passes of ``model`` for the engine: its
    hooks on module outputs do nothing (no gather, no end-of-backward callback, so no
    reduction). For ``torch.autograd.grad`` calls that return gradients computed from saved
    activations; see [Note: per-micro-batch controls].

    Raises:
        ValueError: ``model`` is not sharded.
    """
    states = _states(model, "paused_backward_hooks")
    before = [s.paused for s in states]
    for s in states:
        s.paused = True
    try:
        yield
    finally:
        for s, was in zip(states, before):
            s.paused = was
