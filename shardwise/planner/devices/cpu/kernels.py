"""Seconds of a layer's and the head's kernels, the optimizer update and the engine's copies
on one CPU rank, priced with the calibration's fits ([Note: CPU kernels] in costs.py).

    kf, kb = layer_kernels(hw, spec, tokens, seq, tp, sp, exec_flops)   # forward, backward
"""

from __future__ import annotations

from shardwise.planner.rank_memory import unit_state

__all__ = ["cpu_pricable", "layer_kernels", "head_kernels", "optimizer_seconds",
           "engine_copy_seconds"]


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
             ("rope", tokens * kv * hd, 1), ("swiglu", tokens * spec.ffn_dim // tp, 1),
             # the flash kernel: its multiplies (FLOPs) and its softmax (causal scores)
             ("attention", exec_flops, 1), ("softmax", tokens * seq * h / 2, 1)]
    if kv < h:  # k and v expanded to every query head before the kernel
        calls.append(("repeat_kv", tokens * h * hd, 2))
    return calls


def layer_kernels(hw, spec, tokens: float, seq: int, tp: int, sp: bool, exec_flops: float
                  ) -> tuple[float, float]:
    """(forward, backward) seconds of one dense layer's kernels other than its linears'
    multiplies on one CPU rank, for ``tokens`` tokens (divided by ``memory_efficiency``,
    the constant a refit corrects them with)."""
    c = hw.cpu
    calls = _calls(spec, tokens, seq, tp, sp, exec_flops)
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
