"""Process groups for data parallelism.

:class:`ParallelDims` (in parallel_dims.py) turns degrees into a :class:`ParallelMesh` that
answers every axis by name; :func:`resolve_groups` turns whatever a user passes as ``mesh``
to :func:`shardwise.shard` (nothing, a process group, a ParallelMesh, a DeviceMesh whose
dimension names are ParallelDims names, or an unnamed 1-D / 2-D ``(replicate, shard)``
DeviceMesh) into the groups the engine uses.

[Note: two groups per shard axis] All-gathers and reduce-scatters go to two different
process groups over the same ranks. Collectives on one group must be issued in the same
order on every rank; gathers (forward order, prefetch) and reductions (as gradients become
ready) form two sequences that are each deterministic, but their interleaving can differ
between ranks (a parameter unused on one rank delays its unit's reduction there). Separate
groups make each sequence independent, and on Gloo let a gather and a reduction run at the
same time on different worker threads.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardwise.distributed.parallel_dims import AXIS_NAMES, ParallelDims, ParallelMesh

__all__ = ["ParallelDims", "ParallelMesh", "ShardGroups", "NodeGroup", "resolve_groups",
           "replicated_groups", "node_group", "axis_groups"]


@dataclass
class ShardGroups:
    """The groups one :func:`shardwise.shard` call communicates over."""

    shard: dist.ProcessGroup | None
    gather: dist.ProcessGroup | None
    replicate: dist.ProcessGroup | None
    shard_rank: int
    shard_size: int
    replicate_size: int
    device_mesh: DeviceMesh | None
    dp: dist.ProcessGroup | None = None  # every data rank (replicate x shard), when known
    # Data-parallel degree the reduced gradients are divided by when it is not dp_size
    # (expert parameters reduced over edp: edp x ep, see [Note: expert placement]).
    data_degree: int | None = None

    @property
    def dp_size(self) -> int:
        """Ranks whose gradients are reduced (shard x replicate)."""
        return self.shard_size * self.replicate_size

    @property
    def grad_divisor(self) -> int:
        """What the reduced gradient sum is divided by: the ranks whose losses it averages."""
        return self.data_degree or self.dp_size


_SIBLINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _sibling_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A second group over the same ranks (see [Note: two groups per shard axis])."""
    sib = _SIBLINGS.get(group)
    if sib is None:
        ranks = dist.get_process_group_ranks(group)
        sib = dist.new_group(ranks, use_local_synchronization=True)
        _SIBLINGS[group] = sib
    return sib


@dataclass(frozen=True)
class NodeGroup:
    """A group of ``size`` consecutive ranks of a shard group (one "node"), for the
    hierarchical secondary partition: this rank is ``index`` inside it, and the shard group
    holds ``count`` such nodes."""

    group: dist.ProcessGroup | None
    size: int
    index: int
    count: int


_NODES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def node_group(groups: ShardGroups, size: int) -> NodeGroup:
    """The node of ``size`` consecutive shard-group ranks this rank belongs to.

    Raises:
        ValueError: when ``size`` does not divide the shard group's size.
    """
    n = groups.shard_size
    if size < 1 or n % size:
        raise ValueError(f"hierarchy={size} must divide the shard group size {n} (ranks per "
                         f"node, e.g. 8 GPUs of a host)")
    if groups.shard is None or n == 1:
        return NodeGroup(None, 1, 0, 1)
    ranks = dist.get_process_group_ranks(groups.shard)
    mine = ranks[(groups.shard_rank // size) * size:(groups.shard_rank // size + 1) * size]
    cache = _NODES.setdefault(groups.shard, {})
    if size not in cache:
        cache[size] = dist.new_group(mine, use_local_synchronization=True) if size > 1 else None
    return NodeGroup(cache[size], size, groups.shard_rank % size, n // size)


def replicated_groups(groups: ShardGroups) -> ShardGroups:
    """The same data-parallel ranks with nothing sharded: every rank a one-rank shard group,
    all of them replicas (stage 0 expressed as units: gradients all-reduced over the data
    ranks)."""
    if groups.dp_size == 1 or not dist.is_initialized():
        return ShardGroups(None, None, None, 0, 1, 1, None, data_degree=groups.data_degree)
    if groups.replicate is None:
        replicate = groups.shard
    elif groups.dp is not None:
        replicate = groups.dp
    else:  # hybrid mesh: the replicas of every shard, i.e. all of its ranks
        replicate = dist.group.WORLD if groups.dp_size == dist.get_world_size() else None
        if replicate is None:
            raise ValueError("stage 0 with mixed precision over a partial hybrid mesh is not "
                             "supported; pass a 1-D mesh or a ParallelMesh")
    return ShardGroups(None, None, replicate, 0, 1, groups.dp_size, None,
                       data_degree=groups.data_degree)


def axis_groups(group: dist.ProcessGroup | None, data_degree: int | None = None) -> ShardGroups:
    """The groups of one data axis sharded on its own (no replicas): the ``edp`` ranks that
    hold the same experts, whose reduced gradients are divided by ``data_degree``.

    Args:
        group: the axis's process group (None: this rank alone).
        data_degree: the divisor of the reduced gradients (default: the group's size).
    """
    if group is None or not dist.is_initialized():
        return ShardGroups(None, None, None, 0, 1, 1, None, data_degree=data_degree)
    n = dist.get_world_size(group)
    gather = _sibling_group(group) if n > 1 else group
    return ShardGroups(group, gather, None, dist.get_rank(group), n, 1, None,
                       data_degree=data_degree)


def _named_axes(mesh: DeviceMesh) -> tuple[str, ...] | None:
    """The dimension names of ``mesh`` when every one is a ParallelDims axis name."""
    names = mesh.mesh_dim_names
    if names and all(n in AXIS_NAMES for n in names):
        return tuple(names)
    return None


def _from_device_mesh(mesh: DeviceMesh):
    """(shard group, replicate group) of a DeviceMesh: by name when its dimension names are
    ParallelDims names ([Note: rank order] in parallel_dims.py), else positionally."""
    names = _named_axes(mesh)
    if names is not None:
        axis = "dp_shard_cp" if "dp_shard_cp" in names else "dp_shard"
        shard = mesh.get_group(axis) if axis in names else None
        replicate = mesh.get_group("dp_replicate") if "dp_replicate" in names else None
        if shard is None:  # no data sharding axis: a one-rank shard group
            shard = _self_group()
        return shard, replicate
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    if mesh.ndim == 2:
        return mesh.get_group(1), mesh.get_group(0)
    raise ValueError(f"mesh must be 1-D (shard), 2-D (replicate, shard) or have dimension "
                     f"names among {AXIS_NAMES}; got a {mesh.ndim}-D DeviceMesh with shape "
                     f"{tuple(mesh.shape)} and names {mesh.mesh_dim_names}")


_SELF: dict = {}


def _self_group() -> dist.ProcessGroup:
    """A group of this rank alone (every rank creates every one-rank group, in order)."""
    key = (id(dist.distributed_c10d._get_default_group()),)
    if key not in _SELF:
        mine = None
        for r in range(dist.get_world_size()):
            g = dist.new_group([r])
            mine = g if r == dist.get_rank() else mine
        _SELF[key] = mine
    return _SELF[key]


def resolve_groups(mesh, device_type: str = "cpu") -> ShardGroups:
    """Interpret ``mesh`` as shard groups: None (the world), a ProcessGroup (shard over it),
    a :class:`ParallelMesh` or a DeviceMesh whose dimension names are ParallelDims names
    (shard over ``dp_shard``, replicate over ``dp_replicate``; other axes are left to
    tensor, pipeline and expert parallelism), or an unnamed 1-D (shard) / 2-D (replicate,
    shard) DeviceMesh.

    Raises:
        ValueError: for a mesh of another shape or names, or an unsupported type.
    """
    if not dist.is_initialized():
        if mesh is not None:
            raise ValueError("a mesh was given but torch.distributed is not initialised; call "
                             "shardwise.distributed.init() first")
        return ShardGroups(None, None, None, 0, 1, 1, None)
    replicate, dp = None, None
    if mesh is None:
        shard = dist.group.WORLD
        device_mesh = DeviceMesh.from_group(shard, device_type)
    elif isinstance(mesh, dist.ProcessGroup):
        shard = mesh
        device_mesh = DeviceMesh.from_group(shard, device_type)
    elif isinstance(mesh, ParallelMesh):
        # Context-parallel ranks hold different tokens of the same sequences: their
        # gradients are summed like data ranks', so they shard parameters too (torchtitan's
        # dp_shard_cp). Without cp the names stay dp_shard / dp (same groups).
        cp = mesh.size("cp") > 1
        axis = "dp_shard_cp" if cp else "dp_shard"
        shard, dp = mesh.group(axis), mesh.group("dp_cp" if cp else "dp")
        replicate = mesh.group("dp_replicate") if mesh.size("dp_replicate") > 1 else None
        device_mesh = mesh["dp_replicate", axis] if replicate is not None else mesh[axis]
    elif isinstance(mesh, DeviceMesh):
        shard, replicate = _from_device_mesh(mesh)
        device_mesh = mesh
    else:
        raise ValueError(f"mesh must be None, a ProcessGroup, a ParallelMesh or a DeviceMesh, "
                         f"got {type(mesh).__name__}")
    gather = _sibling_group(shard) if dist.get_world_size(shard) > 1 else shard
    rep_size = dist.get_world_size(replicate) if replicate is not None else 1
    return ShardGroups(shard, gather, replicate if rep_size > 1 else None,
                       dist.get_rank(shard), dist.get_world_size(shard), rep_size, device_mesh,
                       dp)


def split_axis(ranks: list[int], outer: int) -> tuple[list[int], object, list[int], object]:
    """Split one axis (``ranks``, this rank's group along it, in order) into ``outer`` x
    ``len(ranks) // outer``, the inner part fastest varying: this rank's ``(outer ranks,
    outer group, inner ranks, inner group)``.

    Used for grouped-query attention with fewer KV heads than tensor ranks: the ranks of
    one inner group hold copies of the same KV head, the outer group one rank per head.
    Only the axis's members create the groups (every rank makes the same two calls, so
    c10d's group names agree).

    Raises:
        ValueError: when ``outer`` does not divide the axis size.
    """
    n = len(ranks)
    if outer < 1 or n % outer:
        raise ValueError(f"cannot split an axis of {n} ranks into {outer} parts")
    inner = n // outer
    me = ranks.index(dist.get_rank())
    inner_ranks = ranks[(me // inner) * inner:(me // inner + 1) * inner]
    outer_ranks = ranks[me % inner::inner]
    groups = []
    for rs in (outer_ranks, inner_ranks):
        groups.append(dist.new_group(rs, use_local_synchronization=True) if len(rs) > 1
                      else _self_group())
    return outer_ranks, groups[0], inner_ranks, groups[1]
