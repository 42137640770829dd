"""Micro-benchmarks of what a CPU rank runs, for ``--calibrate`` ([Note: CPU kernels] in
devices/cpu/costs.py): the trainer's eager kernels, its optimizer update and the engine's
Gloo collectives, each timed at a few sizes and fitted.

    costs = measure_cpu(ranks=4)   # -> CpuCosts

Kernels are timed on one thread (what a training rank runs), each the least CPU time of
this thread over several calls (``time.thread_time``: the time slices other processes take
on a shared machine are not counted, and the minimum filters out their cache pollution).
The engine's collectives are measured by gloo.py, the composed blocks (whole and
tensor-parallel) by blocks.py.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch
import torch.nn.functional as F

from shardwise.planner.calibrate.blocks import (block_work, measure_blocks, measure_tp_blocks,
                                          median_blocks)
from shardwise.planner.devices.cpu.costs import CpuCosts
from shardwise.planner.devices.cpu.fits import Crowd, Fit, Kernel, fit_terms
from shardwise.planner.calibrate.gloo import (cpu_fractions, fit_collectives, gap_seconds,
                                        measure_gloo)
from shardwise.planner.calibrate.timing import best_time, median_time

__all__ = ["measure_cpu", "measure_kernels", "measure_optimizer", "measure_gloo",
           "measure_contention", "contention_ratios", "measure_linear", "fit_terms",
           "fit_collectives", "LINEAR_SHAPES"]


def _best(fn, repeats: int = 3) -> float:
    """The least CPU time of this thread over at least ``repeats`` calls and 0.02 s (see
    the module docstring)."""
    return best_time(fn, repeats, min_seconds=0.02, max_calls=50, clock=time.thread_time)


def _fwd_bwd(make, sizes, engine: float = 0.0) -> Kernel:
    """Fit a kernel from ``make(size) -> (forward(), forward_backward())`` at each size;
    ``engine``: the fixed cost of one ``autograd.grad`` call, which a training step pays
    once per backward, not per kernel (subtracted)."""
    fwd, bwd = [], []
    for n in sizes:
        f, fb = make(n)
        tf, tfb = _best(f), _best(fb)
        fwd.append(((1.0, n), tf))
        bwd.append(((1.0, n), max(tfb - tf - engine, 1e-7)))
    return Kernel(Fit(*fit_terms(fwd)), Fit(*fit_terms(bwd)))


def _engine_call() -> float:
    """Seconds of one ``autograd.grad`` call around a view (its graph task, nothing to
    compute)."""
    x = torch.randn(8, requires_grad=True)
    g = torch.randn(8)
    return max(0.0, _best(_grad_of(lambda: x.view(2, 4), (x,), g.view(2, 4)), 20)
               - _best(lambda: x.view(2, 4), 20))


LINEAR_SHAPES = [(64, 128, 128), (128, 256, 256), (512, 256, 768), (512, 512, 512),
                 (512, 512, 1536), (1024, 512, 1536), (512, 512, 8192), (2048, 1024, 1024)]
"""(tokens, in, out) of the linears the calibration multiplies: the debug and small
models' shapes and a few beyond, 17 MFLOP to 8.6 GFLOP per multiply."""


def measure_linear(shapes=LINEAR_SHAPES, repeats: int = 3) -> list[tuple[float, float]]:
    """(FLOPs, seconds) per multiply of ``F.linear`` as the trainer runs it: forward and
    backward with autograd (``x @ W.T``, then ``g @ W`` and ``g.T @ x``), a third of the
    whole each, on one thread. Transposed operands and the linear's own views and
    autograd nodes make these slower than square ``torch.mm`` of the same FLOPs."""
    engine = _engine_call()
    out = []
    for t, i, o in shapes:
        x = torch.randn(t, i, requires_grad=True)
        w = torch.randn(o, i, requires_grad=True)
        fb = _grad_of(lambda x=x, w=w: F.linear(x, w), (x, w), torch.randn(t, o))
        out.append((2.0 * t * i * o, max(_best(fb, repeats) - engine, 1e-9) / 3))
    return out


def _grad_of(out_fn, inputs, grad):
    return lambda: torch.autograd.grad(out_fn(), inputs, grad)


def _elementwise(name: str, n: int):
    """(forward, forward + backward) of kernel ``name`` on ``n`` elements (a multiple of
    512), as shardwise.models calls it: widths of 512, heads of 64."""
    from shardwise.models.layers import RMSNorm, apply_rotary, repeat_kv, rope_tables

    d, rows = 512, max(1, n // 512)
    if name == "rmsnorm":
        norm, x = RMSNorm(d, 1e-5), torch.randn(rows, d, requires_grad=True)
        fn = lambda: norm(x)  # noqa: E731
        return fn, _grad_of(fn, (x, norm.weight), torch.randn(rows, d))
    if name == "rope":  # (B, T, H, hd) = (1, rows, 8, 64)
        cos, sin = rope_tables(64, rows, 10000.0)
        x = torch.randn(1, rows, 8, 64, requires_grad=True)
        fn = lambda: apply_rotary(x, cos, sin)  # noqa: E731
        return fn, _grad_of(fn, (x,), torch.randn(1, rows, 8, 64))
    if name == "repeat_kv":  # (1, 4, rows, 64) -> (1, 8, rows, 64): n output elements
        x = torch.randn(1, 4, rows, 64, requires_grad=True)
        fn = lambda: repeat_kv(x, 2)  # noqa: E731
        return fn, _grad_of(fn, (x,), torch.randn(1, 8, rows, 64))
    if name == "swiglu":
        a, b = (torch.randn(rows, d, requires_grad=True) for _ in range(2))
        fn = lambda: F.silu(a) * b  # noqa: E731
        return fn, _grad_of(fn, (a, b), torch.randn(rows, d))
    if name == "residual":  # forward: the add; backward: summing the stream's two grads
        x, y = (torch.randn(rows, d, requires_grad=True) for _ in range(2))
        g1, g2 = torch.randn(rows, d), torch.randn(rows, d)
        return (lambda: x + y), (lambda: (x + y, g1 + g2))
    if name == "copy":  # n bytes
        src, dst = torch.empty(n // 4), torch.empty(n // 4)
        return (lambda: dst.copy_(src)), (lambda: dst.copy_(src))
    raise ValueError(f"unknown kernel {name!r}")


def _attention(quick: bool, engine: float = 0.0) -> tuple[Kernel, Kernel]:
    """The flash kernel, fitted to its FLOPs (attention) and causal scores (softmax)."""
    shapes = [(4, 8, 128, 32), (4, 8, 128, 64), (2, 8, 256, 64)]
    if not quick:
        shapes += [(4, 16, 128, 32), (2, 4, 256, 128)]
    fwd, bwd = [], []
    for b, h, t, hd in shapes:
        q, k, v = (torch.randn(b, h, t, hd, requires_grad=True) for _ in range(3))
        def fn(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        tf = _best(fn)
        tfb = _best(_grad_of(fn, (q, k, v), torch.randn(b, h, t, hd)))
        x = (1.0, 2.0 * b * h * t * t * hd, b * h * t * t / 2)  # latency, FLOPs, scores
        fwd.append((x, tf))
        bwd.append((x, max(tfb - tf - engine, 1e-7)))
    cf, cb = fit_terms(fwd), fit_terms(bwd)
    return (Kernel(Fit(cf[0], cf[1]), Fit(cb[0], cb[1])),
            Kernel(Fit(0.0, cf[2]), Fit(0.0, cb[2])))


CP_BLOCKS = [(2, 64, 64, True), (2, 128, 128, True), (2, 128, 256, False),
             (2, 256, 256, True), (2, 256, 512, False), (1, 512, 512, False)]
"""(sequences, query tokens, key tokens, causal) of the context-parallel operator's kernel
calls the calibration times: diagonal chunks and runs of whole chunks, 8 query heads on 4
key/value heads of 32 features ([Note: context-parallel kernels] in
devices/cpu/kernels.py)."""


def _cp_blocks(quick: bool) -> Kernel:
    """The CPU flash kernel as ``shardwise.parallel.context`` calls it per block (ATen's
    forward and its backward directly, grouped-query heads natively), fitted to the block's
    rectangle ``sequences x heads x query tokens x key tokens x head_dim``: up to 512 keys
    a causal block costs what the whole rectangle does (measured: the kernel computes its
    key blocks whole), so one fit prices both kinds."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    grad = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    fwd, bwd = [], []
    for b, tq, tk, causal in CP_BLOCKS[:4] if quick else CP_BLOCKS:
        q, (k, v) = torch.randn(b, 8, tq, 32), (torch.randn(b, 4, tk, 32) for _ in range(2))
        out, lse = flash(q, k, v, 0.0, causal)[:2]
        d = torch.randn_like(out)
        x = (1.0, float(b * 8 * tq * tk * 32))
        fwd.append((x, _best(lambda q=q, k=k, v=v, c=causal: flash(q, k, v, 0.0, c))))
        bwd.append((x, _best(lambda q=q, k=k, v=v, o=out, lse=lse, d=d, c=causal:
                             grad(d, q, k, v, o, lse, 0.0, c))))
    return Kernel(Fit(*fit_terms(fwd)), Fit(*fit_terms(bwd)))


def _cp_calls(quick: bool, blocks: Kernel) -> Kernel:
    """What the context-parallel operator spends per kernel call beyond the kernel
    (``blocks``): merging each call's output into the running one by log-sum-exp, adding
    its gradients into dQ, dK, dV, slicing, in fp32 ([Note: context-parallel kernels] in
    devices/cpu/kernels.py). Timed as ``ContextParallel.ring_forward`` and ``ring_backward``
    of one process on a zigzag sequence (3 calls: the diagonal chunks and the whole one
    between), less the calls' kernels at ``blocks``' fits, fitted per call to the call's
    query elements (``sequences x heads x query tokens x head_dim``)."""
    from shardwise.parallel.context.runtime import ContextParallel

    one = ContextParallel("ring", "zigzag", (0,), None, (0,), None, (0,), None)
    fwd, bwd = [], []
    for t in (256, 512) if quick else (256, 512, 1024):
        q, (k, v) = torch.randn(2, 8, t, 32), (torch.randn(2, 4, t, 32) for _ in range(2))
        out, lse = one.ring_forward(q, k, v, None)
        d = torch.randn_like(out)
        c = t // 2  # two chunks: c x c causal, c x c whole, c x c causal
        rect = 2 * 8 * c * c * 32
        x = (3.0, 3.0 * 2 * 8 * c * 32)
        tf = _best(lambda q=q, k=k, v=v: one.ring_forward(q, k, v, None))
        tb = _best(lambda q=q, k=k, v=v, o=out, lse=lse, d=d:
                   one.ring_backward(d, q, k, v, o, lse, None))
        fwd.append((x, max(tf - 3 * blocks.fwd(rect), 1e-7)))
        bwd.append((x, max(tb - 3 * blocks.bwd(rect), 1e-7)))
    return Kernel(Fit(*fit_terms(fwd)), Fit(*fit_terms(bwd)))


def _embedding_and_loss(engine: float = 0.0) -> tuple[Kernel, Kernel]:
    emb_f, emb_b, ce_f, ce_b = [], [], [], []
    for vocab, t in ((256, 512), (8192, 512), (8192, 2048)):
        w = torch.randn(vocab, 512, requires_grad=True)
        idx = torch.randint(0, vocab, (t,))
        fn = lambda w=w, idx=idx: F.embedding(idx, w)  # noqa: E731
        tf, tfb = _best(fn), _best(_grad_of(fn, (w,), torch.randn(t, 512)))
        emb_f.append(((1.0, t * 512), tf))
        emb_b.append(((1.0, (vocab + t) * 512), max(tfb - tf - engine, 1e-7)))
        logits = torch.randn(t, vocab, requires_grad=True)
        lfn = lambda x=logits, idx=idx: F.cross_entropy(x.float(), idx)  # noqa: E731
        tf, tfb = _best(lfn), _best(_grad_of(lfn, (logits,), torch.tensor(1.0)))
        ce_f.append(((1.0, t * vocab), tf))
        ce_b.append(((1.0, t * vocab), max(tfb - tf - engine, 1e-7)))
    return (Kernel(Fit(*fit_terms(emb_f)), Fit(*fit_terms(emb_b))),
            Kernel(Fit(*fit_terms(ce_f)), Fit(*fit_terms(ce_b))))


def measure_kernels(quick: bool = False) -> dict[str, Kernel]:
    """Every kernel of [Note: CPU kernels], fitted (one thread: call inside the thread
    setting of ``measure_local``)."""
    sizes = [1 << 15, 1 << 18, 1 << 20] if quick else [1 << 15, 1 << 17, 1 << 19, 1 << 21]
    engine = _engine_call()
    out = {name: _fwd_bwd(lambda n, name=name: _elementwise(name, n), sizes, engine)
           for name in ("rmsnorm", "rope", "repeat_kv", "swiglu", "residual")}
    out["copy"] = _fwd_bwd(lambda n: _elementwise("copy", n), [1 << 18, 1 << 22, 1 << 25])
    out["attention"], out["softmax"] = _attention(quick, engine)
    out["cp_attention"] = _cp_blocks(quick)
    out["cp_call"] = _cp_calls(quick, out["cp_attention"])
    out["embedding"], out["cross_entropy"] = _embedding_and_loss(engine)
    return out


def measure_optimizer(quick: bool = False) -> Fit:
    """The trainer's update -- the engine's foreach norm, the clip's foreach multiply and
    ``torch.optim.AdamW.step`` (per-tensor loop on CPU) -- per tensor and per element.

    Timed as the median call, not the fastest, up to a model's size (16 M elements: the
    weights, gradients and both moments, 256 MiB, far beyond the caches): the update
    streams the whole state through memory once per step, and that is where a shared
    machine's speed varies most between calls (the fastest call comes out well below what
    the trainer's steps spend)."""
    rows = []
    shapes = ((8, 1 << 14), (8, 1 << 19), (64, 1 << 14), (32, 1 << 17)) + \
        (() if quick else ((16, 1 << 20),))
    for k, n in shapes:
        ps = [torch.nn.Parameter(torch.randn(n)) for _ in range(k)]
        for p in ps:
            p.grad = torch.randn(n)
        opt = torch.optim.AdamW(ps, lr=1e-4)
        grads = [p.grad for p in ps]

        def update(opt=opt, grads=grads):
            norm = torch.stack(torch._foreach_norm(grads, 2.0)).norm()
            torch._foreach_mul_(grads, torch.clamp(1.0 / (norm + 1e-6), max=1.0))
            opt.step()
        rows.append(((k, k * n), median_time(update)))
    return Fit(*fit_terms(rows))


CROWD_GAPS = (1, 3)
"""The compute before each crowded call, in ``gloo._multiplies`` units: about a
tensor-parallel collective's (ten to a layer) and a layer's (between a unit's gathers and
reductions) ([Note: crowded collectives] in devices/cpu/step.py)."""

def _contention_worker(barrier, queue, seconds: float) -> None:
    barrier.wait()
    queue.put(block_work(seconds))


def measure_contention(counts: list[int], seconds: float = 2.0) -> dict[int, float]:
    """:func:`contention_ratios`' median-call ratios."""
    return contention_ratios(counts, seconds)[0]


def contention_ratios(counts: list[int], seconds: float = 2.0
                      ) -> tuple[dict[int, float], dict[int, float]]:
    """How much more CPU time a process needs for the same work when ``k`` compute at once
    ([Note: CPU ranks share the cores]), for each ``k`` of ``counts`` (the calibration asks
    for every core busy; more processes than cores add little on an idle machine and
    whatever another job costs on a busy one, so it is not asked): a Llama block's forward
    and backward on ``k`` processes started together (the slowest one's median) over the
    same on one process alone (>= 1). A block, not a square multiply: the trainer's
    transposed multiplies and its working set share the caches and the memory bandwidth.

    Returns the ratios of the median calls and of the fastest calls (the slowest
    process's fastest call over the lone process's: [Note: undisturbed steps] in
    devices/cpu/costs.py; a neighbour moves the median calls from one calibration to the
    next)."""
    ctx = mp.get_context("fork" if not torch.cuda.is_initialized() else "spawn")
    ks = sorted({k for k in counts if k > 1})
    if not ks:
        return {}, {}
    out = []
    for k in [1] + ks:
        barrier, queue = ctx.Barrier(k), ctx.Queue()
        procs = [ctx.Process(target=_contention_worker, args=(barrier, queue, seconds))
                 for _ in range(k)]
        for p in procs:
            p.start()
        try:
            got = [queue.get(timeout=120) for _ in procs]
            out.append((max(m for m, _ in got), max(b for _, b in got)))
        finally:
            for p in procs:
                p.join(timeout=10)
    return tuple({k: max(1.0, t[i] / out[0][i]) for k, t in zip(ks, out[1:], strict=True)}
                 for i in (0, 1))


def measure_cpu(ranks: int, quick: bool = False, cores: int = 1) -> CpuCosts:
    """Kernels and update on one thread, the slowdown with every core busy, then the
    collectives on 2 and ``ranks`` ranks, and with more ranks than ``cores`` those of
    each smaller group of the ``ranks`` after each gap of ``CROWD_GAPS`` ([Note: crowded
    collectives] in devices/cpu/step.py)."""
    block_s = 0.2 if quick else 1.0
    pair = cores >= 2  # [Note: tensor-parallel pairs]: 2 ranks that keep a core each

    def blocks() -> tuple:  # first, middle and last: see median_blocks
        return measure_blocks(seconds=block_s), measure_tp_blocks(block_s) if pair else ()
    passes = [blocks()]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kernels, opt = measure_kernels(quick), measure_optimizer(quick)
    finally:
        torch.set_num_threads(threads)
    busy, busy_best = contention_ratios([cores], seconds=0.5 if quick else 2.0)
    passes.append(blocks())
    sizes = [1 << 12, 1 << 16, 1 << 20] if quick else [1 << 12, 1 << 16, 1 << 19, 1 << 21,
                                                        1 << 23]
    calls = 5 if quick else 21
    rows = {w: measure_gloo(w, sizes, calls=calls) for w in sorted({2, ranks})}
    crowded = {}
    groups = [g for g in range(2, ranks) if ranks % g == 0]
    if cores and ranks > cores and groups:  # [Note: crowded collectives] in devices/cpu/step.py
        crowds = []
        for mult in CROWD_GAPS:
            sub = {g: measure_gloo(ranks, sizes, calls=calls, group=g, multiplies=mult)
                   for g in groups}
            crowds.append(Crowd(fit_collectives(sub), cpu_fractions(sub), gap_seconds(mult)))
        crowded[ranks] = tuple(sorted(crowds, key=lambda c: c.gap_s))
    passes.append(blocks())
    # compose stays 1 here: write_calibration prices the blocks once the fits are known
    return CpuCosts(kernels, opt, fit_collectives(rows), busy,
                    median_blocks(p[0] for p in passes), comm_cpu=cpu_fractions(rows),
                    busy_best=busy_best, crowded=crowded,
                    tp_blocks=median_blocks(p[1] for p in passes) if pair else ())
