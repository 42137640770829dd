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
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.planner import comm_model
from shardwise.planner.pipeline import gather_rounds
from shardwise.planner.rank_memory import unit_state

__all__ = ["Collective", "TP_REGIONS", "LOSS_ALL_REDUCES", "tp_region", "tp_edges",
           "tp_calls_per_layer", "tp_edge_calls", "engine_calls", "pipeline_sends"]

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
