"""bench/lowbit_train.py's bookkeeping: gaps against the bf16 run of the same seed and layout,
the verdict per recipe (every seed within 0.25% for fp8, reported for MX / NVFP4), errors and
non-finite runs shown as such, and run directories read back instead of run again."""

from __future__ import annotations

import json

from bench.lowbit_train import _metrics, _run, gaps, markdown


def _rec(matmul, seed, tail, layout="one rank", finite=True):
    return {"layout": layout, "matmul": matmul, "seed": seed, "tail_mean": tail,
            "finite": finite, "step_s_median": 1.0}


def test_gaps_and_verdicts():
    recs = gaps([_rec("bf16", 0, 4.0), _rec("bf16", 1, 5.0),
                 _rec("fp8_rowwise", 0, 4.004), _rec("fp8_rowwise", 1, 5.005),
                 _rec("fp8_tensorwise", 0, 4.0), _rec("fp8_tensorwise", 1, 5.02),
                 _rec("nvfp4", 0, 4.4), _rec("nvfp4", 1, 5.5),
                 _rec("bf16", 0, 3.0, "tp"), _rec("fp8_rowwise", 0, 2.9, "tp")])
    by = {(r["layout"], r["matmul"], r["seed"]): r["gap"] for r in recs}
    assert abs(by[("one rank", "fp8_rowwise", 0)] - 0.001) < 1e-12
    assert abs(by[("one rank", "fp8_tensorwise", 1)] - 0.004) < 1e-12
    assert abs(by[("tp", "fp8_rowwise", 0)] + 1 / 30) < 1e-12  # against its own layout's bf16
    table = markdown(recs, 300, "python -m bench.lowbit_train")
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in table.splitlines()
            if line.startswith("| ") and "---" not in line}
    assert rows[("one rank", "fp8_rowwise")].endswith("| met |")
    assert rows[("one rank", "fp8_tensorwise")].endswith("| NOT met |")  # one seed misses
    assert rows[("one rank", "nvfp4")].endswith("| reported |")
    assert rows[("tp", "fp8_rowwise")].endswith("| NOT met |")
    assert "+0.100%" in rows[("one rank", "fp8_rowwise")]


def test_errors_and_nan_are_shown_not_hidden():
    err = {"layout": "one rank", "matmul": "mxfp8", "seed": 0, "error": "boom"}
    recs = gaps([_rec("bf16", 0, 4.0), _rec("fp8_blockwise", 0, float("nan"), finite=False),
                 err])
    table = markdown(recs, 300, "x")
    assert "| one rank | mxfp8 | error | - | NO |" in table
    blk = next(line for line in table.splitlines() if "fp8_blockwise" in line)
    assert "| nan |" in blk and "| NO |" in blk and blk.endswith("| NOT met |")


def test_a_complete_run_directory_is_read_back(tmp_path):
    rows = [{"step": s, "loss": 5.0 - s / 100, "step_time_s": 0.5} for s in range(1, 4)]
    rows.insert(2, {"step": 2, "val_loss": 9.0})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    losses, times = _metrics(tmp_path)
    assert losses == {1: 4.99, 2: 4.98, 3: 4.97} and times == [0.5] * 3
    rec = _run(["--precision.matmul", "bf16"], tmp_path, 3, 0)  # 3 steps there: not run again
    assert rec["wall_s"] is None and rec["losses"] == [4.99, 4.98, 4.97]
    assert abs(rec["tail_mean"] - 4.98) < 1e-12 and rec["finite"]


def test_control_row_and_runs_not_made():
    recs = gaps([_rec("bf16", 0, 4.0), _rec("bf16", 1, 5.0), _rec("fp32", 0, 4.1),
                 _rec("fp32", 1, 4.9), _rec("nvfp4", 0, 4.2)])
    table = markdown(recs, 300, "x")
    fp32 = next(line for line in table.splitlines() if "| fp32 |" in line)
    assert fp32.endswith("| control |") and "+2.500%" in fp32 and "-2.000%" in fp32
    nv = next(line for line in table.splitlines() if "| nvfp4 |" in line)
    assert "| not run | - |" in nv
