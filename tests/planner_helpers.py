"""What the planner tests share: a synthetic calibrated CPU device (every fit known, so the
timing tests time nothing), the odd-width debug model sharded and stepped on real ranks,
and the trainer's config of a small job.

    hw = local_cpu(cores=2)                   # a "local" CPU device over Gloo
    est = estimate_debug(hw, dp_shard=2, zero=3)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.planner import get_hardware, get_model_spec
from shardwise.planner.cost_model import CostModel
from shardwise.planner.devices.cpu.costs import KERNELS, CpuCosts
from shardwise.planner.devices.cpu.fits import Fit, Kernel
from shardwise.planner.parallel_layout import Layout
from shardwise.planner.workload import Workload
from shardwise.train.config import load_config, resolve_world

RECORD_KEYS = {"layout", "step_time_s", "tokens_per_s_per_gpu", "mfu", "hfu",
               "memory_per_gpu_gib", "fits", "bottleneck"}
"""The keys of an estimate's JSON record (``shardwise plan --json`` adds whether the trainer
builds the layout)."""
ODD_SHAPE = dict(dim=40, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=67, max_seq_len=16,
                 multiple_of=8)
"""A debug model of odd widths, so that dim-0 sharding pads (rows not divisible by the
world size)."""


def cpu_costs(per_call: float = 1e-4) -> CpuCosts:
    """Calibrated CPU costs of known fits: every kernel ``per_call`` seconds a call (twice
    backward) plus a nanosecond an element, every collective 1 ms (2 ms on 4 ranks) plus a
    nanosecond a byte."""
    kernels = {k: Kernel(Fit(per_call, 1e-9), Fit(2 * per_call, 2e-9)) for k in KERNELS}
    colls = {k: {2: Fit(1e-3, 1e-9), 4: Fit(2e-3, 2e-9)}
             for k in ("all_gather", "reduce_scatter", "all_reduce", "send_recv")}
    return CpuCosts(kernels, Fit(1e-5, 5e-9), colls)


def local_cpu(cores: int = 2):
    """A ``local`` CPU device of ``cores`` cores with :func:`cpu_costs`."""
    base = get_hardware("a100-80gb")
    return base.replace(name="local", cores=cores, backend="gloo", cpu=cpu_costs(),
                        peak_flops={"fp32": 1e11, "bf16": 1e11}, gpus_per_node=8,
                        memory_efficiency=1.0)


def estimate_debug(hw, **layout):
    """The exact estimate of the debug model (micro-batches of 4 sequences of 128 tokens,
    fp32) under ``layout``'s keys on ``hw``."""
    wl = Workload(seq_len=128, global_batch=4 * layout.get("dp_shard", 1)
                  * layout.get("pp_microbatches", 1), compute_dtype="fp32")
    return CostModel(get_model_spec("debug"), hw, wl).estimate(Layout(microbatch=4, **layout),
                                                               exact=True)


def sharded_odd_debug(stage: int, bf16: bool = False, tie: bool = False):
    """The :data:`ODD_SHAPE` debug model sharded at ZeRO ``stage`` (one unit per block), bf16
    compute or fp32 (call on every rank)."""
    cfg = get_model_config("debug", **ODD_SHAPE, tie_embeddings=tie)
    mp = shardwise.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    return shardwise.shard(build_model(cfg, seed=0), stage=stage, wrap={TransformerBlock},
                           mixed_precision=mp)


def lm_backward(model, tokens: torch.Tensor) -> None:
    """One forward and backward of next-token cross-entropy on ``tokens`` ``(B, T + 1)``."""
    logits = model(tokens[:, :-1]).float()
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def train_config(world: int, **over: str):
    """The trainer's config of a job of ``world`` ranks with these ``--section.key``
    overrides."""
    return resolve_world(load_config(None, over), world)
