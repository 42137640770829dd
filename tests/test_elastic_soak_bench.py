"""The elastic soak (bench/elastic_soak.py), short: 3 replica groups of 1 rank, 30 steps, one
kill (the group restarts, holds until step 12 is committed, rejoins and heals) and one stop
(the group freezes, resumes and heals); every check must pass, including bitwise equality
with the fault-free replay of its membership."""

from __future__ import annotations

import json

import pytest

from bench import elastic_runs as er
from bench.elastic_soak import main

pytest.importorskip("torchft")


@pytest.mark.parametrize("groups,size", [(4, 1), (2, 2), (3, 1)])
def test_soak_schedules_spare_group_0_and_spread_faults(groups, size):
    spec = er.soak_schedule(groups, size, 500, 12, 12, 3.0, rejoins=6)
    steps = [int(f.split(":step=")[1].split(":")[0]) for f in spec]
    assert steps == sorted(set(steps)) and steps[0] >= 8 and steps[-1] <= 490
    kills = [f for f in spec if f.startswith("kill")]
    stops = [f for f in spec if f.startswith("stop")]
    assert len(kills) == len(stops) == 12
    assert not any(":group=0:" in f for f in kills)  # its PID must survive the run
    for kind in (kills, stops):
        assert {f.split(":phase=")[1].split(":")[0] for f in kind} == set(er.PHASES)
    assert len({f.split(":group=")[1].split(":")[0] for f in kills}) == groups - 1
    for g in range(1, groups):  # the k-th kill of a group fires in its attempt k, once
        attempts = [f.split(":attempt=")[1].split(":")[0] for f in kills if f":group={g}:" in f]
        assert attempts == [str(k) for k in range(len(attempts))]
    assert all(f.endswith(":attempt=any") for f in stops)
    held = [f for f in kills if ":rejoin=" in f]
    assert len(held) == 6 and held != kills[:6]  # spread over the kills, not the first ones
    for f in held:
        assert int(f.split(":rejoin=")[1]) == int(f.split(":step=")[1].split(":")[0]) + 8
    if groups == 2:  # a stop of group 0 while group 1 restarts would leave no state alive
        assert all(":group=1:" in f for f in stops)
    if size > 1:
        assert {f.split(":rank=")[1].split(":")[0] for f in kills} == {"0", "1"}


def test_quick_soak_passes_every_check(tmp_path):
    out = tmp_path / "res"
    assert main(["--quick", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    (soak,) = res["soak"]
    assert soak["passed"] and all(soak["checks"].values()), soak["checks"]
    assert soak["fired"] == {"kill": 1, "stop": 1, "rejoin": 1}  # held until step 12
    assert soak["restarts"] == {"0": 0, "1": 1, "2": 0}
    assert soak["replay_steps"] == 30
    row = "| 3 groups x 1, kills attempt-pinned | 30 | 1 | 1 |"
    assert row in out.with_suffix(".md").read_text()
