"""Process groups, meshes and the counted collectives shardwise uses."""

from shardwise.distributed.comm import comm_stats, reset_comm_stats
from shardwise.distributed.env import DistEnv, init

__all__ = ["DistEnv", "init", "comm_stats", "reset_comm_stats"]
