"""One sharding unit: its parameters' shards, the gathered parameters and the gradient flow.

A unit owns a set of parameters (see [Note: unit layout] in layout.py). Between steps each
original ``nn.Parameter`` object holds this rank's dim-0 shard (a view into the unit's flat
shard buffer), so ``named_parameters()`` keeps names and ndim, and any optimizer steps the
shards in place. For compute the unit gathers the shards into one flat unsharded buffer and
exposes each parameter as a *full* ``nn.Parameter`` viewing it; these full parameters are
created once and swapped into the owning modules while the unit computes.

[Note: freeing gathered parameters] At stage 3 the unsharded buffer's storage is resized to
zero bytes instead of being dropped, so the full parameters keep their shapes and autograd
metadata. Autograd has saved them for backward; the copy that refills the storage runs under
``_unsafe_preserve_version_counter`` so autograd does not mistake the refill for an in-place
modification of a saved tensor. The bytes come from the buffer pool (see [Note: buffer
pool] in pool.py): the storage swaps data pointers with a pooled buffer on gather and
swaps them back on free, so one storage object (which views of the parameters that
autograd saved, such as a transposed weight, keep referring to) is refilled with reused
memory instead of fresh allocations that fragment the heap. Pointing the parameters at a
different buffer per gather would not do: those saved views keep the storage they were
made from. Without ``UntypedStorage._swap_data_ptr_`` (older torch) the storage is resized.

[Note: unit gather state] ``state`` is one of :class:`Gather`. A gather records the version
of the shards it read (``shard_version``: the sum of the shard Parameters' autograd version
counters, which every in-place update -- an optimizer step, a user's ``p.mul_()`` -- bumps).
Gathered data is used only while that version is current and the unit is not ``stale``
(stages 1/2: set once the reduction hands out gradients, i.e. an optimizer step is
expected); otherwise it is discarded and gathered again. A gather that is still in flight
when its pass ends is completed and discarded (see [Note: prefetch safety] in state.py), so
a gather never outlives the values it read.
"""

from __future__ import annotations

import enum
import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed import comm
from shardwise.distributed.comm.quantized import all_gather_quantized
from shardwise.distributed.mesh import NodeGroup, ShardGroups
from shardwise.distributed.pool import POOL
from shardwise.shard.comm_quant import CommQuant
from shardwise.shard.identity import TAG_BYTES, UnitTag
from shardwise.shard.layout import UnitLayout, build_layout
from shardwise.shard.memory import MemoryTracker
from shardwise.shard.param import ParamEntry, ShardedParam
from shardwise.shard.precision import MixedPrecision
from shardwise.shard.streams import CommStreams
from shardwise.shard.unit_grads import GradientReduction
from shardwise.sizes import nbytes as _nbytes

__all__ = ["ParamEntry", "Unit", "Phase"]


class Phase(enum.Enum):
    """Where a unit is between forwards and the backward pass in progress.

    [Note: micro-batch passes] Forwards and backward passes may interleave (a pipeline's
    1F1B runs forward 2 before backward 1); every backward pass is one autograd call. A
    backward pass starts (its first hook) by marking the units of the latest forward as
    expected and resetting their gradient counters, so each pass runs its own pre- and
    post-backward once per unit, whatever forwards happened in between.
    """

    IDLE = "idle"                    # not expected in the backward pass in progress
    FORWARD = "forward"              # its forward is running
    FORWARD_DONE = "forward_done"    # ran forward; its backward is expected
    BACKWARD = "backward"            # its backward has begun in this pass
    BACKWARD_DONE = "backward_done"  # this pass is done with it (gradients packed or kept)


class Gather(enum.Enum):
    """Whether a unit's full parameters hold its current values ([Note: unit gather state])."""

    SHARDED = "sharded"        # the full parameters are not valid (storage may be freed)
    GATHERING = "gathering"    # an all-gather is in flight; ``unshard`` completes it
    GATHERED = "gathered"      # the full parameters equal the shards of ``gathered_version``


_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


class Unit:
    """Parameters gathered and reduced together: one all-gather and one reduce-scatter each.

    Args:
        name: the unit's module path ("" for the root), used in labels and errors.
        module: the module whose forward brackets the unit's compute.
        entries: the parameters this unit owns.
        groups: process groups to shard, gather and replicate over.
        tracker: where buffer bytes are reported.
        device: where the buffers live (default: the parameters' device; a meta model is
            materialised on the CPU unless "meta" is asked for, to plan without allocating).
        mixed_precision: compute / reduce dtypes (default: the parameters' dtype).
        node: stage 3 hierarchical partition: keep a secondary copy sharded within this
            node after forward, so the backward all-gather stays inside the node.
        quant: quantised communication of weights and / or gradients.
        tag: the unit's identity, sent with every gather ([Note: gather identity]);
            default: a tag of shard call 0, unit 0.
        streams: where collectives run ([Note: CUDA streams]); default: the device's own.

    Attributes:
        params: one :class:`ShardedParam` per parameter, trainable ones first.
        trainable: the trainable prefix of ``params``.
        phase: where the unit is in the current forward / backward ([Note: micro-batch
            passes]); the engine state moves it.
        pending: trainable parameters whose gradient the backward pass in progress has not
            produced yet.
        stale: the shards changed (or will) since the last gather ([Note: unit gather
            state]).
    """

    def __init__(self, name: str, module: nn.Module, entries: list[ParamEntry],
                 groups: ShardGroups, tracker: MemoryTracker,
                 device: torch.device | None = None,
                 mixed_precision: MixedPrecision | None = None,
                 node: NodeGroup | None = None, quant: CommQuant | None = None,
                 tag: UnitTag | None = None, streams: CommStreams | None = None) -> None:
        self.name, self.module, self.groups, self.tracker = name, module, groups, tracker
        entries = sorted(entries, key=lambda e: not e.trainable)  # stable: trainable first
        self.layout: UnitLayout = build_layout([e.param.shape for e in entries],
                                               [e.trainable for e in entries],
                                               groups.shard_size)
        self.dtype = entries[0].param.dtype if entries else torch.float32
        mp = mixed_precision or MixedPrecision()
        self.compute_dtype = mp.param_dtype or self.dtype
        self.reduce_dtype = mp.reduce_dtype or self.compute_dtype
        self.device = device or (entries[0].param.device if entries else torch.device("cpu"))
        if self.device.type == "meta" and device is None:
            self.device = torch.device("cpu")
        self.label = name or "<root>"
        self.tag = tag or UnitTag(0, 0, self.label, {})
        self.streams = streams or CommStreams(self.device)
        self.quant = quant or CommQuant()
        self.node = node
        self.phase = Phase.IDLE
        self.pending = 0
        self.state = Gather.SHARDED
        self.gathered_version = -1
        self.stale = True
        self.gather_work = None
        self.gather_tmp: torch.Tensor | None = None
        self.gather_in: torch.Tensor | None = None
        self._full_donor: torch.Tensor | None = None  # pooled buffer lending its bytes
        self.secondary: torch.Tensor | None = None
        self._from_secondary = False
        self._group_ranks: dict[int, list[int] | None] | None = None
        self.scaled = None  # a ScaledGather: [Note: scaled gathers in the engine]
        self._build_buffers(entries)
        self.trainable = [sp for sp in self.params if sp.trainable]
        self.reduction = GradientReduction(
            self.label, self.layout, self.trainable, groups, self.dtype, self.compute_dtype,
            self.reduce_dtype, self.device, self.quant, self.streams, tracker)

    # ---------------------------------------------------------------- construction
    def _build_buffers(self, entries: list[ParamEntry]) -> None:
        lay, n, r = self.layout, self.layout.world, self.groups.shard_rank
        # The send buffer of the all-gather: the flat shard, then the identity trailer.
        tag_bytes = TAG_BYTES if entries else 0  # a unit with no parameters never gathers
        self.trailer_numel = tag_bytes // self.dtype.itemsize
        self.wire_row = lay.shard_numel + tag_bytes // self.compute_dtype.itemsize
        self.send_buf = torch.zeros(lay.shard_numel + self.trailer_numel, dtype=self.dtype,
                                    device=self.device)
        self.shard_buf = self.send_buf[:lay.shard_numel]
        if self.device.type != "meta" and entries:
            self.tag.write(self.send_buf[lay.shard_numel:])
        self.tracker.add("params", _nbytes(self.send_buf))
        self.full_buf = torch.empty(lay.full_numel, dtype=self.compute_dtype, device=self.device)
        self.params = [ShardedParam(e, p, r, n, self.shard_buf, self.full_buf, self.label)
                       for e, p in zip(entries, lay.params)]
        if self.device.type != "meta":
            self.full_buf.untyped_storage().resize_(0)  # allocated on first gather

    def adopt_shards(self) -> None:
        """Point every original Parameter at its shard (called once, after loading)."""
        for sp in self.params:
            sp.adopt_shard()

    def shard_version(self) -> int:
        """Sum of the shard Parameters' version counters ([Note: unit gather state])."""
        return sum(sp.param._version for sp in self.params)

    @property
    def gathered(self) -> bool:
        """Whether the full parameters hold current values."""
        return self.state is Gather.GATHERED

    def _current(self) -> bool:
        return not self.stale and self.gathered_version == self.shard_version()

    # ---------------------------------------------------------------- gather
    def _alloc_full(self) -> None:
        if self.device.type == "meta":
            raise ValueError(f"unit {self.label} was sharded on the meta device with "
                             f"materialize=False: it can be inspected and planned, not run")
        st = self.full_buf.untyped_storage()
        if st.nbytes() == 0:
            if _CAN_SWAP and self.device.type == "cpu":  # [Note: freeing gathered parameters]
                self._full_donor = POOL.take(self.layout.full_numel, self.compute_dtype,
                                             self.device, exact=True)
                st._swap_data_ptr_(self._full_donor.untyped_storage())
            else:
                st.resize_(self.layout.full_numel * self.full_buf.element_size())
            self.tracker.add("unsharded", st.nbytes())

    def gather_async(self) -> None:
        """Issue the all-gather of this unit's shards unless current data is held or coming.

        With a secondary partition in hand (see [Note: hierarchical partition]) the gather
        runs inside the node only.
        """
        if not self.params or self.state is not Gather.SHARDED and self._current():
            return
        if self.state is Gather.GATHERING:  # in flight, but the shards changed since
            self._drain()
        # The gather reads the shards as they are now: from here on only a change of their
        # version (or a new ``stale``) makes its data out of date.
        self.gathered_version, self.stale = self.shard_version(), False
        self._alloc_full()
        n = self.layout.world
        if n == 1:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full_buf):
                self.full_buf.copy_(self.shard_buf)
            self.state = Gather.GATHERED
            return
        self.state = Gather.GATHERING
        with self.streams.side("gather"):  # [Note: CUDA streams]
            self._issue_gather()

    def _issue_gather(self) -> None:
        if self.secondary is not None:
            self._gather(self.secondary, self.node.group, "secondary_all_gather", True)
            return
        if self.quant.weights:  # blockwise int8 / fp8 on the wire, decoded to compute dtype
            source, kind, codes = self.shard_buf, self.quant.weights, {}
            if self.scaled is not None:  # [Note: scaled gathers in the engine]
                source, self.gather_in, codes = self.scaled.stage(self)
                kind = None  # the parameters not lent codes travel unquantised
                self.tracker.add("comm", _nbytes(self.gather_in))
            self.gather_tmp = POOL.take(self.layout.world * source.numel(), self.compute_dtype,
                                        self.device)
            self.tracker.add("comm", _nbytes(self.gather_tmp))
            self._from_secondary = False
            self.gather_work = all_gather_quantized(
                self.gather_tmp, source, self.groups.gather, kind, self.quant.block_size,
                label=f"{self.label}.all_gather", async_op=True,
                trailer=self.tag.wire(self.device), **codes)
            return
        self.gather_in = self.send_buf
        if self.compute_dtype != self.dtype:  # cast before the gather: half the bytes move
            self.gather_in = POOL.take(self.wire_row, self.compute_dtype, self.device)
            self.gather_in[:self.layout.shard_numel].copy_(self.shard_buf)
            self.tag.write(self.gather_in[self.layout.shard_numel:])
            self.tracker.add("comm", _nbytes(self.gather_in))
        else:  # [Note: step identity]: the count of this gather's step. The shards view
            # the same buffer: the write must not look like a change of their values.
            with torch.autograd._unsafe_preserve_version_counter(self.send_buf):
                self.tag.write_count(self.send_buf[self.layout.shard_numel:])
        self._gather(self.gather_in, self.groups.gather, "all_gather", False)

    def _gather(self, source: torch.Tensor, group, kind: str, from_secondary: bool) -> None:
        rows = self.layout.world if not from_secondary else self.node.size
        self.gather_tmp = POOL.take(rows * source.numel(), self.compute_dtype, self.device)
        self.tracker.add("comm", _nbytes(self.gather_tmp))
        self._from_secondary = from_secondary
        if from_secondary and self.node.size == 1:
            self.gather_tmp.copy_(source)
            self.gather_work = None
            return
        self.gather_work = comm.all_gather_into_tensor(
            self.gather_tmp, source, group, label=f"{self.label}.{kind}", async_op=True)

    def _wait(self) -> None:
        """Complete the gather in flight and check every rank's identity trailer."""
        if self.gather_work is not None:
            self.gather_work.wait()
        if self.quant.weights and not self._from_secondary:
            trailers = getattr(self.gather_work, "trailers", None)
            if trailers is not None:
                self.tag.check(trailers, "all_gather", self._ranks(self.groups.gather))
        else:
            kind = "secondary_all_gather" if self._from_secondary else "all_gather"
            s = self.layout.shard_numel
            group = self.node.group if self._from_secondary else self.groups.gather
            self.tag.check(self.gather_tmp.view(-1, self.wire_row)[:, s:], kind,
                           self._ranks(group))

    def _ranks(self, group) -> list[int] | None:
        """The global ranks of ``group``'s members, in group order (None: unknown)."""
        if self._group_ranks is None:
            self._group_ranks = {}
        key = id(group)
        if key not in self._group_ranks:
            try:
                self._group_ranks[key] = dist.get_process_group_ranks(group)
            except Exception:  # noqa: BLE001 - a group c10d does not know: name rows only
                self._group_ranks[key] = None
        return self._group_ranks[key]

    def _release_gather(self) -> None:
        self.tracker.sub("comm", _nbytes(self.gather_tmp))
        staged = self.gather_in if self.gather_in is not self.send_buf else None
        self.tracker.sub("comm", _nbytes(staged))
        # [Note: buffer pool] / [Note: CUDA streams]: the gather has completed and the copy-out
        # is queued, so its buffers can serve again.
        self.streams.release("gather", self.gather_tmp, staged, self.gather_work)
        self.gather_work, self.gather_tmp, self.gather_in = None, None, None

    def _drain(self) -> None:
        """Complete a gather in flight and discard what it brought (not copied anywhere)."""
        if self.state is not Gather.GATHERING:
            return
        self._wait()
        self._release_gather()
        if self.scaled is not None:  # its codes are never offered
            self.scaled.release(self)
        self.state = Gather.SHARDED

    def unshard(self, keep_secondary: bool = False) -> None:
        """Make the full parameters current: issue the gather if needed, wait, copy out.

        Args:
            keep_secondary: (forward, stage 3 with a node group) keep this rank's secondary
                partition of the gathered parameters for the backward gather.
        """
        self.gather_async()  # discards a gather in flight whose shards changed since
        if self.state is not Gather.GATHERING:
            return
        self._wait()
        n, lay, tmp = self.layout.world, self.layout, self.gather_tmp
        sizes = [p.padded_numel for p in lay.params]
        blocks = [sp.full_block for sp in self.params]
        # [Note: freeing gathered parameters]
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full_buf):
            if self._from_secondary:  # node-major (k, m, row) -> rank-major (m, k, S)
                k, m = self.node.size, self.node.count
                src = tmp.view(k, m, self.wire_row)[:, :, :lay.shard_numel].transpose(0, 1)
                torch.split_with_sizes_copy(src, sizes, dim=2,
                                            out=[b.view(m, k, -1) for b in blocks])
                self.drop_secondary()
            elif self.scaled is not None:
                self.scaled.copy_out(self, tmp)
            else:
                row = lay.shard_numel if self.quant.weights else self.wire_row
                torch.split_with_sizes_copy(tmp.view(n, row)[:, :lay.shard_numel], sizes,
                                            dim=1, out=blocks)
                if keep_secondary and self.node is not None:
                    self._keep_secondary(tmp)
        self._release_gather()
        self.state = Gather.GATHERED

    def _keep_secondary(self, gathered: torch.Tensor) -> None:
        """[Note: hierarchical partition] Rank j of a node of k keeps the primary shards of
        shard ranks j, j + k, j + 2k, ...: an all-gather inside the node then yields every
        rank's shard, node-major, which the copy-out reorders for free. The kept rows carry
        their identity trailers, so the node gather is checked like the primary one; a
        quantised gather decoded its rows and brought the trailers apart, which rejoin them."""
        k, m, row, s = self.node.size, self.node.count, self.wire_row, self.layout.shard_numel
        self.drop_secondary()
        self.secondary = POOL.take(m * row, self.compute_dtype, self.device)
        kept, j = self.secondary.view(m, row), self.node.index
        if self.quant.weights:
            kept[:, :s].copy_(gathered.view(m, k, s)[:, j])
            kept[:, s:].view(torch.uint8).copy_(self.gather_work.trailers.view(m, k, -1)[:, j])
        else:
            kept.copy_(gathered.view(m, k, row)[:, j])
        self.tracker.add("secondary", _nbytes(self.secondary))

    def drop_secondary(self) -> None:
        if self.secondary is not None:
            self.tracker.sub("secondary", _nbytes(self.secondary))
            POOL.give(self.secondary)  # only ever the source of a completed gather
            self.secondary = None

    def reshard(self) -> None:
        """Free the gathered parameters (stage 3); their shapes and autograd links stay.

        A gather still in flight is completed and discarded first; offered codes are
        withdrawn ([Note: scaled gathers in the engine]).
        """
        self._drain()
        if self.scaled is not None:
            self.scaled.release(self)
        st = self.full_buf.untyped_storage()
        if self.device.type == "meta" or st.nbytes() == 0:
            self.state = Gather.SHARDED
            return
        self.tracker.sub("unsharded", st.nbytes())
        if self._full_donor is not None:  # CPU: give the pooled bytes back
            st._swap_data_ptr_(self._full_donor.untyped_storage())
            POOL.give(self._full_donor)
            self._full_donor = None
        else:
            st.resize_(0)
        self.state = Gather.SHARDED

    def swap_in(self) -> None:
        """Register the full parameters in their modules (for compute)."""
        for sp in self.params:
            sp.swap_in()

    def swap_out(self, placeholders: bool = False) -> None:
        """Register the sharded parameters in their modules again (between steps), or, during
        the model's forward, placeholders that name any use ([Note: ungathered
        placeholders])."""
        for sp in self.params:
            sp.swap_out(placeholders)

    # ---------------------------------------------------------------- gradients
    def pack_grads(self) -> None:
        """Pack the full gradients for the reduction (``GradientReduction.pack``)."""
        self.reduction.pack()

    def launch_reduce(self) -> None:
        """Issue the reduction (``GradientReduction.launch``)."""
        self.reduction.launch()

    def finish_reduce(self) -> None:
        """Complete the reduction; the shards' ``.grad`` are set, and an optimizer step is
        now expected, so the gathered parameters are stale ([Note: unit gather state])."""
        if self.reduction.finish():
            self.stale = True
