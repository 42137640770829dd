"""torch.compile of a model's blocks (shardwise.compile_blocks, --train.compile).

One launch of 2 Gloo ranks runs the whole parity grid (stages 0-3, eager vs compiled, and
compile with activation checkpointing) with the ``aot_eager`` backend: it traces forward and
backward like inductor but generates no code, which keeps CI on 2 cores fast. One inductor
smoke test runs stage 3. Dynamo's counters give the graph breaks and graphs; after the
first step ``error_on_recompile`` turns any recompile into a failure.
"""

from __future__ import annotations

import re
import pytest
import torch
from torch import nn

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.parallel import compiled_blocks
from shardwise.parallel.blocks import FORWARD_COLLECTIVES_ATTR
from shardwise.testing.dist import run_ranks
from shardwise.testing.parity import ParityConfig, make_batches, max_rel_err, sharded_run

SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
STEPS = 10
AC_STAGES = (0, 3)  # compile + activation checkpointing: the extremes, to keep CI short


def _model_cfg(**over):
    return get_model_config("debug", **{**SHAPE, **over})


class _Builder:
    """Builds the model for one run (picklable, no closures): seed 0, then AC, then compile."""

    def __init__(self, backend: str | None, ac: str = "none") -> None:
        self.backend, self.ac = backend, ac

    def __call__(self) -> nn.Module:
        model = build_model(_model_cfg(), device="cpu", seed=0)
        shardwise.checkpoint_activations(model, self.ac)
        if self.backend:
            shardwise.compile_blocks(model, backend=self.backend)
        return model


class _Watch:
    """``after_step``: graphs compiled after each step; any recompile after step 1 raises."""

    def __init__(self) -> None:
        self.graphs: list[int] = []

    def __call__(self, model: nn.Module) -> None:
        from torch._dynamo.utils import counters

        self.graphs.append(counters["stats"]["unique_graphs"])
        torch._dynamo.config.error_on_recompile = True


def _compiled_run(builder, batches, cfg):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # every run compiles from scratch: its counts are its own
    counters.clear()
    watch = _Watch()
    try:
        res = sharded_run(builder, batches, cfg, wrap={TransformerBlock}, after_step=watch)
    finally:
        torch._dynamo.config.error_on_recompile = False
    return res, watch.graphs, sum(counters["graph_break"].values())


def _grid(backend: str, stages: tuple[int, ...], ac_stages: tuple[int, ...]) -> dict:
    """Per stage: eager, compiled, and (``ac_stages``) compiled with checkpointing."""
    batches = make_batches(1, STEPS, 1, 4, 16, 256)
    out = {}
    for stage in stages:
        cfg = ParityConfig(stage=stage, optimizer="adamw", steps=STEPS)
        eager = sharded_run(_Builder(None), batches, cfg, wrap={TransformerBlock})
        variants = ("none", "selective", "full") if stage in ac_stages else ("none",)
        for ac in variants:
            res, graphs, breaks = _compiled_run(_Builder(backend, ac), batches, cfg)
            out[(stage, ac)] = {"eager": eager.losses, "compiled": res.losses,
                                "graphs": graphs, "breaks": breaks,
                                "weights": max_rel_err(res.state, eager.state)[0]}
    return out


@pytest.fixture(scope="module")
def grid():
    rows = run_ranks(_grid, world_size=2, args=("aot_eager", (0, 1, 2, 3), AC_STAGES),
                     timeout_s=600)
    assert rows[0].keys() == rows[1].keys()
    return rows[0]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_training_matches_eager_at_every_stage(grid, stage):
    row = grid[(stage, "none")]
    assert len(row["compiled"]) == STEPS
    assert _rel(row["compiled"], row["eager"]) <= 1e-5, (row["compiled"], row["eager"])
    assert row["weights"] <= 1e-5


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_graph_no_graph_breaks_no_recompiles(grid, stage):
    """Both blocks share one graph, compiled in the first step; later steps (stage 3 frees and
    re-gathers the parameters every step) compile nothing (error_on_recompile is on)."""
    for ac in ("none", "selective", "full") if stage in AC_STAGES else ("none",):
        row = grid[(stage, ac)]
        assert row["breaks"] == 0, ac
        assert row["graphs"] == [1] * STEPS, (ac, row["graphs"])


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_compile_with_activation_checkpointing_matches_eager(grid, ac):
    for stage in AC_STAGES:
        row = grid[(stage, ac)]
        assert _rel(row["compiled"], row["eager"]) <= 1e-5, (stage, row)


def _inductor_smoke() -> dict:
    batches = make_batches(1, 3, 1, 4, 16, 256)
    cfg = ParityConfig(stage=3, optimizer="adamw", steps=3)
    eager = sharded_run(_Builder(None), batches, cfg, wrap={TransformerBlock})
    res, graphs, breaks = _compiled_run(_Builder("inductor"), batches, cfg)
    return {"eager": eager.losses, "compiled": res.losses, "graphs": graphs, "breaks": breaks}


def test_inductor_smoke_at_stage_3():
    row = run_ranks(_inductor_smoke, world_size=2, timeout_s=600,
                    env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})[0]
    assert row["breaks"] == 0 and row["graphs"] == [1, 1, 1]
    assert _rel(row["compiled"], row["eager"]) <= 1e-4, row


# ----------------------------------------------------------------------------- refusals


def _refusals() -> dict[str, str]:
    """Every way of putting the engine's collectives inside a compiled region, refused."""
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)

    tokens = torch.randint(0, 256, (2, 8))

    def whole_model():
        model = shardwise.shard(build_model(_model_cfg(), seed=0), stage=3,
                                wrap={TransformerBlock})
        torch.compile(model, backend="aot_eager")(tokens)

    def units_inside_after_shard():
        from shardwise.models.llama import Attention

        model = shardwise.shard(build_model(_model_cfg(), seed=0), stage=3, wrap={Attention})
        shardwise.compile_blocks(model, backend="aot_eager")

    def units_inside_shard_after_compile():
        from shardwise.models.llama import Attention

        model = shardwise.compile_blocks(build_model(_model_cfg(), seed=0), backend="aot_eager")
        shardwise.shard(model, stage=3, wrap={Attention})(tokens)

    attempt("whole_model", whole_model)
    attempt("units_inside_after_shard", units_inside_after_shard)
    attempt("units_inside_shard_after_compile", units_inside_shard_after_compile)
    torch._dynamo.reset()
    return out


def test_collectives_inside_a_compiled_region_are_refused():
    out = run_ranks(_refusals, world_size=2, timeout_s=300)[0]
    assert "the sharding hooks of unit '<root>' issue collectives" in out["whole_model"]
    assert "shardwise.compile_blocks(model)" in out["whole_model"]
    assert ("block 'layers.0' holds sharding units ['layers.0.attention']"
            in out["units_inside_after_shard"])
    assert ("the sharding hooks of unit 'layers.0.attention' issue collectives"
            in out["units_inside_shard_after_compile"])


def test_moe_blocks_and_declared_collectives_are_refused():
    moe = build_model(get_model_config("debug-moe", dim=32, n_layers=1, n_heads=4, n_kv_heads=2),
                      device="meta")
    with pytest.raises(ValueError, match=r"block 'layers.0' holds an MoE feed-forward "
                                         r"\('layers.0.feed_forward'\)"):
        shardwise.compile_blocks(moe, backend="aot_eager")
    dense = build_model(_model_cfg(), device="meta")
    setattr(dense.layers[1].attention.wq, FORWARD_COLLECTIVES_ATTR, "a tensor-parallel gather")
    with pytest.raises(ValueError, match=r"'layers.1.attention.wq', whose forward issues "
                                         r"collectives \(a tensor-parallel gather\)"):
        shardwise.compile_blocks(dense, backend="aot_eager")
    assert compiled_blocks(dense) == []  # refused before anything was compiled


def test_moe_statistics_all_reduce_refuses_to_run_compiled():
    from shardwise.parallel import AllReduceStats

    fn = torch.compile(AllReduceStats(), backend="eager")
    with pytest.raises(ValueError, match=r"MoE balance statistics \(moe.stats all-reduce\) "
                                         r"issue collectives"):
        fn(torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("kwargs, error", [
    ({"mode": "reduce-overhead"}, "mode='reduce-overhead' captures CUDA graphs"),
    ({"backend": ""}, "backend='', expected a backend name"),
    ({"blocks": nn.Linear, "backend": "eager"}, "compile_blocks: no module of Transformer "
                                                "matches blocks=<class 'torch.nn.modules."),
    ({"blocks": 3}, "compile_blocks: blocks must be None"),
])
def test_bad_arguments_are_refused(kwargs, error):
    model = build_model(_model_cfg(), device="meta")
    if "blocks" in kwargs and kwargs["blocks"] is nn.Linear:
        model = nn.Sequential(nn.ReLU())
        error = error.replace("Transformer", "Sequential")
    with pytest.raises(ValueError, match=re.escape(error)):
        shardwise.compile_blocks(model, **kwargs)


def test_compiling_twice_is_refused_and_names_are_reported():
    model = build_model(_model_cfg(), device="meta")
    shardwise.compile_blocks(model, backend="eager")
    assert compiled_blocks(model) == ["layers.0", "layers.1"]
    assert dict(model.named_parameters()).keys() == dict(
        build_model(_model_cfg(), device="meta").named_parameters()).keys()
    with pytest.raises(ValueError, match="block 'layers.0' is compiled already"):
        shardwise.compile_blocks(model, backend="eager")


def test_a_block_has_no_graph_break_by_explain():
    """torch._dynamo.explain on one eager block of each attention kind: one graph, no break."""
    for over in ({}, {"attention": "mla", "q_lora_rank": 16, "kv_lora_rank": 16,
                      "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}):
        cfg = _model_cfg(**over)
        model = build_model(cfg, seed=0)
        cos, sin = model.rope(8)
        x = torch.randn(2, 8, cfg.dim)
        report = torch._dynamo.explain(model.layers[0].forward)(x, cos, sin)
        assert report.graph_break_count == 0 and report.graph_count == 1, report
    torch._dynamo.reset()


def test_refusal_does_not_fire_outside_compiled_regions():
    from shardwise.distributed.compiled import in_compiled_region, refuse_in_compiled_region

    assert not in_compiled_region()
    refuse_in_compiled_region("nothing")  # eager: no error
    seen = []

    def probe(x):
        seen.append(in_compiled_region())
        return x + 1

    torch.compile(probe, backend="eager")(torch.zeros(2))
    assert seen == [True]


def _gpu_check_on_cpu():
    from bench.compile_check import compile_check, format_rows

    rows = compile_check("aot_eager", (3,), dim=64, layers=2, batch=2, seq=16, steps=3,
                         ac=("full",))
    return format_rows(rows, 1e-5)


def test_the_gpu_check_script_runs_here():
    """bench/compile_check.py (what bench/gpu_check.sh runs with inductor on CUDA), on Gloo."""
    table, ok = run_ranks(_gpu_check_on_cpu, world_size=2, timeout_s=300)[0]
    assert ok, table
    assert "| 3 | none | aot_eager |" in table
    assert "| 3 | full | aot_eager |" in table
