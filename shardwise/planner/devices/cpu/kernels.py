"""Seconds of a layer's and the head's kernels, the optimizer update and the engine's copies
on one CPU rank, priced with the calibration's fits ([Note: CPU kernels] in costs.py).

    kf, kb = layer_kernels(hw, spec, tokens, seq, tp, sp, exec_flops)   # forward, backward

[Note: context-parallel kernels] ``shardwise.parallel.context``'s operator runs ATen's CPU
flash kernel (forward, and its backward directly) once per query chunk against each run of
key chunks it sees whole, and once per diagonal chunk (2 cp + 1 calls a pass on the
busiest rank of a zigzag ring, 27 for Ulysses over 4 ranks: sends.py, [Note:
context-parallel sends]), on the grouped-query heads natively (no expanded copy of the
keys). Timed on one thread, that kernel's cost up to 512 keys is its whole query x key
rectangle, causal or not (a 256 x 256 block: 1.13 ms causal, 1.19 ms whole; 128 x 128:
0.34 and 0.33 ms), while the one-rank fits (``attention`` and ``softmax``, timed causal at
128-256 tokens with autograd) price a whole block at about three times what it takes. So
``--calibrate`` times these calls as the operator makes them (``CP_BLOCKS`` in
calibrate/kernels.py) and fits ``cp_attention`` to the rectangle x heads x head_dim,
charged per call (the fit is linear in size: the calls' sum is exact however the sizes
split), which also prices the fixed cost each call pays. Around each call the operator
merges its output into the running one by log-sum-exp and adds its gradients into dQ,
dK, dV (about ten fp32 elementwise operators over the query chunk); ``cp_call`` prices
that per call and query element, timed as one process's ``ring_forward`` and
``ring_backward`` less their calls' kernels (0.15 ms forward and 0.40 ms backward a call
at chunks of 128 tokens, 2 sequences, 8 heads of 32: as much as the kernel itself). A
calibration written before ``cp_attention`` existed prices the calls with ``attention``
and ``softmax`` on their FLOPs and causal entries, and nothing around them.
"""

from __future__ import annotations

from shardwise.planner.rank_memory import unit_state

__all__ = ["cpu_pricable", "layer_kernels", "attention_kernels", "head_kernels",
           "optimizer_seconds", "engine_copy_seconds"]


def cpu_pricable(spec, moe: bool = False) -> bool:
    """Whether a layer of ``spec`` is priced by the CPU kernels: the trainer's dense Llama
    block (RMSNorm, RoPE, SwiGLU, grouped-query attention). Other shapes keep the roofline
    of the GPU device model."""
    return (not moe and spec.norm == "rmsnorm" and spec.mlp == "swiglu"
            and spec.position == "rope" and not spec.is_mla)


def _calls(spec, tokens: float, seq: int, tp: int, sp: bool, exec_flops: float):
    rep = tokens / (tp if sp else 1)  # outside the tensor-parallel regions
    d, h, kv, hd = spec.dim, spec.n_heads // tp, max(1, spec.kv_heads // tp), spec.hd
    calls = [("rmsnorm", rep * d, 2), ("residual", rep * d, 2), ("rope", tokens * h * hd, 1),
             ("rope", tokens * kv * hd, 1), ("swiglu", tokens * spec.ffn_dim // tp, 1)]
    return calls + _attention_calls(None, spec, tokens, seq, tp, exec_flops)


def _attention_calls(hw, spec, tokens: float, seq: int, tp: int, exec_flops: float, w=None):
    """The attention core's kernels: the flash kernel's multiplies (FLOPs) and softmax
    (causal scores), and the expansion of k and v to every query head before it; context
    parallelism's operator (``w`` with ``attn_scores``) runs the kernel per block, on the
    grouped-query heads natively ([Note: context-parallel kernels])."""
    h, kv, hd = spec.n_heads // tp, max(1, spec.kv_heads // tp), spec.hd
    if w is None or not w.attn_scores:  # one kernel on the whole sequence
        calls = [("attention", exec_flops, 1), ("softmax", tokens * seq * h / 2, 1)]
        return calls + ([("repeat_kv", tokens * h * hd, 2)] if kv < h else [])
    n = w.attn_calls
    if "cp_attention" in hw.cpu.kernels:  # the blocks' rectangles, and around each call
        return [("cp_attention", w.attn_area * hd / n, n),
                ("cp_call", w.attn_queries * hd / n, n)]
    return [("attention", exec_flops / n, n), ("softmax", w.attn_scores / n, n)]


def layer_kernels(hw, spec, tokens: float, seq: int, tp: int, sp: bool, exec_flops: float,
                  w=None) -> tuple[float, float]:
    """(forward, backward) seconds of one dense layer's kernels other than its linears'
    multiplies on one CPU rank, for ``tokens`` tokens (divided by ``memory_efficiency``,
    the constant a refit corrects them with); ``w``: the layer's work, whose attention may
    run as context parallelism's blocks."""
    calls = _calls(spec, tokens, seq, tp, sp, exec_flops)
    if w is not None and w.attn_scores:
        calls = calls[:5] + _attention_calls(hw, spec, tokens, seq, tp, exec_flops, w)
    return _priced(hw, calls)


def attention_kernels(hw, spec, w, seq: int, tp: int) -> tuple[float, float]:
    """(forward, backward) seconds of ``w``'s attention core alone on one CPU rank (as
    :func:`layer_kernels` prices it)."""
    return _priced(hw, _attention_calls(hw, spec, w.tokens, seq, tp, w.attn_exec_flops, w))


def _priced(hw, calls) -> tuple[float, float]:
    """Forward and backward seconds of ``calls`` (name, size, how many)."""
    c = hw.cpu
    fwd = sum(c.kernel(name, n, calls=k) for name, n, k in calls)
    bwd = sum(c.kernel(name, n, backward=True, calls=k) for name, n, k in calls)
    return fwd / hw.memory_efficiency, bwd / hw.memory_efficiency


def head_kernels(hw, spec, tokens: float, tp: int, sp: bool, first: bool, last: bool
                 ) -> tuple[float, float]:
    """(forward, backward) seconds of the embedding (``first``), and of the final norm and
    the fp32 cross-entropy (``last``), on one CPU rank."""
    c, d = hw.cpu, spec.dim
    v = -(-spec.vocab_size // tp)
    fwd = bwd = 0.0
    if first:
        fwd += c.kernel("embedding", tokens * d)
        bwd += c.kernel("embedding", spec.vocab_size * d + tokens * d, backward=True)
    if last:
        rep = tokens / (tp if sp else 1)
        fwd += c.kernel("rmsnorm", rep * d) + c.kernel("cross_entropy", tokens * v)
        bwd += c.kernel("rmsnorm", rep * d, True) + c.kernel("cross_entropy", tokens * v, True)
    return fwd / hw.memory_efficiency, bwd / hw.memory_efficiency


def optimizer_seconds(hw, units, world: int) -> float:
    """The update of the rank's shards (foreach norm, clip, ``AdamW.step``): per tensor and
    per element of the shard each parameter keeps."""
    n_tensors = sum(unit_state(tuple(u), world).n_params for u in units)
    numel = sum(unit_state(tuple(u), world).local_numel for u in units)
    return (n_tensors * hw.cpu.optimizer.latency + numel * hw.cpu.optimizer.per_unit) \
        / hw.memory_efficiency


def engine_copy_seconds(hw, units, world: int, zero: int, gathers: float, act_bytes: int,
                        param_bytes: int) -> float:
    """The engine's own copies on the compute thread in one step: each gather's copy-out
    into the full parameters (``gathers`` per unit), the gradient packing and the
    averaging; stage 0: the packing into buckets and their averaging. (The Gloo
    reduce-scatter's local sum is part of its calibrated time.)"""
    c, total = hw.cpu, 0.0
    for u in units:
        s = unit_state(tuple(u), world if zero else 1)
        if not s.n_params:
            continue
        if zero == 0:  # packed into the buckets, then averaged
            total += 2 * c.kernel("copy", s.numel * param_bytes)
            continue
        full = s.full_numel * act_bytes
        total += gathers * c.kernel("copy", full) + c.kernel("copy", full)
        total += c.kernel("copy", s.shard_numel * param_bytes)
    return total / hw.memory_efficiency
