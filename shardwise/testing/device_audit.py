"""A CPU stand-in for an accelerator run: which tensors a collective gets from the host.

[Note: device audit] NCCL serves CUDA tensors only, so a tensor built on the host and handed
to a collective of an NCCL group stops a GPU run (the doctor's start-up exchange did, on the
first H100 run). On a CPU-only machine every tensor is a CPU tensor and every group is Gloo,
which serves the CPU: the bug cannot show. :func:`device_audit` makes it show:

* the run's device is ``cpu:0``: it computes on the CPU, but a factory or ``.to`` that names
  it is visible to a dispatch mode (the device index survives into aten's ``device=``),
  unlike the host's plain ``cpu``;
* a storage is *on the accelerator* when an op that named ``cpu:0`` allocated it, or an op
  that read a tensor on the accelerator did (views share their base's storage, an in-place
  op keeps its target's place, as on a GPU); ``.cpu()`` / ``.to("cpu")`` of such a tensor
  copies to the host, as on a GPU;
* every process group is taken for what it would be on GPUs: the ones created with an
  explicit Gloo backend (the checkpoint manager's) serve the host and the accelerator, every
  other group (the default one and those inheriting its backend) the accelerator only;
  ``comm.group_device`` answers ``cpu:0`` for the latter;
* ``x.device`` of a tensor on the accelerator says ``cpu:0``, so ``device=x.device`` places
  a new tensor beside ``x``, as on a GPU;
* every collective checks that its tensors handed to an accelerator-only group are on the
  accelerator, and raises like ``comm.check_devices`` if not.

Known gap: a TorchFunctionMode is switched off while its handler runs, so inside
``Tensor.backward`` and a custom ``autograd.Function``'s ``apply`` (autograd hooks, backward
passes, ring attention) ``x.device`` says ``cpu``: a tensor placed with ``device=x.device``
there counts as a host tensor. Tensor parallelism (``sp_regather`` in backward), context
parallelism (``cp.kv*`` sends) and quantized gathers at stage 3 (the backward re-gather)
raise for that reason alone, not for a bug; re-entering the mode for those calls is the
next step. Also not seen: tensors made in other threads or inside a tensor subclass's own
dispatch (they count as host tensors, so the audit errs towards raising), and torch's object
collectives, which place their own buffers.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardwise.distributed import comm
from shardwise.distributed.pool import POOL

__all__ = ["ACCELERATOR", "DeviceAudit", "device_audit"]

ACCELERATOR = torch.device("cpu", 0)
_DEVICE_GET = torch.Tensor.device.__get__  # compare with ==: each access makes a new wrapper
_HOST_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}


def _key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage of its own (a subclass)
        return None


def _names_accelerator(device) -> bool | None:
    """True / False when ``device`` names the accelerator / the host; None when absent."""
    if device is None:
        return None
    return torch.device(device).index == 0


class DeviceAudit:
    """The bookkeeping behind :func:`device_audit` (see [Note: device audit])."""

    def __init__(self) -> None:
        self.device = ACCELERATOR
        self.placed: set[int] = set()
        self.host_groups: set[int] = set()
        self.checked = 0

    # ---------------------------------------------------------------- placement
    def on_accelerator(self, t: torch.Tensor) -> bool:
        return _key(t) in self.placed

    def place(self, t: torch.Tensor, on: bool) -> None:
        key = _key(t)
        if key is None or (key in self.placed) == on:
            return
        if on:
            self.placed.add(key)
            weakref.finalize(t.untyped_storage(), self.placed.discard, key)
        else:
            self.placed.discard(key)

    # ---------------------------------------------------------------- groups
    def served_devices(self, group=None) -> frozenset[str]:
        if group is not None and id(group) in self.host_groups:
            return frozenset({"cpu", "cuda"})
        return frozenset({"cuda"})

    def group_device(self, group=None) -> torch.device:
        return torch.device("cpu") if "cpu" in self.served_devices(group) else self.device

    def check(self, kind: str, group, label: str, tensors) -> None:
        """Raise like ``comm.check_devices`` for a host tensor handed to an accelerator-only
        group."""
        self.checked += 1
        if "cpu" in self.served_devices(group):
            return
        for t in tensors:
            if t is not None and not self.on_accelerator(t):
                name = getattr(group, "group_name", "default") if group is not None \
                    else "default"
                raise RuntimeError(
                    f"{kind} {label!r}: a tensor on the host ({t.dtype}, "
                    f"{tuple(t.shape)}) was handed to process group "
                    f"{name!r}, which serves the accelerator only (device audit: on GPUs it "
                    f"is an NCCL group); build it on comm.group_device(group)")


class _Dispatch(TorchDispatchMode):
    def __init__(self, audit: DeviceAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on = _names_accelerator(kwargs.get("device"))
        if on is None:
            on = any(self.audit.on_accelerator(t) for t in ins)
        old = {_key(t) for t in ins}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _key(t) not in old:  # new storage
                self.audit.place(t, on)
        return out


class _Functions(TorchFunctionMode):
    """What the dispatch mode cannot see: ``torch.tensor(..., device=)``, ``x.device``, and
    host copies that are no-ops on a CPU tensor."""

    def __init__(self, audit: DeviceAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_GET:  # ``x.device`` names the accelerator, as on a GPU
            out = func(*args)
            return self.audit.device if self.audit.on_accelerator(args[0]) else out
        if func in (torch.Tensor.cpu, torch.Tensor.to) and args \
                and isinstance(args[0], torch.Tensor) and self.audit.on_accelerator(args[0]):
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if func is torch.Tensor.cpu or (isinstance(target, (str, torch.device))
                                            and _names_accelerator(target) is False):
                return args[0].to(torch.device("cpu"), copy=True,
                                  **({"dtype": kwargs["dtype"]} if "dtype" in kwargs else {}))
        out = func(*args, **kwargs)
        if func in _HOST_FACTORIES and isinstance(out, torch.Tensor):
            on = _names_accelerator(kwargs.get("device"))
            if on is not None:
                self.audit.place(out, on)
        return out


@contextlib.contextmanager
def device_audit() -> Iterator[DeviceAudit]:
    """Run the body as if on GPUs with NCCL groups ([Note: device audit]); test-only.

    Use it on every rank, around the whole job; the body's run device is
    :data:`ACCELERATOR` (``audit.device``), which the job must compute on.

    Yields:
        The :class:`DeviceAudit`; ``checked`` counts the collectives it checked.

    Raises:
        RuntimeError: from the first collective handed a host tensor on an
            accelerator-only group.
    """
    audit = DeviceAudit()
    real_new_group = dist.new_group

    def new_group(*args, **kwargs):
        group = real_new_group(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and "gloo" in str(backend) and group is not None:
            audit.host_groups.add(id(group))
        return group

    dist.new_group = new_group
    comm.set_device_audit(audit)
    POOL.clear()  # its free buffers were placed before this audit: it could not tell where
    try:
        with _Functions(audit), _Dispatch(audit):
            yield audit
    finally:
        comm.set_device_audit(None)
        dist.new_group = real_new_group
        POOL.clear()
