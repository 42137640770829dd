"""Process groups, meshes and the counted collectives shardwise uses."""

from shardwise.distributed.comm import comm_stats, reset_comm_stats
from shardwise.distributed.env import DistEnv, init
from shardwise.distributed.parallel_dims import ParallelDims, ParallelMesh
from shardwise.distributed.placement import Placement, placement_of

__all__ = ["DistEnv", "init", "comm_stats", "reset_comm_stats", "ParallelDims", "ParallelMesh",
           "Placement", "placement_of"]
