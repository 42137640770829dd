"""Autograd plumbing shared by the engine's states: output hooks, end-of-backward callback,
and reductions launched in a fixed order.

[Note: ordered reductions] Gradients become ready in an order that may differ between ranks
(a parameter unused on one rank, data-dependent control flow). Collectives on one process
group must be issued in the same order everywhere, so reductions are *launched* in an order
fixed before backward starts (the reverse of the forward order); an item that becomes ready
early waits for its predecessors. At the end of backward every remaining item is launched,
with zeros for gradients that never arrived, so every rank issues the same collectives.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.autograd import Variable

__all__ = ["tensors_in", "register_output_hooks", "OrderedLauncher", "in_backward"]


def in_backward() -> bool:
    """Whether autograd is executing a backward pass on this thread (e.g. a recompute)."""
    return torch._C._current_graph_task_id() != -1


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """All tensors inside nested tuples, lists, dicts and dataclasses."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return out


def register_output_hooks(output: Any, fn: Callable[[], None]) -> None:
    """Call ``fn()`` when the gradient of any differentiable tensor in ``output`` arrives."""
    for t in tensors_in(output):
        if t.requires_grad:
            t.register_hook(lambda grad: (fn(), grad)[1])


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current backward pass has finished (must be called inside it)."""
    Variable._execution_engine.queue_callback(fn)


class Reducible(Protocol):
    def launch_reduce(self) -> None: ...
    def finish_reduce(self) -> None: ...


class OrderedLauncher:
    """Launch reductions in a fixed order, keeping at most ``max_inflight`` outstanding.

    See [Note: ordered reductions]. Bounding the in-flight reductions bounds the memory of
    their staging buffers.
    """

    def __init__(self, max_inflight: int = 2) -> None:
        self.max_inflight = max_inflight
        self.order: list[Reducible] = []
        self.next = 0
        self.ready: set[int] = set()
        self.inflight: deque[Reducible] = deque()

    def start(self, order: list[Reducible]) -> None:
        """Fix the launch order for this backward pass."""
        assert not self.inflight
        self.order, self.next, self.ready = order, 0, set()

    def mark_ready(self, item: Reducible) -> None:
        """Note that ``item``'s gradients are packed; launch whatever the order allows."""
        self.ready.add(id(item))
        while self.next < len(self.order) and id(self.order[self.next]) in self.ready:
            self._launch(self.order[self.next])
            self.next += 1

    def _launch(self, item: Reducible) -> None:
        item.launch_reduce()
        self.inflight.append(item)
        while len(self.inflight) > self.max_inflight:
            self.inflight.popleft().finish_reduce()

    def flush(self) -> None:
        """Launch every remaining item in order, then wait for all of them."""
        while self.next < len(self.order):
            self._launch(self.order[self.next])
            self.next += 1
        while self.inflight:
            self.inflight.popleft().finish_reduce()
        self.order, self.next, self.ready = [], 0, set()
