"""Reuse of the engine's per-step staging buffers.

[Note: buffer pool] Every step a unit allocates the same staging buffers (the all-gather
output, the packed gradients, the reduce-scatter scratch and output) and frees them
moments later. Through glibc's malloc that pattern fragments the heap: freeing a large
mmapped block raises malloc's mmap threshold, later blocks of that size come from the
heap, and interleaved with autograd's temporaries they leave holes that are never
returned, and resident memory grows for tens of steps by many times the model state.
Keeping the buffers (keyed by size, dtype and device) and handing them out again means the
same few blocks serve every step, so nothing new is allocated after the first step (the
staging buffers and the gathered parameters, see [Note: freeing gathered parameters] in
unit.py); what still grows slowly comes from autograd's own temporaries, which stage 2 and
DDP have too. The growth with and without the pool: docs/engine.md, "Measurements behind
the notes".

What the pool keeps is bounded by the working set it already needed (see :class:`BufferPool`);
``cached_bytes`` reports it (``memory_report().cached_bytes``) and :func:`empty_cache`
returns it to the allocator.
A buffer is given back only after the collective that used it has completed and nothing
else refers to it.
"""

from __future__ import annotations

import threading

import torch

from shardwise.sizes import nbytes as _nbytes

__all__ = ["BufferPool", "POOL", "empty_cache"]


class BufferPool:
    """Free flat buffers, handed out again (best fit) before allocating.

    A request for ``numel`` elements of a dtype is served by the smallest free buffer of that
    dtype and device holding between ``numel`` and twice ``numel`` elements (a 1-D view of
    its first ``numel`` elements); only when none fits is a new buffer allocated. Buffers are
    kept until :meth:`clear`: a buffer is allocated only when every kept one that could serve
    is in use, so what the pool holds is bounded by the most buffers the engine ever needed
    at the same time, and after the first step every request finds one. Serving across sizes
    lets the all-gather buffers of the forward serve the reduce-scatter buffers of the
    backward (similar sizes, never in use together at stages 1/2), which halves what is
    kept (measured: 200 -> ~100 MB on the compute-bound benchmark model at stage 1). An
    earlier policy that evicted by a byte bound reallocated a buffer every step when units
    of several sizes peaked at different moments. ``exact=True`` asks for a buffer of exactly
    ``numel`` elements (whose storage is swapped into a parameter's: see [Note: freeing
    gathered parameters] in unit.py).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        # id(handed-out view) -> (that view, its buffer): holding the view keeps its id unique
        self._lent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.cached_bytes = 0
        self.in_use_bytes = 0
        self.high_water_bytes = 0
        self.hits = 0
        self.misses = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device,
             exact: bool = False) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements (contents undefined)."""
        numel, device = int(numel), torch.device(device)
        if device.type != "cpu":  # the CUDA caching allocator serves ([Note: CUDA streams])
            return torch.empty(numel, dtype=dtype, device=device)
        with self._lock:
            free = self._free.get((dtype, device), [])
            best = None
            for i, buf in enumerate(free):  # the smallest that fits within 2x
                n = buf.numel()
                if (n == numel if exact else numel <= n <= 2 * max(numel, 1)) and \
                        (best is None or n < free[best].numel()):
                    best = i
            if best is not None:
                buf = free.pop(best)
                self.cached_bytes -= _nbytes(buf)
                self.hits += 1
            else:
                buf = None
                self.misses += 1
        if buf is None:
            buf = torch.empty(numel, dtype=dtype, device=device)
        view = buf if buf.numel() == numel else buf[:numel]
        with self._lock:
            self._lent[id(view)] = (view, buf)
            self.in_use_bytes += _nbytes(buf)
            self.high_water_bytes = max(self.high_water_bytes, self.in_use_bytes)
        return view

    def give(self, buf: torch.Tensor | None) -> None:
        """Return ``buf`` (as :meth:`take` handed it out, no longer used anywhere)."""
        if buf is None or buf.device.type != "cpu":
            return
        with self._lock:
            lent = self._lent.pop(id(buf), None)
            if lent is None or lent[0] is not buf:
                return  # not from this pool (or given twice): leave it to the allocator
            base = lent[1]
            self.in_use_bytes -= _nbytes(base)
            self._free.setdefault((base.dtype, base.device), []).append(base)
            self.cached_bytes += _nbytes(base)

    def clear(self) -> None:
        """Drop every free buffer (back to the allocator)."""
        with self._lock:
            self._free.clear()
            self.cached_bytes = 0
            self.high_water_bytes = self.in_use_bytes


POOL = BufferPool()
"""The process-wide pool every unit stages its collectives through."""


def empty_cache() -> None:
    """Free the staging buffers the engine keeps for reuse (see [Note: buffer pool])."""
    POOL.clear()
