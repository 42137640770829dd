"""ZeRO-3 all-gathers of fp8_tensorwise weights in fp8 (issue 33; [Note: fp8 weight gathers],
[Note: scaled gathers in the engine]): bitwise the compute-dtype gather's losses and weights
at world sizes 2 and 3 with uneven shards, half its bytes for the converted weights plus one
amax all-reduce per step for all units, the gathered codes used by forward and backward
with no second cast, prefetch and reshard_after_forward changing no number, and the
trainer's flags.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise import CommQuant, MixedPrecision
from shardwise.parallel.lowbit import LowBitState, lowbit_modules, nonfinite_amax_layers
from shardwise.shard.scaled_gather import CODES_ATTR
from shardwise.testing import run_ranks
from shardwise.testing.parity import ParityConfig, make_batches, sharded_run
from shardwise.testing.trainer import cli_args, logged, refused, train_runs
from shardwise.train.config import load_config
from shardwise.train.preflight import preflight

DIM, HIDDEN, VOCAB, SEQ, BATCH, STEPS = 32, 80, 67, 8, 6, 4
TAG = 16  # identity trailer bytes per rank and gather ([Note: gather identity])


class Block(nn.Module):
    """Two convertible linears ((80, 32) and (32, 80): uneven over 3 ranks) and a 5-row
    parameter (uneven over 2 and 3) that stays high precision."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x)))) * self.gain.mean()


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)  # 67 rows: uneven over 2 and 3
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def _build(lend: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = shardwise.apply_low_precision(Tiny(), "fp8_tensorwise")
    if not lend:  # the layers cast a blockwise-decoded weight: the path of other recipes
        for m in model.modules():
            m.__dict__.pop(CODES_ATTR, None)
    return model


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: the parity config, the weights' wire, the compute dtype."""

    cfg: ParityConfig
    fp8: bool = True
    lend: bool = True
    dtype: str = "bf16"

    @property
    def name(self) -> str:
        wire = ("fp8" if self.lend else "blockwise") if self.fp8 else "compute"
        return f"{self.cfg.name}-{self.dtype}-{wire}"

    @property
    def baseline(self) -> Run:
        """The compute-dtype gather this run must equal bitwise."""
        cfg = dataclasses.replace(self.cfg, reshard_after_forward=True, prefetch=1)
        return Run(cfg, fp8=False, dtype=self.dtype)


def _count_offers(counts: dict) -> None:
    """Count the low-bit layers' weight casts served by an offer (hit) or not (miss)."""
    plain = LowBitState.offered

    def offered(self, weight):
        codes = plain(self, weight)
        counts["hit" if codes is not None else "miss"] += 1
        return codes
    LowBitState.offered = offered
    counts["restore"] = plain


def _offers(model: nn.Module) -> int:
    """How many converted layers hold an offer now."""
    return sum(s._offer is not None for _, _, s in lowbit_modules(model))


def _loss(model: nn.Module, tokens: torch.Tensor, after_forward: list) -> torch.Tensor:
    logits = model(tokens[:, :-1])                                   # (B, T, V)
    after_forward.append(_offers(model))
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _snapshot(per_step: list) -> None:
    s = shardwise.comm_stats()
    amax = s.label("amax_all_reduce")
    per_step.append((s["all_gather"].calls, s["all_gather"].bytes_sent, amax.calls,
                     amax.bytes_sent))


def _train(run: Run) -> dict:
    batches = make_batches(0, STEPS, run.cfg.accum, BATCH, SEQ, VOCAB)
    mp = MixedPrecision(param_dtype=torch.bfloat16) if run.dtype == "bf16" else None
    counts = {"hit": 0, "miss": 0}
    per_step, after_forward, after_step = [], [], []

    def step_done(model: nn.Module) -> None:
        _snapshot(per_step)
        after_step.append(_offers(model))
    shardwise.reset_comm_stats()
    _snapshot(per_step)
    _count_offers(counts)
    try:
        res = sharded_run(lambda: _build(run.lend), batches, run.cfg, wrap={Block},
                          after_step=step_done,
                          loss_fn=lambda m, t: _loss(m, t, after_forward),
                          shard_kwargs=dict(mixed_precision=mp, comm=CommQuant(weights="fp8")
                                            if run.fp8 else None))
    finally:
        LowBitState.offered = counts.pop("restore")
    steps = [tuple(b - a for a, b in zip(x, y)) for x, y in zip(per_step, per_step[1:])]
    return dict(losses=res.losses, state=res.state, offers=counts, steps=steps,
                held=(after_forward, after_step))


def _nonfinite() -> tuple[list[str], bool]:
    """A nan in rank 1's rows of one weight: every rank's agreed multiplier is nan."""
    model = shardwise.shard(_build(), stage=3, wrap={Block}, comm=CommQuant(weights="fp8"),
                            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    if dist.get_rank() == 1:
        with torch.no_grad():
            model.layers[1].up.weight[0, 3] = float("nan")
    tokens = make_batches(1, 1, 1, 2, SEQ, VOCAB)[0, 0]
    loss = _loss(model, tokens, [])
    return nonfinite_amax_layers(model), bool(loss.isnan())


def _grid(runs: list[Run], nonfinite: bool) -> dict[str, dict]:
    out = {run.name: _train(run) for run in runs}
    out["nonfinite"] = _nonfinite() if nonfinite else None
    return out


def _padded(shape: tuple[int, ...], n: int) -> int:
    """Elements of one rank's padded chunk ([Note: unit layout])."""
    return -(-shape[0] // n) * math.prod(shape[1:])


def _expected_step(run: Run, n: int) -> tuple[int, int, int, int]:
    """(gathers, gather bytes sent, amax all-reduces, their bytes) of one step, from the
    shapes: a block's row is its plain parameters in the compute dtype, its two linear
    weights in 1-byte codes (fp8) or the compute dtype, and the trailer."""
    item = 2 if run.dtype == "bf16" else 4
    block = [(DIM,), (DIM,), (HIDDEN, DIM), (HIDDEN,), (DIM, HIDDEN), (5,)]
    coded = _padded((HIDDEN, DIM), n) + _padded((DIM, HIDDEN), n)
    root = sum(_padded(s, n) for s in [(VOCAB, DIM), (VOCAB, DIM), (VOCAB,)])
    per_block = sum(_padded(s, n) for s in block)
    code_bytes = coded if run.fp8 else coded * item       # 1 byte a code: half of bf16
    block_row = (per_block - coded) * item + code_bytes + TAG
    accum, block_gathers = run.cfg.accum, 2 if run.cfg.reshard_after_forward else 1
    if run.cfg.stage < 3:  # gathered once a step, kept through backward and micro-batches
        accum, block_gathers = 1, 1
    gathers = accum * (1 + 2 * block_gathers)
    sent = (n - 1) * accum * ((root * item + TAG) + 2 * block_gathers * block_row)
    weights = 4  # two blocks, two linears each: 4 bytes of amax apiece
    amax = (1, 2 * (n - 1) * 4 * weights // n) if run.fp8 else (0, 0)
    return gathers, sent, *amax


def _check_grid(runs: list[Run], results: list[dict], n: int) -> None:
    got = results[0]
    for run in runs:
        mine = got[run.name]
        assert all(math.isfinite(x) for x in mine["losses"]), run.name
        micro = run.cfg.accum * STEPS * 4 * 2  # four weights, forward and backward
        if run.fp8 and run.lend:  # every cast of a converted weight read the gathered codes
            assert mine["offers"] == {"hit": micro, "miss": 0}, (run.name, mine["offers"])
        else:
            assert mine["offers"] == {"hit": 0, "miss": micro}, (run.name, mine["offers"])
        if run.lend:
            assert mine["steps"] == [_expected_step(run, n)] * STEPS, run.name
        # offers live while the unit is gathered: withdrawn when it reshards (stage 3: after
        # forward unless kept, after backward); a stage-2 unit stays gathered until its
        # next gather, which withdraws them first
        kept = 4 if run.fp8 and run.lend else 0
        raf = run.cfg.stage == 3 and run.cfg.reshard_after_forward
        assert mine["held"] == ([0 if raf else kept] * STEPS * run.cfg.accum,
                                [0 if run.cfg.stage == 3 else kept] * STEPS), run.name
        base = got[run.baseline.name]
        same = mine["losses"] == base["losses"] and all(
            torch.equal(mine["state"][k], v) for k, v in base["state"].items())
        assert same == run.lend, (run.name, mine["losses"], base["losses"])


RAF_OFF = ParityConfig(stage=3, steps=STEPS, optimizer="adamw", reshard_after_forward=False)
BASE = ParityConfig(stage=3, steps=STEPS, optimizer="adamw")
GRIDS = {
    2: [Run(BASE, fp8=False), Run(BASE), Run(RAF_OFF),
        Run(dataclasses.replace(BASE, prefetch=0)), Run(dataclasses.replace(BASE, prefetch=2)),
        Run(dataclasses.replace(BASE, accum=2), fp8=False),
        Run(dataclasses.replace(BASE, accum=2)),
        Run(BASE, fp8=False, dtype="fp32"), Run(BASE, dtype="fp32"),
        Run(dataclasses.replace(BASE, stage=2), fp8=False),
        Run(dataclasses.replace(BASE, stage=2)),
        Run(BASE, lend=False)],
    3: [Run(BASE, fp8=False), Run(BASE), Run(RAF_OFF),
        Run(dataclasses.replace(BASE, prefetch=0)), Run(BASE, lend=False)],
}


@pytest.mark.parametrize("world", [2, 3])
def test_fp8_gathers_are_bitwise_the_compute_dtype_gathers_at_half_the_bytes(world):
    runs = GRIDS[world]
    results = run_ranks(_grid, world, args=(runs, world == 2), timeout_s=600)
    _check_grid(runs, results, world)
    if world == 2:  # every rank flags the layer, the loss is nan on every rank
        assert [r["nonfinite"] for r in results] == [(["layers.1.up", "layers.1.down"], True)] * 2


def test_hierarchy_with_fp8_codes_is_refused_before_any_collective():
    # no process group exists here: the refusal comes before the engine touches one
    with pytest.raises(ValueError, match="comm.hierarchy=2 with comm.weights='fp8': module "
                                         "'layers.0.up' is gathered as fp8 codes"):
        shardwise.shard(_build(), stage=3, wrap={Block},
                        comm=CommQuant(weights="fp8", hierarchy=2))


TINY = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
        "data.seq_len": "32", "train.batch_size": "2", "train.eval_batches": "1",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false",
        "train.steps": "4", "train.eval_interval": "0", "checkpoint.keep_last": "0",
        "optim.warmup_steps": "1", "train.log_interval": "1"}
FP8 = {"parallel.stage": "3", "comm.weights": "fp8", "precision.matmul": "fp8_tensorwise",
       "precision.param_dtype": "bf16"}


def _train_counting(runs: list) -> int:
    """Train ``(cfg, data)`` runs in turn on one process group; amax all-reduces counted."""
    shardwise.reset_comm_stats()
    train_runs(runs)
    return shardwise.comm_stats().label("amax_all_reduce").calls


def test_the_trainer_gathers_fp8_tensorwise_weights_in_fp8(tmp_path):
    cfg = load_config(None, {**TINY, **FP8, "log.dir": str(tmp_path)})
    cfg, data = preflight(cfg, world_size=2)
    # one amax all-reduce per step, and one for the final validation (after the last
    # update: new shards): the flags reached the engine's fp8 gathers
    assert run_ranks(_train_counting, 2, args=([(cfg, data)],), timeout_s=300) == [5, 5]
    losses = [r["loss"] for r in logged(tmp_path)]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses


def test_pipeline_pieces_gather_fp8_codes_bitwise(tmp_path):
    # pp 2 x dp_shard 2: every piece is a shard call of its own; the embedding and head pieces
    # lend no codes and still travel unquantised (CommQuant.rest_unquantised, set by the
    # trainer), so the run is bitwise the compute-dtype gather's
    runs = [preflight(load_config(None, {**TINY, **FP8, **wire, "parallel.pp": "2",
                                         "parallel.pp_microbatches": "2",
                                         "log.dir": str(tmp_path / name)}), world_size=4)
            for name, wire in (("fp", {"comm.weights": "fp"}), ("fp8", {}))]
    # one piece with codes per rank: one amax all-reduce a step, and the final validation's
    assert run_ranks(_train_counting, 4, args=(runs,), timeout_s=600) == [5] * 4
    fp, fp8 = ([r["loss"] for r in logged(tmp_path / name)] for name in ("fp", "fp8"))
    assert fp8 == fp and len(fp) == 4, (fp8, fp)


def test_the_start_line_says_the_converted_weights_travel_as_codes():
    from shardwise.train.trainer import describe_features

    assert "communication weights fp8 (fp8_tensorwise layers as their matmul's codes, the rest " \
           "unquantised), gradients fp" in describe_features(load_config(None, {**TINY, **FP8}))
    rowwise = load_config(None, {**TINY, **FP8, "precision.matmul": "fp8_rowwise"})
    assert "communication weights fp8, gradients fp" in describe_features(rowwise)


def test_the_trainer_refuses_hierarchy_with_fp8_codes(capsys, tmp_path):
    message = refused(capsys, *cli_args({**TINY, **FP8, "comm.hierarchy": "2",
                                         "log.dir": str(tmp_path)}), "--nproc", "4")
    assert message.startswith("comm.hierarchy=2 with comm.weights='fp8' and precision.matmul="
                              "'fp8_tensorwise': the secondary partition keeps compute-dtype "
                              "rows, not the fp8 codes"), message
