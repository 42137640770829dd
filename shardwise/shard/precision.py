"""Mixed precision: 16-bit compute over fp32 master shards, and dynamic loss scaling.

With a :class:`MixedPrecision` policy the engine keeps each rank's parameter shards (the
masters the optimizer updates) in their own dtype, usually fp32, and casts them to
``param_dtype`` before the all-gather, so gathered parameters, activations and gradients
are 16-bit and the all-gather moves half the bytes. Gradients are reduced in
``reduce_dtype`` and land in fp32 on the master shards. Buffers are never cast by the
engine: RoPE tables and normalisation statistics stay fp32.

fp16's narrow range needs loss scaling: :class:`LossScaler` multiplies the loss before
backward, divides the (sharded) gradients after reduction, and skips the optimizer step on
every rank when any rank sees an inf or nan, halving the scale; after ``growth_interval``
clean steps the scale doubles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed import comm

__all__ = ["MixedPrecision", "LossScaler", "DTYPES", "parse_dtype"]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"`` -> torch.bfloat16, etc.; dtypes and None pass through.

    Raises:
        ValueError: for an unknown name.
    """
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for compute and communication (masters stay in the parameters' dtype).

    Attributes:
        param_dtype: dtype of gathered parameters and compute (default None: unchanged).
        reduce_dtype: dtype gradients are reduced in (default None: ``param_dtype``).
        output_dtype: cast floating-point outputs of the sharded module's forward to this
            dtype (default None: leave them).
        cast_inputs: cast floating-point inputs of the sharded module's forward to
            ``param_dtype`` (default True).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            object.__setattr__(self, name, parse_dtype(value))
            value = getattr(self, name)
            if value is not None and not value.is_floating_point:
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype, got {value}")


def cast_floating(obj, dtype: torch.dtype):
    """Cast every floating-point tensor in nested tuples / lists / dicts to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(cast_floating(x, dtype) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating(x, dtype) for x in obj)
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj


class LossScaler:
    """Dynamic loss scaling for fp16 over sharded gradients (all ranks agree on skips).

    Usage::

        scaler = LossScaler()
        scaler.scale(loss).backward()
        if scaler.step(model, optimizer):      # unscales, checks every rank, steps or skips
            ...
        scaler.update()

    Args:
        init_scale: first scale (default 2**16).
        growth_factor, backoff_factor: scale multipliers after a clean run / an overflow.
        growth_interval: clean steps before growing (default 2000).
        enabled: False makes every method a pass-through (bf16 / fp32 runs).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True) -> None:
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1; "
                             f"got {init_scale}, {growth_factor}, {backoff_factor}")
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.enabled = growth_interval, enabled
        self.clean_steps = 0
        self.skipped_steps = 0
        self._found_inf: bool | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (unchanged when disabled)."""
        return loss * self.scale_value if self.enabled else loss

    def unscale_(self, model: nn.Module) -> bool:
        """Divide every gradient by the scale; return whether any rank saw inf / nan."""
        if not self.enabled:
            return False
        # One fused unscale-and-check per device (torch's GradScaler kernel), one all-reduce
        # on the group's device, one host read per step: no sync per gradient.
        device = comm.group_device()
        bad = torch.zeros(1, device=device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in model.parameters():
            if p.grad is not None and p.grad.numel():
                by_device.setdefault(p.grad.device, []).append(p.grad)
        for dev, grads in by_device.items():
            found = torch.zeros(1, device=dev)
            inv = torch.full((1,), 1.0 / self.scale_value, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            bad = torch.maximum(bad, found.to(device, non_blocking=True))
        if dist.is_initialized() and dist.get_world_size() > 1:
            comm.all_reduce(bad, label="loss_scaler.found_inf", op=dist.ReduceOp.MAX)
        self._found_inf = bool(bad.item())
        return self._found_inf

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (if not yet done) and step, or skip on overflow; True when it stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        if self._found_inf is None:
            self.unscale_(model)
        if self._found_inf:
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps."""
        if not self.enabled:
            return
        if self._found_inf:
            self.scale_value *= self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale_value *= self.growth_factor
                self.clean_steps = 0
        self._found_inf = None

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale_value = float(sd["scale"])
        self.clean_steps = int(sd["clean_steps"])
        self.skipped_steps = int(sd["skipped_steps"])
