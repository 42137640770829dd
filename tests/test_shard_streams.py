"""The CUDA side streams keep no staging buffer past its pass ([Note: held buffers are
bounded] in shard/streams.py), measured on the CPU through the engine's CUDA code paths
([Note: CUDA lifetimes on the CPU] in testing/live_memory.py).

The ~1B stage-3 check of bench/gpu_check.py ran out of 80 GB on an H100: at world size 1
the reduction never entered its side stream, so the buffers it released were never freed,
two compute-dtype copies of every gradient per step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.shard.registry import engine_states
from shardwise.shard.streams import CommStreams
from shardwise.testing import run_ranks
from shardwise.testing.live_memory import LiveStorages, cuda_code_paths

MODEL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=509, max_seq_len=32,
             multiple_of=32)  # 509 rows: uneven over 2 ranks
PHASES = ("forward", "loss", "backward", "step")


def test_release_without_the_side_stream_drops_at_once_and_settle_frees_the_rest():
    with cuda_code_paths():
        streams = CommStreams(torch.device("cpu"))
        streams.release("reduce", torch.empty(8), None, on_side=False)  # never on a side stream
        assert streams.held() == 0
        streams.release("reduce", torch.empty(8), torch.empty(8))
        streams.release("gather", torch.empty(8))
        assert streams.held() == 2
        streams.settle()  # waits until they are freed ([Note: CUDA lifetimes on the CPU])
        assert streams.held() == 0


def test_a_released_buffer_still_referenced_elsewhere_is_named_as_a_leak(monkeypatch):
    from shardwise.testing import live_memory
    monkeypatch.setattr(live_memory, "RELEASE_TIMEOUT_S", 0.05)
    with cuda_code_paths():
        streams = CommStreams(torch.device("cpu"))
        kept = torch.empty(8)
        streams.release("reduce", kept, torch.empty(8))
        with pytest.raises(RuntimeError, match=r"1 buffer\(s\) released .*at the end of a pass"):
            streams.settle()
        streams.release("gather", kept)
        with pytest.raises(RuntimeError, match=r"before a gather"):
            with streams.side("gather"):
                pass


def _steps_worker(steps):
    """Bytes alive after each step, per-phase peaks, and what the streams still hold after
    each backward and each step (stage 3, bf16 compute, CUDA code paths)."""
    with cuda_code_paths():
        model = build_model(get_model_config("debug", **MODEL), seed=0)
        shardwise.shard(model, stage=3, wrap={TransformerBlock},
                        mixed_precision=shardwise.MixedPrecision(param_dtype=torch.bfloat16))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        streams = {id(u.streams): u.streams for st in engine_states(model) for u in st.units}
        tracker = LiveStorages()
        tracker.adopt(model.parameters())
        g = torch.Generator().manual_seed(torch.distributed.get_rank())
        after, held = [], []
        with tracker:
            for i in range(steps):
                tok = torch.randint(0, MODEL["vocab_size"], (2, 17), generator=g)
                tracker.step, tracker.phase = i + 1, "forward"
                out = model(tok[:, :-1])
                tracker.phase = "loss"
                loss = F.cross_entropy(out.float().flatten(0, 1), tok[:, 1:].flatten())
                del out
                tracker.phase = "backward"
                loss.backward()
                del loss
                held.append(sum(s.held() for s in streams.values()))
                tracker.phase = "step"
                opt.step()
                opt.zero_grad(set_to_none=True)
                after.append(tracker.now())
        peaks = {f"{s}/{p}": v[0] for (s, p), v in tracker.peaks.items() if p in PHASES}
        params = sum(p.numel() for p in model.parameters())
        return after, peaks, held, dist_params(params)


def dist_params(local: int) -> int:
    t = torch.tensor([local])
    torch.distributed.all_reduce(t)
    return int(t)


@pytest.mark.parametrize("world_size", [1, 2])
def test_stage3_steps_hold_the_same_bytes_with_cuda_buffer_lifetimes(world_size):
    steps = 4
    for after, peaks, held, params in run_ranks(_steps_worker, world_size=world_size,
                                               args=(steps,), timeout_s=120):
        # A leak of the released reduction buffers grows every step by two bf16 copies of
        # this rank's gradients (4 bytes per parameter): far above any rounding.
        assert after[1:] == [after[1]] * (steps - 1), after
        for p in PHASES:  # after the first step (Adam's state), each phase peaks the same
            assert len({peaks[f"{s}/{p}"] for s in range(2, steps + 1)}) == 1, (p, peaks)
        assert held == [0] * steps, held  # nothing released waits past its backward
        assert params > 0
