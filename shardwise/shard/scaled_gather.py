"""Parameter gathers that carry some weights as low-bit codes under scales agreed over the
shard group: the engine's half of [Note: fp8 weight gathers] (parallel/lowbit/gather.py).

A module lends the engine a way to gather one of its weights as codes by carrying a
:class:`GatherCodes` under :data:`CODES_ATTR` (``apply_low_precision`` does, for the recipe
whose weight codes serve every matmul of a layer: ``fp8_tensorwise``). The engine knows no
recipe: it asks that object for amaxes, multipliers, codes and decoding, and tells it when
gathered codes are offered and when they go stale.

[Note: scaled gathers in the engine] With ``CommQuant(weights=k)``, a ``shard`` call one of
whose weights is lent codes of kind ``k`` (or any call, with ``rest_unquantised``) gathers
every unit through :class:`ScaledGather`:

* scales: one :class:`AgreedScales` per call and gather group. At the first gather after
  the shards of its units changed (an optimizer step, a load: the sum of their version
  counters, as [Note: step identity] counts steps), every rank takes the amax of its rows of
  every lent weight cast to the compute dtype (padding rows are zeros and change no
  maximum), and ONE all-reduce(MAX) of that vector, for all units at once, gives every rank
  every whole weight's amax, hence the multiplier the layer's own cast of the gathered
  compute-dtype weight would compute. A nan amax travels as inf: Gloo's MAX keeps or drops
  a nan by the order it meets it (without this, a rank missed its peer's nan), and either
  gives a nan multiplier, as the layer's own cast would ([Note: non-finite amax]).
  Micro-batches, backward regathers and prefetches of the same shards reuse the agreement.
  A pipeline shards each piece by a call of its own, so its rank agrees once per piece
  that has codes (a few bytes each), not once for all of them.
* wire: one ``all_gather_quantized`` per unit, as every ``comm.weights`` gather; a row is
  the unit's other parameters unquantised in the compute dtype, then the lent weights'
  codes (1 byte per element, padding rows included), then the identity trailer ([Note:
  codes on the wire]). The codes are elementwise ``sat(x * q)`` of the compute-dtype rows,
  so the gathered codes are exactly the layer's own cast of the whole weight.
* copy-out: the codes are decoded (``code / q``) into the unit's full buffer, so anything
  else that reads the parameter (a hook, a high-precision path, ``torch.compile``'s trace,
  which cannot read an offer) sees valid values, and they are *offered* to the module, whose
  forward and backward then use them as they are. The offers are withdrawn, and the codes'
  bytes returned, when the unit reshards, discards a gather, or gathers again, so a backward
  regather (stage 3) offers anew and no offer outlives the values it was made from.
* the unit's other parameters travel unquantised, not through the blockwise codec: the
  recipe keeps the embedding, head, norms and routers in high precision on purpose, a
  blockwise fp8 round trip would add there the error the recipe avoids, and unquantised they
  make the whole run bitwise that of the compute-dtype gather (the drift torchao#4300
  reports cannot happen). In a block they are a small share (norms, biases); the embedding
  and the head move the compute dtype's bytes, half of which the blockwise codec saved.
  Sharded by calls of their own (pipeline pieces), they need ``rest_unquantised``, which
  the trainer sets whenever the recipe gathers codes.

The hierarchical partition (``comm.hierarchy``) keeps decoded compute-dtype rows for the
backward's node gather, not codes, so ``shard`` refuses it, before any collective, in a call
that gathers codes (the backward would recast decoded weights: a second cast, exact in bf16
only). Stages 1 and 2 gather through the same path (once a step; the offers stay until the
next gather).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from shardwise.distributed import comm
from shardwise.distributed.pool import POOL
from shardwise.shard.comm_quant import CommQuant
from shardwise.shard.param import ShardedParam
from shardwise.sizes import nbytes as _nbytes

if TYPE_CHECKING:
    from shardwise.shard.unit import Unit

__all__ = ["CODES_ATTR", "GatherCodes", "ScaledGather", "AgreedScales", "attach_scaled_gathers",
           "lends_codes"]

CODES_ATTR = "_shardwise_gather_codes"
AMAX_LABEL = "lowbit.amax_all_reduce"


class GatherCodes(Protocol):
    """What a module lends the engine to gather its parameter ``attr`` as 1-byte codes of
    kind ``kind`` ([Note: scaled gathers in the engine]). ``rows`` are 2-D, in the compute
    dtype; multipliers ``q`` are ``(1, 1)`` fp32."""

    attr: str
    kind: str

    def amax(self, rows: torch.Tensor) -> torch.Tensor:
        """The absmax of ``rows``, one fp32 element."""

    def multiplier(self, amax: torch.Tensor) -> torch.Tensor:
        """The multiplier of a weight whose absmax is ``amax``."""

    def encode(self, rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The 1-byte codes of ``rows`` under ``q``, shaped as ``rows``."""

    def decode(self, codes: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``codes`` (uint8 bytes) decoded into ``out``."""

    def offer(self, weight: torch.Tensor, codes: torch.Tensor, q: torch.Tensor,
              bad: torch.Tensor) -> None:
        """``codes`` (uint8 bytes of the whole weight) are ``weight``'s current codes;
        ``bad``: a 0-d bool, the amax was not finite."""

    def withdraw(self) -> None:
        """The codes last offered are stale."""


def lends_codes(sp: ShardedParam, kind: str) -> GatherCodes | None:
    """The codes a module lends for ``sp`` (a 2-D parameter) of kind ``kind``, if any."""
    if len(sp.layout.shape) != 2:
        return None
    for mod, attr in sp.entry.registrations:
        lent = getattr(mod, CODES_ATTR, None)
        if lent is not None and lent.attr == attr and lent.kind == kind:
            return lent
    return None


class AgreedScales:
    """The multipliers of every lent weight of the units that gather over one group, agreed
    by one all-reduce(MAX) whenever their shards changed ([Note: scaled gathers in the
    engine])."""

    def __init__(self, units: list[Unit], group) -> None:
        self.units, self.group = units, group
        self.entries: list[tuple[Unit, ShardedParam, GatherCodes]] = []
        for u in units:
            u.scaled.slots = range(len(self.entries), len(self.entries) + len(u.scaled.coded))
            self.entries += [(u, sp, lent) for sp, lent in u.scaled.coded]
        self.version: int | None = None
        self.q: list[torch.Tensor] = []
        self.bad: torch.Tensor | None = None

    def current(self) -> None:
        """Agree on the multipliers unless the shards are those of the last agreement."""
        version = sum(u.shard_version() for u in self.units)
        if version == self.version:
            return
        amax = torch.cat([lent.amax(_rows(u, sp)).reshape(1) for u, sp, lent in self.entries])
        amax = torch.where(torch.isnan(amax), torch.inf, amax)  # Gloo's MAX drops nan
        comm.all_reduce(amax, self.group, label=AMAX_LABEL, op=dist.ReduceOp.MAX)
        self.q = [lent.multiplier(amax[i:i + 1].reshape(1, 1))
                  for i, (_, _, lent) in enumerate(self.entries)]
        self.bad = ~torch.isfinite(amax)
        self.version = version


def _rows(u: Unit, sp: ShardedParam) -> torch.Tensor:
    """This rank's padded rows of ``sp`` in the compute dtype, ``(chunk, cols)``."""
    p = sp.layout
    flat = u.shard_buf[p.offset:p.offset + p.padded_numel]
    return flat.view(p.chunk_rows, p.row_numel).to(u.compute_dtype)


class ScaledGather:
    """How one unit's gather carries its lent weights as codes and the rest unquantised.

    Attributes:
        coded: ``(param, lender)`` of the weights that travel as codes, in layout order.
        plain: the other parameters, in layout order.
        slots: where the coded weights' multipliers sit in ``agreed`` (set by it).
        codes: the gathered codes while the unit holds them (uint8, ``world`` rows of every
            coded weight's padded rows, weight-major), else None.
    """

    def __init__(self, unit: Unit, kind: str) -> None:
        self.coded: list[tuple[ShardedParam, GatherCodes]] = []
        self.plain: list[ShardedParam] = []
        for sp in unit.params:
            lent = lends_codes(sp, kind)
            if lent is None:
                self.plain.append(sp)
            else:
                self.coded.append((sp, lent))
        self.plain_numel = sum(sp.layout.padded_numel for sp in self.plain)
        self.code_numel = sum(sp.layout.padded_numel for sp, _ in self.coded)
        self.agreed: AgreedScales | None = None
        self.slots = range(0)
        self.codes: torch.Tensor | None = None
        self._offered = False

    def stage(self, unit: Unit) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Before the gather: ``(plain elements, staging buffer, codes kwargs)`` for
        ``all_gather_quantized``. Agrees on the scales first if the shards changed."""
        self.release(unit)
        if self.agreed is not None:
            self.agreed.current()
        dt, n = unit.compute_dtype, unit.layout.world
        plain_bytes = self.plain_numel * dt.itemsize
        buf = POOL.take(plain_bytes + self.code_numel, torch.uint8, unit.device)
        plain = buf[:plain_bytes].view(dt)
        at = 0
        for sp in self.plain:
            p = sp.layout
            plain[at:at + p.padded_numel].copy_(unit.shard_buf[p.offset:p.offset + p.padded_numel])
            at += p.padded_numel
        codes, at = buf[plain_bytes:], 0
        for (sp, lent), i in zip(self.coded, self.slots):
            enc = lent.encode(_rows(unit, sp), self.agreed.q[i])
            codes[at:at + sp.layout.padded_numel].copy_(enc.view(torch.uint8).view(-1))
            at += sp.layout.padded_numel
        self.codes = POOL.take(n * self.code_numel, torch.uint8, unit.device)
        unit.tracker.add("unsharded", _nbytes(self.codes))
        outs, at = [], 0
        for sp, _ in self.coded:
            outs.append(self.codes[n * at:n * (at + sp.layout.padded_numel)].view(n, -1))
            at += sp.layout.padded_numel
        extra = dict(codes=codes, codes_out=outs) if self.coded else {}
        return plain, buf, extra

    def copy_out(self, unit: Unit, gathered: torch.Tensor) -> None:
        """After the gather: every parameter's full value into the unit's buffer, and the
        coded weights' codes offered to their modules (inside the unit's no-grad copy)."""
        n = unit.layout.world
        torch.split_with_sizes_copy(gathered.view(n, self.plain_numel),
                                    [sp.layout.padded_numel for sp in self.plain], dim=1,
                                    out=[sp.full_block for sp in self.plain])
        at = 0
        for (sp, lent), i in zip(self.coded, self.slots):
            p = sp.layout
            codes = self.codes[n * at:n * (at + p.padded_numel)].view(n * p.chunk_rows, -1)
            lent.decode(codes, self.agreed.q[i], sp.full_block.view(n * p.chunk_rows, -1))
            lent.offer(sp.full, codes[:p.rows], self.agreed.q[i], self.agreed.bad[i])
            at += p.padded_numel
        self._offered = bool(self.coded)

    def release(self, unit: Unit) -> None:
        """Withdraw the offers and return the codes' bytes (the unit reshards, discards a
        gather or gathers again)."""
        if self._offered:
            for _, lent in self.coded:
                lent.withdraw()
            self._offered = False
        if self.codes is not None:
            unit.tracker.sub("unsharded", _nbytes(self.codes))
            unit.streams.release("gather", self.codes)  # [Note: CUDA streams]
            self.codes = None


def attach_scaled_gathers(units: list[Unit], quant: CommQuant | None) -> None:
    """Give every unit of one ``shard`` call a :class:`ScaledGather` when the call gathers
    weights as ``quant.weights`` and one of its weights is lent codes of that kind (or
    ``quant.rest_unquantised``); one :class:`AgreedScales` per gather group ([Note: scaled
    gathers in the engine])."""
    if quant is None or quant.weights is None or not units:
        return
    plans = [ScaledGather(u, quant.weights) for u in units]
    if not quant.rest_unquantised and not any(p.coded for p in plans):
        return  # nothing lent: every unit keeps the blockwise codec
    groups: dict[int, tuple[object, list[Unit]]] = {}
    for u, plan in zip(units, plans):
        u.scaled = plan
        if plan.coded:
            groups.setdefault(id(u.groups.gather), (u.groups.gather, []))[1].append(u)
    for group, members in groups.values():
        agreed = AgreedScales(members, group)
        for u in members:
            u.scaled.agreed = agreed
