"""bench/vla_bench.py: the verdict and interval rules on hand-made rounds, and one tiny run
of the whole benchmark (1 round, 1 warm-up + 2 timed steps, every peer, real BabyAI batches)
whose table and loss agreement are checked, so the benchmark cannot silently rot."""

from __future__ import annotations

import json

import pytest

from bench.vla_report import LOSS_RTOL, loss_agreement, median_interval, overall_verdict

pytest.importorskip("minigrid")


def _round(k: int, sw3: list[float], fsdp2: list[float]) -> dict:
    loss = [[2.0] * len(sw3)] * 2
    return {"round": k, "peers": {"sw3": {"wall": sw3, "cpu": sw3, "loss": loss},
                                  "fsdp2": {"wall": fsdp2, "cpu": fsdp2, "loss": loss}}}


def test_median_interval_is_order_statistics():
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # under 6 values: the range
    xs = [float(i) for i in range(1, 31)]
    assert median_interval(xs) == (10.0, 21.0)  # n = 30: ranks 10 and 21 (95%)
    with pytest.raises(ValueError):
        median_interval([])


def test_verdict_needs_every_round_below_one():
    fast, slow = [0.9] * 10, [1.0] * 10
    assert overall_verdict([_round(1, fast, slow), _round(2, fast, slow)]) == \
        "met in every round"
    assert overall_verdict([_round(1, fast, slow), _round(2, [1.2] * 10, slow)]) == \
        "not met in round 2"
    mixed = [0.9, 1.1] * 5  # paired ratios on both sides of 1.00
    assert overall_verdict([_round(1, mixed, slow)]).startswith("not settled (round 1")


def test_loss_agreement_reads_timed_steps_only():
    rec = _round(1, [1.0] * 3, [1.0] * 3)
    rec["peers"]["sw3"]["loss"] = [[9.0, 2.0, 2.0], [9.0, 2.0, 2.0 * (1 + 1e-3)]]
    data = {"meta": {"warmup": 1}, "rounds": [rec]}
    assert loss_agreement(data, "sw3") == pytest.approx(1e-3)


def test_tiny_run_writes_the_table_and_the_peers_agree(tmp_path):
    from bench.vla_bench import PEERS, main
    out = tmp_path / "vla"
    assert main(["--tiny", "--out", str(out), "--data", str(tmp_path / "demos")]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["peers"] == list(PEERS)
    (rec,) = data["rounds"]
    for name in PEERS:
        peer = rec["peers"][name]
        assert len(peer["wall"]) == len(peer["cpu"]) == 2
        assert all(t > 0 for t in peer["wall"])
        assert [len(losses) for losses in peer["loss"]] == [3, 3]  # 2 ranks, 1 + 2 steps
        assert loss_agreement(data, name) <= LOSS_RTOL
    md = out.with_suffix(".md").read_text()
    verdict = next(line for line in md.splitlines() if line.startswith("**Verdict"))
    assert any(v in verdict for v in ("met in every round", "not met in round",
                                      "not settled"))
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| round | load | sw3 ms | fsdp2 ms | sw3/fsdp2 (95%)")
    assert len(table) == 2 and table[1].startswith("| 1 |")
    assert table[1].count("|") == table[0].count("|")
    assert md.count(": agree (bound 1e-05)") == len(PEERS) - 1
