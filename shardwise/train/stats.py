"""Every rank's small statistics in one all-gather and one host read (the step's record,
validation, the run's summary)."""

from __future__ import annotations

import torch

from shardwise.distributed import comm
from shardwise.distributed import env as dist_env

__all__ = ["gather_stats"]


def gather_stats(values: list[torch.Tensor | float], env: dist_env.DistEnv) -> torch.Tensor:
    """Every rank's ``values`` (0-d tensors or floats): (world_size, len(values)) on the host,
    in one small all-gather and one host read."""
    local = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(env.device)
                         for v in values])
    out = torch.empty(env.world_size * len(values), dtype=torch.float64, device=env.device)
    comm.all_gather_into_tensor(out, local, label="train.stats")
    return out.view(env.world_size, len(values)).cpu()
