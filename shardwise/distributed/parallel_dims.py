"""N-D layouts: degrees -> rank arithmetic -> one mesh that answers every axis by name.

[Note: rank order] A job of ``pp x dp_replicate x dp_shard x cp x tp`` ranks numbers them
with ``tp`` innermost (fastest varying: the ranks of one tensor-parallel group are
consecutive, so they sit inside one node and talk over its fastest links), then ``cp``,
``dp_shard``, ``dp_replicate``, and ``pp`` outermost, as Megatron and torchtitan do::

    rank = (((pp_i * dp_replicate + r_i) * dp_shard + s_i) * cp + c_i) * tp + t_i

Expert parallelism does not multiply the world size: ``ep`` is carved out of the data ranks
``dp_shard x cp`` (as in torchtitan). It takes their innermost ranks: with ``d = s_i * cp +
c_i``, the expert rank is ``d % ep`` and ``d // ep`` numbers the expert-data shards; ``edp``
(the ranks that hold the same experts and average their gradients) is ``dp_replicate x
(dp_shard x cp / ep)``. The flattened axes ``dp`` (``dp_replicate x dp_shard``) and
``dp_shard_cp`` (``dp_shard x cp``) are what data parallelism and the loss average use;
``dp_cp`` (``dp_replicate x dp_shard x cp``) is every rank holding different tokens.

Every axis is answered on every rank, a one-rank mesh where the degree is 1, so code asks
``mesh["tp"]`` without first checking whether tensor parallelism is on. Nothing outside this
module (and :mod:`shardwise.distributed.mesh`) computes ranks by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelDims", "ParallelMesh", "AXIS_NAMES", "BASE_AXES", "DATA_AXES",
           "product_mesh", "affine_ranks"]

BASE_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh dimensions, outermost first ([Note: rank order])."""
AXIS_NAMES = BASE_AXES + ("ep", "edp", "dp", "dp_shard_cp", "dp_cp")
"""Every name a :class:`ParallelMesh` answers."""
DATA_AXES = frozenset({"dp_replicate", "dp_shard", "dp", "dp_shard_cp", "dp_cp", "edp"})
"""Axes whose ranks see different batches (gradients are averaged over them)."""


def _degree(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of a job's layout.

    ``pp x dp_replicate x dp_shard x cp x tp`` must equal ``world_size``; ``ep`` divides
    ``dp_shard x cp`` (it is carved out of the data ranks and does not multiply the world).

    Attributes:
        dp_replicate: data-parallel replicas (hybrid sharding: all-reduce across them);
            default 1.
        dp_shard: ranks a model is sharded over; -1 infers ``world_size // (pp x
            dp_replicate x cp x tp)``. Default -1.
        world_size: number of ranks in the job (default 1).
        pp: pipeline stages (default 1).
        cp: context-parallel degree (default 1); the cp ranks split each sequence
            (``shardwise.parallel.context.apply_cp``) and average gradients like data ranks.
        tp: tensor-parallel degree (default 1).
        ep: expert-parallel degree, carved out of ``dp_shard x cp`` (default 1).
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    world_size: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def resolved(self) -> "ParallelDims":
        """Degrees with -1 inferred.

        Raises:
            ValueError: a degree below 1, degrees whose product is not the world
                size, or ``ep`` not dividing ``dp_shard x cp``; each names the degrees.
        """
        _degree("world_size", self.world_size)
        pp, rep, cp, tp, ep = (_degree(n, getattr(self, n))
                               for n in ("pp", "dp_replicate", "cp", "tp", "ep"))
        others = pp * rep * cp * tp
        shard = self.dp_shard
        if shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"pp x dp_replicate x cp x tp = {pp} x {rep} x {cp} x {tp} = {others} does "
                    f"not divide the world size {self.world_size}, so dp_shard=-1 cannot be "
                    f"inferred")
            shard = self.world_size // others
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1:
            raise ValueError(f"dp_shard must be an int >= 1 or -1 (infer), got {self.dp_shard!r}")
        if others * shard != self.world_size:
            raise ValueError(
                f"pp x dp_replicate x dp_shard x cp x tp = {pp} x {rep} x {shard} x {cp} x {tp} "
                f"= {others * shard}, expected the world size {self.world_size}")
        if (shard * cp) % ep:
            raise ValueError(f"ep={ep} must divide dp_shard x cp = {shard} x {cp} = "
                             f"{shard * cp}: experts are spread over the data ranks")
        return ParallelDims(rep, shard, self.world_size, pp=pp, cp=cp, tp=tp, ep=ep)

    def degree(self, axis: str) -> int:
        """The size of ``axis`` (any of :data:`AXIS_NAMES`) once -1 is inferred.

        Raises:
            ValueError: for an unknown axis name.
        """
        d = self.resolved()
        sizes = {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard,
                 "cp": d.cp, "tp": d.tp, "ep": d.ep, "dp": d.dp_replicate * d.dp_shard,
                 "dp_shard_cp": d.dp_shard * d.cp, "dp_cp": d.dp_replicate * d.dp_shard * d.cp,
                 "edp": d.dp_replicate * d.dp_shard * d.cp // d.ep}
        if axis not in sizes:
            raise ValueError(f"unknown mesh axis {axis!r}; expected one of {AXIS_NAMES}")
        return sizes[axis]

    # ------------------------------------------------------------------ rank arithmetic
    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of global ``rank`` on the base axes ([Note: rank order])."""
        d = self.resolved()
        out = {}
        for name in reversed(BASE_AXES):
            size = getattr(d, name)
            out[name] = rank % size
            rank //= size
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        """The global rank at base-axis ``coords`` (the inverse of :meth:`coords`)."""
        d, rank = self.resolved(), 0
        for name in BASE_AXES:
            rank = rank * getattr(d, name) + coords[name]
        return rank

    def axis_ranks(self, axis: str, rank: int) -> list[int]:
        """Global ranks of ``rank``'s group along ``axis``, in axis order (``rank`` included)."""
        d, c = self.resolved(), self.coords(rank)

        def at(**kw) -> int:
            return self.rank_of({**c, **kw})
        if axis in BASE_AXES:
            return [at(**{axis: i}) for i in range(getattr(d, axis))]
        if axis == "dp":
            return [at(dp_replicate=r, dp_shard=s)
                    for r in range(d.dp_replicate) for s in range(d.dp_shard)]
        if axis == "dp_shard_cp":
            return [at(dp_shard=s, cp=k) for s in range(d.dp_shard) for k in range(d.cp)]
        if axis == "dp_cp":
            return [at(dp_replicate=r, dp_shard=s, cp=k) for r in range(d.dp_replicate)
                    for s in range(d.dp_shard) for k in range(d.cp)]
        inner = c["dp_shard"] * d.cp + c["cp"]  # index in dp_shard x cp
        if axis == "ep":
            base = inner - inner % d.ep
            return [at(dp_shard=j // d.cp, cp=j % d.cp) for j in range(base, base + d.ep)]
        if axis == "edp":
            lane = inner % d.ep
            return [at(dp_replicate=r, dp_shard=j // d.cp, cp=j % d.cp)
                    for r in range(d.dp_replicate)
                    for j in range(lane, d.dp_shard * d.cp, d.ep)]
        raise ValueError(f"unknown mesh axis {axis!r}; expected one of {AXIS_NAMES}")

    def build_mesh(self, device_type: str = "cpu") -> "ParallelMesh":
        """The job's :class:`ParallelMesh` (collective: every rank calls it, in one order).

        Args:
            device_type: "cpu" or "cuda" (default "cpu").

        Raises:
            ValueError: degrees that do not fit (:meth:`resolved`), or a world size other
                than the process group's.
        """
        return ParallelMesh(self, device_type)


def affine_ranks(me: int, axes: list[list[int]]) -> torch.Tensor:
    """The global ranks of an N-D mesh spanned by independent axes through ``me``.

    Each axis is the list of global ranks of ``me``'s group along it. In a product layout
    (every DeviceMesh, every :class:`ParallelMesh`) moving along one axis shifts the rank by
    the same offset wherever the other coordinates are, so the rank at coordinates ``(c_1,
    ..., c_k)`` is ``me + sum_a (axes[a][c_a] - me)``.

    Raises:
        ValueError: when the axes are not independent (two coordinates give one rank).
    """
    sizes = [len(a) for a in axes]
    flat = [me + sum(a[c] - me for a, c in zip(axes, cs))
            for cs in product(*(range(s) for s in sizes))]
    if len(set(flat)) != len(flat) or min(flat) < 0:
        raise ValueError(f"mesh axes {axes} through rank {me} are not independent")
    return torch.tensor(flat, dtype=torch.int).view(*sizes) if sizes else torch.tensor(me)


def product_mesh(device_type: str, names: tuple[str, ...], ranks: list[list[int]],
                 groups: list) -> DeviceMesh:
    """A DeviceMesh with dimensions ``names`` (in that order) from existing process groups,
    creating none: ``ranks[i]`` are the global ranks of ``groups[i]`` in axis order."""
    me = dist.get_rank()
    if len(names) == 1:
        return DeviceMesh.from_group(groups[0], device_type, mesh=list(ranks[0]),
                                     mesh_dim_names=names)
    return DeviceMesh.from_group(list(groups), device_type, mesh=affine_ranks(me, ranks),
                                 mesh_dim_names=names)


class ParallelMesh:
    """One mesh for a whole job: every axis of :data:`AXIS_NAMES` by name.

    ``mesh["tp"]`` is the 1-D DeviceMesh of this rank's tensor-parallel group (one rank
    where ``tp == 1``); ``mesh["dp_replicate", "dp_shard"]`` an N-D DeviceMesh over those
    axes, in the order given. ``shardwise.shard(model, mesh=mesh)`` shards over ``dp_shard``
    and replicates over ``dp_replicate``; ``apply_tp(model, mesh["tp"])`` takes the tensor
    axis. Build it with :meth:`ParallelDims.build_mesh` (collective: process groups are
    created for every axis on every rank, in one order).

    Args:
        dims: the job's degrees (``world_size`` must be the process group's).
        device_type: "cpu" or "cuda".

    Raises:
        ValueError: degrees that do not fit, or torch.distributed not initialised when the
            world size is above 1.
    """

    def __init__(self, dims: ParallelDims, device_type: str = "cpu") -> None:
        self.dims = dims.resolved()
        self.device_type = device_type
        if not dist.is_initialized():
            raise ValueError("ParallelDims.build_mesh needs torch.distributed initialised; "
                             "call shardwise.distributed.init() first")
        if dist.get_world_size() != self.dims.world_size:
            raise ValueError(f"ParallelDims.world_size={self.dims.world_size}, but the process "
                             f"group has {dist.get_world_size()} ranks")
        self.rank = dist.get_rank()
        self._groups: dict[str, object] = {}
        self._meshes: dict[tuple[str, ...], DeviceMesh] = {}
        self._create_groups()

    def _create_groups(self) -> None:
        """Every group of every axis, created by every rank in the same order (c10d's
        ``new_group`` is collective over the world); identical rank sets share one group."""
        world = self.dims.world_size
        by_ranks: dict[tuple[int, ...], object] = {}
        for axis in AXIS_NAMES:
            seen = set()
            for r in range(world):
                ranks = tuple(self.dims.axis_ranks(axis, r))
                if ranks in seen:
                    continue
                seen.add(ranks)
                if ranks not in by_ranks:
                    by_ranks[ranks] = dist.new_group(list(ranks))
                if self.rank in ranks:
                    self._groups[axis] = by_ranks[ranks]

    # ------------------------------------------------------------------ queries
    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The base axes, outermost first (every name of :data:`AXIS_NAMES` is answered)."""
        return BASE_AXES

    @property
    def shape(self) -> tuple[int, ...]:
        """Degrees of the base axes, outermost first."""
        return tuple(getattr(self.dims, n) for n in BASE_AXES)

    def _check(self, axis: str) -> None:
        if axis not in AXIS_NAMES:
            raise ValueError(f"unknown mesh axis {axis!r}; expected one of {AXIS_NAMES}")

    def size(self, axis: str) -> int:
        """Ranks along ``axis``."""
        self._check(axis)
        return self.dims.degree(axis)

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in axis order."""
        self._check(axis)
        return self.dims.axis_ranks(axis, self.rank)

    def local_rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self.ranks(axis).index(self.rank)

    def group(self, axis: str):
        """The process group of this rank along ``axis``."""
        self._check(axis)
        return self._groups[axis]

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        names = (names,) if isinstance(names, str) else tuple(names)
        for n in names:
            self._check(n)
        if names not in self._meshes:
            self._meshes[names] = product_mesh(self.device_type, names,
                                               [self.ranks(n) for n in names],
                                               [self.group(n) for n in names])
        return self._meshes[names]

    def __repr__(self) -> str:
        d = self.dims
        return (f"ParallelMesh(pp={d.pp}, dp_replicate={d.dp_replicate}, dp_shard="
                f"{d.dp_shard}, cp={d.cp}, tp={d.tp}, ep={d.ep}; rank {self.rank} of "
                f"{d.world_size})")

    def describe(self) -> str:
        """The layout in one line, e.g. ``"tp 2 x dp_shard 2"`` (degrees above 1)."""
        d = self.dims
        parts = [f"{n} {getattr(d, n)}" for n in BASE_AXES if getattr(d, n) > 1]
        if d.ep > 1:
            parts.append(f"(ep {d.ep})")
        return " x ".join(parts) or "1 rank"
