"""The ZeRO / FSDP engine: ``shard`` and its companions."""

from shardwise.distributed.pool import empty_cache
from shardwise.shard.api import memory_report, no_sync, replicate, shard
from shardwise.shard.engine_state import EngineState, ZeroPolicy
from shardwise.shard.comm_quant import CommQuant
from shardwise.shard.controls import (graph_parameters, paused_backward_hooks, reshard,
                                      set_gradient_sync, set_reshard_after_backward,
                                      set_reshard_after_forward, unshard)
from shardwise.shard.join import Join, join
from shardwise.shard.grad import clip_grad_norm_, clip_grads_with_norm_, get_total_norm
from shardwise.shard.memory import MemoryReport
from shardwise.shard.nonfinite import NonFiniteError, NonFiniteReport, find_nonfinite_grads
from shardwise.shard.offload import OffloadedOptimizer, offload_optimizer
from shardwise.shard.offload.config import Offload
from shardwise.shard.precision import LossScaler, MixedPrecision
from shardwise.shard.registry import engine_states
from shardwise.shard.state_dict import ShardedParamSpec, full_state_dict, sharded_param_specs

__all__ = ["shard", "replicate", "EngineState", "ZeroPolicy", "no_sync", "clip_grad_norm_",
           "get_total_norm", "clip_grads_with_norm_",
           "full_state_dict", "memory_report", "MemoryReport", "engine_states",
           "MixedPrecision", "LossScaler", "CommQuant", "Offload", "offload_optimizer",
           "OffloadedOptimizer", "ShardedParamSpec", "sharded_param_specs", "empty_cache",
           "find_nonfinite_grads", "NonFiniteReport", "NonFiniteError", "set_gradient_sync",
           "set_reshard_after_forward", "set_reshard_after_backward", "unshard", "reshard",
           "graph_parameters", "paused_backward_hooks", "join", "Join"]
