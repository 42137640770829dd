"""bench/moe_bench.py's checks without launching ranks: the all-to-all byte assertion accepts
counted bytes equal to the formula from the routed counts and refuses any other, and the
balance summary averages the last steps over the layers."""

from __future__ import annotations

import pytest
import torch

from bench.moe_bench import check_bytes
from bench.moe_report import TAIL, balance_summary, to_markdown
from shardwise.parallel import dispatch_bytes

DIM, EXPERTS = 4, 4


def _ranks(routed: list[list[list[int]]], groups: list[list[int]]) -> list[dict]:
    """Per-rank records as sw_job returns them, with the bytes the formula gives."""
    out = [None] * len(routed)
    for group in groups:
        for idx, r in enumerate(group):
            sent = received = 0
            for c in range(len(routed[r])):
                counts = torch.tensor([routed[g][c] for g in group])
                s, q = dispatch_bytes(counts, DIM * 4)[idx]
                sent, received = sent + s, received + q
            ep = len(group)
            out[r] = {"ep_ranks": group, "routed": routed[r], "a2a_sent": sent,
                      "a2a_received": received,
                      "counts_sent": len(routed[r]) * (ep - 1) * (EXPERTS // ep) * 8}
    return out


def test_check_bytes_accepts_the_formula_and_refuses_one_row_more():
    gen = torch.Generator().manual_seed(0)
    routed = [[torch.randint(0, 6, (EXPERTS,), generator=gen).tolist() for _ in range(3)]
              for _ in range(4)]
    ranks = _ranks(routed, [[0, 1], [2, 3]])
    got = check_bytes(ranks, DIM, EXPERTS)
    assert got["sent"] == [r["a2a_sent"] for r in ranks]
    ranks[2]["a2a_sent"] += DIM * 4  # one row the formula does not account for
    with pytest.raises(AssertionError, match="rank 2"):
        check_bytes(ranks, DIM, EXPERTS)


def test_balance_summary_and_table():
    steps = TAIL + 10
    run = {"cv": [[1.0, 3.0]] * 10 + [[0.5, 0.5]] * TAIL, "maxload": [[2.0, 2.0]] * steps,
           "lm_loss": [3.0] * 10 + [2.0] * TAIL}
    s = balance_summary(run)
    assert s["cv_tail"] == 0.5 and s["cv_first"] == 2.0 and s["lm_tail"] == 2.0
    saved = {"meta": {"date": "d", "cpus": 2, "load": "0", "rounds": 1, "steps": 1,
                      "warmup": 1, "batch": 4, "seq": 8, "balance_steps": steps,
                      "small": {"dim": 8, "n_layers": 1, "moe_ffn_dim": 8},
                      "sizes": {"debug": {"params": 1, "active": 1},
                                "debug-moe": {"params": 2, "active": 1}}},
             "rows": {}, "balance": {"aux": run, "bias, rate 0.01": {**run, "mode": "bias"}}}
    text = to_markdown(saved)
    assert "bias, rate 0.01: CV 0.500 vs aux 0.500: met" in text
