"""Low-bit training compute (issue 33) through the trainer on every layout: tensor
parallelism (tp 2, with and without sequence parallelism), pipeline stages (pp 2, 1F1B over
4 micro-batches, the pipeline's accumulation, with and without recompute), expert
parallelism (ep 2 on debug-moe), activation checkpointing (full and selective),
``torch.compile`` of the blocks (``aot_eager``, with and without recompute) and ZeRO stages
0-3, in fp32 and with the bf16 compute-dtype gather; with fp8_tensorwise, fp8_rowwise,
fp8_blockwise, mxfp8 and nvfp4 (fp8_rowwise_gw_hp on the TP and pipeline rows), 3 steps each
and a validation pass after the last.

What each layout must give, against the low-bit run that casts the same tokens (a data
rank's micro-batch is the one-process reference's accumulation micro-batch):

* exactly the same losses and validation losses (``EXACT``): ZeRO stages 0, 1 and 2 against
  stage 3 (the same casts of the same gathered weights; two ranks' sums in one order), full
  and selective activation checkpointing against none (the recompute casts the same
  tensors: [Note: non-finite flags under recompute] in lowbit/linear.py), a pipeline with
  recompute against without, sequence parallelism against tensor parallelism without it
  (the low-bit layers cast the same gathered input), stage 0 against stage 3 in bf16; and
  the same gradient norms, except at stage 0, whose norm sums whole gradients where the
  others sum their shards' (apart in the last bits);
* within 1e-5 relative (``NEAR``: fp32 sums in another order): two data ranks against one
  process accumulating their micro-batches, the pipeline's 4 micro-batches against one
  process accumulating them (the losses are in fact bitwise equal), compiled blocks against
  eager ones;
* close, not equal, where the quantisation groups differ (``GAP``, the measured gaps in
  the comments): under tensor parallelism each rank casts its *shard* of a weight (and,
  row-parallel, of the input) with scales of its own ([Note: low-bit under TP] in
  parallel/tensor/layers.py), so a tensor scale (tensorwise, NVFP4's outer one), a row's
  along a split contraction dim or a 128 x 128 block covers fewer elements than the
  reference's; a pipeline's micro-batch (or an accumulation micro-batch) is cast on its
  own, so against one process taking the 4 sequences at once (``one_batch4``) every
  activation and gradient scale covers a quarter of the tokens; under expert parallelism
  an expert's activation scales cover the rows routed to it from both ranks' tokens, where
  the ep 1 run's (``moe_dp2``) cover one rank's, and the dense layers' cover one rank's
  tokens where the one-process run's (``moe_one``, the same global batch and balance
  statistics) cover all of them. The first step's loss and
  gradient norm (the forward and backward alone) are held separately from the later steps,
  where Adam's first update (a sign per element) amplifies any difference.

No clipping (``optim.grad_clip 0``): the clip coefficient reads the gradient norm, whose
fp32 sum over shards or stages differs from one process's in the last bit, and the codes
turn such a bit into visible loss differences (4-bit ones most). Every recipe compiles in
one process (``compile_one``, against ``one``); on two ranks one recipe compiles without
recompute and two with it, around the sharded engine. The one-process runs go to two
launches and the two-rank runs to a third, all three at once (about 2 minutes on 2 cores),
with a new Dynamo cache for each compiled run, as a new process would have (every recipe
compiles its own graphs).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shardwise.testing.dist import run_ranks
from shardwise.testing.trainer import logged
from shardwise.train.config import load_config
from shardwise.train.preflight import preflight

# dim 128 and 4 key/value heads: every linear takes every recipe (blockwise's 128), also
# each tp 2 shard's 64 and 128 features.
TINY = {"model.dim": "128", "model.n_layers": "2", "model.n_heads": "4",
        "model.n_kv_heads": "4", "model.ffn_dim": "256", "data.seq_len": "32",
        "train.batch_size": "2", "train.eval_batches": "1", "data.max_bytes": "200000",
        "log.progress": "false", "log.plot": "false", "train.steps": "3",
        "train.eval_interval": "0", "checkpoint.keep_last": "0", "optim.warmup_steps": "1",
        "optim.grad_clip": "0"}
MOE = {"model.name": "debug-moe", "model.num_experts": "4", "model.moe_ffn_dim": "128"}
PP = {"parallel.pp": "2", "parallel.pp_schedule": "1f1b", "parallel.pp_microbatches": "4",
      "train.batch_size": "4"}
TP = {"parallel.tp": "2", "parallel.sequence_parallel": "false"}
COMPILE = {"train.compile": "true", "train.compile_backend": "aot_eager"}
BF16 = {"precision.param_dtype": "bf16"}

FIVE = ("fp8_tensorwise", "fp8_rowwise", "fp8_blockwise", "mxfp8", "nvfp4")
TWO = ("fp8_tensorwise", "mxfp8")
# layout -> (world size, overrides, recipes); "bf16" runs no low-bit matmul.
LAYOUTS = {
    # one-process references: the same micro-batches as the layouts that name them
    "one": (1, {}, (*FIVE, "fp8_rowwise_gw_hp", "bf16")),
    "one_accum4": (1, {"train.batch_size": "1", "train.grad_accum": "4"},
                   (*FIVE, "fp8_rowwise_gw_hp", "bf16")),
    "one_accum2": (1, {"train.grad_accum": "2"}, (*FIVE, "bf16")),
    "one_batch4": (1, {"train.batch_size": "4"}, (*FIVE, "bf16")),
    "moe_one": (1, {**MOE, "train.batch_size": "4"}, (*FIVE, "bf16")),
    # two ranks
    "tp2": (2, TP, (*FIVE, "fp8_rowwise_gw_hp", "bf16")),
    "tp2_sp": (2, {"parallel.tp": "2", "parallel.sequence_parallel": "true"}, FIVE),
    "tp2_sp_selective": (2, {"parallel.tp": "2", "train.activation_checkpoint": "selective"},
                         TWO),
    "pp2": (2, PP, (*FIVE, "fp8_rowwise_gw_hp", "bf16")),
    "pp2_full": (2, {**PP, "train.activation_checkpoint": "full"}, TWO),
    "ep2": (2, {**MOE, "parallel.ep": "2"}, (*FIVE, "bf16")),
    "moe_dp2": (2, MOE, (*FIVE, "bf16")),
    "stage0": (2, {"parallel.stage": "0"}, FIVE),
    "stage1": (2, {"parallel.stage": "1"}, TWO),
    "stage2": (2, {"parallel.stage": "2"}, TWO),
    "stage3": (2, {"parallel.stage": "3"}, (*FIVE, "bf16")),
    "full": (2, {"train.activation_checkpoint": "full"}, FIVE),
    "selective": (2, {"train.activation_checkpoint": "selective"}, FIVE),
    # every recipe compiled in one process (compiling costs the same on each rank, so one
    # is enough for what the recipe's graphs are); the sharded engine around compiled
    # blocks on two ranks, with and without recompute
    "compile_one": (1, COMPILE, FIVE),
    "compile": (2, COMPILE, ("fp8_tensorwise",)),
    "compile_full": (2, {**COMPILE, "train.activation_checkpoint": "full"}, TWO),
    "stage0_bf16": (2, {**BF16, "parallel.stage": "0"}, TWO),
    "stage3_bf16": (2, {**BF16, "parallel.stage": "3"}, TWO),
}
KEYS = ("loss", "grad_norm", "val_loss")
# layout -> the layout it must log bitwise the numbers of
EXACT = {"stage0": "stage3", "stage1": "stage3", "stage2": "stage3", "full": "stage3",
         "selective": "stage3", "pp2_full": "pp2", "tp2_sp": "tp2",
         "tp2_sp_selective": "tp2", "stage0_bf16": "stage3_bf16"}
# layout -> (the layout it must match within 1e-5 relative, the keys compared): the
# validation losses only where both evaluate the same sequences (the same data ranks and
# batch size)
NEAR = {"stage3": ("one_accum2", ("loss", "grad_norm")),
        "pp2": ("one_accum4", ("loss", "grad_norm")),
        "compile_one": ("one", KEYS), "compile": ("stage3", KEYS),
        "compile_full": ("stage3", KEYS)}
# (layout, its reference) -> the keys compared after the first step, and per recipe the
# relative tolerances of the first step's loss and gradient norm, and of every compared
# value: the gaps measured on this grid (in brackets, first / every) with a margin.
GAP = {
    ("tp2", "one"): (("loss", "val_loss"), {
        "fp8_tensorwise": (1.5e-2, 5e-3),  # 6.2e-3 / 1.9e-3
        "fp8_rowwise": (5e-4, 3e-3),  # 1.5e-4 / 1.0e-3
        "fp8_rowwise_gw_hp": (5e-4, 5e-4),  # 1.2e-4 / 1.7e-4
        "fp8_blockwise": (1e-3, 3e-3),  # 3.6e-4 / 1.1e-3
        "mxfp8": (1e-5, 1e-4),  # 0 / 1.1e-5: 1 x 32 tiles never straddle a tp 2 shard here
        "nvfp4": (1e-2, 1.5e-2),  # 2.4e-3 / 5.8e-3
        "bf16": (1e-6, 1e-6)}),  # 1.7e-7 / 1.7e-7
    ("pp2", "one_batch4"): (("loss", "val_loss"), {
        "fp8_tensorwise": (1.5e-2, 3e-3),  # 4.5e-3 / 1.1e-3
        "fp8_rowwise": (1e-4, 1e-3),  # 8.8e-8 / 1.1e-7
        "fp8_blockwise": (5e-4, 3e-3),  # 9.1e-5 / 1.1e-3
        "mxfp8": (1e-4, 5e-4),  # 8.6e-8 / 3.1e-5: a 1 x 32 tile along the tokens is
        # one 32-token sequence, the same in a micro-batch of one
        "nvfp4": (4e-2, 5e-3),  # 1.5e-2 / 1.4e-3
        "bf16": (1e-6, 1e-6)}),  # 0 / 1.1e-7
    ("ep2", "moe_dp2"): (("loss", "val_loss"), {
        "fp8_tensorwise": (3e-3, 1e-2),  # 9.3e-4 / 3.4e-3
        "fp8_rowwise": (1e-4, 1e-3),  # 0 / 0: power-of-two row scales, the same here
        "fp8_blockwise": (1e-4, 1e-3),  # 3.3e-6 / 1.3e-4
        "mxfp8": (1e-4, 1.5e-3),  # 3.9e-6 / 4.8e-4
        "nvfp4": (1e-2, 1e-2),  # 4.3e-3 / 2.0e-3
        "bf16": (1e-6, 1e-6)}),  # 0 / 5.4e-8
    ("ep2", "moe_one"): (("loss",), {
        "fp8_tensorwise": (3e-3, 3e-3),  # 9.5e-4 / 1.1e-3
        "fp8_rowwise": (1e-4, 1e-3),  # 1.7e-7 / 5.2e-8
        "fp8_blockwise": (1e-3, 2e-3),  # 3.3e-4 / 6.2e-4
        "mxfp8": (1e-4, 5e-4),  # 5.0e-7 / 5.6e-5
        "nvfp4": (1.5e-2, 1e-2),  # 5.4e-3 / 3.0e-3
        "bf16": (1e-6, 1e-6)}),  # 8.3e-8 / 4.7e-8
}


def _train_all(runs: list) -> None:
    import torch

    from shardwise.train.trainer import build_env, train

    env = build_env(runs[0][0])
    for cfg, data in runs:
        if cfg.train.compile:
            torch._dynamo.reset()  # each recipe compiles its own graphs
        train(cfg, data, env)


def _name(layout: str, recipe: str) -> str:
    return f"{layout}-{recipe}"


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lowbit")
    by_world: dict[int, list] = {}
    for layout, (world, over, recipes) in LAYOUTS.items():
        for recipe in recipes:
            cfg = load_config(None, {**TINY, **over, "precision.matmul": recipe,
                                     "log.dir": str(root / _name(layout, recipe))})
            by_world.setdefault(world, []).append(preflight(cfg, world_size=world))
    # Three launches at once, one core's work each: the one-process runs split in two
    # halves (a compiled run in each as often as the other), and the two-rank runs.
    ones = sorted(by_world[1], key=lambda run: run[0].train.compile)
    launches = [(ones[0::2], 1), (ones[1::2], 1), (by_world[2], 2)]
    with ThreadPoolExecutor(len(launches)) as pool:
        done = [pool.submit(run_ranks, _train_all, world, args=(runs,), timeout_s=1200,
                            threads=1, env={"OMP_NUM_THREADS": "1"})
                for runs, world in launches]
        for future in done:
            future.result()
    return root


def _numbers(root: Path, layout: str, recipe: str) -> dict[tuple[int, str], float]:
    return {(r["step"], key): r[key] for key in KEYS
            for r in logged(root / _name(layout, recipe), key)}


def _cases(table: dict) -> list[tuple[str, str]]:
    return [(layout, recipe) for layout in table for recipe in LAYOUTS[layout][2]]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("layout, recipe", _cases(LAYOUTS))
def test_every_run_is_finite_and_low_bit(grid, layout, recipe):
    got = _numbers(grid, layout, recipe)
    assert sorted({s for s, k in got if k == "loss"}) == [1, 2, 3]
    assert got.keys() >= {(3, "val_loss")}
    assert all(math.isfinite(v) for v in got.values()), got
    if recipe != "bf16" and layout == "one":  # the recipe changes the numbers
        assert got != _numbers(grid, "one", "bf16")


@pytest.mark.parametrize("layout, recipe", _cases(EXACT))
def test_layouts_that_cast_the_same_tensors_are_bitwise_equal(grid, layout, recipe):
    got, want = _numbers(grid, layout, recipe), _numbers(grid, EXACT[layout], recipe)
    assert got.keys() == want.keys()
    assert {k: v for k, v in got.items() if k[1] != "grad_norm"} == \
        {k: v for k, v in want.items() if k[1] != "grad_norm"}
    norm_tol = 3e-6 if layout.startswith("stage0") else 0.0  # whole gradients' norm
    assert all(_rel(got[k], want[k]) <= norm_tol for k in want if k[1] == "grad_norm"), \
        (got, want)


@pytest.mark.parametrize("layout, recipe", _cases(NEAR))
def test_the_same_quantisation_groups_give_the_one_process_numbers(grid, layout, recipe):
    ref, keys = NEAR[layout]
    got, want = _numbers(grid, layout, recipe), _numbers(grid, ref, recipe)
    compared = [k for k in want if k[1] in keys]
    assert compared and all(_rel(got[k], want[k]) <= 1e-5 for k in compared), (got, want)


@pytest.mark.parametrize("layout, ref, recipe", [(*pair, r) for pair, (_, tol) in GAP.items()
                                                 for r in tol])
def test_per_shard_and_per_expert_scales_stay_close(grid, layout, ref, recipe):
    keys, tols = GAP[(layout, ref)]
    first, every = tols[recipe]
    got, want = _numbers(grid, layout, recipe), _numbers(grid, ref, recipe)
    for key in ((1, "loss"), (1, "grad_norm")):
        assert _rel(got[key], want[key]) <= first, (key, got[key], want[key])
    for key in [k for k in want if k[1] in keys]:
        assert _rel(got[key], want[key]) <= every, (key, got[key], want[key])
