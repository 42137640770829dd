"""Pipeline ranks agree on the numbers of ``shard`` calls ([Note: piece identity]).

Every all-gather carries the number of the ``shard`` call that made its unit; ranks of one
job must number the same module alike, also when they build the next layout in the same
processes (re-planning). Pipeline ranks hold different pieces (8 layers over pp 2: rank 0
the embedding and 4 blocks, rank 1 4 blocks, the norm and the head), so every ``shard``
call, at every ZeRO stage including plain stage 0, and every piece a rank does not hold
must take exactly one number. A stage-0 ``shard`` once took none, which left the two ranks
one number apart and made the next layout's gathers refuse each other.
"""

from __future__ import annotations

import torch

from shardwise.distributed import comm_objects
from shardwise.models import LlamaConfig, build_model, init_module_weights
from shardwise.parallel.pipeline import (PipelineExecutor, build_schedule, pipeline_mesh,
                                         shard_stages, split_stages)
from shardwise.shard import shard
from shardwise.shard.identity import next_state_id
from shardwise.testing import run_ranks

CFG = LlamaConfig(dim=16, n_layers=8, n_heads=2, n_kv_heads=1, vocab_size=32, multiple_of=16,
                  max_seq_len=8)
TIED = LlamaConfig(dim=16, n_layers=8, n_heads=2, n_kv_heads=1, vocab_size=32, multiple_of=16,
                   max_seq_len=8, tie_embeddings=True)


def _numbers_after_each_layout() -> list[list[int]]:
    torch.set_num_threads(1)
    seen = []
    for stage in (0, 1, 2, 3):
        for cfg, schedule_name in ((CFG, "1f1b"), (TIED, "zbv")):
            schedule = build_schedule(schedule_name, 2, 4)
            part = split_stages(build_model(cfg, device="meta"), pipeline_mesh(2),
                                schedule.virtual, placement=schedule.placement)
            shard_stages(part, stage=stage, init_weights=init_module_weights)
            tokens = torch.randint(0, 32, (4, 5), generator=torch.Generator().manual_seed(0))
            PipelineExecutor(part, schedule).step(tokens[:, :-1], tokens[:, 1:])
            seen.append(comm_objects.all_gather_object(next_state_id(), label="test.ids"))
    # The next layout in the same processes: a whole model over both ranks, stage 3,
    # which gathers (its gathers would be refused if the numbers differed).
    model = shard(build_model(CFG, device="meta"), stage=3, init_weights=init_module_weights)
    tokens = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    model(tokens[:, :-1]).sum().backward()
    seen.append(comm_objects.all_gather_object(next_state_id(), label="test.ids"))
    return seen


def test_every_rank_numbers_shard_calls_alike_at_every_stage():
    for per_layout in run_ranks(_numbers_after_each_layout, 2, timeout_s=120, threads=1)[0]:
        assert len(set(per_layout)) == 1, per_layout
