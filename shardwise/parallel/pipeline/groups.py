"""The process groups a pipeline runs on: the ``pp`` axis, and the data axes inside a stage.

    mesh = pipeline_mesh(pp=2)                    # world 4: ("pp", "dp_shard") = (2, 2)
    groups = resolve_pipeline_groups(mesh)        # pp group of this rank, dp mesh of its stage
    mesh = ParallelDims(world_size=8, pp=2, tp=2).build_mesh()  # pp x dp_shard x tp
    groups = resolve_pipeline_groups(mesh)        # the same, tp left to apply_tp(mesh["tp"])

Ranks are laid out with ``pp`` outermost (as torchtitan and Megatron do): the data-parallel
ranks of one stage are consecutive, and point-to-point messages go between ranks ``dp``
apart. A pipeline takes its groups from one place, :func:`resolve_pipeline_groups`, which
reads a ``DeviceMesh`` by its dimension names (``"pp"``, and ``"dp_replicate"`` /
``"dp_shard"`` for ZeRO inside a stage), so a job-wide N-D mesh that names these axes works
unchanged. The ``tp`` axis (tensor parallelism inside each stage, applied with ``apply_tp``
before the split) is not the pipeline's: a stage's tensor ranks run the same action list, and
each pipeline message goes between the ranks of one tensor coordinate (the ``pp`` group of a
rank is the ranks that share its data and tensor coordinates). Likewise the ``ep`` axis
(expert parallelism inside each stage, ``apply_ep`` before the split) is carved out of a
stage's data ranks, so a stage's expert-parallel peers run the same action list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.distributed import comm
from shardwise.distributed.parallel_dims import ParallelMesh

__all__ = ["PipelineGroups", "pipeline_mesh", "resolve_pipeline_groups"]

_DATA_AXES = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class PipelineGroups:
    """Where a pipeline rank communicates.

    Attributes:
        pp: the pipeline group (None: a single process, no messages).
        pp_rank: this rank's index in it (its pipeline rank).
        pp_size: pipeline ranks.
        data_mesh: the data-parallel axes of this rank's stage, what ``shardwise.shard``
            takes as ``mesh`` (1-D ``dp_shard`` or 2-D ``(dp_replicate, dp_shard)``); None
            outside ``torch.distributed``.
        tp_ranks: the global ranks of this rank's tensor-parallel group when the mesh has a
            ``tp`` axis (what ``apply_tp`` must have used), else ``()`` (not known).
    """

    pp: dist.ProcessGroup | None
    pp_rank: int
    pp_size: int
    data_mesh: DeviceMesh | None
    tp_ranks: tuple[int, ...] = ()

    def global_rank(self, pp_rank: int) -> int:
        """The global rank of pipeline rank ``pp_rank`` (in this rank's pipeline)."""
        if self.pp is None:
            return 0
        return dist.get_global_rank(self.pp, pp_rank)


def pipeline_mesh(pp: int, dp_replicate: int = 1, device_type: str = "cpu") -> DeviceMesh:
    """A mesh over the world with ``pp`` outermost: ``("pp", "dp_shard")``, or
    ``("pp", "dp_replicate", "dp_shard")`` when ``dp_replicate > 1``.

    Args:
        pp: pipeline ranks (must divide the world size).
        dp_replicate: data-parallel replicas of each stage (HSDP outer axis; default 1).
        device_type: "cpu" or "cuda".

    Returns:
        The DeviceMesh; ``dp_shard = world // (pp * dp_replicate)``.

    Raises:
        ValueError: degrees that do not divide the world size.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if pp < 1 or dp_replicate < 1 or world % (pp * dp_replicate):
        raise ValueError(f"pp={pp} x dp_replicate={dp_replicate} must divide the world size "
                         f"{world}")
    shard = world // (pp * dp_replicate)
    if dp_replicate == 1:
        return init_device_mesh(device_type, (pp, shard), mesh_dim_names=("pp", "dp_shard"))
    return init_device_mesh(device_type, (pp, dp_replicate, shard),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard"))


def resolve_pipeline_groups(mesh=None) -> PipelineGroups:
    """The pipeline groups of this rank, from a mesh, a process group or the world.

    Args:
        mesh: a :class:`~shardwise.distributed.parallel_dims.ParallelMesh` (its ``pp`` axis;
            ``dp_replicate`` / ``dp_shard`` are the stage's data axes, ``tp`` is left to
            ``apply_tp``); a ``DeviceMesh`` with a ``"pp"`` dimension (its other dimensions
            among ``"dp_replicate"``, ``"dp_shard"`` and ``"tp"``); a ProcessGroup (the
            pipeline group; no data parallelism inside a stage); or None (every rank of the
            world is a pipeline rank).

    Returns:
        The :class:`PipelineGroups`.

    Raises:
        ValueError: a DeviceMesh without a ``"pp"`` dimension, or a DeviceMesh with axes
            this pipeline cannot run over (pass a ParallelMesh for expert parallelism), or
            another type.
    """
    if not dist.is_initialized():
        if mesh is not None:
            raise ValueError("a pipeline mesh was given but torch.distributed is not "
                             "initialised; call shardwise.distributed.init() first")
        return PipelineGroups(None, 0, 1, None)
    if isinstance(mesh, ParallelMesh):
        return _from_parallel_mesh(mesh)
    if isinstance(mesh, DeviceMesh):
        names = tuple(mesh.mesh_dim_names or ())
        if "pp" not in names:
            raise ValueError(f"the pipeline mesh needs a 'pp' dimension; got dimensions "
                             f"{names or '(unnamed)'} of shape {tuple(mesh.shape)}")
        other = [n for n in names if n not in ("pp", "tp") and mesh[n].size() > 1]
        unknown = [n for n in other if n not in _DATA_AXES]
        if unknown:
            raise ValueError(f"the pipeline mesh has dimensions {unknown} of size > 1; a "
                             f"pipeline stage runs data parallelism over {_DATA_AXES} and "
                             f"tensor parallelism over 'tp' only")
        pp = mesh["pp"].get_group()
        data = tuple(n for n in _DATA_AXES if n in names and (n == "dp_shard" or n in other))
        data_mesh = mesh[data] if data else _self_mesh(mesh.device_type)
        tp = tuple(int(r) for r in mesh["tp"].mesh.tolist()) if "tp" in names else ()
        return PipelineGroups(pp, dist.get_rank(pp), dist.get_world_size(pp), data_mesh, tp)
    if mesh is None:
        pp = dist.group.WORLD
    elif isinstance(mesh, dist.ProcessGroup):
        pp = mesh
    else:
        raise ValueError(f"mesh must be None, a ProcessGroup, a ParallelMesh or a DeviceMesh "
                         f"with a 'pp' dimension, got {type(mesh).__name__}")
    return PipelineGroups(pp, dist.get_rank(pp), dist.get_world_size(pp),
                          _self_mesh(comm.group_device(pp).type))


def _from_parallel_mesh(mesh: ParallelMesh) -> PipelineGroups:
    """Groups from the job's N-D mesh: ``pp``, the data axes of the stage, the tensor ranks.
    Its ``ep`` / ``edp`` axes (carved out of the stage's data ranks) are ``apply_ep``'s: the
    expert parameters' placements name them, and the engine shards those over ``edp``.
    With context parallelism the stage's ranks of one data rank hold different tokens of
    its sequences: they shard and average like data ranks (``dp_shard_cp``, as
    ``shardwise.shard`` does over a ParallelMesh)."""
    pp = mesh.group("pp")
    shard = "dp_shard_cp" if mesh.size("cp") > 1 else "dp_shard"
    data = ("dp_replicate", shard) if mesh.size("dp_replicate") > 1 else (shard,)
    return PipelineGroups(pp, dist.get_rank(pp), dist.get_world_size(pp), mesh[data],
                          tuple(mesh.ranks("tp")))


def _self_mesh(device_type: str) -> DeviceMesh:
    """A one-rank mesh: ZeRO inside a stage that has no data-parallel peers."""
    me = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return DeviceMesh.from_group(me, device_type)
