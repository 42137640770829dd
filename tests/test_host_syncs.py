"""Host syncs per training step are a constant, whatever the model's size (issue 10).

On a GPU every ``.item()``, ``.cpu()``, ``.tolist()`` or ``bool(tensor)`` waits for the device
to catch up. The trainer's step reads the loss, the global gradient norm and the memory
figures once (one small all-gather), the norm is computed with one fused kernel per shard
group, and the non-finite check only runs its detailed, per-parameter search when that one
read says something is not finite. Here every such call made from a frame in ``shardwise/``
(torch's own internals, e.g. AdamW's step counters, are not ours) is counted over whole
training runs of 2 and 5 steps on a 2-layer and a 6-layer model: the per-step count is the
same for both models and small.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from shardwise.testing.dist import run_ranks
from shardwise.train.config import load_config
from shardwise.train.preflight import preflight
from shardwise.train.trainer import build_env, train

SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
TINY = {"model.dim": "32", "model.n_heads": "4", "model.n_kv_heads": "2", "data.seq_len": "32",
        "train.batch_size": "2", "train.grad_accum": "2", "train.eval_interval": "0",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false",
        "optim.grad_clip": "1.0"}


def _from_shardwise() -> bool:
    frame = sys._getframe(2)
    name = frame.f_code.co_filename.replace("\\", "/")
    return "/shardwise/" in name and "/shardwise/testing/" not in name


def _count_syncs(cfg, data) -> int:
    counts = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counting(original):
        def wrapper(self, *args, **kwargs):
            if _from_shardwise():
                counts["n"] += 1
            return original(self, *args, **kwargs)
        return wrapper

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        train(cfg, data, build_env(cfg))
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return counts["n"]


def _run(tmp: Path, layers: int, steps: int, stage: str) -> int:
    cfg = load_config(None, {**TINY, "model.n_layers": str(layers), "train.steps": str(steps),
                             "parallel.stage": stage, "log.dir": str(tmp / f"{layers}-{steps}")})
    cfg, data = preflight(cfg, world_size=2)
    return max(run_ranks(_count_syncs, world_size=2, args=(cfg, data), timeout_s=180))


def test_host_syncs_per_step_do_not_grow_with_the_model(tmp_path):
    per_step = {}
    for stage in ("3", "1"):
        for layers in (2, 6):
            short = _run(tmp_path / stage, layers, 2, stage)
            long = _run(tmp_path / stage, layers, 5, stage)
            per_step[(stage, layers)] = (long - short) / 3
    assert per_step[("3", 2)] == per_step[("3", 6)], per_step
    assert per_step[("1", 2)] == per_step[("1", 6)], per_step
    assert max(per_step.values()) <= 4, per_step  # the stats read, the step's lr, ...
