"""shardwise.checkpoint: sharded, resharding, atomic and verified checkpoints on
``torch.distributed.checkpoint``, background saves, exact resume, and Hugging Face safetensors
export / import. User guide: docs/checkpoints.md.

    from shardwise import checkpoint
    checkpoint.save("ckpt/step_100", model, optimizer, step=100, extra={"schedule": sched})
    info = checkpoint.load("ckpt/step_100", model, optimizer, extra={"schedule": sched})
    info.step                                    # 100
"""

from shardwise.checkpoint.atomic import latest_checkpoint, list_checkpoints
from shardwise.checkpoint.dcp import CheckpointInfo, SaveResult, load, save, verify
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.manager import Checkpointer, newest_intact, resolve_resume

__all__ = ["save", "load", "verify", "latest_checkpoint", "list_checkpoints", "CheckpointInfo",
           "SaveResult", "CheckpointError", "Checkpointer", "resolve_resume", "newest_intact"]
