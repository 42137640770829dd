"""Helpers of :mod:`shardwise.shard.offload`: sizing optimizer state before it exists, and
host (CPU) fp32 masters for parameters that live on an accelerator.

See [Note: sizing optimizer state] and [Note: CPU offload] in ``offload.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardwise.sizes import nbytes

__all__ = ["ALIGN", "aligned", "tensor_nbytes", "estimate_state_bytes", "HostMasters"]

ALIGN = 64  # bytes; state tensors in the disk layout start on this boundary (view(dtype) needs it)


def aligned(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


tensor_nbytes = nbytes  # the package's one byte count (shardwise.sizes)


def _probe_hyper(group: dict) -> dict:
    """A group's hyper-parameters, minus the kernels that refuse meta tensors (state shapes
    do not depend on them)."""
    hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    for k in ("fused", "foreach", "capturable", "differentiable"):
        if k in hyper:
            hyper[k] = False
    return hyper


def _probe_step(optimizer: torch.optim.Optimizer, group: dict,
                params: list[torch.Tensor]) -> list[int]:
    """State bytes the optimizer creates for ``params`` on their first step (raises if the
    optimizer cannot step these stand-ins)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    probe = object.__new__(type(optimizer))  # skip the subclass's argument checks
    torch.optim.Optimizer.__init__(probe, [{**_probe_hyper(group), "params": params}],
                                   dict(optimizer.defaults))
    with torch.no_grad():
        probe.step()
    sizes = []
    for p in params:
        st = probe.state.get(p, {})
        sizes.append(sum(aligned(tensor_nbytes(v)) for v in st.values()
                         if isinstance(v, torch.Tensor)))
    return sizes


def estimate_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[list[int], str]:
    """Bytes of optimizer state (each tensor rounded up to :data:`ALIGN`) every parameter of
    ``optimizer`` will hold after its first step, in ``param_groups`` order.

    Tries a step on meta-device stand-ins (free), then on zero CPU stand-ins one shape at a
    time, and falls back to twice the parameter's bytes (the Adam family) when the optimizer
    cannot step stand-ins.

    Returns:
        (bytes per parameter, how they were found: "meta", "cpu" or "assumed 2x").
    """
    out: list[int] = []
    how = "meta"
    for group in optimizer.param_groups:
        params = group["params"]
        try:
            out += _probe_step(optimizer, group,
                               [nn.Parameter(torch.empty(p.shape, dtype=p.dtype,
                                                         device="meta")) for p in params])
            continue
        except Exception:  # noqa: BLE001 - any failure means: try the next way
            pass
        cache: dict[tuple, int] = {}
        try:
            for p in params:  # one shape at a time: transient memory of one parameter
                k = (tuple(p.shape), p.dtype)
                if k not in cache:
                    cache[k] = _probe_step(optimizer, group,
                                           [nn.Parameter(torch.zeros(p.shape, dtype=p.dtype))])[0]
                out.append(cache[k])
            how = "cpu" if how == "meta" else how
        except Exception:  # noqa: BLE001
            out += [2 * aligned(tensor_nbytes(p)) + ALIGN for p in params]
            how = "assumed 2x"
    return out, how


@dataclass
class _Pair:
    device_param: nn.Parameter
    master: nn.Parameter
    grad_buf: torch.Tensor


class HostMasters:
    """fp32 masters in host memory for offloaded parameters that live on an accelerator.

    The optimizer steps ``master``; each step copies the device gradient to the host
    (``pull``) and the updated master back into the device parameter (``push``), both on a
    side stream so they overlap the host's work on other chunks. Without an accelerator
    there are no pairs and every method returns at once (the CPU pass-through), unless
    ``force`` makes copies of CPU parameters (tests use it to exercise this path).

    Args:
        params: candidate parameters, keyed by their entry key.
        pin: allocate masters and gradient buffers in pinned memory (accelerators only).
        force: make masters for CPU parameters too.
    """

    def __init__(self, params: dict[int, nn.Parameter], pin: bool = True,
                 force: bool = False) -> None:
        self.pairs: dict[int, _Pair] = {}
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pulled: dict[int, list] = {}
        self._pushed: list[object] = []
        for key, p in params.items():
            if p.device.type == "cpu" and not force:
                continue
            use_pin = pin and p.device.type == "cuda"
            host = torch.empty(p.shape, dtype=p.dtype, pin_memory=use_pin)
            host.copy_(p.detach())
            master = nn.Parameter(host, requires_grad=p.requires_grad)
            grad_buf = torch.empty(p.shape, dtype=p.dtype, pin_memory=use_pin)
            self.pairs[key] = _Pair(p, master, grad_buf)
            if p.device.type == "cuda" and p.device not in self.streams:
                self.streams[p.device] = torch.cuda.Stream(p.device)

    @property
    def active(self) -> bool:
        return bool(self.pairs)

    def master_bytes(self) -> int:
        return sum(tensor_nbytes(pr.master) for pr in self.pairs.values())

    def has_grad(self, key: int) -> bool | None:
        """Whether the device parameter of ``key`` has a gradient (None: no pair)."""
        pr = self.pairs.get(key)
        return None if pr is None else pr.device_param.grad is not None

    def pull(self, keys: list[int], tag: int) -> None:
        """Issue device-to-host copies of the gradients of ``keys`` (async on a stream)."""
        for dev, s in self.streams.items():
            # The side stream must see the reduce-scatters that produced the gradients.
            s.wait_stream(torch.cuda.current_stream(dev))
        used = set()
        for key in keys:
            pr = self.pairs.get(key)
            if pr is None:
                continue
            g = pr.device_param.grad
            if g is None:
                pr.master.grad = None
                continue
            s = self.streams.get(g.device)
            if s is None:
                pr.grad_buf.copy_(g)
            else:
                with torch.cuda.stream(s):
                    pr.grad_buf.copy_(g, non_blocking=True)
                g.record_stream(s)
                used.add(g.device)
            pr.master.grad = pr.grad_buf
        self._pulled[tag] = [self._record(self.streams[d]) for d in used]

    @staticmethod
    def _record(stream) -> object:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_pulled(self, tag: int) -> None:
        """Block until the gradients pulled under ``tag`` are in host memory."""
        for event in self._pulled.pop(tag, []):
            event.synchronize()

    def push(self, keys: list[int]) -> None:
        """Issue host-to-device copies of the updated masters of ``keys`` (async)."""
        used = set()
        for key in keys:
            pr = self.pairs.get(key)
            if pr is None:
                continue
            s = self.streams.get(pr.device_param.device)
            if s is None:
                pr.device_param.data.copy_(pr.master.detach())
                continue
            with torch.cuda.stream(s):
                pr.device_param.data.copy_(pr.master.detach(), non_blocking=True)
            used.add(pr.device_param.device)
        self._pushed += [self._record(self.streams[d]) for d in used]

    def end_step(self) -> None:
        """Order the device's next work (forward) after the pushes, without blocking the host."""
        for dev, s in self.streams.items():
            torch.cuda.current_stream(dev).wait_stream(s)

    def wait_pushed(self) -> None:
        """Block until the last step's pushes have read the masters (before updating them)."""
        for event in self._pushed:
            event.synchronize()
        self._pushed.clear()

    def zero_device_grads(self, set_to_none: bool) -> None:
        for pr in self.pairs.values():
            g = pr.device_param.grad
            if g is None:
                continue
            if set_to_none:
                pr.device_param.grad = None
            else:
                g.zero_()
