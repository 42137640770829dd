"""Meshes and process groups for data parallelism.

:class:`ParallelDims` turns degrees into a named :class:`DeviceMesh`; :func:`resolve_groups`
turns whatever a user passes as ``mesh`` to :func:`shardwise.shard` (nothing, a process
group, a 1-D or a 2-D ``(replicate, shard)`` DeviceMesh) into the groups the engine uses.

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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ParallelDims", "ShardGroups", "NodeGroup", "resolve_groups", "replicated_groups",
           "node_group"]


@dataclass(frozen=True)
class ParallelDims:
    """Data-parallel degrees of a job.

    Attributes:
        dp_replicate: replicas (hybrid sharding: all-reduce across them); default 1.
        dp_shard: ranks a model is sharded over; -1 infers ``world_size // dp_replicate``.
        world_size: number of ranks in the job.
    """

    dp_replicate: int
    dp_shard: int
    world_size: int

    def resolved(self) -> "ParallelDims":
        """Degrees with -1 inferred; raises ValueError when they do not fit the world."""
        if self.dp_replicate < 1:
            raise ValueError(f"dp_replicate must be >= 1, got {self.dp_replicate}")
        shard = self.dp_shard
        if shard == -1:
            if self.world_size % self.dp_replicate:
                raise ValueError(f"dp_replicate={self.dp_replicate} does not divide the world "
                                 f"size {self.world_size}")
            shard = self.world_size // self.dp_replicate
        if shard < 1:
            raise ValueError(f"dp_shard must be >= 1 or -1 (infer), got {self.dp_shard}")
        if shard * self.dp_replicate != self.world_size:
            raise ValueError(f"dp_replicate * dp_shard = {self.dp_replicate} * {shard} = "
                             f"{self.dp_replicate * shard}, expected the world size "
                             f"{self.world_size}")
        return ParallelDims(self.dp_replicate, shard, self.world_size)

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """A 1-D ("dp_shard",) mesh, or 2-D ("dp_replicate", "dp_shard") when replicating."""
        d = self.resolved()
        if d.dp_replicate == 1:
            return init_device_mesh(device_type, (d.dp_shard,), mesh_dim_names=("dp_shard",))
        return init_device_mesh(device_type, (d.dp_replicate, d.dp_shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))


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

    @property
    def dp_size(self) -> int:
        """Ranks whose gradients are averaged (shard x replicate)."""
        return self.shard_size * self.replicate_size


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
    all of them replicas (stage 0 expressed as units: gradients all-reduced over the world)."""
    if groups.dp_size == 1 or not dist.is_initialized():
        return ShardGroups(None, None, None, 0, 1, 1, None)
    if groups.replicate is None:
        replicate = groups.shard
    else:  # hybrid mesh: the replicas of every shard, i.e. all of its ranks
        replicate = dist.group.WORLD if groups.dp_size == dist.get_world_size() else None
        if replicate is None:
            raise ValueError("stage 0 with mixed precision over a partial hybrid mesh is not "
                             "supported; pass a 1-D mesh")
    return ShardGroups(None, None, replicate, 0, 1, groups.dp_size, None)


def resolve_groups(mesh, device_type: str = "cpu") -> ShardGroups:
    """Interpret ``mesh`` (None, ProcessGroup, 1-D or 2-D DeviceMesh) as shard groups.

    Raises:
        ValueError: for a mesh of more than two dimensions or an unsupported type.
    """
    if not dist.is_initialized():
        if mesh is not None:
            raise ValueError("a mesh was given but torch.distributed is not initialised; call "
                             "shardwise.distributed.init() first")
        return ShardGroups(None, None, None, 0, 1, 1, None)
    replicate = None
    if mesh is None:
        shard = dist.group.WORLD
        device_mesh = DeviceMesh.from_group(shard, device_type)
    elif isinstance(mesh, dist.ProcessGroup):
        shard = mesh
        device_mesh = DeviceMesh.from_group(shard, device_type)
    elif isinstance(mesh, DeviceMesh):
        if mesh.ndim == 1:
            shard = mesh.get_group(0)
        elif mesh.ndim == 2:
            replicate, shard = mesh.get_group(0), mesh.get_group(1)
        else:
            raise ValueError(f"mesh must be 1-D (shard) or 2-D (replicate, shard), got a "
                             f"{mesh.ndim}-D DeviceMesh with shape {tuple(mesh.shape)}")
        device_mesh = mesh
    else:
        raise ValueError(f"mesh must be None, a ProcessGroup or a DeviceMesh, got "
                         f"{type(mesh).__name__}")
    gather = _sibling_group(shard) if dist.get_world_size(shard) > 1 else shard
    rep_size = dist.get_world_size(replicate) if replicate is not None else 1
    return ShardGroups(shard, gather, replicate if rep_size > 1 else None,
                       dist.get_rank(shard), dist.get_world_size(shard), rep_size, device_mesh)
