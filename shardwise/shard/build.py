"""Building one ``shard`` / ``replicate`` call's engine state from its unit plans: the
groups of each unit, the units themselves (materialised or loaded from the module's tensors,
every rank starting from the first rank's values), and stage 0's replicated parameters.

``api.py`` validates the arguments and calls these; nothing here reads user arguments that
were not checked there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed import comm
from shardwise.distributed.mesh import ShardGroups, node_group, replicated_groups
from shardwise.shard.comm_quant import CommQuant
from shardwise.shard.discover import UnitPlan
from shardwise.shard.identity import StepCount, UnitTag
from shardwise.shard.materialize import has_meta, materialize
from shardwise.shard.placed import PartialGrads, unit_groups
from shardwise.shard.precision import MixedPrecision
from shardwise.shard.replicate import ReplicateState
from shardwise.shard.scaled_gather import attach_scaled_gathers
from shardwise.shard.streams import CommStreams
from shardwise.shard.unit import Unit

__all__ = ["broadcast_from_first", "broadcast_buffers", "plan_groups", "build_units",
           "build_replicate"]


def broadcast_from_first(tensors: list[torch.Tensor], groups: ShardGroups) -> None:
    """Make every rank start from the first rank's values (as DDP does), flattened."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors or groups.dp_size == 1:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    for g in (groups.shard, groups.replicate):
        if g is not None and dist.get_world_size(g) > 1:
            comm.broadcast(flat, dist.get_global_rank(g, 0), g, label="shard.sync_states")
    off = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()


def broadcast_buffers(module: nn.Module, groups: ShardGroups) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in module.buffers():
        by_dtype.setdefault(b.dtype, []).append(b)
    for bufs in by_dtype.values():
        broadcast_from_first(bufs, groups)


def plan_groups(plans: list[UnitPlan], groups: ShardGroups, replicated: bool
                 ) -> tuple[ShardGroups, list[ShardGroups]]:
    """(the call's groups, each unit's): the call's, or its parameters' own data axis
    ([Note: expert placement]); ``replicated``: stage 0 run as units (every rank a whole
    copy, see replicated_groups)."""
    per_unit = [unit_groups([e.param for e in p.entries], [e.fqns[0] for e in p.entries],
                            groups, p.name or "<root>") for p in plans]
    if not replicated:
        return groups, per_unit
    call = replicated_groups(groups)
    return call, [call if g is groups else replicated_groups(g) for g in per_unit]


def build_units(module, plans, groups, tracker, init_weights, sync_states,
                 do_materialize: bool, mp: MixedPrecision | None,
                 target: torch.device | None, quant: CommQuant | None,
                 per_unit: list[ShardGroups], state_id: int) -> list[Unit]:
    is_meta = any(e.param.is_meta for p in plans for e in p.entries) or has_meta(module)
    device = None
    if is_meta:
        device = (target or torch.device("cpu")) if do_materialize else torch.device("meta")
    nodes = {id(g): node_group(g, quant.hierarchy) if quant and quant.hierarchy else None
             for g in per_unit}
    names: dict = {}
    count = StepCount()  # [Note: step identity]: one per call, carried by its units' gathers
    real = next((e.param.device for p in plans for e in p.entries), torch.device("cpu"))
    streams = CommStreams(device if device is not None and device.type != "meta" else real)
    units = [Unit(p.name, p.module, p.entries, g, tracker, device, mp, nodes[id(g)],
                  quant, UnitTag(state_id, i, p.name or "<root>", names, count), streams)
             for i, (p, g) in enumerate(zip(plans, per_unit))]
    attach_scaled_gathers(units, quant)
    where = {id(sp.param): sp for u in units for sp in u.params}
    if is_meta and not do_materialize:
        pass  # planning mode: shards stay on the meta device, bytes are still accounted
    elif is_meta:
        def sink(param, full):
            where[id(param)].load_full(full)
        tracker.peak_init = materialize(module, units[0].device, init_weights, sink)
    else:
        for u in units:
            if sync_states:
                broadcast_from_first([sp.param for sp in u.params], u.groups)
            for sp in u.params:
                sp.load_full(sp.param.detach())
        if sync_states:
            broadcast_buffers(module, groups)
    for u in units:
        u.adopt_shards()
        u.swap_out()
    return units


def build_replicate(module, entries, groups, bucket_mb, tracker, init_weights,
               sync_states, target: torch.device | None) -> ReplicateState:
    # Expert parameters reduce over their own data axis ([Note: expert placement]).
    per_entry, same = [], {}
    for e in entries:
        g = unit_groups([e.param], e.fqns[:1], groups, "<root>")
        per_entry.append(same.setdefault((id(g.shard), g.data_degree), g))
    if any(e.param.is_meta for e in entries) or has_meta(module):
        fresh: dict[int, torch.Tensor] = {}

        def sink(param, full):
            fresh[id(param)] = full.clone()
        tracker.peak_init = materialize(module, target or torch.device("cpu"), init_weights,
                                        sink)
        for e in entries:
            new = nn.Parameter(fresh[id(e.param)], requires_grad=e.param.requires_grad)
            new.__dict__.update(e.param.__dict__)
            e.param = new
            for m, a in e.registrations:
                m._parameters[a] = new
    elif sync_states:
        for g in same.values():
            broadcast_from_first([e.param for e, eg in zip(entries, per_entry) if eg is g], g)
        broadcast_buffers(module, groups)
    # [Note: partial gradients]: of the materialised parameters
    partial = PartialGrads([e.param for e in entries])
    return ReplicateState(module, entries, groups, bucket_mb, tracker,
                          {id(e.param): g for e, g in zip(entries, per_entry)},
                          [partial] if partial else [])
