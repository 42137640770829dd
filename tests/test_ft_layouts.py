"""The combine and the healing across replica groups laid out differently
([Note: layouts across groups] in shardwise/train/fault_tolerant/pieces.py).

The pure arithmetic on built holdings; then real engine layouts in three processes: group 0
is two ranks sharding the model, group 1 one rank holding it whole (and the other way round
for the stages), joined by one wide Gloo group as a quorum's groups are.
"""

from __future__ import annotations

import datetime
import types
from pathlib import Path

import pytest
import torch

from shardwise.train.fault_tolerant.pieces import (Piece, RankHolding, responsibilities, runs,
                                                   transfers)


def _holding(group, rank, size, ranges, numels):
    return RankHolding(group, rank, size, tuple(ranges), tuple(numels))


def test_a_sharded_group_answers_by_its_shards_and_a_whole_one_splits_evenly():
    # 5 rows of 4 over 2 ranks (3 + 2 rows), a 0-d parameter on rank 0, one of 7 elements.
    sharded = [_holding(0, 0, 2, [(0, 12), (0, 1), (0, 4)], [20, 1, 7]),
               _holding(0, 1, 2, [(12, 20), (0, 0), (4, 7)], [20, 1, 7])]
    assert responsibilities(sharded) == [[(0, 12), (0, 1), (0, 4)], [(12, 20), (0, 0), (4, 7)]]
    whole = [_holding(1, r, 3, [(0, 20), (0, 1), (0, 7)], [20, 1, 7]) for r in range(3)]
    assert responsibilities(whole) == [[(0, 6), (0, 0), (0, 2)], [(6, 13), (0, 0), (2, 4)],
                                       [(13, 20), (0, 1), (4, 7)]]
    holes = [_holding(2, 0, 2, [(0, 8)], [20]), _holding(2, 1, 2, [(12, 20)], [20])]
    with pytest.raises(ValueError, match=r"group 2's 2 ranks do not hold all 20 elements"):
        responsibilities(holes)


def test_alike_layouts_exchange_whole_shards_in_one_run_and_unlike_ones_in_pieces():
    mine = [(12, 20), (0, 0), (4, 7)]
    same = transfers(mine, mine)
    assert same == [Piece(0, 12, 20), Piece(2, 4, 7)]
    assert runs(same, mine) == [(0, 0, 11)]  # a whole shard: one copy (param 1 holds none)
    pieces = transfers([(0, 6), (0, 0), (0, 2)], [(0, 12), (0, 1), (0, 4)])
    assert pieces == [Piece(0, 0, 6), Piece(2, 0, 2)]
    assert runs(pieces, [(0, 12), (0, 1), (0, 4)]) == [(0, 0, 6), (13, 6, 2)]
    row = _holding(1, 0, 3, [(0, 20), (0, 1)], [20, 1])
    assert RankHolding.from_row(row.to_row()) == row


# ----------------------------------------------------------------------- real layouts, 3 ranks

_LAYOUTS = {0: (0, 0, 2), 1: (0, 1, 2), 2: (1, 0, 1)}  # wide rank: (group, rank, size)
_CASES = [(3, 0), (1, 2), (0, 0)]  # (group 0's ZeRO stage, group 1's)


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return x * self.s


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), _Scale(),
                                torch.nn.Linear(5, 3))
    model[0].bias.requires_grad_(False)  # frozen: not combined, still healed
    return model


def _batch(group: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(100 + group))


class _Manager:
    def __init__(self) -> None:
        self.loaded = None

    def batches_committed(self) -> int:
        return 11

    def load_state_dict(self, state) -> None:
        self.loaded = state


class _Loader:
    def __init__(self, consumed: int) -> None:
        self.consumed = consumed

    def state_dict(self):
        return {"consumed": self.consumed}

    def load_state_dict(self, state):
        self.consumed = state["consumed"]


def _worker(w: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore
    from torchft import ProcessGroupGloo

    import shardwise
    from shardwise.train.fault_tolerant.combine import combine_gradients
    from shardwise.train.fault_tolerant.digest import group_state_digest
    from shardwise.train.fault_tolerant.exchange import GradientExchange
    from shardwise.train.fault_tolerant.heal import heal_behind
    from shardwise.train.fault_tolerant.pieces import holding_of
    from shardwise.train.fault_tolerant.wide import WideGroup

    group, rank, size = _LAYOUTS[w]
    client = TCPStore("localhost", port, is_master=False)
    dist.init_process_group("gloo", store=PrefixStore(f"group{group}", client), rank=rank,
                            world_size=size)
    pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=60))
    pg.configure(f"localhost:{port}/wide", f"w{w}", w, 3)
    results = {}
    for case, stages in enumerate(_CASES):
        model = shardwise.shard(_model(), stage=stages[group])
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        every = list(model.parameters())
        trainable = [i for i, p in enumerate(every) if p.requires_grad]
        params = [every[i] for i in trainable]
        loss = model(_batch(group).chunk(size)[rank]).pow(2).mean()
        loss.backward()
        wide = WideGroup.over(pg, holding_of(model, group, rank, size), torch.device("cpu"))
        roster = wide.gather_rows([(0, 2), (1, 1)], 5, 0, 5)
        decision = combine_gradients(params, group, True,
                                     GradientExchange(wide, roster, trainable), None, 0,
                                     loss.detach())
        grads = [p.grad.clone() for p in params]
        # Heal each way: the group behind is perturbed, has no optimizer state, an old
        # schedule, data position and lineage; the other steps once.
        for behind in (1, 0):
            if group == behind:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
                optimizer.state.clear()
            else:
                optimizer.step()
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
            if group != behind:
                schedule.step()
            healable = types.SimpleNamespace(
                model=model, optimizer=optimizer, schedule=schedule, healed=0,
                loader=_Loader(0 if group == behind else 42),
                lineage=0 if group == behind else 123)
            manager = _Manager()
            steps = 3 if group == behind else 7
            roster = wide.gather_rows([(0, 2), (1, 1)], steps, healable.lineage, 7)
            healed = heal_behind(wide, roster, healable, manager)
            digest = group_state_digest(model, optimizer, wide.holding)
            with torch.no_grad():
                probe = model(_batch(9)).clone()
            results[(case, behind)] = {
                "healed": healed, "digest": digest, "probe": probe,
                "lineage": healable.lineage, "loader": healable.loader.consumed,
                "lr": optimizer.param_groups[0]["lr"], "step": (manager.loaded or {}).get("step")}
        results[case] = {"grads": grads, "participants": decision.participants,
                         "ranges": [wide.holding.ranges[i] for i in trainable]}
    torch.save(results, Path(out) / f"rank{w}.pt")
    dist.destroy_process_group()


def _reference_grads() -> list[torch.Tensor]:
    grads = []
    for group in (0, 1):
        model = _model()
        model(_batch(group)).pow(2).mean().backward()
        grads.append([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
    return [(a + b) / 2 for a, b in zip(*grads)]


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    from torch.distributed import TCPStore

    out = tmp_path_factory.mktemp("layouts")
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    torch.multiprocessing.spawn(_worker, args=(store.port, str(out)), nprocs=3, join=True)
    return {w: torch.load(out / f"rank{w}.pt") for w in range(3)}


@pytest.mark.parametrize("case", range(len(_CASES)))
def test_the_combine_across_unlike_layouts_is_the_mean_and_the_same_bits_in_both(three_ranks,
                                                                                 case):
    expected = _reference_grads()
    full = {}
    for w, (group, _, _) in _LAYOUTS.items():
        r = three_ranks[w][case]
        assert r["participants"] == [0, 1]
        for i, ((a, b), g) in enumerate(zip(r["ranges"], r["grads"])):
            buf = full.setdefault((group, i), torch.full((expected[i].numel(),), float("nan")))
            buf[a:b] = g.reshape(-1)
    for i, e in enumerate(expected):
        assert torch.equal(full[(0, i)], full[(1, i)]), i  # both groups: the same bits
        torch.testing.assert_close(full[(0, i)], e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", range(len(_CASES)))
@pytest.mark.parametrize("behind", [1, 0])
def test_a_group_behind_heals_to_the_same_bits_from_another_layout(three_ranks, case, behind):
    rows = {w: three_ranks[w][(case, behind)] for w in range(3)}
    assert len({r["digest"] for r in rows.values()}) == 1  # parameters, buffers, optimizer
    for w, r in rows.items():
        group = _LAYOUTS[w][0]
        assert r["healed"] == (group == behind)
        assert (r["lineage"], r["loader"], r["lr"]) == (123, 42, 0.025)
        assert r["step"] == (7 if group == behind else None)
    # Stage 1 and 2 keep gathered parameters: the healed group's forward uses the new ones.
    assert torch.equal(rows[0]["probe"], rows[2]["probe"])
    assert torch.equal(rows[1]["probe"], rows[2]["probe"])
