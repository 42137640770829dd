"""Parity helpers: train a sharded model on N ranks and a single-process reference on the
same global batches from the same seed, then compare losses, gradient norms and weights.

Batch convention: each optimizer step has ``accum`` micro-batches of ``global_batch``
sequences; data-parallel rank r of n takes sequences ``[r * g / n, (r + 1) * g / n)`` of every
micro-batch, so the reference (one process, all g sequences) computes the same mean loss.
Parameters that receive no gradient anywhere in a step get a zero gradient in the reference
too (the engine's documented semantics).

``loss_fn(model, tokens)`` replaces the default next-token cross-entropy (e.g. to add an MoE
model's balance losses; the recorded loss is still what it returns), and ``after_step(model)``
runs on every rank after each optimizer step (e.g. the MoE bias update).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.distributed import comm

__all__ = ["ParityConfig", "RunResult", "make_batches", "reference_run", "sharded_run",
           "ddp_run", "rel_err", "max_rel_err"]


@dataclass(frozen=True)
class ParityConfig:
    """One engine configuration to compare against the reference."""

    stage: int
    accum: int = 1
    optimizer: str = "sgd"          # "sgd" (momentum 0.9) or "adamw"
    steps: int = 5
    clip: float | None = 1.0
    hybrid: bool = False            # 2-D mesh (2 replicas x world/2 shards)
    reshard_after_forward: bool = True
    prefetch: int = 1

    @property
    def name(self) -> str:
        return (f"stage{self.stage}-accum{self.accum}-{self.optimizer}"
                + ("-hybrid" if self.hybrid else "")
                + ("" if self.reshard_after_forward else "-keep")
                + (f"-prefetch{self.prefetch}" if self.prefetch != 1 else ""))


@dataclass
class RunResult:
    """Per-step global losses and gradient norms, and the final full weights."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)


def make_batches(seed: int, steps: int, accum: int, global_batch: int, seq_len: int,
                 vocab: int) -> torch.Tensor:
    """Token ids of shape (steps, accum, global_batch, seq_len + 1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, accum, global_batch, seq_len + 1), generator=g)


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {name!r}")


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])                                   # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _zero_missing_grads(model: nn.Module) -> None:
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def reference_run(build_model: Callable[[], nn.Module], batches: torch.Tensor,
                  cfg: ParityConfig, *, loss_fn: Callable | None = None,
                  after_step: Callable | None = None) -> RunResult:
    """Train one process on the full global batches."""
    loss_fn = loss_fn or _loss
    model = build_model()
    opt = _optimizer(cfg.optimizer, model.parameters())
    res = RunResult()
    for step in range(cfg.steps):
        total = 0.0
        for micro in range(cfg.accum):
            loss = loss_fn(model, batches[step, micro]) / cfg.accum
            loss.backward()
            total += loss.item()
        _zero_missing_grads(model)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip or float("inf"))
        res.losses.append(total)
        res.grad_norms.append(norm.item())
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model)
    res.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return res


def _hybrid_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))


def sharded_run(build_model: Callable[[], nn.Module], batches: torch.Tensor, cfg: ParityConfig,
                wrap=None, *, loss_fn: Callable | None = None,
                after_step: Callable | None = None,
                shard_kwargs: dict | None = None) -> RunResult:
    """Train with ``shardwise.shard`` on the current process group (call on every rank);
    ``shard_kwargs`` (e.g. ``comm``, ``mixed_precision``) go to ``shard`` as they are."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    mesh = _hybrid_mesh(world) if cfg.hybrid else None
    shardwise.shard(model, stage=cfg.stage, wrap=wrap, mesh=mesh,
                    reshard_after_forward=cfg.reshard_after_forward, prefetch=cfg.prefetch,
                    **(shard_kwargs or {}))
    opt = _optimizer(cfg.optimizer, model.parameters())
    return _train_dp(model, opt, batches, cfg, rank, world,
                     sync=lambda last: shardwise.no_sync(model) if not last else _null(),
                     clip=lambda: shardwise.clip_grad_norm_(model, cfg.clip or float("inf")),
                     full_state=lambda: shardwise.full_state_dict(model),
                     loss_fn=loss_fn, after_step=after_step)


def ddp_run(build_model: Callable[[], nn.Module], batches: torch.Tensor,
            cfg: ParityConfig) -> RunResult:
    """The same training with torch's DistributedDataParallel (the AdamW noise baseline)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = _optimizer(cfg.optimizer, ddp.parameters())
    return _train_dp(ddp, opt, batches, cfg, rank, world,
                     sync=lambda last: ddp.no_sync() if not last else _null(),
                     clip=lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(),
                                                                 cfg.clip or float("inf")),
                     full_state=lambda: {k: v.detach().clone()
                                         for k, v in model.state_dict().items()},
                     zero_missing=True)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _train_dp(model, opt, batches, cfg, rank, world, sync, clip, full_state,
              zero_missing=False, loss_fn=None, after_step=None,
              loss_group=None) -> RunResult:
    """The training loop: data rank ``rank`` of ``world`` takes its slice of each global
    micro-batch; the step's loss is averaged over ``loss_group`` (default: every rank; with
    tensor parallelism, the data ranks, since tensor ranks compute the same loss)."""
    loss_fn = loss_fn or _loss
    per_rank = batches.shape[2] // world
    res = RunResult()
    for step in range(cfg.steps):
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(cfg.accum):
            mine = batches[step, micro, rank * per_rank:(rank + 1) * per_rank]
            with sync(micro == cfg.accum - 1):
                loss = loss_fn(model, mine) / cfg.accum
                loss.backward()
            total += loss.detach().double()
        comm.all_reduce(total, loss_group, label="parity.loss")
        if zero_missing:
            _zero_missing_grads(model)
        norm = clip()
        res.losses.append(total.item() / comm.group_size(loss_group))
        res.grad_norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model)
    res.state = full_state()
    return res


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def max_rel_err(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
                ) -> tuple[float, str]:
    """The largest per-tensor relative error between two state dicts, and its key."""
    assert state.keys() == ref.keys(), (sorted(state), sorted(ref))
    worst = max(((rel_err(state[k], ref[k]), k) for k in ref), default=(0.0, ""))
    return worst
