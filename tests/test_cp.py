"""Context parallelism: layouts, balance, bytes against their closed forms, compile without
graph breaks, and refusals (issue 32). Parity with one process: tests/test_cp_parity.py."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.models import build_model, get_model_config
from shardwise.models.layers import document_ids
from shardwise.parallel.context import (attention_entries, bytes_per_layer, check_sequence_length,
                                        rank_positions, shard_sequence, ulysses_degree,
                                        unshard_sequence)
from shardwise.testing import run_ranks

SMALL = dict(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
             max_seq_len=512)


@pytest.mark.parametrize("cp", [2, 3, 4, 5])
@pytest.mark.parametrize("lb", ["zigzag", "none"])
def test_layout_round_trips_and_covers_every_position_once(cp, lb):
    seq = 2 * cp * 3
    x = torch.arange(2 * seq).view(2, seq)
    parts = [shard_sequence(x, r, cp, lb) for r in range(cp)]
    assert torch.equal(unshard_sequence(parts, lb), x)
    positions = torch.cat([rank_positions(seq, r, cp, lb) for r in range(cp)])
    assert sorted(positions.tolist()) == list(range(seq))
    assert all(torch.equal(p[0], rank_positions(seq, r, cp, lb)) for r, p in enumerate(parts))


@pytest.mark.parametrize("cp", [2, 3, 4, 5, 8])
def test_zigzag_balances_the_causal_work_exactly(cp):
    seq = 2 * cp * 16
    zig = [attention_entries(seq, r, cp, "zigzag") for r in range(cp)]
    flat = [attention_entries(seq, r, cp, "none") for r in range(cp)]
    assert len(set(zig)) == 1
    assert sum(zig) == sum(flat) == seq * (seq + 1) // 2
    # contiguous pieces: the last rank does about 2 cp - 1 times the first's work
    assert max(flat) / min(flat) == pytest.approx(2 * cp - 1, rel=0.05)


def test_lengths_and_degrees_that_do_not_fit_are_named():
    with pytest.raises(ValueError, match=r"sequence length 100 does not divide by 2 x cp = "
                                         r"2 x 4 = 8"):
        check_sequence_length(100, 4, "zigzag")
    with pytest.raises(ValueError, match=r"sequence length 10 does not divide by cp = 4"):
        check_sequence_length(10, 4, "none")
    with pytest.raises(ValueError, match=r"cp_impl='ulysses' at cp=4 needs the key/value heads "
                                         r"\(2 per tensor rank\) to divide by 4"):
        ulysses_degree("ulysses", 4, 2)
    with pytest.raises(ValueError, match=r"cp_impl='hybrid' at cp=3 needs a degree"):
        ulysses_degree("hybrid", 3, 8)
    assert ulysses_degree("hybrid", 8, 2) == 2 and ulysses_degree("hybrid", 8, 8) == 4


def test_document_ids_follow_the_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 5, 6, 0]])
    assert document_ids(pos).tolist() == [[0, 0, 0, 1, 1, 2, 2, 3]]
    with pytest.raises(ValueError, match=r"positions has shape \(8,\)"):
        document_ids(pos[0])


def test_packed_documents_attend_only_to_themselves_in_one_process():
    model = build_model(get_model_config("debug", **SMALL), seed=0)
    a, b = torch.randint(0, 64, (1, 10)), torch.randint(0, 64, (1, 6))
    pos = torch.cat([torch.arange(10), torch.arange(6)])[None]
    out = model(torch.cat([a, b], 1), positions=pos)
    torch.testing.assert_close(out[:, :10], model(a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 10:], model(b), rtol=1e-5, atol=1e-5)


def _bytes_body(cases):
    import torch.distributed as dist

    from shardwise.parallel.context import cp_context
    from shardwise.parallel.context.apply import _Attend
    world = dist.get_world_size()
    mesh = shardwise.ParallelDims(world_size=world, cp=world).build_mesh()
    out = []
    for impl, heads, kv, dtype in cases:
        model = build_model(get_model_config("debug", **{**SMALL, "n_heads": heads,
                                                         "n_kv_heads": kv}), device="meta")
        shardwise.apply_cp(model, mesh["cp"], impl=impl)
        attend = _Attend(cp_context(model))
        q = torch.randn(2, heads, 48 // world, 8, dtype=dtype, requires_grad=True)
        k = torch.randn(2, kv, 48 // world, 8, dtype=dtype, requires_grad=True)
        v = torch.randn(2, kv, 48 // world, 8, dtype=dtype, requires_grad=True)
        shardwise.reset_comm_stats()
        y = attend(q, k, v)
        fwd = shardwise.comm_stats().bytes_sent
        y.backward(torch.ones_like(y))
        out.append((fwd, shardwise.comm_stats().bytes_sent - fwd,
                    shardwise.comm_stats()["send"].calls))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_layer_equal_the_closed_forms(world):
    cases = [("ring", 4, 2, torch.float32), ("ring", 4, 2, torch.bfloat16),
             ("ulysses", 4, world, torch.float32)]
    if world == 4:
        cases += [("hybrid", 4, 2, torch.float32), ("hybrid", 8, 4, torch.bfloat16)]
    got = run_ranks(_bytes_body, world, (cases,))
    for (impl, heads, kv, dtype), per_rank in zip(cases, zip(*got)):
        elem = torch.empty((), dtype=dtype).element_size()
        u = ulysses_degree(impl, world, kv)
        want = bytes_per_layer(impl, batch=2, seq_len=48, cp=world, heads=heads, kv_heads=kv,
                               head_dim=8, elem=elem, ulysses=u)
        for fwd, bwd, _ in per_rank:
            assert (fwd, bwd) == (want["forward"], want["backward"]), (impl, dtype)
    # the ring: n - 1 K/V messages forward, n - 1 backward and n gradient messages
    assert [rank[0][2] for rank in got] == [(world - 1) * 2 + world] * world


def _compile_body():
    import torch._dynamo

    from shardwise.models import TransformerBlock
    from shardwise.testing.cp_parity import cp_loss
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mesh = shardwise.ParallelDims(world_size=2, cp=2).build_mesh()
    model = build_model(get_model_config("debug", **SMALL), seed=0)
    shardwise.apply_cp(model, mesh["cp"], impl="ring")
    shardwise.compile_blocks(model, backend="aot_eager")
    shardwise.replicate(model, mesh=mesh)
    runtime = shardwise.cp_context(model)
    tokens = torch.randint(0, 64, (2, 65), generator=torch.Generator().manual_seed(0))
    loss = cp_loss(True, runtime.shard)(model, tokens)
    loss.backward()
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    return (dict(torch._dynamo.utils.counters["graph_break"]),
            torch._dynamo.utils.counters["stats"]["unique_graphs"], len(blocks), loss.item())


def test_compiled_blocks_hold_the_context_parallel_attention_without_graph_breaks():
    breaks, graphs, blocks, loss = run_ranks(_compile_body, 2, timeout_s=300)[0]
    assert breaks == {}
    assert graphs >= blocks
    assert loss == loss  # finite


def _refusals_body():
    from shardwise.parallel.context import cp_context
    mesh = shardwise.ParallelDims(world_size=2, cp=2).build_mesh()
    errors = []

    def refused(fn):
        try:
            fn()
        except ValueError as exc:
            errors.append(str(exc))
        else:
            errors.append("accepted")

    cfg = get_model_config("debug", **SMALL)
    refused(lambda: shardwise.apply_cp(build_model(cfg, device="meta"), mesh, impl="star"))
    refused(lambda: shardwise.apply_cp(build_model(cfg, device="meta"), mesh,
                                       load_balance="random"))
    refused(lambda: shardwise.apply_cp(build_model(cfg, device="meta"), "cp"))
    mla = get_model_config("debug", **{**SMALL, "attention": "mla", "n_kv_heads": 4,
                                       "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                                       "qk_rope_head_dim": 4, "v_head_dim": 8})
    refused(lambda: shardwise.apply_cp(build_model(mla, device="meta"), mesh))
    sharded = build_model(cfg, seed=0)
    shardwise.shard(sharded, mesh=mesh)
    refused(lambda: shardwise.apply_cp(sharded, mesh))
    twice = shardwise.apply_cp(build_model(cfg, seed=0), mesh)
    refused(lambda: shardwise.apply_cp(twice, mesh))
    # a length that does not cut into 2 x cp chunks fails on every rank before any message
    shardwise.reset_comm_stats()
    refused(lambda: twice(cp_context(twice).shard(torch.zeros(1, 8, dtype=torch.long))[:, :3]))
    refused(lambda: twice(torch.zeros(1, 300, dtype=torch.long)))
    return errors, shardwise.comm_stats().calls


def test_bad_input_is_refused_by_name_before_any_message():
    errors, calls = run_ranks(_refusals_body, 2)[0]
    expected = [r"impl='star', expected one of \('ring', 'ulysses', 'hybrid'\)",
                r"load_balance='random', expected one of \('zigzag', 'none'\)",
                r"cp_mesh must be a 1-D DeviceMesh",
                r"multi-head latent attention \(layers.0.attention\) is not covered",
                r"already sharded: apply_cp goes before shardwise.shard",
                r"already context-parallel; apply_cp once",
                r"sequence length 6 does not divide by 2 x cp = 2 x 2 = 4",
                r"sequence length 300 x cp 2 = 600 exceeds max_seq_len=512"]
    assert len(errors) == len(expected)
    for got, want in zip(errors, expected):
        assert __import__("re").search(want, got), (got, want)
    assert calls == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["cpu_kernels", "tensor_ops"])
def test_block_kernels_merge_to_one_attention(monkeypatch, dtype, path):
    """Both block paths (ATen's CPU flash kernels; the plain-tensor path GPUs run today)
    split over key blocks, merged by log-sum-exp and differentiated per block from the
    merged output, equal one SDPA, with and without packed documents."""
    from shardwise.models.layers import document_mask, repeat_kv
    from shardwise.parallel.context import kernels
    from shardwise.parallel.context.runtime import _backward_block, _forward_block
    if path == "tensor_ops":
        monkeypatch.setattr(kernels, "_cpu_kernels", lambda q: False)
    g = torch.Generator().manual_seed(0)
    q, gy = (torch.randn(2, 4, 24, 8, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, 24, 8, generator=g, dtype=dtype) for _ in range(2))
    docs = document_ids(torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                       10, 11, 12, 0, 1, 2, 3, 4]] * 2))
    ranges = ((0, 8), (8, 16), (16, 24))
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for d in (None, docs):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(
            qq, repeat_kv(kk, 2), repeat_kv(vv, 2), is_causal=d is None,
            attn_mask=None if d is None else document_mask(d))
        ref.backward(gy)
        acc: list = [None] * 3
        for kr in ranges:  # key blocks one at a time, as a ring delivers them
            a, b = kr
            _forward_block(acc, q, k[:, :, a:b], v[:, :, a:b], ranges, (kr,), d, 8 ** -0.5)
        out = torch.cat([o for o, _ in acc], dim=2).to(dtype)
        lse = torch.cat([s for _, s in acc], dim=2)
        dq = torch.zeros(q.shape, dtype=kernels.acc_dtype(dtype))
        dkv = torch.zeros((2, *k.shape), dtype=kernels.acc_dtype(dtype))
        for kr in ranges:
            a, b = kr
            part = torch.zeros((2, 2, 2, b - a, 8), dtype=dkv.dtype)
            _backward_block(dq, part, gy, q, k[:, :, a:b], v[:, :, a:b], out, lse, ranges,
                            (kr,), d, 8 ** -0.5)
            dkv[:, :, :, a:b] += part
        for got, want in ((out, ref), (dq, qq.grad), (dkv[0], kk.grad), (dkv[1], vv.grad)):
            err = (got.double() - want.double()).abs().max() / want.double().abs().max()
            assert err < tol, (path, dtype, d is not None, float(err))
