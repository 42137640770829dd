"""Search over layouts: enumerate the mesh rules, prune what cannot fit, price the rest.

    result = search(spec, hw, Workload(seq_len=8192, global_batch=2048), gpus=16384,
                    fixed={"tp": 8})
    result.ranked[0].layout, result.ranked[0].step_time

[Note: search order] The space is every layout with ``dp_replicate x dp_shard x cp x tp x
pp`` equal to the GPU count (tp inside a node and dividing the heads, cp splitting the
sequence into load-balanced halves of at least 1024 tokens per rank, pp at most the layer
count, the data-parallel degree dividing the global batch), ``ep`` dividing
``dp_shard x cp`` and the expert count, every ZeRO stage, micro-batch size (a power of two
up to 16 sequences, or the one the user fixes), schedule (interleaved 1F1B with 2, 3, 4,
6 or 8 stages per rank), checkpointing policy and sequence-parallel choice. It is pruned
before anything is priced and priced best-first. Each mesh with ``cp > 1`` is searched
with every context-parallel implementation ``apply_cp`` builds whose all-to-all degree the
key/value heads per tensor rank allow (ring always; ulysses and hybrid where they fit:
``parallel_layout.cp_degrees``), or Llama 3's all-gather for multi-head latent attention,
which ``apply_cp`` does not cover; a fixed ``cp_impl`` is the only one, and a layout it
cannot run is refused by ``check_layout`` with the reason:

1. a mesh and ZeRO stage whose parameters, gradients and optimizer state alone exceed the
   device's memory is dropped with every micro-batch, schedule and policy below it (unless
   CPU offload of the optimizer state makes it fit, when the offloaded variant is kept);
2. every remaining layout gets a lower bound of its step time from the closed forms: the
   busiest pipeline rank's micro-batches with their exposed tensor-, context- and expert-
   parallel communication, plus the schedule's bubble;
3. layouts are priced in increasing order of that bound, and pricing stops once the bound
   exceeds the step time of the ``top + 50``-th fastest fitting layout found: nothing left
   can enter the ranking (branch and bound). A layout that does not fit is tried once more
   with CPU offload.

Quantised data-parallel communication is tried only as a refinement of the best layouts (it
never changes memory, only time, and numerics: it must be ``QUANT_MIN_GAIN`` faster); the
best ``top`` are then re-priced exactly (every pipeline rank, the simulated schedule). Keys
the user fixed restrict every level.

[Note: pipelines that fit exactly] The closed forms' in-flight micro-batches
(``ScheduleSpec.peak_inflight``) are a ranking device, not the schedule: for interleaved
1F1B, ZB-V and DualPipeV they count more than the simulated schedule holds (the debug
model's ZB-V on 2 ranks: 334.8 MiB closed, 327.5 MiB simulated, and 327.6 MiB measured by
bench/planner_choice.py's engine accounting; the small model's interleaved 1F1B on 4 ranks:
678 against 622 MiB). A pipeline layout of more than one stage per rank (where the closed
forms count more; for 1F1B and ZB-H1 they count fewer) that they reject for its activations
alone (its states and working buffers fit) and whose step time would place it among the
``top`` fastest that fit is priced again exactly before it is dropped; otherwise a job
capped between the two figures never sees it (bench/results/planner_choice.md, the capped
debug x2 and small x4 jobs). At most ``2 top`` of them, the fastest: simulating every rejected
pipeline quadrupled the 405B search on 16,384 GPUs, and the 297 of DeepSeek-V3's on 2,048
that would qualify added 8 s (none of them fit).

Layouts another layout dominates (no faster under the cost model and holding at least as
much memory) are in the space but not priced, unless the user fixed the key that makes
them differ: ZeRO-1 (ZeRO-2 moves the same bytes and holds less), ``sp=false`` with
``tp > 1`` (sequence parallelism moves the same bytes and holds less), GPipe (1F1B has
its bubble and holds fewer micro-batches), and a checkpointing policy that recomputes more
than one that already fits (recomputation only adds time).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator
from dataclasses import dataclass

from shardwise.planner.cost_model import CostModel, Estimate
from shardwise.planner.parallel_layout import Layout, check_layout, cp_impl_error
from shardwise.planner.rank_memory import state_bytes, workload_state_kwargs
from shardwise.planner.pipeline import min_microbatches
from shardwise.planner.workload import Workload

__all__ = ["SearchResult", "search", "search_space", "in_search_space", "mesh_candidates",
           "evaluate", "explain_empty"]

_MAX_MICROBATCH = 16  # sequences per micro-batch searched: powers of two up to this
_VIRTUAL = (2, 3, 4, 6, 8)  # stages per rank searched for interleaved 1F1B
_MIN_CP_TOKENS = 1024  # context parallelism keeps at least this many tokens per rank
_KEEP = 50  # layouts beyond the printed ones kept in the ranking (the bound's margin)
QUANT_MIN_GAIN = 0.02
"""Quantised communication changes the numerics; the search proposes it only where it is
predicted at least this much faster than the same layout without it."""


@dataclass(frozen=True)
class SearchResult:
    """Ranked estimates (fitting layouts first, fastest first) and the search's counts."""

    ranked: list[Estimate]
    evaluated: int
    pruned: int
    seconds: float


def _divisors(n: int) -> list[int]:
    if n < 1:
        return []
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _allowed(fixed: dict, key: str, values) -> list:
    if key in fixed:
        return [fixed[key]] if fixed[key] in values or key in ("pp_virtual",) else []
    return list(values)


def mesh_candidates(spec, hw, wl: Workload, gpus: int, fixed: dict
                    ) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(dp_replicate, dp_shard, cp, tp, pp, ep) meshes of the search space."""
    node = min(hw.gpus_per_node, gpus)
    tps = [t for t in _divisors(node) if spec.n_heads % t == 0]
    for tp in _allowed(fixed, "tp", tps):
        rest = gpus // tp if gpus % tp == 0 else 0
        cps = [c for c in _divisors(rest) if c == 1 or (wl.seq_len % (2 * c) == 0
                                                        and wl.seq_len // c >= _MIN_CP_TOKENS)]
        for cp in _allowed(fixed, "cp", cps):
            rest2 = rest // cp
            pps = [p for p in _divisors(rest2) if p <= spec.n_layers]
            for pp in _allowed(fixed, "pp", pps):
                dp = rest2 // pp
                if wl.global_batch % dp:
                    continue
                for shard in _allowed(fixed, "dp_shard", _divisors(dp)):
                    rep = dp // shard
                    if fixed.get("dp_replicate", rep) != rep:
                        continue
                    eps = [e for e in _divisors(shard * cp)
                           if e == 1 or (spec.is_moe and spec.n_experts % e == 0)]
                    for ep in _allowed(fixed, "ep", eps):
                        yield rep, shard, cp, tp, pp, ep


def _schedules(pp: int, n_layers: int, m: int, fixed: dict) -> list[tuple[str, int]]:
    if pp == 1:
        return [("none", 1)] if fixed.get("pp_schedule", "none") == "none" else []
    out = [("gpipe", 1), ("1f1b", 1), ("zb1", 1), ("zbv", 2), ("dualpipev", 2)]
    out += [("interleaved_1f1b", v) for v in _VIRTUAL if pp * v <= n_layers]
    if "pp_virtual" in fixed and fixed.get("pp_schedule") == "interleaved_1f1b":
        out.append(("interleaved_1f1b", fixed["pp_virtual"]))
    out = [(s, v) for s, v in out if pp * v <= n_layers and m >= min_microbatches(s, pp)]
    return [(s, v) for s, v in dict.fromkeys(out)
            if fixed.get("pp_schedule", s) == s and fixed.get("pp_virtual", v) == v]


class _Searcher:
    def __init__(self, spec, hw, wl: Workload, gpus: int, fixed: dict,
                 dominated: bool = False) -> None:
        self.spec, self.hw, self.wl, self.gpus, self.fixed = spec, hw, wl, gpus, fixed
        self.dominated = dominated  # also yield the dominated layouts (the whole space)
        self.cm = CostModel(spec, hw, wl)
        self.evaluated = self.pruned = 0
        self._states: dict[tuple, float] = {}

    def states_floor(self, L: Layout) -> float:
        """Model-state bytes of the first pipeline rank (no activations)."""
        key = (L.dp_shard, L.cp, L.tp, L.pp, L.ep, L.zero, L.pp_virtual, L.pp_schedule,
               L.pp_microbatches > 1, L.offload)
        if key not in self._states:
            plan = self.cm.rank_plan(L, 0)
            root, dense, experts = self.cm.units(L, *plan)
            units = [root] + [u for u, n in dense.items() for _ in range(n)]
            kw = workload_state_kwargs(self.wl)
            st = state_bytes(units, L.dp_shard * L.cp, zero=L.zero,
                             accumulate=L.pp_microbatches > 1, **kw)
            if experts:
                ex = [u for u, n in experts.items() for _ in range(n)]
                st = st + state_bytes(ex, max(1, L.dp_shard * L.cp // L.ep), zero=L.zero,
                                      root=None, **kw)
            opt = 0.0 if L.offload == "cpu" else st.optimizer
            self._states[key] = (st.params + st.grads + opt + st.unsharded + st.full_grads
                                 + self.hw.reserved_bytes)
        return self._states[key]

    def layouts(self) -> Iterator[Layout]:
        f, spec, wl = self.fixed, self.spec, self.wl
        for rep, shard, cp, tp, pp, ep in mesh_candidates(spec, self.hw, wl, self.gpus, f):
            dp = rep * shard
            zeros = (0, 1, 2, 3) if self.dominated or "zero" in f else (0, 2, 3)
            for zero in _allowed(f, "zero", zeros):
                if zero == 0 and rep > 1 and "dp_replicate" not in f:
                    continue  # stage 0 replicates everything: one canonical mesh
                per_rank = wl.global_batch // dp
                if "microbatch" in f:
                    mbs = [f["microbatch"]] if per_rank % f["microbatch"] == 0 else []
                else:
                    mbs = [b for b in _divisors(per_rank)
                           if b <= _MAX_MICROBATCH and b & (b - 1) == 0]
                for mb in mbs:
                    m = per_rank // mb
                    if f.get("pp_microbatches", m) != m:
                        continue
                    for impl in self._cp_impls(cp, tp):
                        base = Layout(rep, shard, cp, tp, pp, ep, zero, mb, m, cp_impl=impl)
                        yield from self._below(base, pp, m)

    def _cp_impls(self, cp: int, tp: int) -> list[str]:
        """The context-parallel implementations searched at ``cp`` x ``tp`` ([Note: search
        order]): the fixed one; else at cp 1 ring (nothing differs), and above it the three
        ``apply_cp`` builds whose degree fits the key/value heads per tensor rank, or for
        multi-head latent attention, which it does not cover, Llama 3's all-gather."""
        if "cp_impl" in self.fixed:
            return [self.fixed["cp_impl"]]
        if cp == 1:
            return ["ring"]
        if self.spec.is_mla:
            return ["allgather"]
        return [i for i in ("ring", "ulysses", "hybrid")
                if cp_impl_error(i, cp, tp, self.spec) is None]

    def space(self) -> Iterator[Layout]:
        """Every layout of the search space, dominated ones included (for membership)."""
        every = _Searcher(self.spec, self.hw, self.wl, self.gpus, self.fixed, dominated=True)
        for group in every.layouts():
            yield from group

    def _below(self, base: Layout, pp: int, m: int) -> Iterator[list[Layout]]:
        """Groups of layouts differing only in checkpointing, least recomputation first."""
        f, every = self.fixed, self.dominated
        if base.tp == 1:
            sps = _allowed(f, "sp", [False])
        else:
            sps = _allowed(f, "sp", [False, True] if every or "sp" in f else [True])
        scheds = [(s, v) for s, v in _schedules(pp, self.spec.n_layers, m, f)
                  if s != "gpipe" or every or "pp_schedule" in f]
        b = base
        off, cw, cg = f.get("offload", "none"), f.get("comm_weights", "fp"), \
            f.get("comm_grads", "fp")
        acs = _allowed(f, "ac", ("none", "selective", "full"))
        for sched, v in scheds:
            for sp in sps:
                yield [Layout(b.dp_replicate, b.dp_shard, b.cp, b.tp, b.pp, b.ep, b.zero,
                              b.microbatch, b.pp_microbatches, sched, v, ac, sp, off, cw, cg,
                              b.cp_impl)
                       for ac in acs]

    def _price(self, L: Layout) -> Estimate | None:
        if self.states_floor(L) > self.hw.hbm_bytes and "offload" not in self.fixed:
            L = L.replace(offload="cpu")
            if self.states_floor(L) > self.hw.hbm_bytes:
                return None
        try:
            check_layout(L, self.spec, self.gpus, self.wl.seq_len, self.wl.global_batch)
        except ValueError:
            return None
        est = self.cm.estimate(L)
        self.evaluated += 1
        if not est.fits and L.offload == "none" and "offload" not in self.fixed:
            alt = self.cm.estimate(L.replace(offload="cpu"))
            self.evaluated += 1
            est = alt if alt.fits else est
        return est

    def run(self, keep: int) -> list[Estimate]:
        """Price the space best-first by lower bound until nothing left can enter the
        ``keep`` fastest fitting layouts ([Note: search order])."""
        groups = []
        for group in self.layouts():
            # only the group's first bound orders it: the others are priced when reached
            # (most groups never are, and pricing every bound was most of a 10T search)
            groups.append((self.cm.lower_bound(group[0]), len(groups), group))
        groups.sort()
        out: list[Estimate] = []
        best: list[float] = []  # negated step times of the fastest fitting layouts
        for n, (first, _, group) in enumerate(groups):
            if len(best) >= keep and first > -best[0]:
                self.pruned += sum(len(g[2]) for g in groups[n:])
                break
            for i, L in enumerate(group):
                bound = first if i == 0 else self.cm.lower_bound(L)
                if len(best) >= keep and bound > -best[0]:
                    self.pruned += len(group) - i
                    break
                est = self._price(L)
                if est is None:
                    self.pruned += 1
                    continue
                out.append(est)
                if est.fits:
                    heapq.heappush(best, -est.step_time)
                    if len(best) > keep:
                        heapq.heappop(best)
                    self.pruned += len(group) - i - 1  # recomputing more only adds time
                    break
        return out


def _refine(searcher: _Searcher, ranked: list[Estimate], top: int) -> list[Estimate]:
    """Try quantised data-parallel communication on the best fitting layouts."""
    extra = []
    f = searcher.fixed
    # fp8_tensorwise's weights gather as the codes its multiplies take
    # ([Note: pricing fp8 weight gathers] in dp_cost.py): worth trying beside int8
    fp8 = ("fp8",) if searcher.wl.matmul_recipe == "fp8_tensorwise" else ()
    for est in ranked[:top]:
        L = est.layout
        if L.zero == 0 or not est.fits:
            continue
        for w in (("fp",) if "comm_weights" in f else ("fp", "int8") + fp8):
            for g in (("fp",) if "comm_grads" in f else ("fp", "int8")):
                if (w, g) == (L.comm_weights, L.comm_grads):
                    continue
                q = searcher.cm.estimate(L.replace(comm_weights=w, comm_grads=g))
                searcher.evaluated += 1
                if q.fits and q.step_time <= est.step_time * (1 - QUANT_MIN_GAIN):
                    extra.append(q)
    return extra


def _fit_exactly(searcher: _Searcher, found: list[Estimate], top: int) -> list[Estimate]:
    """``found`` with the pipeline layouts the closed forms reject for their activations
    alone, and that would enter the ``top`` fastest, priced exactly ([Note: pipelines that
    fit exactly])."""
    times = sorted(e.step_time for e in found if e.fits)
    bar = times[top - 1] if len(times) >= top else float("inf")
    rejected = sorted((i for i, e in enumerate(found)
                       if not e.fits and e.layout.pp_virtual > 1 and e.step_time <= bar
                       and e.memory.total - e.memory.activations <= searcher.hw.hbm_bytes),
                      key=lambda i: found[i].step_time)
    out = list(found)
    for i in rejected[:2 * top]:  # the fastest: each is a simulation of every rank
        out[i] = searcher.cm.estimate(found[i].layout, exact=True)
        searcher.evaluated += 1
    return out


def _rank_key(e: Estimate):
    return (not e.fits, e.step_time if e.fits else e.memory.total, e.memory.total)


def search(spec, hw, wl: Workload, gpus: int, fixed: dict | None = None, top: int = 10,
           exact: bool = True) -> SearchResult:
    """Every layout of the space (see [Note: search order]), ranked.

    Args:
        spec, hw, wl: model, device, workload.
        gpus: GPUs of the job.
        fixed: layout keys the user set (``parse_layout``); the search chooses the rest.
        top: how many of the best layouts to refine with quantised communication and to
            re-price exactly (every pipeline rank, the simulated schedule).
        exact: re-price the best layouts exactly (default True; False keeps the closed
            forms, e.g. to compare them with the simulator).

    Returns:
        A :class:`SearchResult`; ``ranked`` is empty only if no layout satisfies the keys.

    Raises:
        ValueError: a GPU count below 1.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus={gpus!r}, expected an integer >= 1")
    start = time.perf_counter()
    s = _Searcher(spec, hw, wl, gpus, dict(fixed or {}))
    found = s.run(keep=max(top, 1) + _KEEP)
    if exact:  # exact=False promises the closed forms alone (the validation's column)
        found = _fit_exactly(s, found, max(top, 1))
    found.sort(key=_rank_key)
    found += _refine(s, found, top)
    found.sort(key=_rank_key)
    # The best are re-priced with every pipeline rank and the simulated schedule.
    if exact:
        best = [s.cm.estimate(e.layout, exact=True) for e in found[:max(top, 1)]]
        found = sorted(best + found[max(top, 1):], key=_rank_key)
    ranked = found
    return SearchResult(ranked, s.evaluated, s.pruned, time.perf_counter() - start)


def search_space(spec, hw, wl: Workload, gpus: int, fixed: dict | None = None
                 ) -> Iterator[Layout]:
    """Every layout of the search space (offload and quantised communication at their
    defaults), dominated ones included: what ``search`` chooses from."""
    yield from _Searcher(spec, hw, wl, gpus, dict(fixed or {})).space()


def in_search_space(layout: Layout, spec, hw, wl: Workload, gpus: int) -> bool:
    """Whether ``layout`` is one of the layouts :func:`search` chooses from (offload and
    quantised communication, which the search adds where they help, aside)."""
    mb, v = layout.microbatch, layout.pp_virtual
    if mb > _MAX_MICROBATCH or mb & (mb - 1) or (layout.pp_schedule == "interleaved_1f1b"
                                                  and v not in _VIRTUAL):
        return False  # fixing them widens the search beyond what the free search takes
    fixed = {k: v for k, v in layout.as_dict().items()
             if k not in ("offload", "comm_weights", "comm_grads")}
    want = layout.replace(offload="none", comm_weights="fp", comm_grads="fp")
    return any(L == want for L in search_space(spec, hw, wl, gpus, fixed))


def explain_empty(spec, hw, wl: Workload, gpus: int, fixed: dict) -> str:
    """Why no layout matches ``fixed``: the mesh / batch rule a completed layout breaks."""
    f = dict(fixed)
    node = min(hw.gpus_per_node, gpus)
    if "tp" in f and (node % f["tp"] or spec.n_heads % f["tp"]):
        return (f"tp={f['tp']} must divide the {node} GPUs of a node ({hw.name}) and the "
                f"{spec.n_heads} attention heads of {spec.name}")
    inner = f.get("tp", 1) * f.get("cp", 1) * f.get("pp", 1) * f.get("dp_replicate", 1)
    shard = f.get("dp_shard", max(1, gpus // inner))
    dp = f.get("dp_replicate", 1) * shard
    mb = f.get("microbatch", 1)
    pp = f.get("pp", 1)
    sched = f.get("pp_schedule", "none" if pp == 1 else "1f1b")
    L = Layout(dp_replicate=f.get("dp_replicate", 1), dp_shard=shard, cp=f.get("cp", 1),
               tp=f.get("tp", 1), pp=pp, ep=f.get("ep", 1), zero=f.get("zero", 2),
               microbatch=mb, pp_microbatches=f.get("pp_microbatches",
                                                    max(1, wl.global_batch // (dp * mb))),
               pp_schedule=sched, pp_virtual=f.get("pp_virtual", 2 if sched in (
                   "zbv", "dualpipev", "interleaved_1f1b") else 1),
               ac=f.get("ac", "none"), sp=f.get("sp", False), offload=f.get("offload", "none"),
               comm_weights=f.get("comm_weights", "fp"), comm_grads=f.get("comm_grads", "fp"),
               cp_impl=f.get("cp_impl", "ring"))
    try:
        check_layout(L, spec, gpus, wl.seq_len, wl.global_batch)
    except ValueError as exc:
        return f"no layout matches the fixed keys {fixed}: {exc}"
    return (f"no layout matches the fixed keys {fixed} within the search space (tp inside a "
            f"node of {hw.gpus_per_node}, micro-batch <= {_MAX_MICROBATCH} dividing the batch "
            f"per data-parallel rank, cp halving the sequence, pp <= {spec.n_layers} layers, "
            f"cp_impl fitting the key/value heads)")


def evaluate(spec, hw, wl: Workload, layout: Layout, gpus: int) -> Estimate:
    """Price one complete layout after checking it against the job.

    Raises:
        ValueError: from ``check_layout`` when the layout cannot run this job.
    """
    check_layout(layout, spec, gpus, wl.seq_len, wl.global_batch)
    return CostModel(spec, hw, wl).estimate(layout, exact=True)
