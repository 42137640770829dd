"""The planner's model-state bytes and collective bytes equal what the engine reports.

Models are sharded with ``shardwise.shard`` on real Gloo ranks (stages 0-3, one and two
ranks, fp32 and bf16 compute, AdamW and SGD) and trained one step; ``memory_report`` and
``comm_stats`` are compared with the planner's formulas, byte for byte.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config, list_model_configs
from shardwise.planner import comm_model, get_model_spec
from shardwise.planner.catalogue import from_llama_config
from shardwise.planner.rank_memory import state_bytes
from shardwise.testing import run_ranks
from tests.planner_helpers import ODD_SHAPE, lm_backward, sharded_odd_debug

CASES = [  # (stage, compute dtype, optimizer, tie embeddings)
    (0, None, "adamw", False), (1, None, "adamw", False), (2, None, "adamw", True),
    (3, None, "adamw", False), (1, "bf16", "adamw", False), (3, "bf16", "sgd", True),
    (3, None, "adamw", True), (2, "bf16", "adamw", False),
]


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def _run_cases(cases):
    rank = dist.get_rank()
    out = []
    for stage, dtype, opt_name, tie in cases:
        model = sharded_odd_debug(stage, bf16=dtype == "bf16", tie=tie)
        opt = _optimizer(opt_name, model.parameters())
        tokens = torch.randint(0, 67, (2, 9), generator=torch.Generator().manual_seed(rank))
        shardwise.reset_comm_stats()
        lm_backward(model, tokens)
        stats = shardwise.comm_stats().as_dict()
        opt.step()
        report = shardwise.memory_report(model, opt)
        out.append((report.param_bytes, report.grad_bytes, report.optimizer_bytes, stats))
    return rank, out


@pytest.mark.parametrize("world", [1, 2])
def test_model_state_bytes_equal_memory_report(world):
    results = run_ranks(_run_cases, world, args=(CASES,), timeout_s=120)
    for rank, reports in results:
        for case, (params, grads, opt, _) in zip(CASES, reports, strict=True):
            stage, dtype, opt_name, tie = case
            spec = from_llama_config(get_model_config("debug", **ODD_SHAPE, tie_embeddings=tie))
            cb = 2 if dtype else 4
            want = state_bytes([tuple(u) for u in spec.unit_shapes()], world, zero=stage,
                               rank=rank, param_bytes=4, compute_bytes=cb, optimizer=opt_name)
            case = f"stage {stage}, {dtype or 'fp32'}, {opt_name}, tie={tie}, rank {rank}"
            assert (params, grads, opt) == (want.params, want.grads, want.optimizer), case


def test_step_collective_bytes_equal_comm_stats():
    """One forward + backward moves the bytes the planner's byte model prices."""
    results = run_ranks(_run_cases, 2, args=(CASES,), timeout_s=120)
    for rank, reports in results:
        for (stage, dtype, _, tie), (*_, stats) in zip(CASES, reports, strict=True):
            spec = from_llama_config(get_model_config("debug", **ODD_SHAPE, tie_embeddings=tie))
            want = comm_model.step_bytes(spec, world=2, zero=stage, param_bytes=4,
                                         compute_bytes=2 if dtype else 4, microbatches=1)
            got = {k: v["bytes_sent"] for k, v in stats.items()}
            assert got == {k: v for k, v in want.items() if v}, (stage, dtype, tie, rank)


def test_registry_models_convert_exactly():
    """Every registry model but the largest: same parameter count, built on meta."""
    names = [n for n in list_model_configs() if n not in ("llama3-70b", "llama3-405b")]
    for name in names:
        cfg = get_model_config(name)
        model = build_model(cfg, device="meta")
        assert get_model_spec(name).num_params() == sum(p.numel() for p in model.parameters())


def _moe_worker(stage):
    rank = dist.get_rank()
    cfg = get_model_config("debug-moe", dim=48, n_layers=2, n_heads=4, n_kv_heads=2,
                           vocab_size=61, moe_ffn_dim=40, max_seq_len=16)
    model = shardwise.shard(build_model(cfg, seed=0), stage=stage, wrap={TransformerBlock})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(rank))
    lm_backward(model, tokens)
    opt.step()
    r = shardwise.memory_report(model, opt)
    return rank, cfg, (r.param_bytes, r.grad_bytes, r.optimizer_bytes)


@pytest.mark.parametrize("stage", [1, 3])
def test_moe_model_state_bytes_equal_memory_report(stage):
    """Grouped expert tensors, router and shared experts are laid out as the engine does."""
    for rank, cfg, got in run_ranks(_moe_worker, 2, args=(stage,), timeout_s=120):
        spec = from_llama_config(cfg)
        want = state_bytes([tuple(u) for u in spec.unit_shapes()], 2, zero=stage, rank=rank)
        assert got == (want.params, want.grads, want.optimizer), (stage, rank)
