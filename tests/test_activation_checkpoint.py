"""Activation checkpointing (shardwise.checkpoint_activations, --train.activation_checkpoint).

One launch of 2 Gloo ranks runs the parity grid (stages 0-3 x none / full / selective, with
and without gradient accumulation) and the stage-3 recompute checks; another runs the
trainer with checkpointing and compile against the plain trainer.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.models.llama import Attention, FeedForward
from shardwise.parallel import AC_POLICIES, checkpointed_blocks
from shardwise.shard import engine_states
from shardwise.shard.hooks import in_backward
from shardwise.testing.dist import run_ranks
from shardwise.testing.parity import ParityConfig, make_batches, max_rel_err, sharded_run

SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
TINY = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
        "data.seq_len": "32", "train.batch_size": "4", "train.eval_batches": "2",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false"}


def _model_cfg():
    return get_model_config("debug", **SHAPE)


class _Builder:
    def __init__(self, policy: str) -> None:
        self.policy = policy

    def __call__(self) -> nn.Module:
        model = build_model(_model_cfg(), device="cpu", seed=0)
        return shardwise.checkpoint_activations(model, self.policy)


# ----------------------------------------------------------------------------- stage 3 hooks


def _unit_of(model: nn.Module, module: nn.Module):
    (state,) = engine_states(model)
    return next(u for u in state.units if u.module is module)


def _recompute_reads_gathered_parameters(policy: str) -> dict:
    """Blocks are units: during the recompute every block's unit is gathered, its full
    parameters are the registered ones, and the step issues as many gathers as without
    checkpointing."""
    model = shardwise.shard(_Builder(policy)(), stage=3, wrap={TransformerBlock})
    seen = []
    for block in model.layers:
        unit, wq = _unit_of(model, block), block.attention.wq
        full = next(sp.full for sp in unit.params if sp.param is wq.weight)

        def probe(mod, args, unit=unit, full=full):
            seen.append((in_backward(), unit.gathered, mod.weight is full))
        wq.register_forward_pre_hook(probe)
    tokens = make_batches(0, 1, 1, 2, 16, 256)[0, 0]
    shardwise.reset_comm_stats()
    model(tokens[:, :-1]).float().logsumexp(-1).mean().backward()
    return {"seen": seen, "gathers": shardwise.comm_stats()["all_gather"].calls}


def _recompute_gathers_inner_units(policy: str) -> dict:
    """Units inside a checkpointed block (prefetch off, so nothing else gathers them first):
    the recompute's pre-forward hooks gather them, each gather counted in comm_stats, and
    the step's gathers equal those without checkpointing."""
    model = shardwise.shard(_Builder(policy)(), stage=3, wrap={Attention, FeedForward},
                            prefetch=0)
    issued = []
    for name, mod in model.named_modules():
        if isinstance(mod, (Attention, FeedForward)):
            unit = _unit_of(model, mod)

            def before(m, args, name=name):
                issued.append([name, in_backward(), shardwise.comm_stats()["all_gather"].calls])

            def after(m, args, unit=unit):
                issued[-1][2] = shardwise.comm_stats()["all_gather"].calls - issued[-1][2]
                issued[-1].append(unit.gathered)
            mod.register_forward_pre_hook(before, prepend=True)  # before the engine's hook
            mod.register_forward_pre_hook(after)                  # after it
    tokens = make_batches(0, 1, 1, 2, 16, 256)[0, 0]
    shardwise.reset_comm_stats()
    model(tokens[:, :-1]).float().logsumexp(-1).mean().backward()
    return {"issued": issued, "gathers": shardwise.comm_stats()["all_gather"].calls}


def _grid() -> dict:
    out = {}
    for accum in (1, 2):
        batches = make_batches(3, 4, accum, 4, 16, 256)
        for stage in (0, 1, 2, 3):
            cfg = ParityConfig(stage=stage, accum=accum, optimizer="adamw", steps=4)
            runs = {p: sharded_run(_Builder(p), batches, cfg, wrap={TransformerBlock})
                    for p in AC_POLICIES}
            for p in ("full", "selective"):
                out[(stage, accum, p)] = {
                    "losses": runs[p].losses, "ref": runs["none"].losses,
                    "norms": runs[p].grad_norms, "ref_norms": runs["none"].grad_norms,
                    "weights": max_rel_err(runs[p].state, runs["none"].state)[0]}
    for p in AC_POLICIES:
        out[("hooks", p)] = _recompute_reads_gathered_parameters(p)
        out[("inner", p)] = _recompute_gathers_inner_units(p)
    return out


@pytest.fixture(scope="module")
def grid():
    rows = run_ranks(_grid, world_size=2, timeout_s=600)
    return rows[0]


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpointed_training_matches_plain_training(grid, stage, accum, policy):
    row = grid[(stage, accum, policy)]
    assert len(row["losses"]) == 4
    assert row["losses"] == row["ref"]          # bitwise: the same ops on the same inputs
    assert row["norms"] == row["ref_norms"]
    assert row["weights"] == 0.0


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_stage3_recompute_finds_the_unit_gathered(grid, policy):
    seen = grid[("hooks", policy)]["seen"]
    plain = grid[("hooks", "none")]
    # The recompute runs each block's forward code again (selective: the saved matmul
    # outputs come from its cache), so the probe on wq fires once more per block.
    assert len([s for s in seen if s[0]]) == 2
    assert all(gathered and full for _, gathered, full in seen), seen
    assert not any(s[0] for s in plain["seen"])
    assert grid[("hooks", policy)]["gathers"] == plain["gathers"]


def test_stage3_recompute_gathers_inner_units_and_counts_them(grid):
    full, plain = grid[("inner", "full")], grid[("inner", "none")]
    in_recompute = [(name, n, ok) for name, back, n, ok in full["issued"] if back]
    # The recompute of each block reaches its attention unit before anything gathered it
    # (the feed-forward was gathered by its own pre-backward hook first).
    assert [(name, n) for name, n, _ in in_recompute] == [
        ("layers.1.attention", 1), ("layers.1.feed_forward", 0),
        ("layers.0.attention", 1), ("layers.0.feed_forward", 0)], in_recompute
    assert all(ok for *_, ok in in_recompute)
    assert full["gathers"] == plain["gathers"]  # it stands in for the pre-backward gather
    assert not any(back for _, back, *_ in plain["issued"])


# ----------------------------------------------------------------------------- the trainer


def _train_runs(runs: dict) -> dict:
    from shardwise.train.trainer import build_env, train

    out = {}
    for name, (cfg, data) in runs.items():
        import json

        train(cfg, data, build_env(cfg))
        lines = (Path(cfg.log.dir) / "metrics.jsonl").read_text().splitlines()
        out[name] = [json.loads(x)["loss"] for x in lines if '"loss"' in x]
    return out


def test_trainer_checkpointing_and_compile_match_plain_training(tmp_path):
    from shardwise.train.config import load_config
    from shardwise.train.preflight import preflight

    runs = {}
    for name, over in (("plain", {}),
                       ("selective", {"train.activation_checkpoint": "selective"}),
                       ("full+compile", {"train.activation_checkpoint": "full",
                                         "train.compile": "true",
                                         "train.compile_backend": "aot_eager"})):
        cfg = load_config(None, {**TINY, "train.steps": "3", "train.eval_interval": "0",
                                 "log.dir": str(tmp_path / name.replace("+", "-")), **over})
        runs[name] = preflight(cfg, world_size=2)
    losses = run_ranks(_train_runs, world_size=2, args=(runs,), timeout_s=300)[0]
    assert len(losses["plain"]) == 3
    assert losses["selective"] == losses["plain"]
    torch.testing.assert_close(losses["full+compile"], losses["plain"], rtol=1e-5, atol=0)


# ----------------------------------------------------------------------------- refusals


def test_policies_agree_with_the_config_checks():
    from shardwise.train.config.checks import AC_POLICIES as CONFIG_POLICIES

    assert CONFIG_POLICIES == AC_POLICIES


@pytest.mark.parametrize("key, value, error", [
    ("train.activation_checkpoint", "selectiv",
     "train.activation_checkpoint must be 'none', 'full' or 'selective', got 'selectiv' "
     "(did you mean 'selective'?)"),
    ("train.compile_backend", "inducter",
     "train.compile_backend must be 'inductor', 'aot_eager' or 'eager', got 'inducter' "
     "(did you mean 'inductor'?)"),
    ("train.compile", "maybe", "train.compile"),
])
def test_config_refuses_unknown_values(key, value, error):
    from shardwise.train.config import load_config

    with pytest.raises(ValueError, match=re.escape(error)):
        load_config(None, {key: value})


@pytest.mark.parametrize("over", [{"train.compile": "true"},
                                  {"train.activation_checkpoint": "full"}])
def test_preflight_refuses_compile_and_checkpointing_of_moe_models(tmp_path, over):
    from shardwise.train.config import load_config
    from shardwise.train.preflight import preflight

    cfg = load_config(None, {"model.name": "debug-moe", "log.dir": str(tmp_path), **over})
    key = next(iter(over))
    with pytest.raises(ValueError, match=f"{key}=.* need a dense model; model 'debug-moe' has "
                                         "MoE layers"):
        preflight(cfg, world_size=2)


def test_library_refusals():
    model = build_model(_model_cfg(), device="meta")
    with pytest.raises(ValueError, match=r"policy='ful', expected one of 'none', 'full', "
                                         r"'selective' \(did you mean 'full'\?\)"):
        shardwise.checkpoint_activations(model, "ful")
    with pytest.raises(ValueError, match="save_ops is for policy 'selective'"):
        shardwise.checkpoint_activations(model, "full", save_ops=[torch.ops.aten.mm])
    assert shardwise.checkpoint_activations(model, "none") is model
    assert checkpointed_blocks(model) == {}
    shardwise.checkpoint_activations(model, "selective")
    assert checkpointed_blocks(model) == {"layers.0": "selective", "layers.1": "selective"}
    with pytest.raises(ValueError, match="block 'layers.0' is checkpointed already"):
        shardwise.checkpoint_activations(model, "full")
    compiled = shardwise.compile_blocks(build_model(_model_cfg(), device="meta"),
                                        backend="eager")
    with pytest.raises(ValueError, match="checkpoint activations before compile_blocks"):
        shardwise.checkpoint_activations(compiled, "full")
    moe = build_model(get_model_config("debug-moe", dim=32, n_layers=1, n_heads=4,
                                       n_kv_heads=2), device="meta")
    with pytest.raises(ValueError, match=r"block 'layers.0' holds an MoE feed-forward "
                                         r"\('layers.0.feed_forward'\)"):
        shardwise.checkpoint_activations(moe, "full")


def test_selective_with_custom_ops_and_other_blocks():
    """save_ops and blocks=predicate: an Attention-only policy keeps only the matmuls asked."""
    torch.manual_seed(0)
    model = build_model(_model_cfg(), seed=0)
    ref = build_model(_model_cfg(), seed=0)
    shardwise.checkpoint_activations(model, "selective", blocks=lambda n, m: isinstance(
        m, Attention), save_ops=[torch.ops.aten.mm.default])
    assert list(checkpointed_blocks(model)) == ["layers.0.attention", "layers.1.attention"]
    tokens = torch.randint(0, 256, (2, 16))
    for m in (model, ref):
        m(tokens).float().logsumexp(-1).mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_full_cuts_activation_memory_by_the_layer_count_and_selective_sits_between():
    """bench/ac_bench.py's measurement on a 4-block model: what forward keeps for backward."""
    from bench.ac_bench import measure_memory

    cfg = get_model_config("debug", dim=64, n_layers=4, n_heads=4, n_kv_heads=2)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    held = {}
    for policy in AC_POLICIES:
        model = shardwise.checkpoint_activations(build_model(cfg, seed=0), policy)
        held[policy] = measure_memory(model, tokens, (TransformerBlock,))
    blocks = {p: m["held_blocks"] for p, m in held.items()}
    # full keeps one (B, T, C) fp32 input per block
    assert blocks["full"] == 4 * 2 * 32 * 64 * 4
    assert blocks["none"] >= 4 * blocks["full"] * 4  # >= n_layers x less
    assert blocks["full"] < blocks["selective"] < blocks["none"]
    assert held["none"]["saved_hooks"] == held["none"]["held"] - 4  # the loss is not saved
