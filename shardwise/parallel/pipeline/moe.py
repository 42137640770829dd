"""MoE layers inside pipeline stages: each stage forward's balance losses as extra backward
roots, and the step's MoE statistics of every layer gathered over the pipeline ranks.

    mesh = ParallelDims(world_size=4, pp=2, ep=2).build_mesh()   # pp 2 x dp_shard 2, ep 2
    model = apply_ep(build_model(cfg, device="meta"), mesh)      # before the split
    part = split_stages(model, mesh, schedule.virtual, placement=schedule.placement)
    shard_stages(part, stage=3, init_weights=init_module_weights)
    apply_global_balance(part, mesh.group("dp"))                 # the stage's data ranks
    loss = PipelineExecutor(part, schedule).step(tokens, targets)  # LM loss; aux in backward
    optimizer.step()
    stats = finish_pipeline_moe_step(part)   # every MoE layer of the model, on every pp rank

[Note: balance losses in a pipeline]
Without a pipeline the objective of one micro-batch is ``lm / M + moe_aux_loss(model) / M``
(``M`` micro-batches per step, shardwise.train.moe). In a pipeline each stage holds some of
the MoE layers, and each of its forwards leaves their weighted balance losses (aux and z,
[Note: global balance statistics] in models/moe.py) on the layers, where the next forward of
the same stage would overwrite them: under 1F1B several micro-batches are in flight. So the
executor takes them (:func:`stage_balance_roots`) right after the stage's forward of that
micro-batch, scaled by ``1 / M`` like the loss, and keeps them with the forward's output;
that micro-batch's backward of the stage (``B``, or ``I`` then ``W``) then runs from the
output (with the gradient received from the next stage) *and* these extra roots (gradient
1). The sum over stages and micro-batches is exactly the gradient of ``sum_mb (lm_mb +
aux_mb) / M`` that one process computes with the same micro-batch grouping. The statistics a
layer balances are reduced over the stage's data ranks (``apply_global_balance(part,
mesh.group("dp"))``: the ranks of one pipeline coordinate whose micro-batches together make
the global micro-batch); the replica count is that group's size, the degree the engine
averages the gradients over.

Schedules that split the backward (zb1, zbv, dualpipev) hand the same roots to the input
pass and the weight pass ([Note: split backward] in split_backward.py): the input pass
backpropagates the output and the balance losses to the stage input (the dispatch and
combine all-to-alls of expert parallelism run there, once), the weight pass computes the
deferred weight gradients of both.

At the end of a step each rank's layers give their statistics (``finish_moe_step``: global
counts, aux and z values, the bias update of ``balance = "bias"``); rank 0, which writes the
metrics, holds only its stages' layers, so :func:`finish_pipeline_moe_step` gathers every
pipeline rank's (one small object all-gather, counted as ``pp.moe_stats``) and orders them
as the unsplit model's layers.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.distributed.comm import objects as comm_objects
from shardwise.models.moe import MoEStepStats, finish_moe_step, moe_aux_loss
from shardwise.parallel.pipeline.split import PipelinePart

__all__ = ["stage_balance_roots", "finish_pipeline_moe_step"]


def stage_balance_roots(stage: nn.Module, microbatches: int) -> list[torch.Tensor]:
    """The weighted balance losses the stage's last forward left, as extra backward roots.

    Call right after the stage's forward of a micro-batch ([Note: balance losses in a
    pipeline]); each layer's term is handed out once.

    Args:
        stage: the stage that just ran its forward (a ``StageModule``).
        microbatches: the step's micro-batches ``M`` (the roots are scaled by ``1 / M``).

    Returns:
        ``[aux / M]`` (a 0-d fp32 tensor), or ``[]`` when the stage holds no MoE layer, ran
        in evaluation mode, or every balance coefficient is zero.
    """
    aux = moe_aux_loss(stage)
    return [] if aux is None else [aux / microbatches]


def finish_pipeline_moe_step(part: PipelinePart, update_bias: bool = True
                             ) -> list[MoEStepStats]:
    """End an optimizer step's MoE bookkeeping: this rank's layers' statistics and bias
    updates, then every pipeline rank's statistics, in the unsplit model's layer order.

    Call once per optimizer step on every rank of the job (collective over the pipeline
    group when the model has MoE layers), after ``optimizer.step()``.

    Args:
        part: this rank's stages.
        update_bias: apply the ``balance = "bias"`` update to this rank's layers (False when
            the step was skipped).

    Returns:
        One :class:`~shardwise.models.moe.MoEStepStats` per MoE layer of the model that ran
        a training forward this step, identical on every pipeline rank.
    """
    stats = finish_moe_step(part, update_bias=update_bias)
    groups = part.groups
    if not part.moe_layers or groups.pp is None or groups.pp_size == 1:
        return stats
    parts = comm_objects.all_gather_object(stats, groups.pp, label="pp.moe_stats")
    order = {name: i for i, name in enumerate(part.moe_layers)}
    return sorted((s for p in parts for s in p), key=lambda s: order[s.name])
