"""What each parallelism sends per layer and micro-batch (and the engine per step): the one
list every device model prices (devices/gpu.py, devices/cpu/). tests/test_planner_cpu_
collectives.py checks it against the collectives ``comm_stats`` counts in real steps.

[Note: tensor-parallel collectives] Megatron's tensor parallelism (``apply_tp``) has two
regions per layer (attention, feed-forward), each a column-parallel linear feeding a
row-parallel one. Without sequence parallelism a region all-reduces its output in forward
and its input's gradient in backward. With it (Korthikanti et al. 2022, Section 4.2.2) a
region all-gathers its sequence-split input and reduce-scatters its output in forward, the
conjugates in backward (an all-gather of the output's gradient, a reduce-scatter of the
input's), and gathers its input again for the weight gradient (the forward kept only its
piece): the same bytes as the all-reduces. A full recomputation replays the forward's;
torchtitan's ``alternate_mm`` replays the all-gathers only (it keeps the reduce-scatters'
outputs). The embedding is vocabulary-parallel (its sum reduce-scattered to the sequence
pieces, or all-reduced), the head gathers its input (and again for its weight gradient)
and reduces its input's gradient, and the vocabulary-parallel loss all-reduces a max and a
sum of one fp32 value per token. How much of this is exposed is the device model's:
a GPU overlaps the weight-gradient regather with the input-gradient multiply (Megatron-LM)
and, with AsyncTP, the forward's with the multiplies they feed; a CPU rank waits for each.

[Note: context-parallel sends] Per attention layer and micro-batch a context-parallel rank
sends what ``shardwise.parallel.context.bytes_per_layer`` says, the closed form its tests
count ([Note: context-parallel bytes]), as the runtime sends it ([Note: ring attention],
[Note: Ulysses attention]):

- ring over ``n`` ranks: in forward step ``s < n - 1`` the next key/value block (``kv``
  bytes) travels while the current block is computed; the backward sends the blocks again,
  and each step's fp32 ``dK``, ``dV`` (``dkv``) travels during the next step's block, the
  last one after the last block, behind nothing;
- Ulysses over ``u`` ranks: four all-to-alls forward (q, k, v, the output) and their four
  adjoints backward, each sending ``(u - 1) / u`` of its tensor, before and after the
  attention, behind nothing;
- hybrid: the Ulysses all-to-alls inside groups of ``u`` consecutive cp ranks, then the
  ring over the ``cp / u`` groups on ``u``-times-longer, ``u``-times-narrower blocks;
- allgather (Llama 3, "The Llama 3 Herd of Models" 2024, Section 3.3.2: the keys and
  values all-gathered, attention computed for the local queries): priced with their
  gradients' reduce-scatter in backward, as the planner priced every cp layout before
  ``shardwise.parallel.context`` existed.

How much of each ring step's transfer is exposed is the stage's (stage_cost.py, [Note:
context-parallel exposure]); here are the bytes, the steps, and the compute of each step:
which query and key chunks meet in it (the layout's ranges), its share of
the rank's causal score entries, and the kernel calls (blocks) it runs, read off the
runtime's own division into calls (a query chunk against a run of key chunks it sees
whole, or against one chunk on the diagonal).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from shardwise.parallel.context import bytes_per_layer, rank_ranges
from shardwise.parallel.context.runtime import kernel_calls
from shardwise.planner import comm_model
from shardwise.planner.parallel_layout import cp_degrees
from shardwise.planner.pipeline import gather_rounds
from shardwise.planner.rank_memory import unit_state

__all__ = ["Collective", "TP_REGIONS", "LOSS_ALL_REDUCES", "tp_region", "tp_edges",
           "tp_calls_per_layer", "tp_edge_calls", "engine_calls", "pipeline_sends",
           "ContextSends", "context_sends", "cp_calls_per_layer", "CP_LOAD_BALANCE"]

CP_LOAD_BALANCE = "zigzag"
"""The layout the planner prices context parallelism in: the trainer's default
(``--parallel.cp_load_balance``), equal causal work on every rank."""

TP_REGIONS = 2
"""Tensor-parallel regions per layer: attention, feed-forward."""
LOSS_ALL_REDUCES = 2
"""The vocabulary-parallel loss's all-reduces (max, sum) of one fp32 value per token."""


@dataclass(frozen=True)
class Collective:
    """One tensor-parallel collective: its kind (all_gather, reduce_scatter, all_reduce) and
    what it carries (the payload of an all-gather or reduce-scatter is a sequence piece, an
    all-reduce's the whole activation)."""

    kind: str
    of: str


_AG, _RS, _AR = "all_gather", "reduce_scatter", "all_reduce"
_SP_REGION = {"forward": (Collective(_AG, "input"), Collective(_RS, "output")),
              "backward": (Collective(_AG, "output grad"), Collective(_RS, "input grad"),
                           Collective(_AG, "weight input"))}
_REGION = {"forward": (Collective(_AR, "output"),), "backward": (Collective(_AR, "input grad"),)}


def tp_region(sp: bool) -> dict[str, tuple[Collective, ...]]:
    """Per pass (``forward``, ``backward``), the collectives one region of a layer issues,
    in order ([Note: tensor-parallel collectives]); a replayed forward repeats the
    forward's."""
    return _SP_REGION if sp else _REGION


def tp_edges(sp: bool, first: bool, last: bool) -> tuple[Collective, ...]:
    """The embedding's (``first``) and the head's (``last``) collectives per micro-batch,
    the loss's all-reduces (:data:`LOSS_ALL_REDUCES`) aside."""
    out: tuple[Collective, ...] = ()
    if first:
        out += (Collective(_RS, "embedding sum"), Collective(_AG, "embedding grad")) if sp \
            else (Collective(_AR, "embedding sum"),)
    if last:
        out += (Collective(_AG, "head input"), Collective(_RS, "head input grad"),
                Collective(_AG, "head weight input")) if sp \
            else (Collective(_AR, "head input grad"),)
    return out


def tp_calls_per_layer(sp: bool, recompute: bool) -> int:
    """The tensor-parallel collectives one layer issues per micro-batch (a full
    ``recompute`` replays the forward's)."""
    region = tp_region(sp)
    return TP_REGIONS * (len(region["forward"]) * (2 if recompute else 1)
                         + len(region["backward"]))


def tp_edge_calls(sp: bool, first: bool, last: bool) -> int:
    """The embedding's, head's and loss's tensor-parallel collectives per micro-batch."""
    return len(tp_edges(sp, first, last)) + (LOSS_ALL_REDUCES if last else 0)


def engine_calls(spec, wl, L, units: list, layers, first: bool, last: bool) -> int:
    """The engine's data-parallel collectives per step on a rank holding ``layers`` (its
    ``units``' parameter shapes, root first), as ``comm_model.step_bytes`` prices them and
    comm_stats counts them: stage 0 one all-reduce per bucket (``comm_model.stage0_buckets``);
    stages 1-2 one reduce-scatter and one gather per unit; stage 3 every unit gathered
    ``pipeline.gather_rounds`` times a step and the non-root units again for each backward
    (with ``reshard_after_forward``), one reduce-scatter per unit; over replicas, each
    reduction also all-reduced."""
    world = L.dp_shard * L.cp
    if world * L.dp_replicate <= 1:
        return 0
    states = [unit_state(tuple(u), world) for u in units]
    held = [st for st in states if st.n_params]
    if L.zero == 0:
        sizes = comm_model.registration_sizes(spec, wl.param_bytes, L.tp, layers, first, last)
        return len(comm_model.stage0_buckets(sizes))
    n, root = len(held), int(bool(states and states[0].n_params))
    gathers = n if L.zero < 3 else gather_rounds(L, wl) * (
        n + (n - root if wl.reshard_after_forward else 0))
    return gathers + n * (2 if L.dp_replicate > 1 else 1)


def pipeline_sends(L) -> int:
    """A pipeline rank's sends and receives per step: an activation and a gradient per
    stage it holds and micro-batch (none without a pipeline)."""
    return 2 * max(1, L.pp_virtual) * L.pp_microbatches if L.pp > 1 else 0


@dataclass(frozen=True)
class ContextSends:
    """What one context-parallel rank sends and computes per attention layer and micro-batch
    ([Note: context-parallel sends]).

    Attributes:
        impl: ``ring``, ``ulysses``, ``hybrid`` or ``allgather``.
        cp: the context-parallel degree.
        ring: ranks a key/value block visits (1: no ring).
        ulysses: the all-to-all degree (1: no all-to-all).
        forward, backward: bytes the rank sends per pass (``bytes_per_layer``; allgather:
            ``cp - 1`` shards each way).
        kv: bytes of one ring step's key and value block.
        dkv: bytes of one ring step's fp32 key and value gradients (backward).
        a2a: the tensors (bytes each rank holds) of one pass's all-to-alls, in order (q, k,
            v, output; backward their adjoints, the same sizes); each sends ``(u - 1) / u``.
        gather: allgather's key/value shard (bytes) per rank.
        steps: per ring step, its share of the rank's causal score entries (sums to 1;
            ``(1.0,)`` without a ring).
        scores: causal score entries the rank computes per sequence and query head.
        blocks: attention kernel calls per pass (a query chunk against the key chunks it
            meets: ``kernel_calls`` in shardwise/parallel/context/runtime.py).
        area: the calls' query x key rectangles per sequence and query head (what the
            CPU flash kernel computes, causal or not, up to its 512-key blocks).
        queries: the calls' query tokens per sequence and query head (what the operator
            merges and accumulates around each call).
    """

    impl: str
    cp: int
    ring: int
    ulysses: int
    forward: int
    backward: int
    kv: float = 0.0
    dkv: float = 0.0
    a2a: tuple[float, ...] = ()
    gather: float = 0.0
    steps: tuple[float, ...] = (1.0,)
    scores: float = 0.0
    blocks: int = 1
    area: float = 0.0
    queries: float = 0.0

    def sent(self, pass_: str) -> float:
        """Bytes the messages of ``pass_`` (``forward``, ``backward``) add up to: equal to
        ``forward`` / ``backward`` (the tests check it)."""
        n, u = self.ring, self.ulysses
        if self.impl == "allgather":  # cp - 1 shards each way
            return self.forward if pass_ == "forward" else self.backward
        total = sum(t * (u - 1) / u for t in self.a2a)
        if n > 1:
            total += (n - 1) * self.kv + (n * self.dkv if pass_ == "backward" else 0.0)
        return total


def cp_calls_per_layer(sends: ContextSends, recompute: bool) -> int:
    """The context-parallel calls one layer issues per micro-batch (a full ``recompute``
    replays the forward's): each all-to-all, each ring step's exchange (forward ``n - 1``,
    backward ``n - 1`` key/value blocks and ``n`` gradient blocks), or allgather's gather
    and reduce-scatter."""
    if sends.impl == "allgather":
        return 2 + (1 if recompute else 0)
    n, a2a = sends.ring, len(sends.a2a)
    fwd = a2a + (n - 1)
    bwd = a2a + (2 * n - 1 if n > 1 else 0)
    return fwd * (2 if recompute else 1) + bwd


def context_sends(spec, impl: str, cp: int, tp: int, microbatch: int, seq_len: int,
                  elem: int) -> ContextSends:
    """What ``impl`` sends and computes per layer on one of ``cp`` ranks for a micro-batch
    of ``microbatch`` sequences of ``seq_len`` tokens, ``spec``'s attention split ``tp``
    ways, activations of ``elem`` bytes ([Note: context-parallel sends]).

    Raises:
        ValueError: from :func:`~shardwise.planner.parallel_layout.cp_degrees`.
    """
    ring, u = cp_degrees(impl, cp, tp, spec)
    if impl == "allgather":
        kv_width = (spec.kv_lora_rank + spec.qk_rope_head_dim) if spec.is_mla else \
            2 * max(1, spec.kv_heads // tp) * spec.hd
        shard = microbatch * seq_len / cp * kv_width * elem
        sent = int((cp - 1) * shard)
        return ContextSends(impl, cp, 1, 1, sent, sent, gather=shard)
    heads, kv = spec.n_heads // tp, max(1, spec.kv_heads // tp)
    shape = dict(batch=microbatch, heads=heads, kv_heads=kv, head_dim=spec.hd, elem=elem)
    total = bytes_per_layer(impl, seq_len=seq_len, cp=cp, ulysses=u, **shape)
    # the ring's part: cp / u ranks on blocks of u x seq_len / cp tokens (the same bytes)
    ring_b = bytes_per_layer("ring", seq_len=seq_len // u, cp=ring, **shape)
    kv_b = ring_b["forward"] / (ring - 1) if ring > 1 else 0.0
    dkv_b = (ring_b["backward"] - ring_b["forward"]) / ring if ring > 1 else 0.0
    a2a: tuple[float, ...] = ()
    if u > 1:  # q, k, v, output in proportion to their heads
        sent = total["forward"] - ring_b["forward"]
        parts = (heads, kv, kv, heads)
        a2a = tuple(sent * p / sum(parts) * u / (u - 1) for p in parts)
    steps, scores, blocks, area, queries = _ring_work(seq_len, cp, ring, u, CP_LOAD_BALANCE)
    return ContextSends(impl, cp, ring, u, total["forward"], total["backward"], kv_b, dkv_b, a2a,
                        steps=steps, scores=scores, blocks=blocks, area=area, queries=queries)


@functools.lru_cache(maxsize=256)
def _ring_work(seq_len: int, cp: int, ring: int, u: int, load_balance: str
               ) -> tuple[tuple[float, ...], float, int, float, float]:
    """(each ring step's share of the rank's causal entries, entries per query head and
    sequence, kernel calls per pass, the calls' query x key rectangles and their query
    tokens per query head and sequence) of the busiest ring member, as ``ring_forward``
    meets the chunks: member ``m`` holds its all-to-all group's ranges and at step ``s``
    the block of member ``(m - s) mod ring``,
    computed in the runtime's own kernel calls (``kernel_calls`` in runtime.py: a query chunk
    against a run of key chunks it sees whole, or one causal chunk)."""
    def ranges(member: int) -> tuple:
        return tuple(r for k in range(u)
                     for r in rank_ranges(seq_len, member * u + k, cp, load_balance))

    best = None
    for m in range(ring):
        per_step, calls, area, queries = [], 0, 0, 0
        for s in range(ring):
            step = kernel_calls(ranges(m), ranges((m - s) % ring))
            per_step.append(sum(_entries(qr, kr) for _, qr, _, krs, _ in step for kr in krs))
            calls += len(step)
            area += sum((qb - qa) * (kb - ka) for (qa, qb), _, (ka, kb), _, _ in step)
            queries += sum(qb - qa for (qa, qb), _, _, _, _ in step)
        if best is None or (sum(per_step), calls) > (sum(best[0]), best[1]):
            best = (per_step, calls, area, queries)  # the most entries, then calls
    per_step, calls, area, queries = best
    total = sum(per_step)
    return tuple(e / total for e in per_step), total / u, calls, area / u, queries / u


def _entries(q: tuple[int, int], k: tuple[int, int]) -> int:
    """Causal score entries (key position <= query position) of queries ``q`` against keys
    ``k`` (``[start, stop)`` ranges)."""
    (qs, qe), (ks, ke) = q, k
    total = 0
    lo = max(qs, ks)  # queries below ks see none of these keys
    if lo < qe:  # query p sees keys ks..min(p, ke - 1)
        full_from = max(lo, ke - 1)  # from here every key of the block is seen
        part_hi = min(qe, full_from)
        total += (part_hi - lo) * (lo - ks + 1 + part_hi - 1 - ks + 1) // 2 \
            if part_hi > lo else 0
        total += max(0, qe - full_from) * (ke - ks)
    return total
