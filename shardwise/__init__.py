"""shardwise: PyTorch-native distributed training (ZeRO-1/2/3, offload, low precision).

    import shardwise
    env = shardwise.distributed.init()                 # torchrun, SLURM or one process
    model = shardwise.shard(model, stage=3, wrap={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loss.backward(); shardwise.clip_grad_norm_(model, 1.0); opt.step(); opt.zero_grad()

Before ``shard``, in this order: ``shardwise.checkpoint_activations(model, policy="full")``
and ``shardwise.compile_blocks(model)`` (docs/compile.md).
"""

from shardwise import distributed
from shardwise.distributed.comm import CommStats, comm_stats, reset_comm_stats
from shardwise.parallel import checkpoint_activations, compile_blocks
from shardwise.shard import (CommQuant, LossScaler, MemoryReport, MixedPrecision, Offload,
                             OffloadedOptimizer, clip_grad_norm_, empty_cache,
                             full_state_dict, memory_report, no_sync, offload_optimizer,
                             shard)
from shardwise.train.nonfinite import NonFiniteReport, find_nonfinite_grads

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "distributed",
    "shard",
    "checkpoint_activations",
    "compile_blocks",
    "no_sync",
    "clip_grad_norm_",
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
