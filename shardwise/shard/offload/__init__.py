"""CPU and disk offload of optimizer state and fp32 master parameters (ZeRO-Offload /
ZeRO-Infinity style) around ANY ``torch.optim`` optimizer.

    model = shardwise.shard(model, stage=3, wrap={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    with shardwise.offload_optimizer(opt, shardwise.Offload(device="disk", path="/scratch/opt",
                                                            buffer_mb=256)) as opt:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        for batch in loader:
            loss_fn(model(batch)).backward(); opt.step(); sched.step(); opt.zero_grad()

Modules: this one (the notes and ``offload_optimizer``), ``config`` (the policy and
its directory checks), ``optim`` (the wrapper), ``disk`` (the per-rank file
and its I/O thread; files are removed on close, garbage collection and exit, and orphans of
killed processes by the next run: [Note: cleanup]), ``host`` (state sizing, host
masters).

[Note: offload design]
The wrapper does not re-implement any optimizer. ``step()`` splits the parameters into
chunks and, per chunk, temporarily sets each ``param_groups[i]["params"]`` to the chunk's
parameters and calls the wrapped optimizer's own ``step()``. Every ``torch.optim`` optimizer
but LBFGS (refused) updates a parameter from its own gradient and state only, so a chunked
step computes exactly what one step over all parameters computes: offload in fp32 is
bitwise equal to no offload. Before and after each chunk the wrapper moves what that chunk
needs: gradients and masters (CPU offload on an accelerator), optimizer state (disk).
``OffloadedOptimizer`` subclasses ``torch.optim.Optimizer`` and shares the wrapped
optimizer's ``param_groups`` dicts, ``state`` and ``defaults``, so LR schedulers (which
require an ``Optimizer`` and patch its ``step``), ``zero_grad`` and checkpoints work on it.
The wrapped optimizer's own step hooks run once per chunk.

[Note: CPU offload]
fp32 masters and optimizer state live in host memory and the step runs there with the
optimizer's foreach kernels (``Offload.foreach`` sets ``foreach=True`` on groups that left
it unset; bitwise equal to the default on CPU). For a parameter on an accelerator the
wrapper keeps a host master (pinned) in the optimizer in its place (see HostMasters in
host.py): per chunk, gradients are copied device-to-host on a side stream, the
host steps the chunk while the next chunk's gradients are in flight, and the updated
masters are copied host-to-device, overlapping the next chunk's step; the device's next
forward is ordered after those copies without blocking the host. ``budget_bytes`` caps
the bytes (masters + optimizer state) moved off the device, parameters taken in order;
the rest stay on the device and the same optimizer steps them there. On a machine without
an accelerator the parameters already are host tensors: CPU offload degenerates to a
pass-through that calls the wrapped optimizer's ``step()`` once, with no copy.

[Note: disk offload]
Optimizer state lives in one file per rank (see [Note: disk layout] in disk.py) and
streams through RAM one chunk at a time: the chunk's state is read into one buffer, the
chunk steps, its state is queued for write-back and dropped from ``optimizer.state``.
With ``prefetch`` a chunk holds at most half of ``buffer_mb`` so that the next chunk's
read overlaps this chunk's step; the single FIFO I/O thread orders every read after the
write-back before it ([Note: one FIFO I/O thread]), so the optimizer state held in RAM
never exceeds ``buffer_mb``: ``stats().peak_resident_bytes`` counts it (buffers being
read, stepped or written, and state the optimizer creates on a first step) and the tests
assert the bound. The write-back of the last chunks overlaps the next forward; anything
that reads the state (``state_dict``, ``close``) waits for it first. Not counted: the
step's temporaries (Adam's denominator: one chunk's worth) and the kernel's page cache,
which may keep recently written file pages (reclaimable, not process memory). Masters
stay in host memory (``device="disk"`` moves optimizer state only). Between steps
``optimizer.state`` holds no streamed state, so ``shardwise.memory_report`` counts only
RAM-resident state.

[Note: sizing optimizer state]
Chunks, the disk-space check and the budget need each parameter's state bytes before the
optimizer has created any. ``estimate_state_bytes`` runs the optimizer's own first step on
meta-device stand-ins (no memory, exact shapes and dtypes); after the first real step the
recorded sizes replace the estimate.

[Note: offload checkpoints]
``state_dict()`` returns the ordinary ``torch.optim`` format with real tensors, so it saves
and loads like any optimizer's (and into a plain optimizer): for disk offload it reads all
state back into RAM for the duration (checkpoint time only). ``load_state_dict`` loads
through the wrapped optimizer, then writes the streamed state back to disk.
"""

from __future__ import annotations

import shutil

import torch
from torch import nn

from shardwise.shard.offload.config import (DiskUsage, Offload, OffloadStats, check_offload_dir,
                                            local_ranks)
from shardwise.shard.offload.optim import OffloadedOptimizer
from shardwise.shard.registry import engine_states

__all__ = ["Offload", "OffloadedOptimizer", "OffloadStats", "offload_optimizer", "policy_of",
           "check_offload_dir", "local_ranks"]


def policy_of(model: nn.Module) -> Offload | None:
    """The :class:`Offload` given to ``shardwise.shard(model, ..., offload=...)``, if any (the
    engine keeps it as its state's ``offload`` attribute)."""
    found = {id(p): p for p in (s.offload for s in engine_states(model))
             if p is not None}
    if len(found) > 1:
        raise ValueError("the model's sharded parts were given different Offload policies; "
                         "pass offload= explicitly")
    return next(iter(found.values()), None)


def offload_optimizer(optimizer: torch.optim.Optimizer, offload: Offload | None = None, *,
                      model: nn.Module | None = None,
                      disk_usage: DiskUsage = shutil.disk_usage,
                      _force_host_masters: bool = False) -> OffloadedOptimizer:
    """Wrap ``optimizer`` so its state (and masters) are offloaded as ``offload`` says.

    Call it once, after building the optimizer on the (sharded) model's parameters and
    before the first step; then use the returned object as the optimizer everywhere
    (``step``, ``zero_grad``, LR schedulers, ``state_dict``, checkpoints). Close it (or use
    it as a context manager) to delete disk files; they are also deleted at garbage
    collection and at interpreter exit.

    Args:
        optimizer: any ``torch.optim.Optimizer`` except LBFGS.
        offload: the policy (:class:`Offload`). Default None: the one given to
            ``shardwise.shard(model, ..., offload=...)`` (see :func:`policy_of`).
        model: the model, to find that policy and to name parameters in errors.
        disk_usage: free-space query for the directory check (tests inject one).
        _force_host_masters: make host masters even for CPU parameters (tests exercise the
            accelerator code path with it).

    Returns:
        An :class:`OffloadedOptimizer`.

    Raises:
        ValueError: a bad optimizer or policy, no policy given or found on ``model``, a
            directory that is missing, read-only or too small (see
            :func:`check_offload_dir`), or a parameter whose state alone exceeds a chunk.
    """
    if offload is None:
        offload = policy_of(model) if model is not None else None
        if offload is None:
            raise ValueError("offload_optimizer needs offload=Offload(...), or model= sharded "
                             "with shardwise.shard(..., offload=Offload(...))")
    wrapper = OffloadedOptimizer(optimizer, offload, model=model, disk_usage=disk_usage,
                                 force_host_masters=_force_host_masters)
    optimizer._shardwise_offload_wrapped = True  # see guard_unwrapped_steps
    return wrapper


def guard_unwrapped_steps(params: list[nn.Parameter], offload: Offload) -> None:
    """Refuse, at its first step, an optimizer over these parameters that was not passed
    through :func:`offload_optimizer`: without it nothing is offloaded, silently.

    Registers one global optimizer step pre-hook per call (``shard(..., offload=...)``).
    """
    import weakref

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    owned = weakref.WeakValueDictionary({id(p): p for p in params})  # tensors: no == here

    def hook(optimizer, args, kwargs):
        if isinstance(optimizer, OffloadedOptimizer) or getattr(
                optimizer, "_shardwise_offload_wrapped", False):
            return
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        if first is not None and owned.get(id(first)) is first:
            raise ValueError(
                f"this model was sharded with offload={offload}, but "
                f"{type(optimizer).__name__} was not wrapped: use "
                f"opt = shardwise.offload_optimizer(opt, model=model) before the first step")
    register_optimizer_step_pre_hook(hook)
