"""A calibrated CPU rank as the planner prices it: the trainer's eager kernels, update and
Gloo collectives from the calibration's fits ([Note: CPU kernels] in costs.py), the cores'
time-sharing and contention (step.py), the engine's buffers replayed (engine_buffers.py).
What the calibration did not measure (a MoE or GPT-style layer, fp8, the expert
all-to-all) falls back to the roofline of the GPU device model; a low-bit recipe runs
emulated on CPU ranks, its casts priced at the calibrated memory bandwidth.

    dev = CpuDevice(get_hardware("local"))       # needs a calibration with its [cpu] table
    dev.all_gather(shard_bytes, comm_model.place(2, 1, 2))
"""

from __future__ import annotations

import math

from shardwise.planner import comm_model
from shardwise.planner.devices.cpu import step
from shardwise.planner.devices.cpu.engine_buffers import rank_transient
from shardwise.planner.devices.cpu.kernels import (attention_kernels, cpu_pricable,
                                                   head_kernels, layer_kernels,
                                                   optimizer_seconds)
from shardwise.planner.devices.gpu import GpuDevice
from shardwise.planner.recipe_cost import recipe_seconds
from shardwise.planner.sends import LOSS_ALL_REDUCES, TP_REGIONS, tp_edges, tp_region
from shardwise.planner.work import layer_work

__all__ = ["CpuDevice"]


class CpuDevice:
    """The device model of CPU ranks (protocol: devices/base.py).

    Args:
        hw: a hardware entry with its calibration's CPU costs (``hw.cpu``).
    """

    def __init__(self, hw) -> None:
        self.hw = hw
        self.roofline = GpuDevice(hw)  # what the calibration did not measure

    # ------------------------------------------------------------------ compute
    def layer_seconds(self, spec, wl, w, tp: int, sp: bool, moe: bool
                      ) -> tuple[float, float, float, float]:
        """The multiplies on the calibrated efficiency curve and the other kernels' fits,
        each composed as the calibration's blocks ([Note: composed blocks] in costs.py)."""
        if wl.compute_dtype == "fp8" or not cpu_pricable(spec, moe):
            return self.roofline.layer_seconds(spec, wl, w, tp, sp, moe)
        gemm = sum(n * self.hw.matmul_time(f, wl.compute_dtype) for f, n in w.gemms)
        kf, kb = layer_kernels(self.hw, spec, w.tokens, wl.seq_len, tp, sp, w.attn_exec_flops,
                               w)
        mm, ker = self.composition(spec)
        fwd, bwd, wgrad, cheap = (mm * gemm + ker * kf, 2 * mm * gemm + ker * kb, mm * gemm,
                                  ker * kf)
        if w.lowbit is not None:  # emulated on CPUs; casts not calibrated: the roofline's
            rs = recipe_seconds(self.hw, wl, w)
            fwd, bwd, wgrad = fwd + rs.fwd, bwd + rs.bwd, wgrad + rs.wgrad
            cheap += rs.cast_fwd
        return fwd, bwd, wgrad, cheap

    def attention_seconds(self, spec, wl, w, tp: int) -> tuple[float, float]:
        """The attention core's calibrated kernels (per block under context parallelism:
        [Note: context-parallel kernels] in kernels.py) with the kernels' factor."""
        if wl.compute_dtype == "fp8" or not cpu_pricable(spec):
            return self.roofline.attention_seconds(spec, wl, w, tp)
        f, b = attention_kernels(self.hw, spec, w, wl.seq_len, tp)
        ker = self.composition(spec)[1]
        return ker * f, ker * b

    def layer_parts(self, spec, wl, tp: int, sp: bool, mb: int) -> tuple[float, float, float]:
        """(forward multiplies, forward kernels, backward kernels) seconds of one dense
        layer of ``mb`` sequences, no composition factor (the calibration's blocks are
        priced by them; the backward multiplies are twice the forward's)."""
        s = wl.seq_len
        w = layer_work(spec, False, mb * s, s, tp, 1, wl.attention, wl.act_bytes,
                       wl.fused_kernels, wl.fused_norm)
        gemm = sum(n * self.hw.matmul_time(f, wl.compute_dtype) for f, n in w.gemms)
        kf, kb = layer_kernels(self.hw, spec, w.tokens, s, tp, sp, w.attn_exec_flops)
        return gemm, kf, kb

    def composition(self, spec) -> tuple[float, float]:
        """The calibration's (``compose``, ``kernel_compose``) for a model whose layers the
        kernels price; (1, 1) otherwise (a MoE model's included)."""
        if not cpu_pricable(spec, spec.is_moe):
            return 1.0, 1.0
        return self.hw.cpu.compose, self.hw.cpu.kernel_compose

    def edge_seconds(self, spec, wl, tokens: float, tp: int, sp: bool, first: bool,
                     last: bool) -> tuple[float, float]:
        if not cpu_pricable(spec):
            return self.roofline.edge_seconds(spec, wl, tokens, tp, sp, first, last)
        return head_kernels(self.hw, spec, tokens, tp, sp, first, last)

    def accumulate_seconds(self, spec, wl, shapes: list, per_param: float,
                           kernel_factor: float) -> float:
        """The calibrated elementwise add (the ``residual`` kernel, one call per parameter
        tensor, a pass being 3 words a parameter) with the layers' kernel factor."""
        if not cpu_pricable(spec):
            return self.roofline.accumulate_seconds(spec, wl, shapes, per_param, kernel_factor)
        adds = sum(self.hw.cpu.kernel("residual", math.prod(s)) for s in shapes)
        passes = per_param / (3 * wl.act_bytes)
        return kernel_factor * passes * adds / self.hw.memory_efficiency

    def optimizer_seconds(self, units: list, world: int, experts: bool, nbytes: float
                          ) -> float:
        if experts:
            return self.roofline.optimizer_seconds(units, world, experts, nbytes)
        return optimizer_seconds(self.hw, units, world)

    # ------------------------------------------------------------------ communication
    def _measured(self, kind: str, g, nbytes: float, fallback) -> float:
        """The calibration's fit for ``kind`` on ``g``, else ``fallback()``."""
        if g.size <= 1:
            return 0.0
        t = self.hw.cpu.collective(kind, g.size, nbytes)
        return fallback() if t is None else t

    def all_gather(self, shard_bytes: float, g) -> float:
        return self._measured("all_gather", g, shard_bytes,
                              lambda: self.roofline.all_gather(shard_bytes, g))

    def reduce_scatter(self, shard_bytes: float, g) -> float:
        return self._measured("reduce_scatter", g, shard_bytes,
                              lambda: self.all_gather(shard_bytes, g))

    def all_reduce(self, nbytes: float, g) -> float:
        return self._measured("all_reduce", g, nbytes, lambda: self.roofline.all_reduce(nbytes, g))

    def dispatch(self, token_bytes: float, tokens: float, top_k: int, g,
                 node_limit: int = 0) -> float:
        return self.roofline.dispatch(token_bytes, tokens, top_k, g, node_limit)

    def p2p(self, nbytes: float, across_nodes: bool) -> float:
        """The calibrated send/receive pair (one message each way, as a ring step and a
        pipeline send exchange them)."""
        t = self.hw.cpu.collective("send_recv", 2, nbytes)
        return self.roofline.p2p(nbytes, across_nodes) if t is None else t

    def all_to_all(self, nbytes: float, g) -> float:
        """The calibrated reduce-scatter whose shard is ``nbytes / g.size``: on Gloo the
        engine's reduce-scatter is that all-to-all (``all_to_all_single`` of the whole
        tensor) plus a local sum ([Note: reduce-scatter on Gloo] in
        shardwise/distributed/comm), so its fit prices the exchange (and the sum, a little
        above it)."""
        return self._measured("reduce_scatter", g, nbytes / g.size,
                              lambda: self.roofline.all_to_all(nbytes, g))

    def _tp_times(self, wl, tokens: float, dim: int, tp: int) -> dict[str, float]:
        grp = comm_model.place(tp, 1, self.hw.gpus_per_node)
        act = tokens * dim * wl.act_bytes
        return {"all_gather": self.all_gather(act / tp, grp),
                "reduce_scatter": self.reduce_scatter(act / tp, grp),
                "all_reduce": self.all_reduce(act, grp)}

    def tp_seconds(self, wl, tokens: float, dim: int, tp: int, sp: bool, ac: str,
                   gemm: float, replay_gemm: float) -> float:
        """Every collective apply_tp issues, one after another (a full recomputation
        replays the forward's; [Note: tensor-parallel collectives] in sends.py)."""
        t = self._tp_times(wl, tokens, dim, tp)
        region = tp_region(sp)
        fwd = sum(t[c.kind] for c in region["forward"])
        bwd = sum(t[c.kind] for c in region["backward"])
        return TP_REGIONS * (fwd * (2 if ac == "full" else 1) + bwd)

    def tp_edge_seconds(self, wl, tokens: float, dim: int, tp: int, sp: bool, first: bool,
                        last: bool) -> float:
        """The embedding's, head's and loss's collectives, one after another."""
        if tp <= 1:
            return 0.0
        t = self._tp_times(wl, tokens, dim, tp)
        total = 0.0
        if first:
            total += sum(t[c.kind] for c in tp_edges(sp, True, False))
        if last:
            grp = comm_model.place(tp, 1, self.hw.gpus_per_node)
            total += sum(t[c.kind] for c in tp_edges(sp, False, True))
            total += LOSS_ALL_REDUCES * self.all_reduce(tokens * 4, grp)
        return total

    # ------------------------------------------------------------------ the step
    def overlaps(self, ranks: int) -> bool:
        """Collectives overlap compute only while a core is left for Gloo's threads
        ([Note: CPU ranks share the cores] in step.py)."""
        return not step.saturated(self.hw, ranks)

    def transient_bytes(self, cm, L, layers: list, first: bool, last: bool, states,
                        tokens: float) -> tuple[float, float, float]:
        """The engine's schedule replayed ([Note: buffer replay] in engine_buffers.py),
        plus the one gathered sequence-parallel input apply_tp tracks at a time."""
        if not self.hw.cores:
            return self.roofline.transient_bytes(cm, L, layers, first, last, states, tokens)
        wl = cm.wl
        unsharded, comm, full_grads = cm.cached(
            ("replay", L.tp, L.ep, L.dp_shard, L.cp, L.zero, L.pp, L.pp_microbatches,
             L.comm_weights, L.comm_grads, tuple(layers), first, last),
            lambda: rank_transient(cm.spec, wl, L, layers, first, last))
        comm += tokens * cm.spec.dim * wl.act_bytes if L.tp > 1 and L.sp else 0.0
        return unsharded, comm, full_grads

    def combine(self, cm, L, breakdown: dict[str, float], layers: list, first: bool,
                last: bool) -> dict[str, float]:
        """The cores' contention, the engine's copies and the cores' time-sharing
        ([Note: CPU ranks share the cores] in step.py)."""
        return step.combine(self.hw, cm, L, breakdown, layers, first, last)

    def crowded(self, ranks: int) -> bool:
        """Whether ``ranks`` ranks beyond the cores meet their smaller groups' collectives
        crowded ([Note: crowded collectives] in step.py)."""
        c = self.hw.cpu
        return bool(c.crowded) and c.in_world(ranks, self.hw.cores) is not c

    def in_world(self, ranks: int, gap_s: float | None = None) -> CpuDevice:
        return CpuDevice(self.hw.replace(cpu=self.hw.cpu.in_world(ranks, self.hw.cores,
                                                                  gap_s)))
