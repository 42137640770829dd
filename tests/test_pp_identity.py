"""Gathers name what a ``shard`` call is, not how many calls came before it ([Note: gather
identity], [Note: piece identity]).

Pipeline ranks hold different pieces (8 layers over pp 2: rank 0 the embedding and 4
blocks, rank 1 4 blocks, the norm and the head) and shard only their own, at every ZeRO
stage including plain stage 0; the next layout built in the same processes (re-planning)
must still gather without a refusal. Identities used to be a per-process counter that
pipeline code had to advance for every piece it did not hold (and re-planning had to align
across ranks); now a call's identity comes from its name or its parameters, so ranks that
sharded different things before agree anyway, and the pieces of identical blocks still tell
each other apart.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.models import LlamaConfig, build_model, init_module_weights
from shardwise.parallel.pipeline import (PipelineExecutor, build_schedule, pipeline_mesh,
                                         shard_stages, split_stages)
from shardwise.shard import engine_states, shard
from shardwise.shard.identity import GatherMismatch, call_identity
from shardwise.testing import run_ranks

CFG = LlamaConfig(dim=16, n_layers=8, n_heads=2, n_kv_heads=1, vocab_size=32, multiple_of=16,
                  max_seq_len=8)
TIED = LlamaConfig(dim=16, n_layers=8, n_heads=2, n_kv_heads=1, vocab_size=32, multiple_of=16,
                   max_seq_len=8, tie_embeddings=True)


def _pipelines_then_a_whole_model() -> list[int]:
    torch.set_num_threads(1)
    for stage in (0, 1, 2, 3):
        for cfg, schedule_name in ((CFG, "1f1b"), (TIED, "zbv")):
            schedule = build_schedule(schedule_name, 2, 4)
            part = split_stages(build_model(cfg, device="meta"), pipeline_mesh(2),
                                schedule.virtual, placement=schedule.placement)
            shard_stages(part, stage=stage, init_weights=init_module_weights)
            tokens = torch.randint(0, 32, (4, 5), generator=torch.Generator().manual_seed(0))
            PipelineExecutor(part, schedule).step(tokens[:, :-1], tokens[:, 1:])
    # The next layout in the same processes: a whole model over both ranks, stage 3, which
    # gathers (its gathers would be refused if the ranks named its units differently).
    model = shard(build_model(CFG, device="meta"), stage=3, init_weights=init_module_weights)
    tokens = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    model(tokens[:, :-1]).sum().backward()
    return [u.tag.state_id for s in engine_states(model) for u in s.units]


def test_ranks_agree_after_sharding_different_pieces_at_every_stage():
    ids = run_ranks(_pipelines_then_a_whole_model, 2, timeout_s=120, threads=1)
    assert ids[0] == ids[1] and ids[0]


def test_identical_blocks_sharded_one_by_one_are_told_apart_by_name():
    blocks = [("layers.0.attention.wq.weight", (16, 16))]
    assert call_identity(None, blocks) == call_identity(None, list(blocks))
    assert call_identity("layers.3", blocks) != call_identity("layers.4", blocks)


def _pieces_out_of_order() -> str:
    """Two identically shaped pieces sharded under their names; rank 1 runs them in the
    other order: the first gather pairs layers.0 with layers.1 and is refused."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    shard(a, stage=3, name="layers.0")
    shard(b, stage=3, name="layers.1")
    x = torch.ones(2, 8)
    try:
        for m in ((a, b) if dist.get_rank() == 0 else (b, a)):
            m(x)
    except GatherMismatch as exc:
        return str(exc)
    return "no error"


def test_pieces_run_out_of_order_are_refused():
    messages = run_ranks(_pieces_out_of_order, 2, timeout_s=60)
    from shardwise.shard.identity import call_identity as ident

    other = ident("layers.1", [])
    assert f"rank 1 sent an unknown payload (shard call {other}, unit 0" in messages[0]
    assert "issued their parameter gathers in different orders" in messages[0]
