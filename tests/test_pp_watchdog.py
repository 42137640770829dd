"""A rank that fails or hangs inside a pipeline schedule is named with the action it was on.

The executor keeps ``watchdog.active().context["pp action"]`` on the action each rank runs,
and point-to-point waits are tracked for hangs ([Note: point-to-point tracking] in
distributed/p2p.py), so the watchdog's one report names the failing rank, its action, and
what the waiting rank waits for.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from shardwise.distributed import watchdog as wdm
from shardwise.models import LlamaConfig, build_model
from shardwise.parallel.pipeline import PipelineExecutor, build_schedule, split_stages
from shardwise.testing import run_ranks

T = 2.0
CFG = LlamaConfig(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=32, multiple_of=16,
                  max_seq_len=8)


def _pipeline():
    schedule = build_schedule("1f1b", pp=2, microbatches=4)
    part = split_stages(build_model(CFG, seed=0), None, 1, placement=schedule.placement)
    tokens = torch.randint(0, 32, (8, 5), generator=torch.Generator().manual_seed(0))
    return PipelineExecutor(part, schedule), part, tokens[:, :-1], tokens[:, 1:]


def _case(what: str):
    wdm.start(wdm.WatchdogConfig(timeout_s=30.0 if what == "raise" else T))
    pipe, part, x, y = _pipeline()
    pipe.step(x, y)  # one clean step first: shapes agreed, nothing pending
    if dist.get_rank() == 1:
        calls = {"n": 0}

        def fault(module, args):
            calls["n"] += 1
            if calls["n"] == 3:  # the forward of micro-batch 2
                if what == "raise":
                    raise RuntimeError("injected fault in a block")
                while True:  # stuck in Python: never sends its activation's successor
                    time.sleep(0.02)
        part.layers["1"].register_forward_pre_hook(fault)
    start = time.monotonic()
    try:
        with wdm.guard():
            pipe.step(x, y)
    except wdm.CollectiveError as exc:
        return time.monotonic() - start, str(exc)
    except RuntimeError as exc:
        return time.monotonic() - start, f"own: {exc}"
    finally:
        wdm.stop()
    return time.monotonic() - start, "no report"


def test_a_rank_raising_inside_an_action_is_named_with_the_action():
    (seconds, report), (_, own) = run_ranks(_case, 2, args=("raise",), timeout_s=60,
                                             collective_timeout_s=30)
    assert own == "own: injected fault in a block"
    assert report.splitlines()[0] == (
        "shardwise watchdog: rank 1 failed at pp action 1F2 (forward of stage 1, micro-batch 2)"
        ": RuntimeError: injected fault in a block")
    assert "rank 0 (host" in report and "in fault" in report
    assert seconds < 5.0  # not the 30 s timeout


def test_a_rank_hanging_inside_an_action_leaves_its_peer_waiting_on_a_named_message():
    results = run_ranks(_case, 2, args=("hang",), timeout_s=60, collective_timeout_s=T + 2)
    seconds, report = results[0]
    assert results[1][1] == report
    head = report.splitlines()[0]
    assert head == ("shardwise watchdog: recv 'pp.0RECV_B2' float32[2, 4, 16] (point-to-point "
                    "with rank 1) did not complete within 2 s on rank 0 at pp action 0SEND_F3 "
                    "0RECV_B2: rank 1 is not waiting for any message or collective at pp action "
                    "1F2 (forward of stage 1, micro-batch 2)"), head
    assert "rank 0 (host" in report and "waiting" in report
    assert T < seconds < T + 8
