"""shardwise.data.vla: BabyAI demonstrations for vision-language-action training (issue 34).

Demonstrations come from minigrid's BabyAI levels and expert bot (optional: ``pip install
shardwise[vla]``; imported only when generating or rolling out). Typical use::

    from shardwise.data.vla import (VLALoader, ensure_dataset, eval_seeds, rollout,
                                    GreedyActionPolicy, save_strip_png)

    path = ensure_dataset("data/gotolocal-1k", "BabyAI-GoToLocal-v0", episodes=1000)
    loader = VLALoader(path, batch_size=8, rank=r, world_size=n, seed=0, frames=1,
                       val_fraction=0.05)
    batch = loader.next_batch()   # VLABatch: tokens/labels (8, T), images (N, 3, 56, 56)
    logits = model(batch.tokens, batch.images)
    result = rollout(GreedyActionPolicy(model), "BabyAI-GoToLocal-v0", eval_seeds(200),
                     frames=1, record=True)  # success_rate, mean_steps, episode
    save_strip_png(result.episode, "rollout.png")

The sample layout and token ids are the VLA interface shared with shardwise/models/vla*.py.
"""

from shardwise.data.vla.batch import IGNORE_INDEX, VLABatch, VLASample, collate
from shardwise.data.vla.build import BuildReport, build_dataset, ensure_dataset
from shardwise.data.vla.demos import (EVAL_SEED_BASE, TRAIN_SEED_BASE, Episode,
                                      check_train_seeds, eval_seeds, generate_demos,
                                      generate_episode)
from shardwise.data.vla.env import (ACTION_NAMES, DEFAULT_TILE_SIZE, NUM_ACTIONS, make_env,
                                    require_minigrid)
from shardwise.data.vla.evaluate import (ExpertPolicy, GreedyActionPolicy, RandomPolicy,
                                         RolloutResult, rollout, save_strip_png)
from shardwise.data.vla.loader import VLALoader
from shardwise.data.vla.samples import SampleSpec, build_sample
from shardwise.data.vla.store import VLADataset, read_index, write_dataset
from shardwise.data.vla.tokens import (ACT_ID, BOS_ID, IMAGE_ID, MISSION_WORDS, PAD_ID, UNK_ID,
                                       MissionTokenizer, split_mission)

__all__ = [
    "MissionTokenizer", "MISSION_WORDS", "split_mission",
    "PAD_ID", "BOS_ID", "IMAGE_ID", "ACT_ID", "UNK_ID", "IGNORE_INDEX",
    "ACTION_NAMES", "NUM_ACTIONS", "DEFAULT_TILE_SIZE", "make_env", "require_minigrid",
    "Episode", "TRAIN_SEED_BASE", "EVAL_SEED_BASE", "check_train_seeds", "eval_seeds",
    "generate_episode", "generate_demos",
    "write_dataset", "read_index", "VLADataset", "BuildReport", "build_dataset",
    "ensure_dataset",
    "SampleSpec", "build_sample", "VLASample", "VLABatch", "collate", "VLALoader",
    "rollout", "RolloutResult", "ExpertPolicy", "RandomPolicy", "GreedyActionPolicy",
    "save_strip_png",
]
