"""After warm-up, a training step allocates nothing large from shardwise's own code (issue 17).

Long runs grew resident memory step after step because the engine allocated and freed the
same large buffers every step (Gloo's all-gather temporaries, codec scratch, gradient
packing, secondary copies), which fragments glibc's heap. Here every large allocation of
one profiled step is attributed to the Python frames above it (torch.profiler with memory
and stacks): none of 64 KiB or more may come from a frame in ``shardwise/`` outside
``models/`` and ``testing/``, over stages 1-3 x {fp32, bf16, int8 weights + int4 gradients}
x ``zero_grad(set_to_none=True|False)``, with gradient clipping in the step and parameters
whose rows do not divide the ranks (padding). Autograd's own activation and gradient
buffers are not the engine's and are not counted (DDP has them too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.testing import run_ranks

THRESHOLD = 64 * 1024
MODEL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=127, max_seq_len=32,
             multiple_of=32)  # 127 embedding rows: padded at 2 ranks
PRECISIONS = {"fp32": {}, "bf16": {"mixed_precision": shardwise.MixedPrecision(
    param_dtype=torch.bfloat16)}, "int8/int4": {"comm": shardwise.CommQuant(weights="int8",
                                                                            grads="int4")}}


def _ours(frame: str) -> bool:
    return "shardwise/" in frame and "/models/" not in frame and "/testing/" not in frame


def _engine_allocations(prof) -> list[str]:
    """Allocations of >= THRESHOLD bytes with a shardwise frame (outside models/testing)."""
    found = []
    for e in prof.events():
        if e.self_cpu_memory_usage < THRESHOLD:
            continue
        frames, parent = [], e.cpu_parent
        while parent is not None:
            if _ours(parent.name):
                frames.append(parent.name.split("shardwise/")[-1])
            parent = parent.cpu_parent
        if frames:
            found.append(f"{e.name} {e.self_cpu_memory_usage} B at {' <- '.join(frames[:4])}")
    return found


def _step(model, opt, gen, set_to_none: bool) -> None:
    tok = torch.randint(0, 127, (2, 17), generator=gen)
    F.cross_entropy(model(tok[:, :-1]).float().flatten(0, 1), tok[:, 1:].flatten()).backward()
    shardwise.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)


def _profile_warm_steps(stage: int, kwargs: dict, set_to_none: bool) -> list[str]:
    model = shardwise.shard(build_model(get_model_config("debug", **MODEL), seed=0),
                            stage=stage, wrap={TransformerBlock}, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        _step(model, opt, gen, set_to_none)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                 with_stack=True) as prof:
        for _ in range(2):
            _step(model, opt, gen, set_to_none)
    shardwise.empty_cache()
    return _engine_allocations(prof)


def _grid() -> dict:
    return {(stage, precision, set_to_none): _profile_warm_steps(stage, kwargs, set_to_none)
            for stage in (1, 2, 3) for precision, kwargs in PRECISIONS.items()
            for set_to_none in (True, False)}


def test_a_warm_step_allocates_nothing_large_in_the_engine():
    for rank, found in enumerate(run_ranks(_grid, world_size=2, timeout_s=600)):
        bad = {k: v for k, v in found.items() if v}
        assert not bad, f"rank {rank}: " + "\n".join(
            f"stage {s} {p} set_to_none={n}: {v[:3]}" for (s, p, n), v in bad.items())
