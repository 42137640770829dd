"""shardwise: PyTorch-native distributed training (ZeRO-1/2/3, offload, low precision).

    import shardwise
    env = shardwise.distributed.init()                 # torchrun, SLURM or one process
    model = shardwise.shard(model, stage=3, wrap={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loss.backward(); shardwise.clip_grad_norm_(model, 1.0); opt.step(); opt.zero_grad()
"""

from shardwise import distributed
from shardwise.distributed.comm import CommStats, comm_stats, reset_comm_stats
from shardwise.shard import (CommQuant, LossScaler, MemoryReport, MixedPrecision,
                             NonFiniteReport, Offload, OffloadedOptimizer, clip_grad_norm_,
                             clip_grads_with_norm_, empty_cache, find_nonfinite_grads,
                             full_state_dict, get_total_norm, graph_parameters, memory_report,
                             no_sync, offload_optimizer, reshard, set_gradient_sync,
                             set_reshard_after_backward, set_reshard_after_forward, shard,
                             unshard)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "distributed",
    "shard",
    "no_sync",
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
