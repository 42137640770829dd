"""bench/cp_bench.py: the verdicts and tables from a small hand-made record, and one tiny
run of the rank code (cp 1 and cp 2 at T = 64, one step per row, PyTorch's context_parallel
through the CPU shim) rendered the same way, so the benchmark cannot silently rot."""

from __future__ import annotations

import pytest

from bench.cp_bench import (PER_CP, aggregate, expected_bytes, parse_args, speed_job,
                            to_markdown, verdict)
from shardwise.testing import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")
MIB = 2**20


def _meta(seq: int, rounds: int) -> dict:
    return {"date": "d", "torch": "t", "commit": "c", "cores": 2, "machine": "m",
            "quick": True, "seq": [seq], "batch": 1, "steps": 2, "warmup": 1,
            "rounds": rounds, "cap_mib": 256, "grain": 512, "load_at_start": [0.5, 0, 0]}


def _row(wall: float, cpu: float, ranks: int, loss: float = 5.0) -> dict:
    return {"wall": [wall, wall], "cpu": [cpu, cpu], "cpu_ranks": [[cpu, cpu]] * ranks,
            "loss": [loss, loss]}


def _bytes(name: str, seq: int, cp: int) -> dict:
    exp = expected_bytes(name, seq, cp, 1)
    one = {"fwd": {"cp": 4 * exp["forward"], "all_reduce": 0},
           "bwd": {"cp": 4 * exp["backward"], "all_reduce": 100}}
    return {"saved_bytes": [1000 * MIB // cp] * cp, "bytes": [one] * cp}


def test_verdict_needs_every_round():
    assert verdict([0.9, 1.0]) == "met"
    assert verdict([1.01, 1.2]) == "not met"
    assert verdict([0.9, 1.1]).startswith("not settled")
    assert verdict([]) == "no peer"


def test_tables_from_a_small_record():
    seq = 64
    rounds = [
        {"load": [1.0], "rows": {"cp1": _row(1.0, 1.0, 1)}},
        {"load": [1.0], "rows": {"cp1": _row(1.0, 1.0, 1)}}]
    cp2 = [{"load": [2.0], "rows": {"sw-ring": _row(0.9, 0.5, 2), "torch-allgather":
                                    _row(1.0, 0.5, 2)}},
           {"load": [3.0], "rows": {"sw-ring": _row(1.1, 0.45, 2), "torch-allgather":
                                    _row(1.0, 0.5, 2)}}]
    trials = [{"seq": 512, "peak_growth": 2**20, "saved_bytes": 2**20, "step_s": 1.0,
               "fits": True},
              {"seq": 1024, "peak_growth": 2**30, "saved_bytes": 2**20, "step_s": 1.0,
               "fits": False}]
    data = {"meta": {**_meta(seq, 2), "minutes": 1.0},
            "speed": {str(seq): {"1": rounds, "2": cp2}},
            "extras": {str(seq): {"1": {"cp1": {"saved_bytes": [1000 * MIB], "bytes": []}},
                                  "2": {"sw-ring": _bytes("sw-ring", seq, 2),
                                        "torch-allgather": {"saved_bytes": [530 * MIB, 500 * MIB],
                                                            "bytes": []}}}},
            "max_len": {"cp1@cp1": {"name": "cp1", "cp": 1, "max_seq": 512, "bounded": False,
                                    "trials": trials},
                        "sw-ring@cp4": {"name": "sw-ring", "cp": 4, "max_seq": 2048,
                                        "bounded": False, "trials": []}},
            "torch_as_shipped": {"cp2": {"default backend (CPU flash)": "NotImplementedError: x"}}}
    text = to_markdown(data)
    assert ("- T 64: step time 0.90 / 1.10: **not settled (rounds on both sides of 1.00)**; "
            "CPU time 1.00 / 0.90: **met**") in text
    assert "| 64 | sw-ring | torch-allgather | 0.90-1.10 | not settled" in text
    assert "- T 64: sw-ring cp 2 1.000: **met**" in text
    assert "| 64 | 2 | torch-allgather | 530.00 | 500.00 | 500.00 | 1.060 |" in text
    assert "| cp 1 (one process) | 512 | 1 | 1 | 1.0 | 1024 | 1024 |" in text
    assert "| 64 | 2 | sw-ring | 32 | 32 | 96 | 96 | yes | 0 |" in text
    assert "| 2 | zigzag | 1040, 1040 | 1.000 |" in text
    assert "cp 4 trains at 4.00x cp 1's longest sequence" in text
    assert "cp2, default backend (CPU flash): `NotImplementedError: x`" in text
    assert "| 1 | cp1 | one process, plain SDPA | 1000 / 1000 |" in text


def _tiny(cp: int, names: list[str]):
    return run_ranks(speed_job, cp, args=(cp, names, 64, 1, 1, 1, 0, True), timeout_s=240,
                     threads=1)


def test_tiny_run_renders_and_checks_itself():
    names = [n for n in PER_CP[2] if n in ("sw-ring", "sw-ulysses", "torch-allgather")]
    data = {"meta": _meta(64, 1), "speed": {"64": {}}, "extras": {"64": {}}}
    for cp, rows in ((1, ["cp1"]), (2, names)):
        rec, extra = aggregate(_tiny(cp, rows), rows, True)
        rec["load"] = [0.0]
        data["speed"]["64"][str(cp)] = [rec]
        data["extras"]["64"][str(cp)] = extra["rows"]
        if "torch_as_shipped" in extra:
            data["torch_as_shipped"] = {f"cp{cp}": extra["torch_as_shipped"]}
    text = to_markdown(data)
    # PyTorch's context_parallel as shipped stops at the CPU flash kernel
    assert "_scaled_dot_product_flash_attention_for_cpu.default does not have a sharding " \
           "strategy registered" in text
    # every row trains the same model on the same data: cp 1's loss
    ref = data["speed"]["64"]["1"][0]["rows"]["cp1"]["loss"]
    for row in data["speed"]["64"]["2"][0]["rows"].values():
        assert row["loss"] == pytest.approx(ref, rel=1e-5)
    assert "| 64 | 2 | sw-ring | 32 | 32 | 96 | 96 | yes |" in text
    assert "| 64 | 2 | sw-ulysses | 48 | 48 | 48 | 48 | yes |" in text
    assert "- T 64: sw-ring cp 2 1.000, sw-ulysses cp 2 1.000: **met**" in text
    assert "| 64 | sw-ring | torch-allgather |" in text
    assert parse_args(["--quick"]).seq == [1024]
