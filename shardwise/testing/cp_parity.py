"""Context-parallel parity: train with ``apply_cp`` (and tp / ep / ZeRO over a
:class:`ParallelMesh`) and compare with one process on the same global batches
(shardwise.testing.parity).

Batch semantics (issue 32): the data ranks split each global micro-batch as in parity.py;
the cp ranks of one data rank see the same sequences and each feeds its part of them
(:meth:`ContextParallel.shard`, inputs and targets alike); the step's loss is the mean over
``dp_cp`` (every cp rank holds as many tokens, so the mean of the means is the global mean).
With ``documents=True`` every sequence is packed: a document starts after each token
divisible by 7, so the boundaries travel with the tokens whatever the slicing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.distributed.parallel_dims import ParallelDims, ParallelMesh
from shardwise.models.moe import finish_moe_step, moe_aux_loss
from shardwise.parallel import apply_ep, apply_global_balance, apply_tp
from shardwise.parallel.context import apply_cp, cp_context
from shardwise.parallel.tensor import vocab_parallel_cross_entropy
from shardwise.testing.parity import RunResult, _null, _optimizer, _train_dp

__all__ = ["CPConfig", "cp_run", "cp_loss", "packed_positions"]


@dataclass(frozen=True)
class CPConfig:
    """One context-parallel layout to compare with the reference."""

    cp: int
    impl: str = "ring"
    load_balance: str = "zigzag"
    tp: int = 1
    dp_shard: int = 1
    ep: int = 1
    stage: int = 0
    documents: bool = False
    steps: int = 3
    accum: int = 1
    optimizer: str = "sgd"
    clip: float | None = None
    compile: bool = False
    checkpoint: bool = False

    @property
    def name(self) -> str:
        parts = [f"cp{self.cp}", self.impl, self.load_balance]
        parts += [f"{a}{n}" for a, n in (("tp", self.tp), ("dp", self.dp_shard),
                                         ("ep", self.ep)) if n > 1]
        parts += [f"stage{self.stage}"]
        parts += [x for x, on in (("docs", self.documents), ("compile", self.compile),
                                  ("ac", self.checkpoint)) if on]
        return "-".join(parts)


def packed_positions(tokens: torch.Tensor) -> torch.Tensor:
    """Per-document position ids of ``(B, T)`` tokens: a new document after every token
    divisible by 7."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] % 7 == 0
    idx = torch.arange(tokens.shape[1]).expand_as(tokens)
    last_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - last_start


def cp_loss(documents: bool, shard: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
            tp_group=None, aux: bool = False):  # noqa: ANN001
    """The next-token loss of a ``(B, T + 1)`` batch, on this rank's part (``shard``)."""

    def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        kwargs = {"positions": shard(packed_positions(inputs))} if documents else {}
        logits = model(shard(inputs), **kwargs)
        if tp_group is not None:
            out = vocab_parallel_cross_entropy(logits, shard(targets), tp_group)
        else:
            out = F.cross_entropy(logits.float().flatten(0, 1), shard(targets).flatten())
        extra = moe_aux_loss(model) if aux else None
        return out if extra is None else out + extra
    return loss


def _mesh(cfg: CPConfig, cache: dict) -> ParallelMesh:
    dims = ParallelDims(1, cfg.dp_shard, dist.get_world_size(), cp=cfg.cp, tp=cfg.tp,
                        ep=cfg.ep).resolved()
    if dims not in cache:
        cache[dims] = dims.build_mesh()
    return cache[dims]


def cp_run(build_model: Callable[[], nn.Module], batches: torch.Tensor, cfg: CPConfig, wrap,
           mesh_cache: dict) -> RunResult:
    """Train ``build_model()`` laid out as ``cfg`` says; call on every rank."""
    mesh = _mesh(cfg, mesh_cache)
    model = build_model()
    tp_group = None
    if cfg.tp > 1:
        apply_tp(model, mesh["tp"])
        tp_group = mesh["tp"]
    moe = getattr(getattr(model, "config", None), "num_experts", 0) > 0
    if cfg.ep > 1:
        apply_ep(model, mesh)
    apply_cp(model, mesh["cp"], impl=cfg.impl, load_balance=cfg.load_balance)
    if cfg.checkpoint:
        shardwise.checkpoint_activations(model, policy="full")
    if cfg.compile:
        shardwise.compile_blocks(model, backend="eager")
    if moe:  # balance statistics over every rank holding different tokens
        apply_global_balance(model, mesh.group("dp_cp"))
    shardwise.shard(model, stage=cfg.stage, wrap=wrap, mesh=mesh)
    runtime = cp_context(model)
    opt = _optimizer(cfg.optimizer, model.parameters())
    return _train_dp(model, opt, batches, cfg, mesh.local_rank("dp"), mesh.size("dp"),
                     sync=lambda last: shardwise.no_sync(model) if not last else _null(),
                     clip=lambda: shardwise.clip_grad_norm_(model, cfg.clip or float("inf")),
                     full_state=lambda: shardwise.full_state_dict(model),
                     loss_fn=cp_loss(cfg.documents, runtime.shard, tp_group, aux=moe),
                     loss_group=mesh.group("dp_cp"),
                     after_step=finish_moe_step if moe else None)
