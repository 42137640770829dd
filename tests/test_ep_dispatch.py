"""Expert-parallel dispatch and combine ([Note: expert dispatch]): with random routings on 4
Gloo ranks (ep 2 and ep 4; experts that receive no token from some rank, ranks that route
nothing, every token to one expert, a rank whose experts receive nothing and whose compute
returns an output not connected to the rows), dispatch -> compute -> combine returns every
row's result in order, rows reach the experts they were routed to, the backward is exact
(bitwise the gradient the rows would get on one process), and the bytes ``comm_stats``
counts equal :func:`dispatch_bytes` from the counts. Plus the capacity groups of the
single-process reference (a property test against one capacity per group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise
from shardwise.distributed.mesh import ParallelDims
from shardwise.distributed.placement import Axis
from shardwise.models.router import expert_capacity, sort_by_expert
from shardwise.parallel.expert import EP_LABELS, ExpertGroup, dispatch_bytes, \
    dispatch_compute_combine
from shardwise.testing import run_ranks

WORLD, DIM, SEEDS = 4, 6, 12
PATTERNS = ("random", "sparse", "one_expert", "nothing_here", "all_remote", "idle_owner")


def _counts(pattern: str, e: int, gen: torch.Generator, rank: int, ep: int) -> torch.Tensor:
    """This rank's rows per expert for one case (seeded per rank: every rank differs)."""
    counts = torch.randint(0, 5, (e,), generator=gen)
    if pattern == "sparse":  # most experts get nothing from this rank
        counts *= torch.rand(e, generator=gen) < 0.3
    elif pattern == "one_expert":  # every rank sends every row to expert 1
        counts = torch.zeros(e, dtype=torch.int64)
        counts[1] = 3 + rank
    elif pattern == "nothing_here" and rank % 2:
        counts = torch.zeros(e, dtype=torch.int64)
    elif pattern == "all_remote":  # nothing for this rank's own experts
        local = e // ep
        own = rank % ep
        counts[own * local:(own + 1) * local] = 0
    elif pattern == "idle_owner":  # ep rank 0's experts receive nothing from anyone
        counts[:e // ep] = 0
    return counts


def _case(g: ExpertGroup, counts: torch.Tensor, gen: torch.Generator) -> dict:
    m = int(counts.sum())
    x = torch.randn(m, DIM, generator=gen, requires_grad=True)
    r = torch.randn(m, DIM, generator=gen)
    expert = torch.repeat_interleave(torch.arange(g.num_experts), counts)  # (M,) of each row
    scale = (expert + 1).to(x.dtype).unsqueeze(1)
    seen = {}

    def compute(rows, local_counts):
        seen["local"] = local_counts.clone()
        if rows.shape[0] == 0:  # as expert_ffn: an output that does not depend on the rows
            return rows.new_zeros(0, rows.shape[1])
        eid = torch.repeat_interleave(torch.arange(local_counts.numel()), local_counts) + g.first
        return rows * (eid + 1).to(rows.dtype).unsqueeze(1)  # tags every row with its expert

    identity = dispatch_compute_combine(x, counts, g, lambda rows, c: rows)
    shardwise.reset_comm_stats()
    y = dispatch_compute_combine(x, counts, g, compute)
    (y * r).sum().backward()
    stats = shardwise.comm_stats()
    return {"identity": torch.equal(identity, x.detach()),
            "forward": torch.equal(y.detach(), x.detach() * scale),
            "backward": torch.equal(x.grad, r * scale),
            "counts": counts, "local": seen["local"],
            "bytes": {op: (stats.label(op).bytes_sent, stats.label(op).bytes_received)
                      for op in EP_LABELS}}


def _worker() -> dict:
    torch.set_num_threads(1)
    rank, out = dist.get_rank(), {}
    for ep in (2, 4):
        mesh = ParallelDims(world_size=WORLD, ep=ep).build_mesh()
        g = ExpertGroup(Axis("ep", tuple(mesh.ranks("ep")), mesh.group("ep")), 8, "t")
        for pattern in PATTERNS:
            for seed in range(SEEDS // len(PATTERNS) + 1):
                gen = torch.Generator().manual_seed(1000 * seed + rank)
                out[(ep, pattern, seed)] = _case(g, _counts(pattern, 8, gen, rank, ep), gen)
    return out


def test_dispatch_combine_is_the_identity_with_an_exact_backward():
    results = run_ranks(_worker, WORLD, timeout_s=180)
    for key in results[0]:
        ep = key[0]
        for rank, res in enumerate(results):
            case = res[key]
            assert case["identity"] and case["forward"] and case["backward"], (key, rank)
        groups = [list(range(i, i + ep)) for i in range(0, WORLD, ep)]  # ep is innermost
        for ranks in groups:
            counts = torch.stack([results[r][key]["counts"] for r in ranks])  # (ep, E)
            # Each expert's owner received exactly the rows every rank routed to it.
            for j, r in enumerate(ranks):
                local = 8 // ep
                assert torch.equal(results[r][key]["local"],
                                   counts[:, j * local:(j + 1) * local].sum(0)), (key, r)
            want = dispatch_bytes(counts, DIM * 4)
            for j, r in enumerate(ranks):
                got = results[r][key]["bytes"]
                tokens = [sum(got[op][i] for op in EP_LABELS[1:]) for i in (0, 1)]
                assert tuple(tokens) == want[j], (key, r, got, want[j])
                assert got["ep_counts"] == ((ep - 1) * (8 // ep) * 8,) * 2


def test_dispatch_bytes_formula_on_a_hand_count():
    # 2 ranks, 4 experts (2 each): rank 0 sends 1 + 2 rows to rank 1, receives 4 + 0.
    counts = torch.tensor([[5, 0, 1, 2], [4, 0, 7, 1]])
    assert dispatch_bytes(counts, 10) == [(2 * (3 + 4) * 10,) * 2, (2 * (4 + 3) * 10,) * 2]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 3), st.integers(2, 6),
       st.floats(0.25, 2.0), st.integers(0, 2**31 - 1))
def test_capacity_groups_drop_what_each_group_drops_alone(groups, per_group, top_k, experts,
                                                          factor, seed):
    top_k = min(top_k, experts)
    n = groups * per_group
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(n, experts, generator=gen).topk(top_k, dim=-1).indices  # (N, k)
    cap = expert_capacity(factor, per_group, top_k, experts)
    joint = sort_by_expert(ids, experts, cap, groups)
    kept, counts = set(), torch.zeros(experts, dtype=torch.int64)
    for g in range(groups):
        alone = sort_by_expert(ids[g * per_group:(g + 1) * per_group], experts, cap)
        slot, token = alone.order // per_group, alone.order % per_group
        kept |= set((slot * n + g * per_group + token).tolist())
        counts += alone.counts
    assert set(joint.order.tolist()) == kept
    assert torch.equal(joint.counts, counts)
    assert torch.equal(joint.routed, torch.bincount(ids.reshape(-1), minlength=experts))
    flat = ids.t().reshape(-1)[joint.order]
    assert torch.equal(flat, flat.sort(stable=True).values)  # still sorted by expert
