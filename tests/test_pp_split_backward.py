"""The zero-bubble split backward ([Note: split backward] in split_backward.py): the input
pass (I) and the weight pass (W) give the unsplit backward's gradients bit for bit, and
together run the unsplit backward's matrix multiplies once each, not more.

The hard cases: a weight used twice in a row, a custom autograd.Function that consumes a
weight, an output that does not depend on the stage input, a checkpointed block (not
split), a leaf that is not a parameter, and every zero-bubble schedule in the executor
against its non-split twin (op counts per step).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from shardwise.models import LlamaConfig, build_model
from shardwise.parallel.pipeline import PipelineExecutor, build_schedule, split_stages
from shardwise.parallel.pipeline.split_backward import input_pass, weight_pass

CFG = LlamaConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32,
                  max_seq_len=16)
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm"}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops (by packet name) run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def gemms(self) -> int:
        return sum(n for name, n in self.counts.items() if name in _GEMMS)


def _blocks():
    model = build_model(CFG, seed=0)
    cos, sin = model.rope(8)

    def stage(x):
        for block in model.layers:
            x = block(x, cos, sin)  # (B, T, C)
        return x
    return model.layers, stage


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 8, CFG.dim, generator=g), torch.randn(2, 8, CFG.dim, generator=g)


def _unsplit(params, fn, x0, g):
    x = x0.clone().requires_grad_()
    counter = OpCounter()
    out = fn(x)
    with counter:
        torch.autograd.backward(out, g)
    grads = [p.grad.clone() if p.grad is not None else None for p in params]
    for p in params:
        p.grad = None
    return x.grad, grads, counter


def _split(params, fn, x0, g, split=True):
    x = x0.clone().requires_grad_()
    out = fn(x)
    counter_i, counter_w = OpCounter(), OpCounter()
    with counter_i:
        deferred = input_pass([out], [g], x, split=split)
    x_grad = x.grad.clone()
    after_i = [p.grad is None for p in params]
    with counter_w:
        weight_pass(deferred, [list(params)])
    grads = [p.grad.clone() if p.grad is not None else None for p in params]
    for p in params:
        p.grad = None
    return x_grad, grads, counter_i, counter_w, after_i


def _same(a, b):
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


def test_llama_blocks_split_bitwise_with_each_gemm_once():
    layers, stage = _blocks()
    params = list(layers.parameters())
    x0, g = _inputs()
    ref_x, ref, ref_ops = _unsplit(params, stage, x0, g)
    got_x, got, ops_i, ops_w, untouched = _split(params, stage, x0, g)
    assert all(untouched)  # the I pass accumulates no weight gradient
    assert torch.equal(got_x, ref_x)
    assert _same(got, ref)
    # 7 linears per block: B runs 2 GEMMs per linear (input and weight gradients) plus the
    # attention's; I runs the input halves and W exactly the weight halves.
    assert ops_i.gemms() + ops_w.gemms() == ref_ops.gemms()
    assert ops_w.gemms() == 7 * CFG.n_layers
    assert ops_w.counts["_scaled_dot_product_flash_attention_for_cpu_backward"] == 0


class Twice(nn.Module):
    """One linear applied twice in a row: its weight's gradient has two contributions, one
    of them reachable from the other's node through the input path."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(CFG.dim, CFG.dim)
        self.other = nn.Linear(CFG.dim, CFG.dim, bias=False)

    def forward(self, x):
        return self.other(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


class _MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.flatten(0, -2).t() @ grad.flatten(0, -2)


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(CFG.dim, CFG.dim) / 8)
        self.lin = nn.Linear(CFG.dim, CFG.dim)

    def forward(self, x):
        return self.lin(_MatMul.apply(torch.relu(x), self.w))


class Detached(nn.Module):
    """The output does not depend on the input at all."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(CFG.dim))

    def forward(self, x):
        return torch.zeros_like(x).detach() + self.bias * 2


class WithLeaf(nn.Module):
    """A non-parameter leaf requiring grad takes part (an attribute tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(CFG.dim, CFG.dim)
        self.scale = torch.full((CFG.dim,), 0.5, requires_grad=True)

    def forward(self, x):
        return self.lin(x) * self.scale


@pytest.mark.parametrize("module", [Twice, Custom, Detached, WithLeaf])
def test_hard_graphs_split_exactly(module):
    torch.manual_seed(0)
    m = module()
    params = list(m.parameters()) + ([m.scale] if isinstance(m, WithLeaf) else [])
    x0, g = _inputs()
    ref_x, ref, _ = _unsplit(params, m, x0, g)
    if ref_x is None:
        ref_x = torch.zeros_like(x0)
    x = x0.clone().requires_grad_()
    deferred = input_pass([m(x)], [g], x)
    assert torch.equal(x.grad, ref_x)
    weight_pass(deferred, [params])
    assert _same([p.grad for p in params], ref)


def test_checkpointed_blocks_are_not_split_and_stay_exact():
    layers, _ = _blocks()
    model = build_model(CFG, seed=0)
    cos, sin = model.rope(8)

    def stage(x):
        for block in layers:
            x = checkpoint(block, x, cos, sin, use_reentrant=False)
        return x
    params = list(layers.parameters())
    x0, g = _inputs()
    ref_x, ref, _ = _unsplit(params, stage, x0, g)
    got_x, got, _, _, _ = _split(params, stage, x0, g, split=False)
    assert torch.equal(got_x, ref_x) and _same(got, ref)


PAIRS = [("zbv", "interleaved_1f1b"), ("zb1", "1f1b"), ("dualpipev", "interleaved_1f1b")]


def _step_counts(pairs, pp: int) -> dict:
    """Per schedule: (loss, gradients by name, GEMMs run by this rank) of one step."""
    from shardwise.parallel.pipeline import pipeline_mesh
    torch.set_num_threads(1)
    mesh = pipeline_mesh(pp) if pp > 1 else None
    tokens = torch.randint(0, CFG.vocab_size, (4, 9), generator=torch.Generator().manual_seed(3))
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = {}
    for split_name, whole_name in pairs:
        virtual = build_schedule(split_name, pp, 4).virtual
        for name in (split_name, whole_name):
            schedule = build_schedule(name, pp, 4, virtual)
            part = split_stages(build_model(CFG, seed=0), mesh, schedule.virtual,
                                placement=schedule.placement)
            counter = OpCounter()
            with counter:
                loss = PipelineExecutor(part, schedule).step(x, y)
            out[name] = (loss, {n: p.grad for n, p in part.named_parameters()},
                         counter.gemms(), schedule.placement)
    return out


def _check_pairs(per_rank: list[dict], pairs) -> None:
    """The twins' losses and gradients agree; their GEMMs too, per rank when both place the
    stages alike, else over all ranks (a V puts the head on rank 0, a loop on the last)."""
    for split_name, whole_name in pairs:
        same_place = per_rank[0][split_name][3] == per_rank[0][whole_name][3]
        for r in per_rank:
            loss_a, grads_a, gemms_a, _ = r[split_name]
            loss_b, grads_b, gemms_b, _ = r[whole_name]
            if same_place:
                assert gemms_a == gemms_b, (split_name, gemms_a, whole_name, gemms_b)
            torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=0)
        totals = [sum(r[name][2] for r in per_rank) for name in (split_name, whole_name)]
        assert totals[0] == totals[1], (split_name, whole_name, totals)
        grads_a = {n: g for r in per_rank for n, g in r[split_name][1].items()}
        grads_b = {n: g for r in per_rank for n, g in r[whole_name][1].items()}
        assert set(grads_a) == set(grads_b)
        for n in grads_b:
            torch.testing.assert_close(grads_a[n], grads_b[n], rtol=1e-6, atol=1e-7, msg=n)


def test_zero_bubble_step_on_one_rank_runs_the_gemms_of_its_unsplit_twin():
    """Every stage on one rank (pp 1, two virtual stages): ZB-V's step runs exactly as many
    matrix multiplies as interleaved 1F1B's over the same stages, same gradients."""
    pairs = PAIRS[:1]
    _check_pairs([_step_counts(pairs, 1)], pairs)


def test_zero_bubble_steps_on_two_ranks_run_the_gemms_of_their_unsplit_twins():
    """pp 2: per rank, each zero-bubble schedule's step runs as many matrix multiplies as a
    schedule without I / W over the same stages (the W passes recompute nothing)."""
    from shardwise.testing import run_ranks
    _check_pairs(run_ranks(_step_counts, 2, args=(PAIRS, 2), timeout_s=120, threads=1), PAIRS)


def _engine_pairs() -> dict:
    """ZB-H1 against 1F1B under the ZeRO engine with bf16 compute: (loss, gradients) of one
    step per (ZeRO stage, keep_gathered)."""
    import shardwise
    from shardwise.models import init_module_weights
    from shardwise.parallel.pipeline import pipeline_mesh, shard_stages
    torch.set_num_threads(1)
    tokens = torch.randint(0, CFG.vocab_size, (8, 9), generator=torch.Generator().manual_seed(5))
    out = {}
    for stage in (1, 3):
        for keep in (True, False):
            for name in ("1f1b", "zb1"):
                schedule = build_schedule(name, 2, 4)
                part = split_stages(build_model(CFG, device="meta"), pipeline_mesh(2), 1,
                                    placement=schedule.placement)
                torch.manual_seed(0)
                shard_stages(part, stage=stage, init_weights=init_module_weights,
                             mixed_precision=shardwise.MixedPrecision(param_dtype="bf16"))
                loss = PipelineExecutor(part, schedule, keep_gathered=keep).step(
                    tokens[:, :-1], tokens[:, 1:])
                out[(stage, keep, name)] = (loss, {n: p.grad.clone() for n, p in
                                                   part.named_parameters()})
    return out


def test_zero_bubble_under_the_engine_matches_1f1b_bitwise():
    """bf16 compute, ZeRO 1 and 3, stage kept gathered or re-gathered per micro-batch: the
    split backward's sharded gradients equal 1F1B's bit for bit on both pipeline ranks."""
    from shardwise.testing import run_ranks
    for r in run_ranks(_engine_pairs, 2, timeout_s=120, threads=1):
        for stage in (1, 3):
            for keep in (True, False):
                loss_a, grads_a = r[(stage, keep, "1f1b")]
                loss_b, grads_b = r[(stage, keep, "zb1")]
                assert torch.equal(loss_a, loss_b), (stage, keep)
                assert set(grads_a) == set(grads_b)
                for n in grads_a:
                    assert torch.equal(grads_a[n], grads_b[n]), (stage, keep, n)
