"""shardwise.parallel: tensor, sequence, expert and pipeline parallelism.

Tensor (and sequence) parallelism: :func:`apply_tp`, :func:`vocab_parallel_cross_entropy`
(see :mod:`shardwise.parallel.tensor`).

Expert parallelism: :func:`apply_ep` (see :mod:`shardwise.parallel.expert`). Mixture-of-experts
balance statistics over the data ranks: :func:`apply_global_balance`.

Activation checkpointing and ``torch.compile`` of a model's blocks, applied in this order
before ``shard`` (docs/compile.md)::

    from shardwise.parallel import checkpoint_activations, compile_blocks
    checkpoint_activations(model, policy="selective")   # "full", "selective" or "none"
    compile_blocks(model, backend="inductor")           # engine hooks stay outside the graphs

Pipeline schedules are data (docs/design.md, principle 4)::

    from shardwise.parallel import build_schedule, simulate
    schedule = build_schedule("1f1b", pp=4, microbatches=8)
    print(schedule.to_text(), simulate(schedule).bubble)

and the executor runs the same schedule on real ranks (``split_stages``, ``shard_stages``,
``PipelineExecutor``; see docs/parallelism.md).
"""

from shardwise.parallel.tensor import apply_tp, vocab_parallel_cross_entropy
from shardwise.parallel.expert import apply_ep, dispatch_bytes, ep_context
from shardwise.parallel.blocks import DEFAULT_BLOCKS, select_blocks
from shardwise.parallel.checkpointing import (AC_POLICIES, SELECTIVE_SAVE_OPS,
                                              checkpoint_activations, checkpointed_blocks)
from shardwise.parallel.compile import compile_blocks, compiled_blocks
from shardwise.parallel.moe_stats import AllReduceStats, apply_global_balance
from shardwise.parallel.pipeline import (SCHEDULE_NAMES, Action, Costs, DeadlockError, Kind,
                                         PipelineExecutor, PipelinePart, Schedule, Simulation,
                                         build_schedule, clip_pipeline_grad_norm_,
                                         critical_path, describe_simulation, draw_timeline,
                                         format_timeline, pipeline_grad_norm, pipeline_mesh,
                                         shard_stages, simulate, split_stages,
                                         validate_schedule)

__all__ = [
    "apply_tp",
    "vocab_parallel_cross_entropy",
    "apply_ep",
    "ep_context",
    "dispatch_bytes",
    "checkpoint_activations",
    "checkpointed_blocks",
    "AC_POLICIES",
    "SELECTIVE_SAVE_OPS",
    "compile_blocks",
    "compiled_blocks",
    "select_blocks",
    "DEFAULT_BLOCKS",
    "AllReduceStats",
    "apply_global_balance",
    "SCHEDULE_NAMES",
    "Action",
    "Kind",
    "Schedule",
    "build_schedule",
    "validate_schedule",
    "DeadlockError",
    "Costs",
    "Simulation",
    "simulate",
    "critical_path",
    "format_timeline",
    "draw_timeline",
    "describe_simulation",
    "pipeline_mesh",
    "split_stages",
    "shard_stages",
    "PipelinePart",
    "PipelineExecutor",
    "pipeline_grad_norm",
    "clip_pipeline_grad_norm_",
]
