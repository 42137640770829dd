"""Expert-parallel parity: train an MoE model with ``apply_ep`` (after ``apply_tp`` when
``tp > 1``) + ``shard`` over a :class:`ParallelMesh`, and one process on the same global
batches (shardwise.testing.parity's batch convention), then compare.

The recorded loss is the language-model loss alone (mean over the data ranks): under
sequence parallelism each tensor rank's balance loss covers its own sequence shard, so only
the LM loss is one number per data rank; the balance losses are compared through the
step statistics (global counts, aux and z values), which every rank holds whole. The
reference routes the global batch with ``capacity_groups`` = the data-parallel degree, so
capacity mode drops per data rank's micro-batch exactly as the ranks do.
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
from shardwise.distributed.mesh import ParallelDims, ParallelMesh
from shardwise.models import finish_moe_step, moe_aux_loss, set_capacity_groups
from shardwise.parallel import apply_ep, apply_global_balance, apply_tp
from shardwise.parallel import vocab_parallel_cross_entropy
from shardwise.testing.parity import _null, _optimizer, _zero_missing_grads

__all__ = ["EPConfig", "EPResult", "ep_run", "ep_reference_run", "ep_mesh"]


@dataclass(frozen=True)
class EPConfig:
    """One expert-parallel layout to compare with the reference."""

    ep: int
    stage: int = 3
    tp: int = 1
    accum: int = 1
    steps: int = 3
    clip: float | None = 1.0
    meta: bool = False

    @property
    def name(self) -> str:
        parts = [f"ep{self.ep}"] + ([f"tp{self.tp}"] if self.tp > 1 else [])
        parts += [f"stage{self.stage}", f"accum{self.accum}"] + (["meta"] if self.meta else [])
        return "-".join(parts)


@dataclass
class EPResult:
    """Per-step LM losses, gradient norms and MoE statistics, and the final full weights."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    counts: list[list[torch.Tensor]] = field(default_factory=list)
    dropped: list[list[float]] = field(default_factory=list)
    balance: list[list[tuple[float, float]]] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)


def ep_mesh(cfg: EPConfig, cache: dict) -> ParallelMesh:
    """The ParallelMesh of ``cfg`` on this job (built once per layout: collective)."""
    dims = ParallelDims(world_size=dist.get_world_size(), tp=cfg.tp, ep=cfg.ep).resolved()
    if dims not in cache:
        cache[dims] = dims.build_mesh()
    return cache[dims]


def _record(res: EPResult, model: nn.Module) -> None:
    stats = finish_moe_step(model)
    res.counts.append([s.counts for s in stats])
    res.dropped.append([s.dropped for s in stats])
    res.balance.append([(s.aux_loss, s.z_loss) for s in stats])


def _lm(logits: torch.Tensor, tokens: torch.Tensor, tp_group) -> torch.Tensor:  # noqa: ANN001
    if tp_group is not None:
        return vocab_parallel_cross_entropy(logits, tokens[:, 1:], tp_group)
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _train(model, opt, batches, cfg, data_rank: int, data_size: int, *, sync, clip,
           tp_group=None, loss_group=None, logits_of=None) -> EPResult:  # noqa: ANN001
    per_rank = batches.shape[2] // data_size
    logits_of = logits_of or (lambda out: out)
    res = EPResult()
    for step in range(cfg.steps):
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(cfg.accum):
            mine = batches[step, micro, data_rank * per_rank:(data_rank + 1) * per_rank]
            with sync(micro == cfg.accum - 1):
                lm = _lm(logits_of(model(mine[:, :-1])), mine, tp_group) / cfg.accum
                aux = moe_aux_loss(model)
                (lm if aux is None else lm + aux / cfg.accum).backward()
            total += lm.detach().double()
        comm.all_reduce(total, loss_group, label="parity.loss")
        norm = clip()
        res.losses.append(total.item() / comm.group_size(loss_group))
        res.grad_norms.append(float(norm))
        opt.step()
        opt.zero_grad()
        _record(res, model)
    return res


def ep_reference_run(build_model: Callable[[], nn.Module], batches: torch.Tensor,
                     cfg: EPConfig, data_size: int, *,
                     logits_of: Callable | None = None) -> EPResult:
    """One process on the whole global batches, routing ``data_size`` capacity groups."""
    model = set_capacity_groups(build_model(), data_size)
    opt = _optimizer("sgd", model.parameters())

    def clip() -> torch.Tensor:
        _zero_missing_grads(model)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip or float("inf"))
    res = _train(model, opt, batches, cfg, 0, 1, sync=lambda last: _null(), clip=clip,
                 logits_of=logits_of)
    res.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return res


def ep_run(build_model: Callable[[], nn.Module], batches: torch.Tensor, cfg: EPConfig, wrap,
           mesh_cache: dict, *, init_weights=None, logits_of: Callable | None = None,
           inspect: Callable[[nn.Module], None] | None = None) -> EPResult:  # noqa: ANN001
    """Train ``build_model()`` (a meta-device model with ``cfg.meta``) as ``cfg`` lays it
    out; call on every rank. ``inspect(model)`` runs between ``apply_ep`` and ``shard``."""
    mesh = ep_mesh(cfg, mesh_cache)
    model = build_model()
    tp_group = None
    if cfg.tp > 1:
        apply_tp(model, mesh["tp"], sequence_parallel=True)
        tp_group = mesh.group("tp")
    apply_ep(model, mesh)
    if inspect is not None:
        inspect(model)
    if cfg.meta:
        torch.manual_seed(0)
    shardwise.shard(model, stage=cfg.stage, wrap=wrap, mesh=mesh, init_weights=init_weights)
    # Sequence parallelism: every rank routes its own tokens, dp replicas average gradients.
    if cfg.tp > 1:
        apply_global_balance(model, None, replicas=mesh.size("dp"))
    else:
        apply_global_balance(model, mesh.group("dp"))
    opt = _optimizer("sgd", model.parameters())
    res = _train(model, opt, batches, cfg, mesh.local_rank("dp"), mesh.size("dp"),
                 sync=lambda last: shardwise.no_sync(model) if not last else _null(),
                 clip=lambda: shardwise.clip_grad_norm_(model, cfg.clip or float("inf")),
                 tp_group=tp_group, loss_group=mesh.group("dp"), logits_of=logits_of)
    res.state = shardwise.full_state_dict(model)
    return res
