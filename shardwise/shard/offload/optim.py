"""``OffloadedOptimizer``: the chunked step, state streaming and state dicts behind
:func:`shardwise.shard.offload.offload_optimizer`. The design is in the notes of ``offload.py``.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardwise.shard.offload.config import DiskUsage, Offload, OffloadStats, check_offload_dir
from shardwise.shard.offload.disk import DiskStore
from shardwise.shard.offload.host import HostMasters, estimate_state_bytes, tensor_nbytes

__all__ = ["OffloadedOptimizer"]


@dataclass
class _Entry:
    key: int  # position in param_groups order at wrap time
    group: int
    pos: int  # index in the group's params
    param: nn.Parameter  # what the optimizer steps: the parameter or its host master
    source: nn.Parameter  # the model's parameter (the same object unless there is a master)
    offloaded: bool
    param_bytes: int
    state_bytes: int  # estimate, until the disk store holds a record
    name: str


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _check_optimizer(optimizer) -> None:
    if isinstance(optimizer, OffloadedOptimizer):
        raise ValueError("the optimizer is already offloaded; wrap it once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"offload_optimizer expects a torch.optim.Optimizer, got "
                         f"{type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("LBFGS cannot be offloaded: its step needs every parameter at once "
                         "(see [Note: offload design])")


def _fresh_bytes(states: list[dict], flat: torch.Tensor) -> int:
    """Bytes of state tensors not living in ``flat`` (created or replaced by the step)."""
    home = flat.untyped_storage().data_ptr() if flat.numel() else None
    seen, total = set(), 0
    for st in states:
        for v in st.values():
            if isinstance(v, torch.Tensor):
                ptr = v.untyped_storage().data_ptr()
                if ptr != home and ptr not in seen:
                    seen.add(ptr)
                    total += v.untyped_storage().nbytes()
    return total


class OffloadedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim`` optimizer whose state (and masters) are offloaded; see
    [Note: offload design]. Build it with :func:`offload_optimizer`."""

    def __init__(self, optimizer: torch.optim.Optimizer, offload: Offload, *,
                 model: nn.Module | None = None, disk_usage: DiskUsage = shutil.disk_usage,
                 force_host_masters: bool = False) -> None:
        _check_optimizer(optimizer)
        if not isinstance(offload, Offload):
            raise ValueError(f"offload must be a shardwise.Offload, got {type(offload).__name__}")
        self._ready = False
        # The base init gives the hook dicts and the profiled step; then share the wrapped
        # optimizer's groups (same dicts: LR schedulers write lr there) and state.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer, self.offload = optimizer, offload
        self._sync()
        self._store: DiskStore | None = None
        self._entries = self._plan(model)
        if offload.device == "disk":
            self._chunk_bytes = offload.buffer_bytes // (2 if offload.prefetch else 1)
            self._check_chunks()
            need = sum(e.state_bytes for e in self._entries if e.offloaded)
            check_offload_dir(offload.path, need, disk_usage=disk_usage)
        else:
            self._chunk_bytes = offload.buffer_bytes
        if offload.device == "disk":  # checked above; nothing is changed before this point
            self._store = DiskStore(offload.path, _rank())
        self._masters = HostMasters({e.key: e.source for e in self._entries if e.offloaded},
                                    pin=offload.pin_memory, force=force_host_masters)
        self._install_masters()
        if offload.foreach:
            for g in self.param_groups:
                if g.get("foreach", False) is None and not g.get("fused"):
                    g["foreach"] = True
        if self._store is not None:
            self._spill()  # state that exists already (stepped or loaded before wrapping)
        self._ready = True

    # ------------------------------------------------------------------ setup
    def _sync(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    def _plan(self, model: nn.Module | None) -> list[_Entry]:
        """Entries in param_groups order; the budget picks the offloaded ones in order."""
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        sizes, self._size_source = estimate_state_bytes(self.optimizer)
        budget = self.offload.budget_bytes
        used, entries, key = 0, [], 0
        for gi, g in enumerate(self.param_groups):
            for pos, p in enumerate(g["params"]):
                pb = tensor_nbytes(p)
                cost = pb + sizes[key]
                take = budget is None or used + cost <= budget
                used += cost if take else 0
                entries.append(_Entry(key, gi, pos, p, p, take, pb, sizes[key],
                                      names.get(id(p), f"#{key} {tuple(p.shape)}")))
                key += 1
        return entries

    def _check_chunks(self) -> None:
        for e in self._entries:
            if e.offloaded and e.state_bytes > self._chunk_bytes:
                need = math.ceil(e.state_bytes * (2 if self.offload.prefetch else 1)
                                 / 2 ** 20 * 100) / 100  # MiB, rounded up
                raise ValueError(f"parameter {e.name} has {e.state_bytes} bytes of optimizer "
                                 f"state, more than a chunk ({self._chunk_bytes} bytes) of "
                                 f"Offload(buffer_mb={self.offload.buffer_mb!r}); use "
                                 f"buffer_mb >= {need:.2f}")

    def _install_masters(self) -> None:
        """Put each host master where its parameter was in the optimizer (state moves too)."""
        for e in self._entries:
            pair = self._masters.pairs.get(e.key)
            if pair is None:
                continue
            self.param_groups[e.group]["params"][e.pos] = pair.master
            if e.source in self.state:
                self.state[pair.master] = {k: v.to("cpu") if isinstance(v, torch.Tensor) else v
                                           for k, v in self.state.pop(e.source).items()}
            e.param = pair.master

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_ready", False):
            raise ValueError("add parameter groups to the optimizer before offload_optimizer "
                             "wraps it")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ step
    def _has_grad(self, e: _Entry) -> bool:
        return e.source.grad is not None

    def _chunks(self, entries: list[_Entry]) -> list[list[_Entry]]:
        """Consecutive entries whose state (disk) or master (cpu) bytes fit a chunk."""
        chunks, cur, size = [], [], 0
        for e in entries:
            n = e.param_bytes
            if self._store is not None:
                rec = self._store.record_bytes(e.key)
                n = e.state_bytes if rec is None else rec
                if n > self._chunk_bytes:
                    raise ValueError(f"parameter {e.name} now has {n} bytes of optimizer state, "
                                     f"more than a chunk ({self._chunk_bytes} bytes); raise "
                                     f"Offload(buffer_mb={self.offload.buffer_mb!r})")
            if cur and size + n > self._chunk_bytes:
                chunks.append(cur)
                cur, size = [], 0
            cur.append(e)
            size += n
        return chunks + ([cur] if cur else [])

    def _step_subset(self, entries: list[_Entry]) -> None:
        """Step the wrapped optimizer over ``entries`` only (groups restricted in place)."""
        by_group: dict[int, list] = {}
        for e in entries:
            by_group.setdefault(e.group, []).append(e.param)
        groups = self.optimizer.param_groups
        saved = {gi: groups[gi]["params"] for gi in by_group}
        try:
            for gi, ps in by_group.items():
                groups[gi]["params"] = ps
            # Only groups with work: optimizers then never see an empty group.
            self.optimizer.param_groups = [groups[gi] for gi in sorted(by_group)]
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = groups
            for gi, ps in saved.items():
                groups[gi]["params"] = ps

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step over every parameter with a gradient, chunk by chunk.

        Args:
            closure: re-evaluates the loss (called once, with grad enabled).

        Returns:
            The closure's loss, or None.
        """
        if self._store is not None and self._store.closed:
            raise ValueError("this OffloadedOptimizer was closed; its disk state is gone")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._store is None and not self._masters.active:
            self.optimizer.step()  # [Note: CPU offload]: no accelerator, nothing to move
            return loss
        self._masters.wait_pushed()  # the last step's host-to-device copies read the masters
        live = [e for e in self._entries if self._has_grad(e)]
        kept = [e for e in live if not e.offloaded]
        if kept:  # on the device: launched first so it overlaps the host's chunks
            self._step_subset(kept)
        chunks = self._chunks([e for e in live if e.offloaded])
        for i, c in enumerate(chunks):
            self._masters.pull([e.key for e in c], i)
        if self._store is None:
            for i, c in enumerate(chunks):
                self._masters.wait_pulled(i)
                self._step_subset(c)
                self._masters.push([e.key for e in c])
        else:
            self._stream(chunks)
        self._masters.end_step()
        return loss

    def _stream(self, chunks: list[list[_Entry]]) -> None:
        """[Note: disk offload]: read ahead, step, write back, chunk by chunk."""
        store, prefetch = self._store, self.offload.prefetch
        futs = {0: store.load_async([e.key for e in chunks[0]])} if chunks else {}
        for i, chunk in enumerate(chunks):
            if prefetch and i + 1 < len(chunks):
                futs[i + 1] = store.load_async([e.key for e in chunks[i + 1]])
            self._masters.wait_pulled(i)
            flat, states = store.wait(futs.pop(i))
            for e, st in zip(chunk, states):
                if st is not None:
                    self.state[e.param] = st
            del states
            self._step_subset(chunk)
            items = [(e.key, self.state.pop(e.param)) for e in chunk if e.param in self.state]
            fresh = _fresh_bytes([st for _, st in items], flat)
            store.stats.hold(fresh)
            store.store_async(items, flat.numel() + fresh)
            del flat, items  # the write task now holds the only references
            self._masters.push([e.key for e in chunk])
            if not prefetch and i + 1 < len(chunks):  # queued after the write: one chunk
                futs[i + 1] = store.load_async([e.key for e in chunks[i + 1]])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._masters.zero_device_grads(set_to_none)

    # ------------------------------------------------------------------ state
    def _spill(self) -> None:
        """Write every streamed parameter's RAM state to disk and drop it from RAM."""
        items = []
        for e in self._entries:
            if not e.offloaded:
                continue
            st = self.state.pop(e.param, None)
            if st:
                items.append((e.key, st))
            else:
                self._store.forget(e.key)
        self._store.store_async(items, 0)
        del items
        self._store.flush()

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict, with real tensors ([Note: offload checkpoints])."""
        if self._store is None:
            return self.optimizer.state_dict()
        streamed = [e for e in self._entries if e.offloaded]
        for e, st in zip(streamed, self._store.load([e.key for e in streamed])):
            if st is not None:
                self.state[e.param] = st
        try:
            return self.optimizer.state_dict()
        finally:
            for e in streamed:
                self.state.pop(e.param, None)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict (from this wrapper or the plain optimizer) and offload it."""
        if self._store is not None:
            self._store.flush()
        self.optimizer.load_state_dict(state_dict)
        self._sync()  # load_state_dict replaces the wrapped optimizer's groups and state
        if self._store is not None:
            self._spill()

    def model_params(self) -> list[nn.Parameter]:
        """The model's parameters in ``param_groups`` order (the indices of ``state_dict``).
        ``param_groups`` may hold host masters in their place ([Note: CPU offload])."""
        return [e.source for e in self._entries]

    # ------------------------------------------------------------------ reporting, cleanup
    def stats(self) -> OffloadStats:
        """Bytes and seconds of this rank's offload (:class:`OffloadStats`)."""
        off = [e for e in self._entries if e.offloaded]
        common = dict(device=self.offload.device, offloaded_params=len(off),
                      kept_params=len(self._entries) - len(off),
                      offloaded_bytes=sum(e.param_bytes + e.state_bytes for e in off),
                      host_master_bytes=self._masters.master_bytes(),
                      state_size_source=self._size_source,
                      buffer_bytes=self.offload.buffer_bytes, chunk_bytes=self._chunk_bytes)
        if self._store is None:
            held = sum(tensor_nbytes(v) for e in off for v in self.state.get(e.param, {}).values()
                       if isinstance(v, torch.Tensor))
            return OffloadStats(**common, resident_bytes=held, peak_resident_bytes=held)
        return OffloadStats(**common, **self._store.stats.snapshot(),
                            file_bytes=self._store.file_bytes(), run_dir=self._store.dir)

    def reset_peak(self) -> None:
        """Restart ``peak_resident_bytes`` from the bytes held now."""
        if self._store is not None:
            with self._store.stats.lock:
                self._store.stats.peak_resident_bytes = self._store.stats.resident_bytes

    def close(self) -> None:
        """Finish queued writes and delete this rank's disk files (idempotent). The
        streamed state is gone afterwards: take a ``state_dict()`` first to keep it."""
        if self._store is not None:
            self._store.close()

    def __enter__(self) -> OffloadedOptimizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
