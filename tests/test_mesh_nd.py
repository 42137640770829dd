"""N-D layouts (issue 11): ParallelDims validates every degree by name, ranks are ordered tp
innermost ... pp outermost, ep is carved from dp_shard x cp, the mesh answers every axis
name, and ``shard(..., mesh=...)`` reads a named mesh by name and an unnamed 1-D / 2-D one
by position."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardwise
from shardwise.distributed.mesh import resolve_groups
from shardwise.distributed.parallel_dims import AXIS_NAMES, ParallelDims
from shardwise.testing import run_ranks


@pytest.mark.parametrize("dims, error", [
    (ParallelDims(world_size=8, tp=3), "pp x dp_replicate x cp x tp = 1 x 1 x 1 x 3 = 3 does "
                                       "not divide the world size 8"),
    (ParallelDims(2, 3, 8, tp=2), "pp x dp_replicate x dp_shard x cp x tp = 1 x 2 x 3 x 1 x "
                                  "2 = 12, expected the world size 8"),
    (ParallelDims(world_size=8, ep=3), "ep=3 must divide dp_shard x cp = 8 x 1 = 8"),
    (ParallelDims(world_size=8, cp=3), "pp x dp_replicate x cp x tp = 1 x 1 x 3 x 1 = 3 does "
                                       "not divide the world size 8"),
    (ParallelDims(world_size=8, tp=0), "tp must be an int >= 1, got 0"),
    (ParallelDims(0, -1, 8), "dp_replicate must be an int >= 1, got 0"),
])
def test_degrees_that_do_not_fit_are_named(dims, error):
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        dims.resolved()


def test_positional_use_keeps_working():
    assert ParallelDims(2, -1, 8).resolved() == ParallelDims(2, 4, 8)
    assert ParallelDims(1, -1, 4).degree("dp") == 4


def test_rank_order_and_expert_axes():
    d = ParallelDims(dp_replicate=2, dp_shard=2, world_size=16, pp=2, tp=2, ep=2)
    # rank = (((pp * R + r) * S + s) * C + c) * T + t
    assert [d.rank_of(d.coords(r)) for r in range(16)] == list(range(16))
    assert d.coords(13) == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1}
    assert d.axis_ranks("tp", 5) == [4, 5]                      # innermost: consecutive
    assert d.axis_ranks("dp_shard", 5) == [5, 7]
    assert d.axis_ranks("dp_replicate", 5) == [1, 5]
    assert d.axis_ranks("pp", 5) == [5, 13]                     # outermost
    assert d.axis_ranks("dp", 5) == [1, 3, 5, 7]
    assert d.axis_ranks("ep", 5) == [5, 7]                      # inside dp_shard x cp
    assert d.axis_ranks("edp", 5) == [1, 5]                     # same experts: replicas
    assert {a: d.degree(a) for a in AXIS_NAMES} == {
        "pp": 2, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2, "ep": 2, "edp": 2,
        "dp": 4, "dp_shard_cp": 2, "dp_cp": 4}
    e = ParallelDims(world_size=8, ep=2)                        # ep 2 out of dp_shard 8
    assert e.axis_ranks("ep", 3) == [2, 3] and e.axis_ranks("edp", 3) == [1, 3, 5, 7]


def _mesh_and_shard():
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = ParallelDims(world_size=world, tp=2).build_mesh()
    out = {a: (mesh.size(a), mesh.ranks(a), tuple(mesh[a].mesh.tolist())) for a in AXIS_NAMES}
    two = mesh["dp_shard", "tp"]
    out["2d"] = (two.mesh_dim_names, two.mesh.tolist())
    groups = resolve_groups(mesh)
    out["groups"] = (groups.shard_size, groups.replicate_size,
                     dist.get_process_group_ranks(groups.shard))
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    g = resolve_groups(named)  # read by name: shards over dp_shard, leaves tp alone
    out["named"] = (g.shard_size, g.replicate_size, dist.get_process_group_ranks(g.shard))
    pos = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    g = resolve_groups(pos)  # 2-D, other names: replicate x shard by position, as before
    out["positional"] = (g.shard_size, g.replicate_size)
    odd = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("x", "y", "z"))
    try:
        shardwise.shard(torch.nn.Linear(2, 2), mesh=odd)
    except ValueError as exc:
        out["odd"] = str(exc)
    out["rank"] = rank
    return out


def test_the_mesh_answers_every_axis_and_shard_reads_names():
    for out in run_ranks(_mesh_and_shard, 4):
        r = out["rank"]
        t0 = r - r % 2
        assert out["tp"] == (2, [t0, t0 + 1], (t0, t0 + 1))
        assert out["dp_shard"] == (2, [r % 2, r % 2 + 2], (r % 2, r % 2 + 2))
        for one in ("pp", "dp_replicate", "cp", "ep"):
            assert out[one] == (1, [r], (r,)), one
        assert out["dp"][0] == 2 and out["edp"][0] == 2
        assert out["2d"] == (("dp_shard", "tp"), [[0, 1], [2, 3]])
        assert out["groups"] == (2, 1, [r % 2, r % 2 + 2])
        assert out["named"] == (2, 1, [r % 2, r % 2 + 2])
        assert out["positional"] == (2, 2)
        assert "names ('x', 'y', 'z')" in out["odd"] and "dp_shard" in out["odd"]
