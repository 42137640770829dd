"""A GPU as the planner prices it: datasheet peaks, a fitted matrix-multiply efficiency
curve, the memory bandwidth, and the alpha-beta links of comm_model.py.

    dev = GpuDevice(get_hardware("h100"))
    dev.all_gather(shard_bytes, comm_model.place(8, 1, 8))

[Note: layer time] A layer's forward is the sum of its matrix multiplies (each at the
hardware's achievable fraction of peak for its size), its attention core (one batched
kernel) and its bandwidth-bound kernels (norms, residual adds, activation functions,
dropout, unfused softmax) at the fitted fraction of HBM bandwidth. fp8 training
(``compute_dtype="fp8"``) also casts every linear's operands (work.fp8_cast_bytes); a
low-bit recipe (``matmul_recipe``) moves the converted multiplies to its dtype's rate and
adds its casts ([Note: pricing a low-bit recipe] in recipe_cost.py). Backward runs two
multiplies per forward multiply (input and weight gradients) at the same size, 2.5x the
attention kernel's forward work for flash attention (it recomputes the scores) and 2x
otherwise, and twice the bandwidth-bound bytes. Communication that overlaps compute
occupies ``comm_sm_fraction`` of the cores, which the kernels then lack.

Tensor-parallel collectives ([Note: tensor-parallel collectives] in sends.py) are charged
per pass, the backward's conjugates included and its weight-gradient regather left out
(Megatron-LM overlaps it with the input-gradient multiply). ``overlap_tp`` (torch's
AsyncTP, the micro-pipelined all-gather-matmul and matmul-reduce-scatter that
torch.compile builds) hides the collectives of the forward passes behind the multiplies
they are fused with, only what exceeds them staying exposed; the backward's stay exposed.
That is what PyTorch reported for it ("up to ~20% forward pass speedup and ~8% end-to-end
speedup in Llama3 70B", discuss.pytorch.org/t/209487, Aug 2024) and what torchtitan's
Table 4 measured (829 -> 876 tokens/s/GPU, +5.7%, for Llama 3.1 70B at TP 8). The
embedding's and head's collectives are not charged: small beside the layers' at the sizes
a GPU is planned for.

[Note: the engine's copies on GPUs] A gather lands in one flat buffer; shardwise's engine
and FSDP2 (``foreach_all_gather_copy_out``) then copy each parameter out of it into its own
tensor, and before a reduction they pack the gradients into the reduction's flat buffer,
cast to the reduction dtype (FSDP2's ``foreach_reduce``: ``chunk_cat``). Those are
bandwidth-bound passes over the rank's whole (unsharded) parameters: a read and a write in
the compute dtype per gather, a read in the compute dtype and a write in the reduction
dtype per step's reduction, charged at the memory bandwidth with the data-parallel time
(the copy-out runs on the compute stream; the packing, on FSDP2's reduce-scatter stream,
competes with the compute for the same bandwidth). Stage 3 gathers every unit
``pipeline.gather_rounds`` times a step and, resharding after forward, the non-root units
again for each backward; stages 1-2 gather once a step. Stacks whose parameters and
gradients live in the collectives' flat buffers (Megatron-LM's and DeepSpeed's, FSDP1's
flat parameters) copy nothing: the workload's ``dp_copies`` False. For Llama 3 8B on 64
A100 at stage 3 (one micro-batch of 8192 tokens, fp32 reductions) it is 8.0 billion
parameters x (2 gathers x 4 + 6) bytes less the root's second gather, about 0.07 s of a
2.5 s step.
"""

from __future__ import annotations

import math
from collections import Counter

from shardwise.planner import comm_model
from shardwise.planner.dp_cost import reduce_element_bytes
from shardwise.planner.pipeline import gather_rounds
from shardwise.planner.rank_memory import unit_state
from shardwise.planner.recipe_cost import recipe_seconds
from shardwise.planner.sends import TP_REGIONS, tp_region
from shardwise.planner.work import fp8_cast_bytes, head_work
from shardwise.planner.workload import ATTENTION_DTYPE

__all__ = ["GpuDevice", "dp_copy_seconds"]


class GpuDevice:
    """The roofline device model (see the module docstring; protocol: devices/base.py).

    Args:
        hw: the device's :class:`~shardwise.planner.hardware.Hardware` entry.
    """

    def __init__(self, hw) -> None:
        self.hw = hw

    # ------------------------------------------------------------------ compute
    def layer_seconds(self, spec, wl, w, tp: int, sp: bool, moe: bool
                      ) -> tuple[float, float, float, float]:
        """(forward, backward, weight-gradient, selective-recompute) seconds of ``w``
        ([Note: layer time])."""
        hw, dt = self.hw, wl.compute_dtype
        gemm = sum(n * hw.matmul_time(f, dt) for f, n in w.gemms)
        adt = ATTENTION_DTYPE.get(dt, dt)
        attn = w.attn_exec_flops / (hw.peak(adt) * hw.matmul_efficiency(w.attn_unit_flops)) \
            if w.attn_exec_flops else 0.0
        rep = w.elementwise_rep / (tp if sp else 1)
        mem = hw.memory_time(rep + w.elementwise_tp + w.core_bytes)
        cast_f = cast_b = 0.0
        if dt == "fp8":
            cast_f, cast_b = (hw.memory_time(x) for x in fp8_cast_bytes(w))
        attn_bwd = attn * (2.5 if wl.attention == "flash" else 2.0)
        # What selective recomputation replays ([Note: selective recomputation]).
        cheap = attn + hw.memory_time(w.core_bytes) if wl.attention != "flash" else mem
        low = (0.0,) * 4
        if w.lowbit is not None:  # [Note: pricing a low-bit recipe] in recipe_cost.py
            rs = recipe_seconds(hw, wl, w)
            low = (rs.fwd, rs.bwd, rs.wgrad, rs.cast_fwd if wl.attention == "flash" else 0.0)
        slow = 1 / (1 - wl.comm_sm_fraction)  # cores the overlapped comm occupies
        return ((gemm + attn + mem + cast_f + low[0]) * slow,
                (2 * gemm + attn_bwd + 2 * mem + cast_b + low[1]) * slow,
                (gemm + low[2]) * slow, (cheap + low[3]) * slow)

    def attention_seconds(self, spec, wl, w, tp: int) -> tuple[float, float]:
        """The attention kernel's forward at the efficiency of its size (each call's
        FLOPs), its backward 2.5x that with flash attention (2x unfused): what
        :meth:`layer_seconds` charges for it, before the cores overlapped communication
        occupies (``comm_sm_fraction``: the kernel the transfers hide behind)."""
        adt = ATTENTION_DTYPE.get(wl.compute_dtype, wl.compute_dtype)
        attn = w.attn_exec_flops / (self.hw.peak(adt) * self.hw.matmul_efficiency(
            w.attn_unit_flops)) if w.attn_exec_flops else 0.0
        return attn, attn * (2.5 if wl.attention == "flash" else 2.0)

    def composition(self, spec) -> tuple[float, float]:
        """(1, 1): the efficiency curve and the bandwidth price parts as a layer runs them."""
        return 1.0, 1.0

    def edge_seconds(self, spec, wl, tokens: float, tp: int, sp: bool, first: bool,
                     last: bool) -> tuple[float, float]:
        """The embedding's and the loss's bytes at the memory bandwidth."""
        fwd = bwd = 0.0
        if first:
            emb = self.hw.memory_time(tokens * spec.dim * (2 * wl.act_bytes + 4))
            fwd, bwd = fwd + emb / 3, bwd + 2 * emb / 3
        if last:
            loss = self.hw.memory_time(head_work(spec, tokens, tp, wl.act_bytes)[1])
            fwd, bwd = fwd + loss / 2, bwd + loss / 2
        return fwd, bwd

    def accumulate_seconds(self, spec, wl, shapes: list, per_param: float,
                           kernel_factor: float) -> float:
        """The accumulation's bytes at the memory bandwidth."""
        return self.hw.memory_time(per_param * sum(math.prod(s) for s in shapes))

    def optimizer_seconds(self, units: list, world: int, experts: bool, nbytes: float
                          ) -> float:
        """The update's state bytes at the memory bandwidth."""
        return self.hw.memory_time(nbytes)

    # ------------------------------------------------------------------ communication
    def all_gather(self, shard_bytes: float, g) -> float:
        return comm_model.all_gather_time(shard_bytes, g, self.hw)

    def reduce_scatter(self, shard_bytes: float, g) -> float:
        return comm_model.reduce_scatter_time(shard_bytes, g, self.hw)

    def all_reduce(self, nbytes: float, g) -> float:
        return comm_model.all_reduce_time(nbytes, g, self.hw)

    def dispatch(self, token_bytes: float, tokens: float, top_k: int, g,
                 node_limit: int = 0) -> float:
        return comm_model.dispatch_time(token_bytes, tokens, top_k, g, self.hw, node_limit)

    def p2p(self, nbytes: float, across_nodes: bool) -> float:
        return comm_model.p2p_time(nbytes, across_nodes, self.hw)

    def all_to_all(self, nbytes: float, g) -> float:
        return comm_model.all_to_all_time(nbytes, g, self.hw)

    def tp_seconds(self, wl, tokens: float, dim: int, tp: int, sp: bool, ac: str,
                   gemm: float, replay_gemm: float) -> float:
        """Exposed tensor-parallel seconds of one layer and micro-batch (the module
        docstring): the backward's, and each forward pass's beyond what AsyncTP hides."""
        act = tokens * dim * wl.act_bytes
        grp = comm_model.place(tp, 1, self.hw.gpus_per_node)
        priced = {"all_gather": self.all_gather(act / tp, grp),
                  "reduce_scatter": self.reduce_scatter(act / tp, grp),
                  "all_reduce": self.all_reduce(act, grp)}

        def seconds(calls) -> tuple[float, float]:
            """(what a pass of ``calls`` costs, the part of it that is not reduce-scatters)."""
            n = Counter(c.kind for c in calls for _ in range(TP_REGIONS))
            kept = sum(k * priced[kind] for kind, k in n.items() if kind != "reduce_scatter")
            rs = n.get("reduce_scatter", 0)
            return (kept + rs * priced["reduce_scatter"] if rs else kept), kept

        region = tp_region(sp)
        one, gathers = seconds(region["forward"])
        back, _ = seconds(c for c in region["backward"] if c.of != "weight input")
        forward = [(one, gemm)]  # (collective seconds, multiplies they can hide behind)
        if ac == "full":
            forward.append((one, gemm))
        elif ac == "selective" and wl.selective_ac == "alternate_mm":
            forward.append((gathers, replay_gemm))  # reduce-scatter outputs are kept
        if wl.overlap_tp:
            f = wl.overlap_tp_fraction  # fused: hidden up to the multiplies' time
            return back + sum((1 - f) * c + max(0.0, f * c - m) for c, m in forward)
        return back + sum(c for c, _ in forward)

    def tp_edge_seconds(self, wl, tokens: float, dim: int, tp: int, sp: bool, first: bool,
                        last: bool) -> float:
        """0: not charged on GPUs (the module docstring)."""
        return 0.0

    # ------------------------------------------------------------------ the step
    def overlaps(self, ranks: int) -> bool:
        """True: each rank has its own device and its collectives their own engines."""
        return True

    def transient_bytes(self, cm, L, layers: list, first: bool, last: bool, states,
                        tokens: float) -> tuple[float, float, float]:
        """The per-unit formula of rank_memory.py, plus the tensor-parallel regions'
        gathered input and its gradient."""
        comm = states.comm + (2 * tokens * cm.spec.dim * cm.wl.act_bytes if L.tp > 1 else 0.0)
        return states.unsharded, comm, states.full_grads

    def combine(self, cm, L, breakdown: dict[str, float], layers: list, first: bool,
                last: bool) -> dict[str, float]:
        """The components, with the engine's copies ([Note: the engine's copies on GPUs])
        on the data-parallel time."""
        out = dict(breakdown)
        out["dp_comm"] += dp_copy_seconds(cm, L, layers, first, last)
        return out

    def crowded(self, ranks: int) -> bool:
        """False: a GPU's collectives meet no other rank's compute."""
        return False

    def in_world(self, ranks: int, gap_s: float | None = None) -> GpuDevice:
        return self


def dp_copy_seconds(cm, L, layers, first: bool, last: bool) -> float:
    """Seconds of the engine's copies around its gathers and reductions in one step on a
    GPU rank holding ``layers`` ([Note: the engine's copies on GPUs]); 0 at stage 0,
    without data-parallel sharding, or for stacks without them (``dp_copies`` False)."""
    wl = cm.wl
    world = L.dp_shard * L.cp
    if not wl.dp_copies or L.zero == 0 or world <= 1:
        return 0.0
    root, dense, experts = cm.units(L, layers, first, last)
    root_n = unit_state(tuple(root), world).full_numel if root else 0
    rest = sum(count * unit_state(tuple(u), world).full_numel
               for u, count in (*dense.items(), *experts.items()) if u)
    if L.zero == 3:
        gathers = gather_rounds(L, wl) * (root_n + rest * (2 if wl.reshard_after_forward else 1))
    else:
        gathers = root_n + rest
    reduce_bytes = reduce_element_bytes(wl, L.zero)
    nbytes = 2 * wl.act_bytes * gathers + (wl.act_bytes + reduce_bytes) * (root_n + rest)
    return cm.hw.memory_time(nbytes)
