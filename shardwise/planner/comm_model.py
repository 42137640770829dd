"""Time of each collective on a placed group: an alpha-beta model per link level.

[Note: hierarchical collectives] The mesh puts ``tp`` innermost, then ``cp``, ``dp_shard``,
``dp_replicate`` and ``pp`` outermost, so a group of ``n`` ranks with stride ``S`` (the
product of the degrees inside its axes) has ``k = min(n, G // S)`` members on each node of
``G`` GPUs. A collective over such a group runs hierarchically, as NCCL does: a phase over
the ``k`` ranks inside the node (NVLink) and a phase over the ``m = n / k`` nodes (the
network, each GPU on its own NIC). Each phase moves the bytes the formulas of
:mod:`shardwise.distributed.comm.byte_counts` give for its group and payload, the same formulas
``comm_stats`` records, and costs ``latency * steps + bytes / bandwidth`` on its link:

* all-gather of a ``b``-byte shard: ``m - 1`` network steps of ``b``, then ``k - 1``
  NVLink steps of ``m b``; reduce-scatter mirrors it;
* all-reduce of ``B`` bytes: reduce-scatter + all-gather in each level, the network level
  on ``B / k`` bytes; its latency grows with ``log2`` of the node count (NCCL's trees);
* all-to-all: ``(k - 1) / n`` of the payload over NVLink and ``(n - k) / n`` over the
  network, concurrently;
* send/receive between neighbouring pipeline stages: one message on the link joining them.

Links carry the achievable bandwidth of the hardware entry (datasheet x fitted efficiency).
This is the GPU device model's network (devices/gpu.py); a calibrated CPU device prices the
collectives it measured from its own fits and falls back to it for the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.distributed.comm import byte_counts as comm_bytes
from shardwise.planner.hardware import Hardware, Link
from shardwise.planner.rank_memory import TAG_BYTES, unit_state

__all__ = ["Group", "place", "all_gather_time", "reduce_scatter_time", "all_reduce_time",
           "all_to_all_time", "dispatch_time", "p2p_time", "step_bytes", "stage0_buckets",
           "registration_sizes"]


@dataclass(frozen=True)
class Group:
    """A process group as placed on nodes: ``size`` ranks, ``per_node`` on each node."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return self.size // self.per_node


def place(size: int, stride: int, gpus_per_node: int) -> Group:
    """The placement of a group of ``size`` ranks whose members are ``stride`` ranks apart
    (see [Note: hierarchical collectives])."""
    if size <= 1:
        return Group(1, 1)
    per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    while size % per_node:  # a node holds a whole number of the group's members
        per_node -= 1
    return Group(size, per_node)


def _phase(link: Link, steps: float, nbytes: float) -> float:
    return 0.0 if nbytes <= 0 else steps * link.latency + nbytes / link.bandwidth


def all_gather_time(shard_bytes: float, g: Group, hw: Hardware) -> float:
    """Seconds for an all-gather of ``shard_bytes`` per rank over ``g``."""
    if g.size <= 1:
        return 0.0
    m, k = g.nodes, g.per_node
    inter = comm_bytes.all_gather_bytes(m, int(shard_bytes))[0]
    intra = comm_bytes.all_gather_bytes(k, int(m * shard_bytes))[0]
    return _phase(hw.inter, m - 1, inter) + _phase(hw.intra, k - 1, intra)


def reduce_scatter_time(shard_bytes: float, g: Group, hw: Hardware) -> float:
    """Seconds for a reduce-scatter whose output is ``shard_bytes`` per rank over ``g``:
    an all-gather's steps and bytes in the other direction."""
    return all_gather_time(shard_bytes, g, hw)


def all_reduce_time(nbytes: float, g: Group, hw: Hardware) -> float:
    """Seconds for an all-reduce of ``nbytes`` over ``g`` (hierarchical, tree latency)."""
    if g.size <= 1:
        return 0.0
    m, k = g.nodes, g.per_node
    intra = comm_bytes.all_reduce_bytes(k, int(nbytes))[0]
    inter = comm_bytes.all_reduce_bytes(m, int(nbytes / k))[0]
    return (_phase(hw.intra, 2 * (k - 1), intra)
            + _phase(hw.inter, 2 * math.ceil(math.log2(m)) if m > 1 else 0, inter))


def all_to_all_time(nbytes: float, g: Group, hw: Hardware) -> float:
    """Seconds for an all-to-all where each rank sends ``nbytes`` spread evenly over ``g``."""
    if g.size <= 1:
        return 0.0
    n, k = g.size, g.per_node
    intra = _phase(hw.intra, 1, nbytes * (k - 1) / n)
    inter = _phase(hw.inter, 1, nbytes * (n - k) / n)
    return max(intra, inter)


def dispatch_time(token_bytes: float, tokens: float, top_k: int, g: Group, hw: Hardware,
                  node_limit: int = 0) -> float:
    """Seconds to send ``tokens`` tokens of ``token_bytes`` each to their ``top_k`` experts
    spread evenly over ``g`` (the expert all-to-all's dispatch, or its combine).

    Without a node limit every (token, expert) pair is a message, as a plain all-to-all
    sends it. With ``node_limit = M`` (DeepSeek-V3's node-limited routing and its dispatch
    kernels) a token crosses the network once per remote node it targets, at most ``M``,
    and NVLink forwards it to the experts inside that node.
    """
    if g.size <= 1:
        return 0.0
    if not node_limit or g.nodes == 1:
        return all_to_all_time(tokens * top_k * token_bytes, g, hw)
    n_nodes = g.nodes
    remote = (n_nodes - 1) * (1 - (1 - 1 / n_nodes) ** top_k)  # expected remote nodes hit
    inter = _phase(hw.inter, 1, tokens * token_bytes * min(node_limit, remote))
    intra = _phase(hw.intra, 1, tokens * top_k * token_bytes * (g.per_node - 1) / g.per_node)
    return max(inter, intra)


def p2p_time(nbytes: float, across_nodes: bool, hw: Hardware) -> float:
    """Seconds for one point-to-point message between neighbouring pipeline stages."""
    return _phase(hw.inter if across_nodes else hw.intra, 1, nbytes)


def step_bytes(spec, world: int, *, zero: int, param_bytes: int = 4, compute_bytes: int = 4,
               reduce_bytes: int | None = None, microbatches: int = 1,
               reshard_after_forward: bool = True) -> dict[str, int]:
    """Bytes one rank sends per collective kind in one step of the ZeRO engine over a
    ``world``-rank group (one unit per block plus the root unit), as ``comm_stats`` counts.

    Stage 0 all-reduces whole gradients (one bucket per ~25 MiB); stages 1-2 gather the
    updated shards once; stage 3 gathers every unit for forward and the non-root units
    again for backward, per micro-batch; gradients are reduce-scattered once.
    """
    rb = reduce_bytes or compute_bytes
    units = [unit_state(tuple(u), world) for u in spec.unit_shapes()]
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    if zero == 0:
        if compute_bytes != param_bytes:  # stage 0 as units over one-rank shard groups
            out["all_reduce"] = sum(comm_bytes.all_reduce_bytes(world, u.shard_numel * rb)[0]
                                    for u in units)
        else:
            out["all_reduce"] = sum(comm_bytes.all_reduce_bytes(world, b)[0]
                                    for b in _buckets(spec, param_bytes))
        return out
    shard = [u.shard_numel for u in units]
    wire = [s * compute_bytes + (TAG_BYTES if u.n_params else 0)  # gathered bytes per unit
            for s, u in zip(shard, units, strict=True)]
    gathers = sum(wire)
    if zero == 3:
        per_mb = sum(wire) + (sum(wire[1:]) if reshard_after_forward else 0)
        gathers = microbatches * per_mb
    out["all_gather"] = comm_bytes.all_gather_bytes(world, gathers)[0]
    out["reduce_scatter"] = comm_bytes.reduce_scatter_bytes(world, sum(shard) * rb)[0]
    return out


def _buckets(spec, param_bytes: int, cap_mb: float = 25.0) -> list[int]:
    """Stage-0 bucket sizes in bytes of the whole model."""
    return stage0_buckets(registration_sizes(spec, param_bytes), cap_mb)


def stage0_buckets(sizes: list[int], cap_mb: float = 25.0) -> list[int]:
    """Stage-0 bucket sizes in bytes of parameters of ``sizes`` bytes (registration order),
    as the engine packs them (``shard.replicate``): in reverse order, a 1 MiB first
    bucket, then ``cap_mb``."""
    buckets, cur = [], 0
    for nbytes in sizes[::-1]:
        cap = (min(1.0, cap_mb) if not buckets else cap_mb) * 2 ** 20
        if cur and cur + nbytes > cap:
            buckets.append(cur)
            cur = 0
        cur += nbytes
    return buckets + ([cur] if cur else [])


def registration_sizes(spec, param_bytes: int, tp: int = 1, layers=None, first: bool = True,
                       last: bool = True) -> list[int]:
    """Parameter bytes in ``Transformer.parameters()`` order (embedding, blocks, norm, head)
    of a rank holding ``layers`` (None: every block) of the pipeline's ``first`` and / or
    ``last`` stage, its tensors split ``tp`` ways."""
    root = spec.root_shapes(tp, first, last)
    front = root[:len(spec.root_shapes(tp, first, False))]
    layers = range(spec.n_layers) if layers is None else layers
    blocks = [s for i in layers for s in spec.block_shapes(i, tp)]
    return [math.prod(s) * param_bytes for s in front + blocks + root[len(front):]]
