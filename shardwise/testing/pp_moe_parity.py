"""MoE pipeline parity: train an MoE model split into pipeline stages (expert-parallel inside
each stage when ``ep > 1``) and one process on the same global batches with the same
micro-batch grouping, then compare.

Batch convention: each step has ``microbatches x per_microbatch x dp`` sequences; data rank
``r`` takes the ``r``-th consecutive ``1 / dp`` of them and the executor cuts its share into
the schedule's micro-batches. The reference runs global micro-batch ``mb`` as the
concatenation, in data-rank order, of every rank's ``mb``-th micro-batch, with
``capacity_groups = dp`` (capacity mode drops per rank's micro-batch, as the ranks do), and
backpropagates ``(lm + moe_aux_loss) / microbatches`` per micro-batch ([Note: balance
losses in a pipeline] in shardwise/parallel/pipeline/moe.py). The evaluation too runs by
global micro-batch, as the forward-only schedule does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise.distributed import comm
from shardwise.distributed.mesh import ParallelDims
from shardwise.models import (finish_moe_step, init_module_weights, moe_aux_loss,
                              set_capacity_groups)
from shardwise.parallel import apply_ep, apply_global_balance, apply_tp
from shardwise.parallel.expert import expert_modules
from shardwise.parallel.pipeline import (PipelineExecutor, build_schedule, clip_pipeline_grad_norm_,
                                         cross_entropy_loss, finish_pipeline_moe_step,
                                         shard_stages, split_stages)
from shardwise.testing.parity import _zero_missing_grads

__all__ = ["PPMoECase", "PPMoEResult", "pp_moe_run", "pp_moe_reference_run", "pp_moe_batches"]


@dataclass(frozen=True)
class PPMoECase:
    """One pipelined MoE layout to compare with the reference."""

    schedule: str
    microbatches: int
    stage: int
    dp: int = 1
    ep: int = 1
    model: str = "base"        # a key of the test's model variants
    keep_gathered: bool = True
    pp: int = 2
    tp: int = 1                # tensor (and sequence) parallelism inside each stage

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def name(self) -> str:
        extra = "".join([f"-dp{self.dp}" if self.dp > 1 else "",
                         f"-ep{self.ep}" if self.ep > 1 else "",
                         f"-tp{self.tp}" if self.tp > 1 else "",
                         "" if self.keep_gathered else "-regather",
                         "" if self.model == "base" else f"-{self.model}"])
        return f"pp{self.pp}-{self.schedule}-m{self.microbatches}-stage{self.stage}{extra}"


@dataclass
class PPMoEResult:
    """Per-step LM losses, gradient norms and MoE statistics, the final evaluation loss,
    the final full weights, and the experts each rank held."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    counts: list[list[torch.Tensor]] = field(default_factory=list)
    dropped: list[list[float]] = field(default_factory=list)
    balance: list[list[tuple[float, float]]] = field(default_factory=list)
    names: list[list[str]] = field(default_factory=list)
    eval_loss: float = 0.0
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    local_experts: list[int] = field(default_factory=list)


def pp_moe_batches(case: PPMoECase, steps: int, per_microbatch: int, seq: int,
                   vocab: int) -> torch.Tensor:
    """Token ids ``(steps + 1, global batch, seq + 1)``; the last batch is for evaluation."""
    g = torch.Generator().manual_seed(case.microbatches * 10 + case.dp)
    batch = case.microbatches * per_microbatch * case.dp
    return torch.randint(0, vocab, (steps + 1, batch, seq + 1), generator=g)


def _record(res: PPMoEResult, stats) -> None:  # noqa: ANN001
    res.counts.append([s.counts for s in stats])
    res.dropped.append([s.dropped for s in stats])
    res.balance.append([(s.aux_loss, s.z_loss) for s in stats])
    res.names.append([s.name for s in stats])


def _global_microbatch(batch: torch.Tensor, case: PPMoECase, mb: int) -> torch.Tensor:
    """Every data rank's ``mb``-th micro-batch, concatenated in data-rank order."""
    share = batch.shape[0] // case.dp
    per = share // case.microbatches
    return torch.cat([batch[r * share + mb * per:r * share + (mb + 1) * per]
                      for r in range(case.dp)])


def pp_moe_reference_run(build: Callable[[], nn.Module], batches: torch.Tensor,
                         case: PPMoECase, clip: float) -> PPMoEResult:
    """One process, the same global micro-batches (see the module docstring)."""
    model = set_capacity_groups(build(), case.dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    res, m = PPMoEResult(), case.microbatches
    for step in range(batches.shape[0] - 1):
        total = 0.0
        for mb in range(m):
            tokens = _global_microbatch(batches[step], case, mb)
            lm = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
            aux = moe_aux_loss(model)
            ((lm if aux is None else lm + aux) / m).backward()
            total += lm.item() / m
        _zero_missing_grads(model)
        res.grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        res.losses.append(total)
        opt.step()
        opt.zero_grad()
        _record(res, finish_moe_step(model))
    model.eval()
    with torch.no_grad():  # by micro-batch too: in capacity mode each has its capacity
        for mb in range(m):
            tokens = _global_microbatch(batches[-1], case, mb)
            res.eval_loss += cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).item() / m
    res.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return res


def pp_moe_run(build: Callable[[], nn.Module], batches: torch.Tensor, case: PPMoECase,
               clip: float, meshes: dict) -> PPMoEResult:
    """Train ``build()`` (a meta-device MoE model) as ``case`` lays it out; call on every
    rank: ParallelDims(pp, tp, ep) -> apply_tp (sequence parallel) -> apply_ep -> split ->
    shard_stages -> global balance over the stage's data (x tensor) ranks."""
    dims = ParallelDims(world_size=dist.get_world_size(), pp=case.pp, tp=case.tp,
                        ep=case.ep).resolved()
    if dims not in meshes:  # one set of process groups per layout (collective)
        meshes[dims] = dims.build_mesh()
    mesh = meshes[dims]
    schedule = build_schedule(case.schedule, pp=case.pp, microbatches=case.microbatches)
    model = build()
    if case.tp > 1:
        apply_tp(model, mesh["tp"], sequence_parallel=True)
    if case.ep > 1:
        apply_ep(model, mesh)
    res = PPMoEResult()
    res.local_experts = [next(iter(m.parameters())).shape[0] for _, m in expert_modules(model)]
    part = split_stages(model, mesh, schedule.virtual, placement=schedule.placement)
    torch.manual_seed(0)
    shard_stages(part, stage=case.stage, init_weights=init_module_weights)
    if case.tp > 1:  # each tensor rank routes its sequence shard; the data ranks are replicas
        apply_global_balance(part, (mesh.group("dp"), mesh.group("tp")), replicas=case.dp)
    else:
        apply_global_balance(part, mesh.group("dp"))
    pipe = PipelineExecutor(part, schedule, keep_gathered=case.keep_gathered)
    opt = torch.optim.SGD(part.parameters(), lr=0.05, momentum=0.9)
    r, dp_group = mesh.local_rank("dp"), mesh.group("dp")
    share = batches.shape[1] // case.dp
    for step in range(batches.shape[0] - 1):
        mine = batches[step, r * share:(r + 1) * share]
        loss = pipe.step(mine[:, :-1], mine[:, 1:])
        comm.all_reduce(loss, dp_group, label="test.loss")
        res.losses.append(loss.item() / case.dp)
        res.grad_norms.append(clip_pipeline_grad_norm_(part, clip).item())
        opt.step()
        opt.zero_grad()
        _record(res, finish_pipeline_moe_step(part))
    mine = batches[-1, r * share:(r + 1) * share]
    loss = pipe.evaluate(mine[:, :-1], mine[:, 1:])
    comm.all_reduce(loss, dp_group, label="test.loss")
    res.eval_loss = loss.item() / case.dp
    res.state = shardwise.full_state_dict(part)
    return res
