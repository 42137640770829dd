"""Seconds and bytes of one micro-batch on one pipeline rank: its layers, embedding and head.

[Note: layer time] A layer's forward is the sum of its matrix multiplies (each at the
hardware's achievable fraction of peak for its size), its attention core (one batched
kernel) and its bandwidth-bound kernels (norms, residual adds, activation functions,
dropout, unfused softmax) at the fitted fraction of HBM bandwidth. fp8 training also casts
every linear's operands (work.fp8_cast_bytes). Backward runs two
multiplies per forward multiply (input and weight gradients) at the same size, 2.5x the
attention kernel's forward work for flash attention (it recomputes the scores) and 2x
otherwise, and twice the bandwidth-bound bytes. Recomputation replays the forward (full) or
what the stack's selective policy replays ([Note: selective policies] in recompute.py; a
layer policy gives each block full or no checkpointing). Context-parallel key/value
gathers and expert all-to-alls are priced by comm_model and counted as exposed unless the
workload overlaps them (then only what exceeds the compute they hide behind).

[Note: tensor-parallel collectives] Megatron's tensor parallelism runs two collectives per
layer and pass: an all-reduce after the attention block's and after the MLP's row-parallel
linear; with sequence parallelism each becomes a reduce-scatter, and an all-gather runs
before each column-parallel linear: two all-gathers and two reduce-scatters, the same
bytes as the two all-reduces (Korthikanti et al. 2022, Section 4.2.2). A pass is the
forward, the backward (the conjugate collectives) and a replayed forward (full
recomputation; torchtitan's ``alternate_mm`` replays the all-gathers only, it keeps the
reduce-scatters' outputs). ``overlap_tp`` (torch's AsyncTP, the micro-pipelined
all-gather-matmul and matmul-reduce-scatter that torch.compile builds) hides the
collectives of the forward passes behind the multiplies they are fused with, only what
exceeds them staying exposed; the backward's stay exposed. That is what PyTorch reported
for it ("up to ~20% forward pass speedup and ~8% end-to-end speedup in Llama3 70B",
discuss.pytorch.org/t/209487, Aug 2024) and what torchtitan's Table 4 measured (829 ->
876 tokens/s/GPU, +5.7%, for Llama 3.1 70B at TP 8).

[Note: gradient accumulation] With several micro-batches per step, each backward adds its
weight gradients into the ones accumulated so far. Megatron-LM since February 2022
(``gradient_accumulation_fusion``, with fp32 accumulation) has the weight-gradient
multiply add into the fp32 buffer itself; every other stack the planner knows runs a
separate pass over all of the rank's parameters per micro-batch: autograd's in-place add
into ``.grad`` (Megatron-LM's fp16 default of 2021, DeepSpeed's 2021 ZeRO-1 pipeline
engine), Megatron-LM's ``main_grad.add_`` hooks, DeepSpeed's 2022 BF16_Optimizer
(``update_hp_grads``: a cast to fp32 and an add), FSDP2's fp32 accumulation of unsharded
bf16 gradients. Autograd's add (the workload's ``autograd_accum``, the default: shardwise's
engine runs every micro-batch but the last without gradient sync, so autograd adds each
new gradient into the full parameters' ``.grad`` in the compute dtype) reads two words and
writes one per parameter, and only from the second micro-batch on: the first hands its
gradient over. Those stacks' own passes (``grad_accum_bytes``) run on every micro-batch,
the first included. So a step of ``m > 1`` micro-batches moves ``3 x word x (m - 1) +
grad_accum_bytes x m`` bytes per parameter; a step of one micro-batch accumulates nothing
(its gradient goes straight to the reduction). It is priced at the memory bandwidth (on
CPU ranks as the calibrated elementwise add), averaged over the micro-batches, on the
weight-gradient part of each one's backward, so it lengthens each slot of the pipeline.
Per slot it costs ``bytes x flop rate / (8 x tokens per micro-batch x
bandwidth)`` of the layers' time with full recomputation, whatever the model's size: about 4%
for 6 bytes and one 2048-token sequence on an A100.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from shardwise.planner import comm_model
from shardwise.planner.cpu_stage import (cpu_pricable, head_kernels, layer_kernels,
                                         tp_head_comm, tp_layer_comm)
from shardwise.planner.pipeline import placement
from shardwise.planner.recompute import layer_ac, replayed_matmuls
from shardwise.planner.work import (LayerWork, fp8_cast_bytes, head_saved, head_work,
                                   layer_work, saved_bytes)
from shardwise.planner.workload import ATTENTION_DTYPE, DTYPE_BYTES

__all__ = ["LayerTimes", "RankTimes", "StageCoster", "stage_layers"]


@dataclass(frozen=True)
class LayerTimes:
    """One layer, one micro-batch, one rank (seconds, FLOPs, bytes)."""

    fwd: float
    bwd: float
    wgrad: float
    recompute: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    model_flops: float
    recompute_flops: float
    saved: float
    working: float


@dataclass(frozen=True)
class RankTimes:
    """A pipeline rank's per-micro-batch totals."""

    fwd: float
    bwd: float
    wgrad: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    model_flops: float
    recompute_flops: float
    saved: float
    working: float
    logits: float
    layers: int

    @property
    def busy(self) -> float:
        """Seconds the rank is occupied per micro-batch, exposed communication included."""
        return self.fwd + self.bwd + self.tp_comm + self.cp_comm + self.ep_comm


def stage_layers(n_layers: int, pp: int, virtual: int, schedule: str = "1f1b"
                 ) -> list[tuple[list[int], bool, bool]]:
    """Per pipeline rank: (its layer indices, whether it holds the embedding, whether it
    holds the final norm and head). ``pp x virtual`` stages split the layers in order (the
    first ``n_layers % stages`` one layer longer) and sit on ranks as the schedule places
    them (``pipeline.placement``: looped, or a V where rank 0 holds the first and last)."""
    chunks = pp * virtual
    base, extra = divmod(n_layers, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        size = base + (1 if c < extra else 0)
        bounds.append(range(start, start + size))
        start += size
    place = placement(schedule, pp, virtual)
    return [([i for c in range(chunks) if place[c] == r for i in bounds[c]],
             place[0] == r, place[-1] == r) for r in range(pp)]


class StageCoster:
    """Prices layers and pipeline ranks for one model, device and workload (cached)."""

    def __init__(self, spec, hw, wl) -> None:
        self.spec, self.hw, self.wl = spec, hw, wl
        self._layers: dict[tuple, LayerTimes] = {}

    # ------------------------------------------------------------------ one layer
    def layer(self, moe: bool, tp: int, cp: int, sp: bool, ep: int, mb: int, ac: str
              ) -> LayerTimes:
        key = (moe, tp, cp, sp, ep, mb, ac)
        if key not in self._layers:
            self._layers[key] = self._price_layer(*key)
        return self._layers[key]

    def _compute(self, w: LayerWork, sp: bool, tp: int, moe: bool = False
                 ) -> tuple[float, float, float, float]:
        """(forward, backward, weight-gradient, selective-recompute) seconds."""
        hw, dt = self.hw, self.wl.compute_dtype
        gemm = sum(n * hw.matmul_time(f, dt) for f, n in w.gemms)
        if dt != "fp8" and cpu_pricable(hw, self.spec, moe):  # [Note: CPU kernels]
            kf, kb = layer_kernels(hw, self.spec, w.tokens, self.wl.seq_len, tp, sp,
                                   w.attn_exec_flops)
            mm, ker = self._cpu_compose()
            return mm * gemm + ker * kf, 2 * mm * gemm + ker * kb, mm * gemm, ker * kf
        adt = ATTENTION_DTYPE.get(dt, dt)
        attn = w.attn_exec_flops / (hw.peak(adt) * hw.matmul_efficiency(w.attn_unit_flops)) \
            if w.attn_exec_flops else 0.0
        rep = w.elementwise_rep / (tp if sp else 1)
        mem = hw.memory_time(rep + w.elementwise_tp + w.core_bytes)
        cast_f = cast_b = 0.0
        if dt == "fp8":
            cast_f, cast_b = (hw.memory_time(x) for x in fp8_cast_bytes(w))
        attn_bwd = attn * (2.5 if self.wl.attention == "flash" else 2.0)
        # What selective recomputation replays ([Note: selective recomputation]).
        cheap = attn + hw.memory_time(w.core_bytes) if self.wl.attention != "flash" else mem
        slow = 1 / (1 - self.wl.comm_sm_fraction)  # cores the overlapped comm occupies
        return ((gemm + attn + mem + cast_f) * slow, (2 * gemm + attn_bwd + 2 * mem + cast_b)
                * slow, gemm * slow, cheap * slow)

    def _cpu_compose(self) -> tuple[float, float]:
        """(multiplies', other kernels') composition factors of a CPU rank's layers and
        head ([Note: two composition factors] in cpu_blocks.py); (1, 1) where the layers
        are not priced by the CPU kernels (a MoE model's included)."""
        if not cpu_pricable(self.hw, self.spec, self.spec.is_moe):
            return 1.0, 1.0
        return self.hw.cpu.compose, self.hw.cpu.kernel_compose

    def cpu_parts(self, moe: bool, tp: int, sp: bool, mb: int) -> tuple[float, float, float]:
        """(forward multiplies, forward kernels, backward kernels) seconds of one layer on
        a CPU rank, no composition factor (the calibration's blocks are priced by them;
        the backward multiplies are twice the forward's)."""
        s = self.wl.seq_len
        w = layer_work(self.spec, moe, mb * s, s, tp, 1, self.wl.attention, self.wl.act_bytes,
                       self.wl.fused_kernels, self.wl.fused_norm)
        gemm = sum(n * self.hw.matmul_time(f, self.wl.compute_dtype) for f, n in w.gemms)
        kf, kb = layer_kernels(self.hw, self.spec, w.tokens, s, tp, sp, w.attn_exec_flops)
        return gemm, kf, kb

    def _price_layer(self, moe, tp, cp, sp, ep, mb, ac) -> LayerTimes:
        s, wl, hw, spec = self.wl.seq_len, self.wl, self.hw, self.spec
        tokens = mb * s / cp
        w = layer_work(spec, moe, tokens, s, tp, ep, wl.attention, wl.act_bytes,
                       wl.fused_kernels, wl.fused_norm)
        fwd, bwd, wgrad, cheap = self._compute(w, sp, tp, moe)
        attn_fwd = w.attn_exec_flops / (hw.peak("bf16") * hw.matmul_efficiency(
            w.attn_unit_flops)) if w.attn_exec_flops else 0.0
        replayed = replayed_matmuls(spec, moe, tokens, tp, w.gemms) \
            if ac == "selective" and wl.selective_ac == "alternate_mm" else []
        replay_gemm = self._cpu_compose()[0] * sum(
            hw.matmul_time(f, wl.compute_dtype) for f in replayed) / (1 - wl.comm_sm_fraction)
        recompute = {"none": 0.0, "selective": cheap + replay_gemm, "full": fwd}[ac]
        sel_flops = (w.attn_model_flops if wl.attention != "flash" else 0.0) + sum(replayed)
        rec_flops = {"none": 0.0, "selective": sel_flops, "full": w.model_flops}[ac]
        passes = 3 if ac == "full" else 2  # forward, backward (+ the replayed forward)
        g = self.hw.gpus_per_node
        act = tokens * spec.dim * wl.act_bytes
        tp_comm = 0.0
        if tp > 1 and hw.cpu is not None:  # the collectives apply_tp issues, as measured
            tp_comm = tp_layer_comm(hw, tokens, spec.dim, wl.act_bytes, tp, sp, ac == "full")
        elif tp > 1:
            tp_comm = self._tp_comm(act, tp, sp, ac, wgrad, replay_gemm)
        cp_comm = 0.0
        if cp > 1:
            kv = (spec.kv_lora_rank + spec.qk_rope_head_dim) if spec.is_mla else \
                2 * max(1, spec.kv_heads // tp) * spec.hd
            grp = comm_model.place(cp, tp, g)
            gather = comm_model.all_gather_time(tokens * kv * wl.act_bytes, grp, hw)
            cp_comm = max(0.0, gather - attn_fwd) * (passes - 1) + max(0.0, gather - 2 * attn_fwd)
        ep_comm = 0.0
        if moe and ep > 1:
            grp = comm_model.place(ep, tp, g)
            # Dispatch in the matmul dtype (fp8 training sends fp8), combine in 16 bits.
            a2a = sum(comm_model.dispatch_time(spec.dim * nbytes, tokens, spec.top_k, grp, hw,
                                               wl.ep_node_limit)
                      for nbytes in (DTYPE_BYTES[wl.compute_dtype], wl.act_bytes))
            ep_comm = passes * a2a
            if wl.overlap_ep:  # DualPipe-style: hidden behind another micro-batch's compute
                ep_comm = max(0.0, ep_comm - (fwd + bwd + recompute))
        working = saved_bytes(w, tp, sp, "none") if ac == "full" else 0.0
        return LayerTimes(fwd, bwd, wgrad, recompute, tp_comm, cp_comm, ep_comm,
                          w.model_flops, rec_flops, saved_bytes(w, tp, sp, ac), working)

    def _tp_comm(self, act: float, tp: int, sp: bool, ac: str, gemm: float,
                 replay_gemm: float) -> float:
        """Exposed tensor-parallel seconds of one layer and micro-batch
        ([Note: tensor-parallel collectives]); ``act``: bytes of the layer's activation,
        ``gemm``: its forward multiplies' seconds, ``replay_gemm``: those ``alternate_mm``
        replays."""
        hw = self.hw
        grp = comm_model.place(tp, 1, hw.gpus_per_node)
        if sp:  # all-gathers before both column-parallel blocks, reduce-scatters after
            gathers = 2 * comm_model.all_gather_time(act / tp, grp, hw)
            one = gathers + 2 * comm_model.reduce_scatter_time(act / tp, grp, hw)
        else:  # an all-reduce after each row-parallel block
            gathers = one = 2 * comm_model.all_reduce_time(act, grp, hw)
        forward = [(one, gemm)]  # (collective seconds, multiplies they can hide behind)
        if ac == "full":
            forward.append((one, gemm))
        elif ac == "selective" and self.wl.selective_ac == "alternate_mm":
            forward.append((gathers, replay_gemm))  # reduce-scatter outputs are kept
        if self.wl.overlap_tp:
            f = self.wl.overlap_tp_fraction  # fused: hidden up to the multiplies' time
            return one + sum((1 - f) * c + max(0.0, f * c - m) for c, m in forward)
        return one + sum(c for c, _ in forward)

    # ------------------------------------------------------------------ one rank
    def rank(self, L, layers: list[int], first: bool, last: bool) -> RankTimes:
        """Per-micro-batch totals of a pipeline rank holding ``layers``."""
        spec = self.spec
        sums = [0.0] * 10
        working = 0.0
        for moe, ac, count in self._layer_kinds(layers, L.ac):
            t = self.layer(moe, L.tp, L.cp, L.sp, L.ep, L.microbatch, ac)
            vals = (t.fwd, t.bwd + t.recompute, t.wgrad, t.tp_comm, t.cp_comm, t.ep_comm,
                    t.model_flops, t.recompute_flops, t.saved, 0.0)
            sums = [a + count * b for a, b in zip(sums, vals, strict=True)]
            working = max(working, t.working)
        fwd, bwd, wgrad, tpc, cpc, epc, flops, rflops, saved, _ = sums
        tokens = L.microbatch * self.wl.seq_len / L.cp
        logits = 0.0
        mm, ker = self._cpu_compose()  # [Note: composed blocks]
        ef, eb = self._head_kernels(L, tokens, first, last)
        fwd, bwd = fwd + ker * ef, bwd + ker * eb
        if self.hw.cpu is not None:
            tpc += tp_head_comm(self.hw, tokens, spec.dim, self.wl.act_bytes, L.tp, L.sp,
                                first, last)
        if last:
            hf, _, logits = head_work(spec, tokens, L.tp, self.wl.act_bytes)
            head = mm * self.hw.matmul_time(hf, self.wl.compute_dtype)
            fwd, bwd, wgrad = fwd + head, bwd + 2 * head, wgrad + head
            saved += head_saved(spec, tokens, L.tp, L.sp, self.wl.act_bytes,
                                self.wl.fused_kernels)
            flops += hf
            if spec.mtp_layers:  # DeepSeek's multi-token prediction: one more layer + head
                t = self.layer(spec.is_moe, L.tp, L.cp, L.sp, L.ep, L.microbatch, L.ac)
                k = spec.mtp_layers
                fwd, bwd = fwd + k * (t.fwd + head), bwd + k * (t.bwd + t.recompute + 2 * head)
                flops += k * (t.model_flops + hf)
                saved += k * t.saved
        if per_param := self.accum_bytes(L):  # [Note: gradient accumulation]
            acc = self._accum_seconds(L, layers, first, last, per_param, ker)
            bwd, wgrad = bwd + acc, wgrad + acc
        return RankTimes(fwd, bwd, wgrad, tpc, cpc, epc, flops, rflops, saved, working,
                         logits, len(layers))

    def accum_bytes(self, L) -> float:
        """Bytes per parameter one micro-batch's backward moves, on average over the step's
        micro-batches, to accumulate the weight gradients ([Note: gradient accumulation]):
        autograd's add after the first micro-batch, and the stack's own pass on every one."""
        m = L.pp_microbatches
        if m == 1:  # nothing to accumulate
            return 0.0
        per_param = self.wl.grad_accum_bytes
        if self.wl.autograd_accum:
            per_param += 3 * self.wl.act_bytes * (m - 1) / m
        return per_param

    def _accum_seconds(self, L, layers: list[int], first: bool, last: bool,
                       per_param: float, ker: float) -> float:
        """Seconds of one micro-batch's gradient accumulation, ``per_param`` bytes per
        parameter the rank holds whole (its tensor- and expert-parallel shards): at the
        memory bandwidth, or on CPU ranks as the calibrated elementwise add (the
        ``residual`` kernel, one call per parameter tensor, a pass being 3 words a
        parameter) with the layers' kernel factor ``ker``."""
        shapes = [s for i in layers for s in self.spec.block_shapes(i, L.tp, L.ep)]
        shapes += self.spec.root_shapes(L.tp, first, last)
        if cpu_pricable(self.hw, self.spec):
            adds = sum(self.hw.cpu.kernel("residual", math.prod(s)) for s in shapes)
            passes = per_param / (3 * self.wl.act_bytes)
            return ker * passes * adds / self.hw.memory_efficiency
        return self.hw.memory_time(per_param * sum(math.prod(s) for s in shapes))

    def _head_kernels(self, L, tokens: float, first: bool, last: bool) -> tuple[float, float]:
        """(forward, backward) seconds of the embedding and the loss (the head's multiply
        aside): their kernels on CPU ranks, else the bytes they move."""
        spec, wl = self.spec, self.wl
        if cpu_pricable(self.hw, spec):
            return head_kernels(self.hw, spec, tokens, L.tp, L.sp, first, last)
        fwd = bwd = 0.0
        if first:
            emb = self.hw.memory_time(tokens * spec.dim * (2 * wl.act_bytes + 4))
            fwd, bwd = fwd + emb / 3, bwd + 2 * emb / 3
        if last:
            loss = self.hw.memory_time(head_work(spec, tokens, L.tp, wl.act_bytes)[1])
            fwd, bwd = fwd + loss / 2, bwd + loss / 2
        return fwd, bwd

    def _layer_kinds(self, layers: list[int], ac: str) -> list[tuple[bool, str, int]]:
        """(MoE feed-forward, checkpointing policy, how many) over ``layers``."""
        kinds = Counter((self.spec.is_moe_layer(i), layer_ac(ac, self.wl.selective_ac, i))
                        for i in layers)
        return [(moe, a, n) for (moe, a), n in sorted(kinds.items())]
