"""Prefetching never changes the numbers, whatever the model's topology (issue 15).

A grid over generated topologies (shardwise.testing.topologies: identically shaped units in
two branches whose backward passes interleave, units run out of registration order, skipped
on some steps, called twice, nested, a frozen unit, the branch order changing per step), a
plain two-tower contrastive model, and a Hugging Face CLIP built from a config, each at 2
and 3 ranks, stages 1-3, prefetch 0/1/2, with and without reshard_after_forward, SGD with
momentum, compared with one process on the same global batch (the step's loss is the mean
of the ranks' losses, as data parallelism defines it) and with torch DDP on the same ranks:

* prefetch 0, 1 and 2 give bitwise-identical weights for every (stage, reshard) layout;
* every layout equals one process no worse than DDP's own deviation (or 1e-5 relative);
* every failure message carries the topology's seed (rerun one with
  ``TopologyModel(seed)``); ``SHARDWISE_FUZZ_SEEDS=40`` widens the search locally.

Plus the detection side: ranks that gather units in different orders get an error naming
both units (the identity carried with every gather), and the debug watchdog names the
reordered gather before it runs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.testing import run_ranks
from shardwise.testing.topologies import Block
from shardwise.testing.topology_parity import (LAYOUTS, grid, has_transformers, reference,
                                               weight_err)

SEEDS = tuple(range(int(os.environ.get("SHARDWISE_FUZZ_SEEDS", "5"))))
SUBJECTS = [f"fuzz-{s}" for s in SEEDS] + ["two-tower"] + (["hf-clip"] if has_transformers()
                                                           else [])
TOL = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_prefetch_never_changes_the_numbers_on_any_topology(world):
    results = run_ranks(grid, world_size=world, args=(SUBJECTS,), timeout_s=900)[0]
    failures = []
    for subject in SUBJECTS:
        ref = reference(subject, world)
        ddp_err, _ = weight_err(results[(subject, "ddp")], ref)
        limit = max(TOL, ddp_err)
        for stage, raf in LAYOUTS:
            runs = [results[(subject, (stage, raf, p))] for p in (0, 1, 2)]
            where = f"{subject} (TopologyModel seed in the name) world {world} stage {stage} " \
                    f"reshard_after_forward={raf}"
            for p, state in zip((1, 2), runs[1:]):
                differ = [k for k in state if not torch.equal(state[k], runs[0][k])]
                if differ:
                    failures.append(f"{where}: prefetch {p} differs from prefetch 0 in "
                                    f"{len(differ)} tensors, e.g. {differ[:3]}")
            err, key = weight_err(runs[1], ref)
            if err > limit:
                failures.append(f"{where}: {err:.2e} from one process at {key} (DDP "
                                f"{ddp_err:.2e})")
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- detection

class _TwoSame(torch.nn.Module):
    """Two identically shaped units whose order depends on the rank (a user's bug)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = Block(), Block()

    def forward(self, x):
        order = (self.first, self.second) if dist.get_rank() == 0 else (self.second,
                                                                          self.first)
        for m in order:
            x = m(x)
        return x.square().mean()


def _rank_dependent_order(debug: bool) -> str:
    from shardwise.distributed import watchdog as wdm
    if debug:
        wdm.start(wdm.WatchdogConfig(timeout_s=20.0, mode="debug"))
    model = shardwise.shard(_TwoSame(), stage=3, wrap={Block}, prefetch=0)
    try:
        model(torch.randn(4, 8)).backward()
    except (wdm.CollectiveError, RuntimeError) as exc:
        return str(exc).splitlines()[0]
    finally:
        if debug:
            wdm.stop()
    return "no error"


def test_ranks_gathering_units_in_different_orders_get_an_error_naming_both():
    first = run_ranks(_rank_dependent_order, world_size=2, args=(False,), timeout_s=60)
    assert "rank 1 sent unit 'second'" in first[0], first
    assert "where this rank gathered unit 'first'" in first[0], first
    assert "rank 0 sent unit 'first'" in first[1], first


def test_the_debug_watchdog_names_a_reordered_gather_before_it_runs():
    first = run_ranks(_rank_dependent_order, world_size=2, args=(True,), timeout_s=60,
                      collective_timeout_s=25)
    assert first[0] == first[1], first
    assert "ranks disagree on collective" in first[0], first
    assert "'first.all_gather'" in first[0] and "'second.all_gather'" in first[0], first


# ----------------------------------------------------------------------------- edits in place

def _edit_in_place_then_forward(stage: int):
    from shardwise.testing.topology_parity import build
    model, wrap = build("fuzz-0")
    shardwise.shard(model, stage=stage, wrap=wrap, prefetch=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    a, b = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank())), \
        torch.randn(4, 5)
    model(a, b).backward()
    opt.step()
    model(a, b)  # gathers (stages 1/2 keep the gathered weights for the next step)
    with torch.no_grad():  # a user's edit, no mark_stale(): the next forward must see it
        for p in model.parameters():
            p.mul_(0.5)
    with torch.no_grad():
        out = model(a, b)
    state = shardwise.full_state_dict(model)
    plain, _ = build("fuzz-0")
    plain.load_state_dict(state)
    plain.step = model.step
    with torch.no_grad():
        return (out - plain(a, b)).abs().item()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_in_place_edits_of_the_shards_reach_the_next_forward(stage):
    diffs = run_ranks(_edit_in_place_then_forward, world_size=2, args=(stage,), timeout_s=120)
    assert max(diffs) < 1e-6, diffs
