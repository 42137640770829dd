"""What a CPU rank spends a step on, as ``--calibrate`` measured it: the trainer's eager
kernels, its optimizer update and the Gloo collectives, each fitted to its size.

    costs = get_hardware("local").cpu
    costs.kernel("rmsnorm", tokens * dim)            # forward seconds of one call
    costs.kernel("rmsnorm", tokens * dim, backward=True)
    costs.collective("all_gather", 2, shard_bytes)   # seconds on 2 Gloo ranks

[Note: CPU kernels] On a GPU the bandwidth-bound kernels cost the bytes they move over HBM
(work.py). A CPU rank (one thread) runs the same eager PyTorch operators far from any
bandwidth limit: a norm's operators on a cache-resident tensor cost their dispatch (with
autograd) and per-element arithmetic (the exp of SiLU, the rsqrt), and the flash-attention
kernel reaches a fraction of the matrix multiplies' FLOP/s. So ``--calibrate`` times each
kernel the trainer's Llama block runs, forward and forward + backward with autograd,
exactly as shardwise.models calls it (``RMSNorm``, ``apply_rotary``, ``repeat_kv``,
SiLU-gated product, residual add, ``scaled_dot_product_attention``, the embedding, the fp32
cross-entropy) at a few sizes, and fits ``seconds = latency + per_unit * size`` per kernel
and pass (calibrate/kernels.py). The size is elements, except attention (its executed
forward FLOPs, work.py's ``attn_exec_flops``, plus a ``softmax`` term per causal score:
fitted jointly over head widths, as a narrow head spends more of its time in the softmax),
the embedding's backward (``vocab x dim + tokens x dim``: it zeroes the whole table),
``copy`` (bytes: the engine's gather copy-out, gradient packing and averaging) and
``cp_attention`` (the context-parallel operator's per-block flash calls, fitted to the
block's rectangle) and ``cp_call`` (what the operator spends around each call: its merge
and gradient additions, fitted to the call's query elements; [Note: context-parallel
kernels] in kernels.py; a calibration written before them has neither, and those blocks
are priced with ``attention`` and ``softmax``). A backward
is timed as one ``autograd.grad`` call, whose own fixed cost (a training step pays it
once) is subtracted. The optimizer update (the engine's foreach norm, the clip and
``torch.optim.AdamW.step`` over per-parameter tensors) is fitted per tensor and per
element. Matrix multiplies keep the device's efficiency curve (hardware.py), fitted on
``F.linear`` forward and backward at linear shapes (``calibrate.kernels.measure_linear``),
as the trainer multiplies.

Collectives are timed per kind as the engine issues them on Gloo (all-gather into a flat
buffer, the reduce-scatter as an all-to-all plus a local sum, all-reduce, a send/receive
pair) and per group size, and fitted to ``latency + bytes / bandwidth`` with the payload
the cost model passes (the gathered shard, the reduced shard, the all-reduced tensor, the
message).

[Note: composed blocks] The kernels and multiplies are each timed alone, as the fastest of
a few calls on warm caches: what they cost at best. A training step is priced from their
sum, but it runs them one after another on cold caches (each operator evicts the last
one's operands), and it is measured as the median step, on a machine whose speed drifts
with its neighbours. So ``--calibrate`` also runs whole Llama blocks (shardwise.models'
``TransformerBlock``, forward and backward, at widths that are not the registry models'
own) for a second each, three times (before the kernels, between them and the
collectives, after: one pass alone lets a fast minute decide), keeps the median call of
each pass and the median of the three passes, prices the same blocks from the fits, and
stores their ratio as ``compose``: the trainer's layers and head are priced at ``compose``
times their parts. Where the blocks tell the multiplies from the other kernels (their
mixes of the two differ enough), the two get factors of their own, ``compose`` and
``compose_kernels`` ([Note: two composition factors] in calibrate/blocks.py); otherwise
one factor, the geometric mean of the blocks' ratios. The same blocks split 2 ways over
tensor-parallel ranks give ``collective_overhead``, charged on every collective ([Note:
tensor-parallel pairs] and [Note: collectives between operators] in calibrate/blocks.py).

[Note: undisturbed steps] A shared machine's speed is not its own: the same block timed
back to back in one-second windows has a median call that moves from one second to the
next (the shared cores' caches, memory bandwidth and clock, not lost time slices), while
its fastest call stays steady. The calibration therefore keeps both: ``compose`` and
``busy`` from the median calls (what a step typically takes, the prediction
``--parallel.plan auto`` starts from), and ``compose_best`` and ``busy_best`` from the
fastest calls. ``CpuCosts.undisturbed()`` prices the layers and head with the latter: the
step the ranks take while nothing else slows the machine, which planner_bench compares
with the trainer's fastest step (the figures: bench/results/planner_bench.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from shardwise.planner.devices.cpu.fits import Crowd, Fit, Kernel, fit_terms

__all__ = ["Fit", "Kernel", "Crowd", "CpuCosts", "KERNELS", "COLLECTIVES", "fit_terms"]

KERNELS = ("rmsnorm", "rope", "repeat_kv", "swiglu", "residual", "attention", "softmax",
           "embedding", "cross_entropy", "copy", "cp_attention", "cp_call")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "send_recv")


@dataclass(frozen=True)
class CpuCosts:
    """The measured CPU costs of a ``local`` device (see [Note: CPU kernels]).

    Attributes:
        kernels: name -> forward / backward fits, names of ``KERNELS``.
        optimizer: seconds per parameter tensor (latency) and per element (per_unit) of
            the update (norm, clip, AdamW step).
        collectives: kind -> group size -> fit of seconds against payload bytes.
        busy: processes computing at once -> how much slower each computes (see below).
    """

    kernels: dict[str, Kernel]
    optimizer: Fit
    collectives: dict[str, dict[int, Fit]]
    busy: dict[int, float] = field(default_factory=dict)
    """Measured: with ``k`` processes computing at once on as many cores, how much more CPU
    time each needs for the same work (shared clock, caches and memory bandwidth)."""
    blocks: tuple[tuple[int, int, int, float, float], ...] = ()
    """Measured: ``(dim, heads, kv_heads, seconds, fastest seconds)`` of whole Llama
    blocks' forward and backward on one thread, 4 x 128 tokens: the median call and the
    fastest call ([Note: composed blocks])."""
    compose: float = 1.0
    """The blocks' measured seconds (median call) over what the fits price them at
    (geometric mean): the factor the trainer's layers and head are priced with ([Note:
    composed blocks])."""
    compose_best: float = 0.0
    """The same ratio for the blocks' fastest calls: the factor of :meth:`undisturbed`
    (0: not measured, ``compose`` stands in)."""
    comm_cpu: dict[int, float] = field(default_factory=dict)
    """Measured: group size -> the fraction of a collective's seconds its callers spend on
    a core (process CPU time over wall time, median over kinds and payloads); the rest is
    waiting ([Note: CPU ranks share the cores] in step.py). Empty: not measured (0)."""
    busy_best: dict[int, float] = field(default_factory=dict)
    """Measured: ``busy`` from the fastest calls instead of the median ones, the slowdown
    of :meth:`undisturbed` (empty: not measured, ``busy`` stands in)."""
    crowded: dict[int, tuple[Crowd, ...]] = field(default_factory=dict)
    """Measured: world size (more ranks than cores) -> its smaller groups' collectives at
    one or more gaps, shortest first (:meth:`in_world`; empty: not measured, the groups'
    lone fits stand in)."""
    compose_kernels: float = 0.0
    """The factor the layers' and head's kernels other than the multiplies (norms, RoPE,
    SwiGLU, attention, the loss) are priced with, when the blocks tell it from the
    multiplies' (``compose``): 0, not measured, ``compose`` stands in (:attr:`kernel_compose`,
    [Note: composed blocks])."""
    compose_kernels_best: float = 0.0
    """``compose_kernels`` from the blocks' fastest calls (0: not measured)."""
    tp_blocks: tuple[tuple[int, int, int, float, float], ...] = ()
    """Measured: ``(dim, heads, kv_heads, seconds, fastest seconds)`` of tensor-parallel
    (sequence-parallel) Llama blocks' forward and backward on 2 Gloo ranks, each on its
    own core, the slowest rank's median and fastest call ([Note: tensor-parallel pairs])."""
    collective_overhead: float = 0.0
    """Seconds each collective met between a block's operators (tensor-parallel, the
    engine's gathers and reductions, pipeline sends) costs beyond its fit while the ranks
    keep a core each, from ``tp_blocks``' median calls ([Note: tensor-parallel pairs],
    [Note: collectives between operators]); 0: not measured."""
    collective_overhead_best: float | None = None
    """``collective_overhead`` from the fastest calls, for :meth:`undisturbed` (None: not
    measured, ``collective_overhead`` stands in)."""

    @property
    def kernel_compose(self) -> float:
        """The factor of the layers' and head's non-multiply kernels: ``compose_kernels``,
        or ``compose`` where the calibration did not tell them apart."""
        return self.compose_kernels or self.compose

    def in_world(self, ranks: int, cores: int, gap_s: float | None = None) -> "CpuCosts":
        """These costs as a job of ``ranks`` ranks on ``cores`` cores meets its
        collectives ([Note: crowded collectives] in step.py): beyond the cores, the
        group sizes measured crowded in the nearest measured world (the larger on a tie)
        replace their lone fits and CPU fractions, interpolated between the measured gaps
        at ``gap_s``, the compute between the job's collectives (None: the longest
        measured gap). The result carries no crowds, so applying it again changes
        nothing; within the cores, these costs unchanged."""
        if not self.crowded or not cores or ranks <= cores:
            return self
        crowds = self.crowded[_nearest(self.crowded, ranks)]
        crowd = crowds[-1]
        if gap_s is not None and len(crowds) > 1:
            pair = next(((a, b) for a, b in zip(crowds, crowds[1:], strict=False)
                         if gap_s <= b.gap_s), crowds[-2:])
            crowd = pair[0].blend(pair[1], gap_s)
        colls = {k: {**v, **crowd.collectives.get(k, {})} for k, v in self.collectives.items()}
        for k, v in crowd.collectives.items():
            colls.setdefault(k, dict(v))
        return dataclasses.replace(self, collectives=colls, crowded={},
                                   comm_cpu={**self.comm_cpu, **crowd.comm_cpu})

    def comm_cpu_fraction(self, world: int) -> float:
        """The CPU fraction of a collective over ``world`` ranks, from the nearest measured
        group size (the larger on a tie); 0 when not measured or ``world`` is 1."""
        if world <= 1 or not self.comm_cpu:
            return 0.0
        return self.comm_cpu[_nearest(self.comm_cpu, world)]

    def undisturbed(self) -> "CpuCosts":
        """These costs with the layers and head priced at the blocks' fastest calls
        (``compose_best``, ``compose_kernels_best``), every core's slowdown at theirs
        (``busy_best``) and the tensor-parallel collectives' overhead at theirs: the step
        the ranks take when no neighbour slows the machine,
        to compare with the trainer's fastest step ([Note: undisturbed steps])."""
        best = self.collective_overhead_best
        best = self.collective_overhead if best is None else best
        return dataclasses.replace(
            self, compose=self.compose_best or self.compose,
            compose_kernels=self.compose_kernels_best or self.compose_kernels,
            busy=self.busy_best or self.busy, collective_overhead=best)

    def contention(self, ranks: int, cores: int) -> float:
        """The slowdown of each rank's compute with ``ranks`` ranks on ``cores`` cores: 1
        for one rank, the measured ratios up to every core busy (linear between), and the
        every-core ratio beyond (time-slicing more ranks over the cores adds nothing
        measurable to a rank's CPU time)."""
        pts = sorted({1: 1.0, **{k: v for k, v in self.busy.items() if k <= cores}}.items())
        ranks = min(ranks, cores)
        if ranks <= 1 or len(pts) == 1:
            return 1.0
        for (k0, r0), (k1, r1) in zip(pts, pts[1:], strict=False):
            if ranks <= k1:
                return r0 + (r1 - r0) * (ranks - k0) / (k1 - k0)
        return pts[-1][1]

    def kernel(self, name: str, size: float, backward: bool = False, calls: int = 1) -> float:
        """Seconds of ``calls`` calls of kernel ``name`` of ``size`` each (0 if the
        calibration did not measure it)."""
        k = self.kernels.get(name)
        if k is None or calls <= 0:
            return 0.0
        return calls * (k.bwd if backward else k.fwd)(size)

    def collective(self, kind: str, world: int, nbytes: float) -> float | None:
        """Seconds of one collective of ``kind`` over ``world`` ranks, from the fit of the
        nearest measured group size (the larger on a tie); None when the calibration did
        not measure ``kind`` (the caller falls back to the alpha-beta link)."""
        by_world = self.collectives.get(kind)
        if not by_world:
            return None
        if world <= 1 or nbytes <= 0:
            return 0.0
        return by_world[_nearest(by_world, world)](nbytes)

    # ------------------------------------------------------------------ TOML
    @classmethod
    def from_table(cls, t: dict) -> "CpuCosts":
        """From the ``[local.cpu]`` table ``write_calibration`` writes.

        Raises:
            ValueError: a kernel or collective entry of the wrong shape.
        """
        def fit(v, what) -> Fit:
            if not (isinstance(v, list) and len(v) == 2):
                raise ValueError(f"calibration [local.cpu] {what}: expected [latency, "
                                 f"per_unit], got {v!r}")
            return Fit(float(v[0]), float(v[1]))

        kernels = {}
        for name in KERNELS:
            if name in t:
                v = t[name]
                if not (isinstance(v, list) and len(v) == 4):
                    raise ValueError(f"calibration [local.cpu] {name}: expected [fwd latency, "
                                     f"fwd per unit, bwd latency, bwd per unit], got {v!r}")
                kernels[name] = Kernel(fit(v[:2], name), fit(v[2:], name))
        def collectives(table: dict, where: str) -> dict[str, dict[int, Fit]]:
            out = {kind: {int(w): fit(v, f"{where}{kind}.{w}") for w, v in table.get(
                "collectives", {}).get(kind, {}).items()} for kind in COLLECTIVES}
            return {k: v for k, v in out.items() if v}

        def fractions(table: dict, where: str) -> dict[int, float]:
            out = {int(k): float(v) for k, v in table.get("comm_cpu", {}).items()}
            bad = [(k, v) for k, v in out.items() if not 0.0 <= v <= 1.0]
            if bad:
                raise ValueError(f"calibration [local.cpu] {where}comm_cpu.{bad[0][0]} = "
                                 f"{bad[0][1]}: expected a fraction between 0 and 1 (CPU "
                                 f"seconds over seconds)")
            return out

        colls = collectives(t, "")
        opt = fit(t.get("optimizer", [0.0, 0.0]), "optimizer")
        comm_cpu = fractions(t, "")
        crowded = {}
        for w, crowds in t.get("crowded", {}).items():
            if not isinstance(crowds, list):
                raise ValueError(f"calibration [local.cpu] crowded.{w}: expected an array "
                                 f"of tables ([[local.cpu.crowded.{w}]]), got {crowds!r}")
            where = f"crowded.{w}."
            crowded[int(w)] = tuple(sorted((Crowd(collectives(c, where), fractions(c, where),
                                                  float(c.get("gap_s", 0.0)))
                                            for c in crowds), key=lambda c: c.gap_s))
        busy, busy_best = ({int(k): float(v) for k, v in t.get(key, {}).items()}
                           for key in ("busy", "busy_best"))
        overhead = _seconds(t, "collective_overhead", 0.0)
        return cls(kernels, opt, colls, busy, _block_rows(t, "blocks"),
                   _factor(t, "compose", 1.0), _factor(t, "compose_best", 0.0), comm_cpu,
                   busy_best, crowded, _factor(t, "compose_kernels", 0.0),
                   _factor(t, "compose_kernels_best", 0.0), _block_rows(t, "tp_blocks"),
                   overhead, _seconds(t, "collective_overhead_best", None))

    def toml_lines(self, prefix: str = "local") -> list[str]:
        """This record as the ``[<prefix>.cpu]`` tables of a calibration file."""
        lines = [f"[{prefix}.cpu]"]
        for name, k in self.kernels.items():
            lines.append(f"{name} = [{k.fwd.latency:.6g}, {k.fwd.per_unit:.6g}, "
                         f"{k.bwd.latency:.6g}, {k.bwd.per_unit:.6g}]")
        lines.append(f"optimizer = [{self.optimizer.latency:.6g}, "
                     f"{self.optimizer.per_unit:.6g}]")
        lines.append("busy = { " + ", ".join(f"{k} = {v:.4g}" for k, v in
                                             sorted(self.busy.items())) + " }")
        if self.busy_best:
            lines.append("busy_best = { " + ", ".join(f"{k} = {v:.4g}" for k, v in
                                                      sorted(self.busy_best.items())) + " }")
        lines.append("blocks = [" + ", ".join(_row(b) for b in self.blocks) + "]")
        lines.append(f"compose = {self.compose:.4g}")
        if self.compose_best:
            lines.append(f"compose_best = {self.compose_best:.4g}")
        for key in ("compose_kernels", "compose_kernels_best"):
            if getattr(self, key):
                lines.append(f"{key} = {getattr(self, key):.4g}")
        if self.tp_blocks:
            lines.append("tp_blocks = [" + ", ".join(_row(b) for b in self.tp_blocks) + "]")
            lines.append(f"collective_overhead = {self.collective_overhead:.6g}")
        if self.collective_overhead_best is not None:
            lines.append(f"collective_overhead_best = {self.collective_overhead_best:.6g}")
        lines.append(_fractions_line(self.comm_cpu))
        lines += _collectives_lines(f"{prefix}.cpu", self.collectives)
        for world, crowds in sorted(self.crowded.items()):
            for crowd in crowds:
                lines += [f"[[{prefix}.cpu.crowded.{world}]]", f"gap_s = {crowd.gap_s:.6g}",
                          _fractions_line(crowd.comm_cpu)]
                lines += _collectives_lines(f"{prefix}.cpu.crowded.{world}",
                                            crowd.collectives)
        return lines


def _row(block: tuple) -> str:
    return "[" + ", ".join(f"{x:.6g}" if isinstance(x, float) else str(x) for x in block) + "]"


def _block_rows(t: dict, key: str) -> tuple[tuple[int, int, int, float, float], ...]:
    """``[[dim, heads, kv_heads, seconds, fastest seconds], ...]`` of ``key`` (an older
    file's four columns: the fastest call is the median)."""
    rows = t.get(key, [])
    if not (isinstance(rows, list) and all(isinstance(b, list) and len(b) in (4, 5)
                                           for b in rows)):
        raise ValueError(f"calibration [local.cpu] {key}: expected [[dim, heads, kv_heads, "
                         f"seconds, fastest seconds], ...], got {rows!r}")
    return tuple((int(b[0]), int(b[1]), int(b[2]), float(b[3]), float(b[-1])) for b in rows)


def _factor(t: dict, key: str, default: float) -> float:
    """A composition factor: between 0.2 and 5 (0, the default of the optional ones, is
    "not measured")."""
    v = float(t.get(key, default))
    if not (0.2 <= v <= 5.0 or v == default == 0.0):
        raise ValueError(f"calibration [local.cpu] {key} = {v}: expected a factor between "
                         f"0.2 and 5 (measured blocks over priced)")
    return v


def _seconds(t: dict, key: str, default: float | None) -> float | None:
    """Seconds per call, between 0 and 1 (``default`` when absent)."""
    if key not in t:
        return default
    v = float(t[key])
    if not 0.0 <= v < 1.0:
        raise ValueError(f"calibration [local.cpu] {key} = {v}: expected seconds per "
                         f"collective, at least 0 and under 1")
    return v


def _fractions_line(comm_cpu: dict[int, float]) -> str:
    return "comm_cpu = { " + ", ".join(f"{k} = {v:.4g}" for k, v in
                                       sorted(comm_cpu.items())) + " }"


def _collectives_lines(table: str, collectives: dict[str, dict[int, Fit]]) -> list[str]:
    lines = [f"[{table}.collectives]"]
    for kind, by_world in collectives.items():
        inner = ", ".join(f"{w} = [{f.latency:.6g}, {f.per_unit:.6g}]"
                          for w, f in sorted(by_world.items()))
        lines.append(f"{kind} = {{ {inner} }}")
    return lines


def _nearest(sizes, world: int) -> int:
    """The measured group size nearest ``world`` (the larger on a tie)."""
    return min(sizes, key=lambda w: (abs(w - world), -w))
