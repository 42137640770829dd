"""Pipeline parallelism: schedules as data (actions, generators, validator, simulator).

    from shardwise.parallel.pipeline import Costs, build_schedule, simulate
    s = build_schedule("zb1", pp=4, microbatches=8)
    sim = simulate(s, Costs(f=1, b=2, i=1, w=1))
    print(s.to_text(), sim.bubble)

A model is split along the pieces it declares (``pipeline_pieces``: shardwise's Transformer
declares its own, a Hugging Face decoder is read by ``hf_decoder_pieces``, any other model
passes ``split_stages(..., pieces=PipelinePieces(...))``).

The same :class:`Schedule` drives the executor on real ranks and the planner's simulator:

    part = shard_stages(split_stages(model, pipeline_mesh(pp=2), s.virtual,
                                     placement=s.placement), stage=1)
    loss = PipelineExecutor(part, s).step(tokens, targets)
"""

from shardwise.parallel.pipeline.actions import Action, Kind
from shardwise.parallel.pipeline.messages import steps
from shardwise.parallel.pipeline.replay import DeadlockError
from shardwise.parallel.pipeline.action_lists import Schedule, looped_placement, v_placement
from shardwise.parallel.pipeline.schedules import (SCHEDULE_NAMES, ScheduleSpec, build_schedule,
                                                   schedule_spec)
from shardwise.parallel.pipeline.simulate import (Costs, Simulation, TimedAction, critical_path,
                                                  simulate)
from shardwise.parallel.pipeline.timeline import (describe_simulation, draw_timeline,
                                                  format_timeline)
from shardwise.parallel.pipeline.validate import validate_schedule
from shardwise.parallel.pipeline.groups import (PipelineGroups, pipeline_mesh,
                                                resolve_pipeline_groups)
from shardwise.parallel.pipeline.pieces import (Piece, PipelinePieces, hf_decoder_pieces,
                                                pipeline_pieces)
from shardwise.parallel.pipeline.split import (PipelinePart, StageModule, split_stages,
                                               stage_layer_counts)
from shardwise.parallel.pipeline.sharding import shard_stages
from shardwise.parallel.pipeline.executor import (ActionTime, PipelineExecutor,
                                                  cross_entropy_loss, default_loss,
                                                  forward_schedule, split_microbatches)
from shardwise.parallel.pipeline.norms import clip_pipeline_grad_norm_, pipeline_grad_norm
from shardwise.parallel.pipeline.moe import finish_pipeline_moe_step

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "build_schedule",
    "SCHEDULE_NAMES",
    "ScheduleSpec",
    "schedule_spec",
    "looped_placement",
    "v_placement",
    "validate_schedule",
    "steps",
    "DeadlockError",
    "Costs",
    "Simulation",
    "TimedAction",
    "simulate",
    "critical_path",
    "format_timeline",
    "draw_timeline",
    "describe_simulation",
    "PipelineGroups",
    "pipeline_mesh",
    "resolve_pipeline_groups",
    "Piece",
    "PipelinePieces",
    "pipeline_pieces",
    "hf_decoder_pieces",
    "PipelinePart",
    "StageModule",
    "split_stages",
    "stage_layer_counts",
    "shard_stages",
    "PipelineExecutor",
    "ActionTime",
    "cross_entropy_loss",
    "default_loss",
    "forward_schedule",
    "split_microbatches",
    "pipeline_grad_norm",
    "clip_pipeline_grad_norm_",
    "finish_pipeline_moe_step",
]
