"""shardwise: PyTorch-native distributed training (ZeRO-1/2/3, tensor / sequence / context /
expert parallelism, offload, low precision).

    import shardwise
    env = shardwise.distributed.init()                 # torchrun, SLURM or one process
    mesh = shardwise.ParallelDims(world_size=env.world_size, tp=2).build_mesh()
    model = shardwise.apply_low_precision(model, recipe="fp8_rowwise")  # optional: fp8 matmuls
    model = shardwise.apply_tp(model, mesh["tp"])      # optional: Megatron TP + SP
    model = shardwise.apply_ep(model, mesh)            # optional: MoE experts over ep
    model = shardwise.apply_cp(model, mesh["cp"])      # optional: sequences over cp
    model = shardwise.shard(model, stage=3, wrap={Block}, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loss.backward(); shardwise.clip_grad_norm_(model, 1.0); opt.step(); opt.zero_grad()

Before ``shard``, in this order: ``shardwise.checkpoint_activations(model, policy="full")``
and ``shardwise.compile_blocks(model)`` (docs/compile.md).
"""

from shardwise import distributed
from shardwise.distributed.comm import CommStats, comm_stats, reset_comm_stats
from shardwise.distributed.parallel_dims import ParallelDims, ParallelMesh
from shardwise.distributed.placement import Placement, placement_of
from shardwise.parallel import checkpoint_activations, compile_blocks
from shardwise.parallel.context import apply_cp, cp_context
from shardwise.parallel.expert import apply_ep
from shardwise.parallel.lowbit import apply_low_precision, low_precision_report
from shardwise.parallel.tensor import apply_tp, vocab_parallel_cross_entropy
from shardwise.shard import (CommQuant, LossScaler, MemoryReport, MixedPrecision,
                             NonFiniteReport, Offload, OffloadedOptimizer, clip_grad_norm_,
                             clip_grads_with_norm_, empty_cache, find_nonfinite_grads,
                             full_state_dict, get_total_norm, graph_parameters, join,
                             memory_report, no_sync, offload_optimizer, replicate, reshard,
                             set_gradient_sync, set_reshard_after_backward,
                             set_reshard_after_forward, shard, unshard)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "distributed",
    "shard",
    "replicate",
    "apply_tp",
    "apply_ep",
    "apply_cp",
    "cp_context",
    "apply_low_precision",
    "low_precision_report",
    "vocab_parallel_cross_entropy",
    "ParallelDims",
    "ParallelMesh",
    "Placement",
    "placement_of",
    "checkpoint_activations",
    "compile_blocks",
    "no_sync",
    "join",
    "set_gradient_sync",
    "set_reshard_after_forward",
    "set_reshard_after_backward",
    "unshard",
    "reshard",
    "graph_parameters",
    "clip_grad_norm_",
    "get_total_norm",
    "clip_grads_with_norm_",
    "full_state_dict",
    "memory_report",
    "MemoryReport",
    "empty_cache",
    "MixedPrecision",
    "LossScaler",
    "CommQuant",
    "Offload",
    "offload_optimizer",
    "OffloadedOptimizer",
    "comm_stats",
    "reset_comm_stats",
    "CommStats",
    "find_nonfinite_grads",
    "NonFiniteReport",
]
