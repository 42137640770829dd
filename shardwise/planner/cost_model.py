"""Step time, memory and utilisation of one layout: :class:`CostModel`.

    cm = CostModel(get_model_spec("llama3-405b"), get_hardware("h100"),
                   Workload(seq_len=8192, global_batch=2048))
    est = cm.estimate(Layout(tp=8, pp=16, dp_shard=128, pp_schedule="1f1b",
                             pp_microbatches=16, ac="full"))
    est.step_time, est.memory.total, est.mfu, est.bottleneck

[Note: step time] The busiest pipeline rank sets the pace. Per micro-batch it spends
forward + backward (+ recomputation) seconds and the exposed tensor-, context- and expert-
parallel communication of its layers (stage_cost.py, priced by the device model: devices/);
a step runs ``pp_microbatches`` of them, plus the schedule's bubble (pipeline.py), the exposed
pipeline sends, the exposed data-parallel collectives, and the optimizer step (HBM-bound
on the device, or host-bound with the transfers over PCIe when offloaded). Data-parallel
collectives are priced per unit by the device model from the bytes of
:func:`shardwise.distributed.comm.byte_counts` (quantised payloads from the engine's
``packed_nbytes``) and hide behind compute as the engine schedules them: gradient
reductions behind the last micro-batch's backward, stage-3 gathers behind the computing
unit, stage-1/2 gathers behind the next forward. A stack that synchronises gradients only
after the step's last backward (``dp_sync_after_backward``: torch.distributed.pipelining
with FSDP2 disables gradient sync in every micro-batch's backward and then runs each
stage's post-backward reductions, ``PipelineStage``) leaves its reductions exposed and,
keeping parameters gathered between micro-batches, gathers once per step.

[Note: tied embeddings across stages] A model whose head reuses the embedding's weight,
split over pipeline ranks with the embedding on the first and the head on the last, keeps
one copy on each; after the step's last backward the two all-reduce that weight's gradient
(Megatron-LM's ``_allreduce_embedding_grads``, DeepSpeed's ``ReduceTiedGrads``), behind
no compute, over the pipeline's link (across nodes at any real scale), in the gradients'
reduction dtype. It is charged to ``pp_comm``. A placement where one rank holds both (the
V schedules) has nothing to reduce. With Megatron's 51200-word vocabularies it is a few
milliseconds; with BLOOM's 250880 words, fp32 gradients and 6.25 GB/s a GPU, 0.7 s a step.

Every component is reported; the largest one is the layout's ``bottleneck`` (compute
includes the device optimizer step; context-parallel exchanges count as tp_comm). The
device model says how the parts combine (``DeviceModel.combine``: a GPU adds the
engine's copies, CPU ranks their cores' contention and time-sharing), and whether one
rank's own timeline must be priced apart (``crowded``: [Note: crowded collectives] in
devices/cpu/step.py), the longer of the two winning.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from shardwise.planner import comm_model
from shardwise.planner.devices.registry import device_model
from shardwise.planner.dp_cost import dp_exposed, dp_times, scale_sync_seconds, shard_numel
from shardwise.planner.estimate import BOTTLENECKS, Estimate  # re-exported: the result
from shardwise.planner.parallel_layout import Layout
from shardwise.planner.pipeline import gather_rounds, placement, schedule_profile, weighted_peaks
from shardwise.planner.rank_memory import MemoryBreakdown, state_bytes, workload_state_kwargs
from shardwise.planner.sends import tp_calls_per_layer
from shardwise.planner.stage_cost import (RankTimes, StageCoster, fbw_seconds, stage_bounds,
                                          stage_layers)
from shardwise.planner.workload import Workload

__all__ = ["CostModel", "Estimate", "BOTTLENECKS", "FRAGMENTATION"]

FRAGMENTATION = 0.05
"""Allocator fragmentation allowance, a fraction of model states and activations."""
_OPT_BYTES = {"adamw": 30, "adam": 30, "sgd": 18}  # HBM bytes per parameter per step

Ranks = list[tuple[int, RankTimes, list[int]]]


class CostModel:
    """Prices layouts of one model on one device for one workload (see the notes).

    Args:
        spec: the :class:`~shardwise.planner.spec.ModelSpec`.
        hw: the :class:`~shardwise.planner.hardware.Hardware` entry.
        wl: the :class:`~shardwise.planner.workload.Workload`.
        device: the device model (default ``devices.registry.device_model(hw)``).

    Attributes:
        timeline_only: price one rank's own timeline, not the cores' time-sharing (the
            crowded half of [Note: crowded collectives] in devices/cpu/step.py).
    """

    def __init__(self, spec, hw, wl: Workload, device=None) -> None:
        self.spec, self.hw, self.wl = spec, hw, wl
        self.device = device if device is not None else device_model(hw)
        self.timeline_only = False
        self.stages = StageCoster(spec, self.device, wl)
        self._ranks: dict[tuple, Ranks] = {}
        self._flops: float | None = None
        self._cache: dict[tuple, object] = {}  # units, states, dp times, optimizer, recompute

    def cached(self, key: tuple, make):
        """``make()``, computed once per ``key`` for this model (device models and dp_cost
        keep their per-layout results here)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    # ------------------------------------------------------------------ one rank's timeline
    def _timeline_twin(self, L: Layout) -> "CostModel | None":
        """The model pricing ``L``'s collectives on one rank's timeline when the device
        meets them amid other ranks' work ([Note: crowded collectives] in
        devices/cpu/step.py); None otherwise."""
        if self.timeline_only or not self.device.crowded(L.gpus):
            return None
        gap = self.tp_gap(L)
        key = ("crowded", L.gpus, None if gap is None else round(gap, 6))
        return self.cached(key, lambda: self._make_twin(L.gpus, gap))

    def tp_gap(self, L: Layout) -> float | None:
        """Seconds of compute between two of the busiest rank's tensor-parallel
        collectives (None without tensor parallelism)."""
        if L.tp <= 1:
            return None
        _, rt, layers = max(self.sample_ranks(L), key=lambda x: x[1].busy)
        calls = len(layers) * tp_calls_per_layer(L.sp, L.ac == "full")
        return (rt.fwd + rt.bwd) / calls if calls else None

    def _make_twin(self, ranks: int, tp_gap: float | None) -> "CostModel":
        dev = self.device.in_world(ranks)
        cm = CostModel(self.spec, dev.hw, self.wl, device=dev)
        if tp_gap is not None:  # a fraction of a layer apart: the peers' turns are shorter
            cm.stages = StageCoster(self.spec, self.device.in_world(ranks, tp_gap), self.wl)
        cm.timeline_only = True
        return cm

    # ------------------------------------------------------------------ ranks
    def sample_ranks(self, L: Layout) -> Ranks:
        """(rank, per-micro-batch times, layers) of the pipeline ranks the closed forms
        price: the first (the most layers, uneven splits giving the first stages one more,
        and the embedding), the last (the head; rank 0 in a V) and, for a MoE model, the
        second (no dense-first layers; with ``pp_split="ends"`` the middle ranks hold the
        most layers: [Note: stage splits] in stage_cost.py)."""
        middle = (self.spec.is_moe or self.wl.pp_split == "ends") and L.pp > 2
        picks = sorted({0, L.pp - 1} | ({1} if middle else set()))
        return self._priced_ranks(L, "sample", picks)

    def all_ranks(self, L: Layout) -> Ranks:
        """(rank, per-micro-batch times, layers) of every pipeline rank."""
        return self._priced_ranks(L, "all", range(L.pp))

    def _priced_ranks(self, L: Layout, which: str, picks) -> Ranks:
        key = (which, L.tp, L.cp, L.sp, L.ep, L.pp, L.pp_virtual, L.pp_schedule, L.microbatch,
               L.ac, self.stages.accum_bytes(L), L.cp_impl if L.cp > 1 else "ring",
               self.stages.offered(L))
        if key not in self._ranks:
            plan = self.stage_plan(L)
            self._ranks[key] = [(r, self.stages.rank(L, *plan[r]), plan[r][0]) for r in picks]
        return self._ranks[key]

    def stage_plan(self, L: Layout) -> list[tuple[list[int], bool, bool]]:
        """Per pipeline rank: (layers, holds the embedding, holds the head), the layers
        split over stages as the workload's ``pp_split`` says."""
        return stage_layers(self.spec.n_layers, L.pp, L.pp_virtual, L.pp_schedule,
                            self.wl.pp_split)

    def rank_plan(self, L: Layout, r: int) -> tuple[list[int], bool, bool]:
        """(layers, holds the embedding, holds the head) of pipeline rank ``r``."""
        return self.stage_plan(L)[r]

    def units(self, L: Layout, layers: list[int], first: bool, last: bool):
        """(root unit's shapes, Counter of dense units' shapes, Counter of expert units'
        shapes) of the rank holding ``layers`` (cached)."""
        key = ("units", L.tp, L.ep, tuple(layers), first, last)
        return self.cached(key, lambda: self._make_units(L, layers, first, last))

    def _make_units(self, L: Layout, layers: list[int], first: bool, last: bool):
        root = tuple(self.spec.root_shapes(L.tp, first, last))
        dense = Counter(tuple(self.spec.block_shapes(i, L.tp, L.ep, experts=False))
                        for i in layers)
        experts = Counter(tuple(self.spec.expert_shapes(i, L.tp, L.ep)) for i in layers
                          if self.spec.is_moe_layer(i))
        return root, dense, experts

    def rank_units(self, L: Layout, layers: list[int], first: bool, last: bool) -> list:
        """Every unit's shapes on the rank holding ``layers``: the root, the dense units,
        the expert units."""
        root, dense, experts = self.units(L, layers, first, last)
        return ([root] + [u for u, n in dense.items() for _ in range(n)]
                + [u for u, n in experts.items() for _ in range(n)])

    # ------------------------------------------------------------------ memory
    def _memory(self, L: Layout, r: int, rt: RankTimes, layers, inflight: float,
                held: float | None = None) -> MemoryBreakdown:
        """Peak bytes of pipeline rank ``r``; ``held``: its saved activations at the peak
        when the schedule's replay weighed its stages ([Note: stages of unequal weight]),
        else ``inflight`` micro-batches of all its layers."""
        _, first, last = self.rank_plan(L, r)
        st = self.states(L, layers, first, last)
        optimizer = 0.0 if L.offload == "cpu" else st.optimizer
        tokens = L.microbatch * self.wl.seq_len / L.cp
        unsharded, comm, full_grads = self.device.transient_bytes(self, L, layers, first,
                                                                  last, st, tokens)
        acts = (inflight * rt.saved if held is None else held) + rt.working
        frag = FRAGMENTATION * (st.params + st.grads + optimizer + unsharded + full_grads
                                + acts)
        return MemoryBreakdown(st.params, st.grads, optimizer, unsharded, full_grads, comm,
                               acts, rt.logits, self.hw.reserved_bytes, frag, r)

    def states(self, L: Layout, layers: list[int], first: bool, last: bool):
        """Model-state bytes of the rank holding ``layers`` (cached)."""
        key = ("states", L.tp, L.ep, L.dp_shard, L.cp, L.zero, L.pp_microbatches > 1,
               tuple(layers), first, last)
        return self.cached(key, lambda: self._make_states(L, layers, first, last))

    def _make_states(self, L: Layout, layers: list[int], first: bool, last: bool):
        wl = self.wl
        root, dense, experts = self.units(L, layers, first, last)
        units = [root] + [u for u, n in dense.items() for _ in range(n)]
        kw = dict(zero=L.zero, prefetch=wl.prefetch, **workload_state_kwargs(wl),
                  accumulate=L.pp_microbatches > 1,
                  reshard_after_forward=wl.reshard_after_forward)
        st = state_bytes(units, L.dp_shard * L.cp, root=0 if root else None, **kw)
        if experts:
            ex = [u for u, n in experts.items() for _ in range(n)]
            st = st + state_bytes(ex, max(1, L.dp_shard * L.cp // L.ep), root=None, **kw)
        return st

    # ------------------------------------------------------------------ data parallel
    def dp_collective_seconds(self, L: Layout) -> float:
        """Seconds of one step's data-parallel collectives on the first pipeline rank,
        overlapped or not (what a profile of its gathers and reductions adds up to)."""
        if (twin := self._timeline_twin(L)) is not None:
            return twin.dp_collective_seconds(L)
        plan = self.rank_plan(L, 0)
        gather, _, red, _ = dp_times(self, L, *plan)
        if L.zero == 3:
            gather *= gather_rounds(L, self.wl) * (2 if self.wl.reshard_after_forward else 1)
        return gather + red + scale_sync_seconds(self, L, *plan)

    # ------------------------------------------------------------------ the step
    def lower_bound(self, L: Layout) -> float:
        """A lower bound of ``estimate(L).step_time`` (closed forms): the busiest sampled
        rank's micro-batches and the schedule's bubble, without data-parallel, pipeline-send
        and optimizer time."""
        rt = max(self.sample_ranks(L), key=lambda x: x[1].busy)[1]
        prof = schedule_profile(L.pp_schedule, L.pp, L.pp_virtual, L.pp_microbatches,
                                *fbw_seconds(rt))
        return L.pp_microbatches * rt.busy + prof.bubble_time

    def estimate(self, L: Layout, exact: bool = False) -> Estimate:
        """Price one resolved layout (assumed valid: see ``parallel_layout.check_layout``).

        Args:
            L: the layout.
            exact: price every pipeline rank and simulate the schedule the executor runs
                (see [Note: pipeline profile]); default: sampled ranks and closed forms.

        Returns:
            The :class:`Estimate`: step time and its components, memory, utilisation.
        """
        if (twin := self._timeline_twin(L)) is not None:  # [Note: crowded collectives]
            own, shared = twin.estimate(L, exact), self._estimate(L, exact)
            extra = max(0.0, shared.step_time - own.step_time)
            breakdown = {**own.breakdown, "compute": own.breakdown["compute"] + extra}
            return dataclasses.replace(own, step_time=own.step_time + extra,
                                       breakdown=breakdown)
        return self._estimate(L, exact)

    def _estimate(self, L: Layout, exact: bool) -> Estimate:
        wl, hw, spec = self.wl, self.hw, self.spec
        m = L.pp_microbatches
        ranks = self.all_ranks(L) if exact else self.sample_ranks(L)
        r_star, rt, layers = max(ranks, key=lambda x: x[1].busy)
        prof = schedule_profile(L.pp_schedule, L.pp, L.pp_virtual, m, *fbw_seconds(rt),
                                exact=exact and L.pp > 1,
                                rank_costs=[fbw_seconds(x[1]) for x in ranks] if exact else None)
        tokens = L.microbatch * wl.seq_len / L.cp
        split = L.tp if (L.sp or wl.p2p_scatter_gather) else 1
        p2p_bytes = tokens * spec.dim * wl.act_bytes / split
        across = L.dp * L.cp * L.tp >= hw.gpus_per_node
        t_p2p = self.device.p2p(p2p_bytes, across) if L.pp > 1 else 0.0
        overlap = self.device.overlaps(L.gpus)
        pp_comm = 2 * (L.pp - 1) * t_p2p + (0.0 if wl.overlap_pp and overlap
                                             else 2 * L.pp_virtual * m * t_p2p)
        pp_comm += self._tied_embedding_time(L)
        _, first, last = self.rank_plan(L, r_star)
        dp = dp_exposed(self, L, rt, layers, first, last, overlap)
        opt, offload = self.optimizer_seconds(L, layers, first, last)
        breakdown = {"compute": m * (rt.fwd + rt.bwd), "tp_comm": m * rt.tp_comm,
                     "cp_comm": m * rt.cp_comm, "ep_all_to_all": m * rt.ep_comm,
                     "pp_bubble": prof.bubble_time, "pp_comm": pp_comm, "dp_comm": dp,
                     "optimizer": opt, "offload": offload}
        breakdown = self.device.combine(self, L, breakdown, layers, first, last)
        step = sum(breakdown.values())
        mems = []
        held = self._stage_weighted(L) if exact else None
        for r, rtr, lay in ranks:
            inflight = prof.per_rank[r] if len(prof.per_rank) == L.pp else \
                self._inflight(L, prof.peak_inflight, r)
            mems.append(self._memory(L, r, rtr, lay, inflight,
                                     None if held is None else held[r]))
        mem = max(mems, key=lambda x: x.total)
        model_flops = self._model_flops()
        hw_flops = model_flops + self._recompute_flops(L)
        return Estimate(L, step, breakdown, mem, mem.total <= hw.hbm_bytes, model_flops,
                        hw_flops, L.gpus, wl.tokens, hw.peak("bf16"))

    def _stage_weighted(self, L: Layout) -> tuple[float, ...] | None:
        """Per rank, the saved bytes at the schedule's peak with each stage weighed by its
        own layers and edges ([Note: stages of unequal weight] in pipeline.py), for the
        schedules with more than one stage per rank; None otherwise (one stage: the rank's
        own)."""
        place = placement(L.pp_schedule, L.pp, L.pp_virtual)
        if L.pp == 1 or L.pp_schedule == "gpipe" or L.pp_virtual == 1:
            return None
        bounds = stage_bounds(self.spec.n_layers, len(place), self.wl.pp_split)
        last = len(place) - 1
        weights = tuple(round(self.stages.rank(L, list(b), c == 0, c == last).saved)
                        for c, b in enumerate(bounds))
        return weighted_peaks(L.pp_schedule, L.pp, L.pp_virtual, L.pp_microbatches, weights)

    def _inflight(self, L: Layout, peak: float, r: int) -> float:
        if L.pp == 1:
            return 1.0
        if L.pp_schedule == "gpipe":
            return peak
        return max(1.0, peak - r * peak / L.pp)

    def _tied_embedding_time(self, L: Layout) -> float:
        """Seconds of the all-reduce of a tied embedding's gradient between the pipeline
        ranks holding the embedding and the head ([Note: tied embeddings across stages])."""
        spec = self.spec
        if not spec.tie_embeddings or L.pp == 1:
            return 0.0
        plan = self.stage_plan(L)
        if any(first and last for _, first, last in plan):
            return 0.0
        grad_bytes = 4 if self.wl.reduce_fp32 else self.wl.act_bytes
        nbytes = -(-spec.vocab_size // L.tp) * spec.dim * grad_bytes
        pair = comm_model.place(2, L.dp * L.cp * L.tp * (L.pp - 1), self.hw.gpus_per_node)
        return self.device.all_reduce(nbytes, pair)

    def optimizer_seconds(self, L: Layout, layers, first, last) -> tuple[float, float]:
        """(optimizer step on the device, offloaded step on the host) seconds of the rank
        holding ``layers`` (cached)."""
        key = ("opt", L.tp, L.ep, L.dp_shard, L.cp, L.zero, L.offload, tuple(layers), first,
               last)
        return self.cached(key, lambda: self._make_optimizer(L, layers, first, last))

    def _make_optimizer(self, L: Layout, layers, first, last) -> tuple[float, float]:
        root, dense, experts = self.units(L, layers, first, last)
        world = 1 if L.zero == 0 else L.dp_shard * L.cp
        n = shard_numel(root, world) if root else 0
        n += sum(c * shard_numel(u, world) for u, c in dense.items())
        ew = 1 if L.zero == 0 else max(1, L.dp_shard * L.cp // L.ep)
        n += sum(c * shard_numel(u, ew) for u, c in experts.items())
        nbytes = n * _OPT_BYTES[self.wl.optimizer] * self.wl.param_bytes / 4
        if L.offload == "cpu":
            host = nbytes / self.hw.host_bandwidth
            pcie = n * 2 * self.wl.param_bytes / self.hw.pcie_bandwidth
            return 0.0, max(host, pcie)
        units = [root] + [u for u, c in dense.items() for _ in range(c)]
        return self.device.optimizer_seconds(units, world, bool(experts), nbytes), 0.0

    def _model_flops(self) -> float:
        """FLOPs per step as MFU counts them: 3x forward (backward = 2x), no recompute."""
        if self._flops is None:
            rt = self.stages.rank(Layout(), list(range(self.spec.n_layers)), True, True)
            self._flops = 3 * rt.model_flops * self.wl.global_batch
        return self._flops

    def _recompute_flops(self, L: Layout) -> float:
        return self.cached(("recompute", L.ac), lambda: self._make_recompute(L))

    def _make_recompute(self, L: Layout) -> float:
        rt = self.stages.rank(L.replace(tp=1, cp=1, sp=False, ep=1, microbatch=1),
                              list(range(self.spec.n_layers)), False, False)
        return rt.recompute_flops * self.wl.global_batch
