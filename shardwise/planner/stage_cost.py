"""Seconds and bytes of one micro-batch on one pipeline rank: its layers, embedding and head.

A layer's work (work.py: its multiplies, kernels' bytes and saved activations) is priced by
the device model (devices/: per-layer compute seconds, per-collective seconds); this module
adds up what a pipeline rank runs per micro-batch: its layers under their checkpointing
policies, the embedding and head, the exposed tensor-, context- and expert-parallel
communication (what each sends: sends.py), and the gradient accumulation. Expert
all-to-alls are counted as exposed unless the workload overlaps them (then only what
exceeds the compute they hide behind); context-parallel exchanges as below.

[Note: context-parallel exposure] What a context-parallel layer exposes, from what it sends
(sends.py, [Note: context-parallel sends]), each message and the attention priced by the
device model (its own links or calibrated Gloo calls, its own attention kernels):

- a ring step's transfer is posted before that step's block is computed, so per step only
  ``max(0, transfer - block compute)`` is exposed, the block being the step's share of the
  rank's causal entries times its attention forward (or backward); in the backward the
  transfer in flight during a block is the next key/value block and the previous step's
  ``dK``, ``dV``, and the last ``dK``, ``dV`` arrive after the last block, exposed whole.
  Where the device hides no communication behind compute (``DeviceModel.overlaps``: CPU
  ranks on saturated cores, whose Gloo threads need the cores the blocks run on: [Note:
  CPU ranks share the cores]) every transfer is exposed. Measured on 2 Gloo ranks on 2
  cores (debug, 1024 tokens, cp 2 ring), a layer's forward and backward waited 1.0 and
  5.6 ms beyond their compute threads' time: one key/value block forward, and backward
  the block and two gradient blocks, about 1.9 ms each at the calibrated send/receive;
  the overlapped rule would have exposed only the last, 1.25 ms;
- Ulysses' all-to-alls (four a pass) run before and after the attention, exposed whole;
- hybrid is both, the all-to-alls over its groups of ``u``, the ring over the groups;
- Llama 3's all-gather hides behind the layer's attention forward, its backward's
  reduce-scatter behind twice that (as the planner priced every cp layout before);
- full recomputation replays the forward's exchanges (the operator runs again).

The groups sit on the mesh as ``apply_cp`` builds them: the cp ranks just outside tp, an
all-to-all group of ``u`` consecutive cp ranks, a ring of every ``u``-th.

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
(its gradient goes straight to the reduction). The device prices it (at the memory
bandwidth, or on CPU ranks as the calibrated elementwise add), averaged over the
micro-batches, on the weight-gradient part of each one's backward, so it lengthens each
slot of the pipeline. Per slot it costs ``bytes x flop rate / (8 x tokens per micro-batch
x bandwidth)`` of the layers' time with full recomputation, whatever the model's size:
about 4% for 6 bytes and one 2048-token sequence on an A100.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass

from shardwise.planner import comm_model
from shardwise.planner.pipeline import placement
from shardwise.planner.recipe_cost import multiply_seconds
from shardwise.planner.recipe_work import recipe_work
from shardwise.planner.recompute import (alternate_mm_saved, layer_ac, replayed_matmuls,
                                         stack_saved_delta, up_projection_flops)
from shardwise.planner.sends import ContextSends, context_sends
from shardwise.planner.work import head_saved, head_work, layer_work, saved_bytes
from shardwise.planner.workload import DTYPE_BYTES, PP_SPLITS

__all__ = ["LayerTimes", "RankTimes", "StageCoster", "stage_layers", "stage_bounds",
           "fbw_seconds", "cp_exposed_seconds"]


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


def fbw_seconds(rt: RankTimes) -> tuple[float, float, float]:
    """A rank's forward, backward and weight-gradient seconds per micro-batch with its
    exposed communication folded in (what a pipeline schedule replays)."""
    comm = rt.tp_comm + rt.cp_comm + rt.ep_comm
    share = rt.fwd / (rt.fwd + rt.bwd) if rt.fwd + rt.bwd else 0.5
    return rt.fwd + comm * share, rt.bwd + comm * (1 - share), rt.wgrad


def stage_bounds(n_layers: int, chunks: int, split: str = "even") -> list[range]:
    """Each pipeline stage's layers, in order.

    [Note: stage splits] "even": the first ``n_layers % chunks`` stages one layer longer
    (the planner's default). "ends": the embedding and the head each count as one layer,
    so ``n_layers + 2`` slots split evenly and the first and the last stage hold one layer
    fewer: Llama 3 balances its pipeline so (arXiv:2407.21783 Section 3.3.2: "we reduce one
    Transformer layer each from the first and the last stages"), BigScience's BLOOM
    partition counts the tied embedding as a layer (tr11-176B-ml README), and torchtitan's
    generated split points at 9dec370 (``pipelining_utils.generate_split_points``: the
    remainder on the middle stages) give the same stages for Llama 3.1 405B's 126 layers
    over 8 or 16 stages (15/16/15 and 7/8/7 layers).

    Raises:
        ValueError: an unknown ``split``.
    """
    if split not in PP_SPLITS:
        raise ValueError(f"pp_split={split!r}, expected one of {', '.join(PP_SPLITS)}")
    ends = split == "ends" and chunks > 1
    base, extra = divmod(n_layers + (2 if ends else 0), chunks)
    sizes = [base + (1 if c < extra else 0) for c in range(chunks)]
    if ends:
        sizes[0] -= 1
        sizes[-1] -= 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append(range(start, start + size))
        start += size
    return bounds


@functools.lru_cache(maxsize=4096)
def stage_layers(n_layers: int, pp: int, virtual: int, schedule: str = "1f1b",
                 split: str = "even") -> list[tuple[list[int], bool, bool]]:
    """Per pipeline rank: (its layer indices, whether it holds the embedding, whether it
    holds the final norm and head). ``pp x virtual`` stages split the layers in order as
    ``split`` says (:func:`stage_bounds`) and sit on ranks as the schedule places them
    (``pipeline.placement``: looped, or a V where rank 0 holds the first and last).
    Cached (the search asks for the same split once per layout priced): callers read the
    lists, never change them."""
    chunks = pp * virtual
    bounds = stage_bounds(n_layers, chunks, split)
    place = placement(schedule, pp, virtual)
    return [([i for c in range(chunks) if place[c] == r for i in bounds[c]],
             place[0] == r, place[-1] == r) for r in range(pp)]


class StageCoster:
    """Prices layers and pipeline ranks for one model, device model and workload (cached).

    Args:
        spec: the :class:`~shardwise.planner.spec.ModelSpec`.
        device: its device model (``devices.registry.device_model(hw)``).
        wl: the :class:`~shardwise.planner.workload.Workload`.
    """

    def __init__(self, spec, device, wl) -> None:
        self.spec, self.device, self.hw, self.wl = spec, device, device.hw, wl
        self._layers: dict[tuple, LayerTimes] = {}
        self._accum: dict[tuple, float] = {}

    # ------------------------------------------------------------------ one layer
    def layer(self, moe: bool, tp: int, cp: int, sp: bool, ep: int, mb: int, ac: str,
              cp_impl: str = "ring", overlap: bool = True, offered: bool = False
              ) -> LayerTimes:
        """One layer (``moe``: a mixture-of-experts feed-forward) for one micro-batch of
        ``mb`` sequences under checkpointing policy ``ac`` (cached); ``overlap``: whether
        the device hides communication behind compute for this many ranks
        (``DeviceModel.overlaps``); ``offered``: the low-bit recipe's weights arrive as fp8
        codes from ZeRO-3's gathers (:meth:`offered`)."""
        key = (moe, tp, cp, sp, ep, mb, ac, cp_impl if cp > 1 else "ring",
               overlap if cp > 1 else True, offered)
        if key not in self._layers:
            self._layers[key] = self._price_layer(*key)
        return self._layers[key]

    def offered(self, L) -> bool:
        """Whether layout ``L`` gathers the recipe's weights as fp8 codes that go straight
        into the multiplies: fp8_tensorwise with ``comm_weights=fp8`` at ZeRO stage 3
        ([Note: pricing a low-bit recipe] in recipe_cost.py)."""
        return (self.wl.matmul_recipe == "fp8_tensorwise" and L.zero == 3
                and L.comm_weights == "fp8")

    def work(self, moe: bool, tp: int, cp: int, sp: bool, ep: int, mb: int,
             cp_impl: str = "ring", offered: bool = False):
        """(one layer's ``LayerWork`` for a micro-batch of ``mb`` sequences, its ``lowbit``
        set under a low-bit recipe, and the context-parallel sends or None)."""
        s, wl, spec = self.wl.seq_len, self.wl, self.spec
        tokens = mb * s / cp
        sends = context_sends(spec, cp_impl, cp, tp, mb, s, wl.act_bytes) if cp > 1 else None
        blocks = {} if sends is None or sends.impl == "allgather" else dict(
            cp_scores=mb * sends.scores, cp_calls=sends.blocks, cp_area=mb * sends.area,
            cp_queries=mb * sends.queries)
        w = layer_work(spec, moe, tokens, s, tp, ep, wl.attention, wl.act_bytes,
                       wl.fused_kernels, wl.fused_norm, **blocks)
        if wl.matmul_recipe != "none":
            keeps = wl.attention == "flash" and not blocks  # wo reads the kernel's output
            w = dataclasses.replace(w, lowbit=recipe_work(
                spec, moe, tokens, tp, ep, wl.matmul_recipe, wl.act_bytes,
                wl.fused_kernels, offered, sp, keeps))
        return w, sends

    def _price_layer(self, moe, tp, cp, sp, ep, mb, ac, cp_impl, overlap, offered
                     ) -> LayerTimes:
        s, wl, hw, spec = self.wl.seq_len, self.wl, self.hw, self.spec
        tokens = mb * s / cp
        w, sends = self.work(moe, tp, cp, sp, ep, mb, cp_impl, offered)
        fwd, bwd, wgrad, cheap = self.device.layer_seconds(spec, wl, w, tp, sp, moe)
        replayed = replayed_matmuls(spec, moe, tokens, tp, w.gemms) \
            if ac == "selective" and wl.selective_ac == "alternate_mm" else []
        if ac == "selective" and wl.mla_up_recompute and spec.is_mla:
            # recompute.py [Note: DeepSeek-V3's activation storage]
            replayed = replayed + up_projection_flops(spec, w.gemms)
        replay_gemm = self.device.composition(spec)[0] * sum(
            multiply_seconds(hw, wl, w, f) for f in replayed) / (1 - wl.comm_sm_fraction)
        recompute = {"none": 0.0, "selective": cheap + replay_gemm, "full": fwd}[ac]
        sel_flops = (w.attn_model_flops if wl.attention != "flash" else 0.0) + sum(replayed)
        rec_flops = {"none": 0.0, "selective": sel_flops, "full": w.model_flops}[ac]
        passes = 3 if ac == "full" else 2  # forward, backward (+ the replayed forward)
        g, dev = self.hw.gpus_per_node, self.device
        tp_comm = 0.0
        if tp > 1:  # [Note: tensor-parallel collectives] in sends.py
            tp_comm = dev.tp_seconds(wl, tokens, spec.dim, tp, sp, ac, wgrad, replay_gemm)
        cp_comm = 0.0
        if sends is not None:  # [Note: context-parallel exposure]
            attn = dev.attention_seconds(spec, wl, w, tp)
            cp_comm = cp_exposed_seconds(dev, sends, attn, tp, g, passes - 1, overlap)
        ep_comm = 0.0
        if moe and ep > 1:
            grp = comm_model.place(ep, tp, g)
            # Dispatch in the matmul dtype (fp8 training sends fp8), combine in 16 bits.
            a2a = sum(dev.dispatch(spec.dim * nbytes, tokens, spec.top_k, grp, wl.ep_node_limit)
                      for nbytes in (DTYPE_BYTES[wl.compute_dtype], wl.act_bytes))
            ep_comm = passes * a2a
            if wl.overlap_ep:  # DualPipe-style: hidden behind another micro-batch's compute
                ep_comm = max(0.0, ep_comm - (fwd + bwd + recompute))
        # A recipe's saved codes count without checkpointing only
        # ([Note: what a recipe saves] in recipe_work.py).
        codes = w.lowbit.saved_delta if w.lowbit is not None else 0.0
        working = saved_bytes(w, tp, sp, "none") + codes if ac == "full" else 0.0
        saved = saved_bytes(w, tp, sp, ac) + (codes if ac == "none" else 0.0)
        if ac == "selective":  # what the stack keeps ([Note: what alternate_mm keeps])
            if wl.selective_ac == "alternate_mm" and not (moe or spec.is_mla):
                saved = alternate_mm_saved(spec, tokens, tp, sp, wl.act_bytes)
            saved += stack_saved_delta(spec, wl, moe, tokens, tp, sp)
        return LayerTimes(fwd, bwd, wgrad, recompute, tp_comm, cp_comm, ep_comm,
                          w.model_flops, rec_flops, saved, working)

    # ------------------------------------------------------------------ one rank
    def rank(self, L, layers: list[int], first: bool, last: bool) -> RankTimes:
        """Per-micro-batch totals of a pipeline rank holding ``layers``."""
        spec = self.spec
        sums = [0.0] * 10
        working = 0.0
        overlap, offered = self.device.overlaps(L.gpus), self.offered(L)
        for moe, ac, count in self._layer_kinds(layers, L.ac):
            t = self.layer(moe, L.tp, L.cp, L.sp, L.ep, L.microbatch, ac, L.cp_impl, overlap,
                           offered)
            vals = (t.fwd, t.bwd + t.recompute, t.wgrad, t.tp_comm, t.cp_comm, t.ep_comm,
                    t.model_flops, t.recompute_flops, t.saved, 0.0)
            sums = [a + count * b for a, b in zip(sums, vals, strict=True)]
            working = max(working, t.working)
        fwd, bwd, wgrad, tpc, cpc, epc, flops, rflops, saved, _ = sums
        tokens = L.microbatch * self.wl.seq_len / L.cp
        logits = 0.0
        dev = self.device
        mm, ker = dev.composition(spec)
        ef, eb = dev.edge_seconds(spec, self.wl, tokens, L.tp, L.sp, first, last)
        fwd, bwd = fwd + ker * ef, bwd + ker * eb
        tpc += dev.tp_edge_seconds(self.wl, tokens, spec.dim, L.tp, L.sp, first, last)
        if last:
            hf, _, logits = head_work(spec, tokens, L.tp, self.wl.act_bytes)
            if self.wl.loss_grad_fp32:  # 12 (16: loss_parallel) bytes a logit in
                peak = 16 if L.tp > 1 else 12  # backward, 4 of them counted as saved
                logits *= (peak - 4) / (self.wl.act_bytes + 4)
            head = mm * self.hw.matmul_time(hf, self.wl.compute_dtype)
            fwd, bwd, wgrad = fwd + head, bwd + 2 * head, wgrad + head
            saved += head_saved(spec, tokens, L.tp, L.sp, self.wl.act_bytes,
                                self.wl.fused_kernels)
            flops += hf
            if spec.mtp_layers:  # DeepSeek's multi-token prediction: one more layer + head
                t = self.layer(spec.is_moe, L.tp, L.cp, L.sp, L.ep, L.microbatch, L.ac,
                               L.cp_impl, overlap, offered)
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
        parameter the rank holds whole (its tensor- and expert-parallel shards), priced by
        the device with the layers' kernel factor ``ker``. Cached by the rank's count of
        dense and MoE blocks (a block's shapes depend on its index only through whether it
        is MoE): listing every block's shapes for every layout priced was half the search
        time of a 10T MoE (docs/planner.md, "Ten trillion parameters")."""
        moe = sum(1 for i in layers if self.spec.is_moe_layer(i))
        key = (L.tp, L.ep, len(layers) - moe, moe, first, last, per_param, ker)
        if key not in self._accum:
            shapes = [s for i in layers for s in self.spec.block_shapes(i, L.tp, L.ep)]
            shapes += self.spec.root_shapes(L.tp, first, last)
            self._accum[key] = self.device.accumulate_seconds(self.spec, self.wl, shapes,
                                                              per_param, ker)
        return self._accum[key]

    def _layer_kinds(self, layers: list[int], ac: str) -> list[tuple[bool, str, int]]:
        """(MoE feed-forward, checkpointing policy, how many) over ``layers``."""
        kinds = Counter((self.spec.is_moe_layer(i), layer_ac(ac, self.wl.selective_ac, i))
                        for i in layers)
        return [(moe, a, n) for (moe, a), n in sorted(kinds.items())]


def cp_exposed_seconds(dev, sends: ContextSends, attn: tuple[float, float], tp: int,
                       gpus_per_node: int, replays: int = 1, overlap: bool = True) -> float:
    """Exposed seconds of one layer's context-parallel exchanges per micro-batch ([Note:
    context-parallel exposure]).

    Args:
        dev: the device model pricing each message.
        sends: what the layer sends (``sends.context_sends``).
        attn: the rank's attention (forward, backward) seconds (``dev.attention_seconds``).
        tp: the tensor-parallel degree (the cp ranks' stride on the mesh).
        gpus_per_node: ranks per node (the groups' placement).
        replays: how often the forward runs (2 with full recomputation).
        overlap: whether the device hides transfers behind compute at all
            (``DeviceModel.overlaps``: CPU ranks on saturated cores do not).
    """
    fwd_attn, bwd_attn = attn if overlap else (0.0, 0.0)
    if sends.impl == "allgather":
        grp = comm_model.place(sends.cp, tp, gpus_per_node)
        gather = dev.all_gather(sends.gather, grp)
        scatter = dev.reduce_scatter(sends.gather, grp)
        return max(0.0, gather - fwd_attn) * replays + max(0.0, scatter - 2 * fwd_attn)
    a2a_grp = comm_model.place(sends.ulysses, tp, gpus_per_node)
    a2a = sum(dev.all_to_all(t, a2a_grp) for t in sends.a2a)
    fwd = bwd = a2a
    n = sends.ring
    if n > 1:
        ring_grp = comm_model.place(n, sends.ulysses * tp, gpus_per_node)
        kv = dev.p2p(sends.kv, ring_grp.nodes > 1)
        dkv = dev.p2p(sends.dkv, ring_grp.nodes > 1)
        for s, share in enumerate(sends.steps):
            nxt = kv if s < n - 1 else 0.0
            fwd += max(0.0, nxt - share * fwd_attn)
            bwd += max(0.0, nxt + (dkv if s > 0 else 0.0) - share * bwd_attn)
        bwd += dkv  # the last block's dK, dV, behind nothing
    return fwd * replays + bwd
