"""Tensor-parallel parity: train with ``apply_tp`` + ``shard`` over a :class:`ParallelMesh`
and compare with one process on the same global batches (shardwise.testing.parity).

Batch semantics (issue 11): the data ranks split each global micro-batch as in parity.py;
the tensor ranks of one data rank see the same sequences; the step's loss is the mean over
the data ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.distributed.mesh import ParallelDims, ParallelMesh
from shardwise.parallel import apply_tp, vocab_parallel_cross_entropy
from shardwise.testing.parity import RunResult, _null, _optimizer, _train_dp

__all__ = ["TPConfig", "tp_run", "mesh_for"]


@dataclass(frozen=True)
class TPConfig:
    """One tensor-parallel layout to compare with the reference."""

    tp: int
    dp_shard: int = -1
    dp_replicate: int = 1
    stage: int = 3
    sp: bool = True
    loss_parallel: bool = True
    accum: int = 1
    optimizer: str = "sgd"
    steps: int = 5
    clip: float | None = 1.0
    meta: bool = False
    param_dtype: str | None = None  # mixed precision compute dtype ("bf16")
    comm_grads: str | None = None   # quantised gradient reduce-scatter ("int8")

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp}"]
        if self.dp_replicate > 1:
            parts.append(f"rep{self.dp_replicate}")
        parts += [f"stage{self.stage}", "sp" if self.sp else "nosp", f"accum{self.accum}",
                  self.optimizer]
        parts += [x for x, on in (("lossfull", not self.loss_parallel), ("meta", self.meta),
                                  (f"mp-{self.param_dtype}", self.param_dtype),
                                  (f"q-{self.comm_grads}", self.comm_grads)) if on]
        return "-".join(parts)


def mesh_for(cfg: TPConfig, cache: dict) -> ParallelMesh:
    """The ParallelMesh of ``cfg`` on this job (built once per layout: building is
    collective and creates process groups)."""
    import torch.distributed as dist

    dims = ParallelDims(cfg.dp_replicate, cfg.dp_shard, dist.get_world_size(), tp=cfg.tp)
    key = dims.resolved()
    if key not in cache:
        cache[key] = dims.build_mesh()
    return cache[key]


def _tp_loss(mesh: ParallelMesh, loss_parallel: bool, logits_of: Callable):
    def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = logits_of(model(tokens[:, :-1]))
        if loss_parallel:
            return vocab_parallel_cross_entropy(logits, tokens[:, 1:], mesh["tp"])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    return loss


def tp_run(build_model: Callable[[], nn.Module], batches: torch.Tensor, cfg: TPConfig, wrap,
           mesh_cache: dict, *, plan: dict | None = None, init_weights=None,
           logits_of: Callable = lambda out: out) -> RunResult:
    """Train ``build_model()`` (or, with ``cfg.meta``, the meta-device model it returns)
    parallelised as ``cfg`` describes; call on every rank.

    Args:
        logits_of: the logits in the model's output (``lambda out: out.logits`` for HF).
    """
    mesh = mesh_for(cfg, mesh_cache)
    model = build_model()
    apply_tp(model, mesh["tp"], plan=plan, sequence_parallel=cfg.sp,
             loss_parallel=cfg.loss_parallel)
    mp = shardwise.MixedPrecision(param_dtype=cfg.param_dtype) if cfg.param_dtype else None
    quant = shardwise.CommQuant(grads=cfg.comm_grads) if cfg.comm_grads else None
    if cfg.meta:
        torch.manual_seed(0)
    shardwise.shard(model, stage=cfg.stage, wrap=wrap, mesh=mesh, mixed_precision=mp,
                    comm=quant, init_weights=init_weights)
    opt = _optimizer(cfg.optimizer, model.parameters())
    return _train_dp(model, opt, batches, cfg, mesh.local_rank("dp"), mesh.size("dp"),
                     sync=lambda last: shardwise.no_sync(model) if not last else _null(),
                     clip=lambda: shardwise.clip_grad_norm_(model, cfg.clip or float("inf")),
                     full_state=lambda: shardwise.full_state_dict(model),
                     loss_fn=_tp_loss(mesh, cfg.loss_parallel, logits_of),
                     loss_group=mesh.group("dp"))
