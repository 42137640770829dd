"""Reuse of the engine's per-step staging buffers.

[Note: buffer pool] Every step a unit allocates the same staging buffers (the all-gather
output, the packed gradients, the reduce-scatter scratch and output) and frees them
moments later. Through glibc's malloc that pattern fragments the heap: freeing a large
mmapped block raises malloc's mmap threshold, later blocks of that size come from the
heap, and interleaved with autograd's temporaries they leave holes that are never
returned. Measured on the overhead-bound benchmark model (9.6M parameters, stage 3, 2
ranks), resident memory grew by about 8 MiB per step and settled 790 MiB above its start
after ~50 steps; the model state is 73 MiB. Keeping the buffers (keyed by size, dtype and
device) and handing them out again means the same few blocks serve every step, so nothing
new is allocated after the first step: with the pool (staging buffers and gathered
parameters, see [Note: freeing gathered parameters] in unit.py) the same run stood 277 MiB
above its start after 40 steps instead of 675 MiB; what still grows slowly comes from
autograd's own temporaries, which stage 2 and DDP have too.

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
    """Free flat buffers by (numel, dtype, device), handed out again before allocating.

    What it keeps is bounded per key by the working set: at most as many free buffers of a
    key as were ever in use at the same time (``peak`` per key), so every buffer a step needs
    is served from the cache after the first step, whatever the order in which buffers of
    different sizes are taken and given back, and nothing beyond that set is kept. (An
    earlier bound, twice the peak of the bytes in use across all keys, evicted one buffer
    per step when units of several sizes peaked at different moments -- a stage-3 step in
    bf16 with quantised communication at 3 ranks -- and reallocated it every step.)
    ``cached_bytes`` reports what is kept; :meth:`clear` returns it to the allocator.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._in_use: dict[tuple[int, torch.dtype, torch.device], int] = {}
        self._peak: dict[tuple[int, torch.dtype, torch.device], int] = {}
        self._lock = threading.Lock()
        self.cached_bytes = 0
        self.in_use_bytes = 0
        self.high_water_bytes = 0
        self.hits = 0
        self.misses = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements (contents undefined)."""
        key = (int(numel), dtype, torch.device(device))
        if key[2].type != "cpu":  # the CUDA caching allocator serves ([Note: CUDA streams])
            return torch.empty(key[0], dtype=dtype, device=key[2])
        size = key[0] * dtype.itemsize
        with self._lock:
            self.in_use_bytes += size
            self.high_water_bytes = max(self.high_water_bytes, self.in_use_bytes)
            count = self._in_use[key] = self._in_use.get(key, 0) + 1
            self._peak[key] = max(self._peak.get(key, 0), count)
            free = self._free.get(key)
            if free:
                self.cached_bytes -= size
                self.hits += 1
                return free.pop()
            self.misses += 1
        return torch.empty(key[0], dtype=dtype, device=key[2])

    def give(self, buf: torch.Tensor | None) -> None:
        """Return ``buf`` (taken from :meth:`take`, no longer used anywhere) for reuse."""
        if buf is None or buf.device.type != "cpu":
            return
        key = (buf.numel(), buf.dtype, buf.device)
        size = _nbytes(buf)
        with self._lock:
            self.in_use_bytes -= size
            self._in_use[key] = max(0, self._in_use.get(key, 0) - 1)
            free = self._free.setdefault(key, [])
            if len(free) + self._in_use[key] >= self._peak.get(key, 0):
                return  # more than the working set of this key: back to the allocator
            free.append(buf)
            self.cached_bytes += size

    def clear(self) -> None:
        """Drop every free buffer (back to the allocator) and forget the working sets."""
        with self._lock:
            self._free.clear()
            self.cached_bytes = 0
            self.high_water_bytes = self.in_use_bytes
            self._peak = {k: c for k, c in self._in_use.items() if c}


POOL = BufferPool()
"""The process-wide pool every unit stages its collectives through."""


def empty_cache() -> None:
    """Free the staging buffers the engine keeps for reuse (see [Note: buffer pool])."""
    POOL.clear()
