"""The context-parallel attention of one model: its groups, its layout and the two
algorithms (ring and all-to-all), called through the custom operators of ops.py.

[Note: ring attention] Each rank of the ring holds its queries and passes its key/value
block to the next rank, ``n - 1`` times, so every query block meets every key block; the
next block's transfer is posted before the current block is computed (overlap). Partial
outputs merge by their log-sum-exp in fp32 ([Note: blockwise attention]). Nothing remote is
kept for the backward: it passes the key/value blocks around again, with the gradients of
each block (fp32, accumulated by every rank it visits) travelling one step behind it, so
after ``n`` steps each rank receives the complete ``dK``, ``dV`` of its own block. Each
step allocates fresh buffers: no transfer ever overwrites a block a later step still reads
(the stale-buffer bug of diffusers#14265). Per rank and layer the ring sends
``(n - 1) x (K + V)`` forward and ``(n - 1) x (K + V) + n x (dK + dV)`` backward
(:func:`shardwise.parallel.context.bytes_per_layer`).

[Note: Ulysses attention] An all-to-all turns ``(B, H, T / n, hd)`` (every head, a piece of
the sequence) into ``(B, H / n, T, hd)`` (a group of heads, the whole sequence held by the
group), attention runs locally, and a second all-to-all turns the output back: four
all-to-alls forward (q, k, v, out) and their four adjoints backward. Query heads ``h`` use
key head ``h // (H / KV)``, so cutting both head axes into ``n`` equal groups keeps every
query head with its key head: the degree must divide the key/value heads. ``hybrid`` does
the all-to-all inside groups of consecutive cp ranks and the ring across those groups.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from shardwise.distributed import comm
from shardwise.distributed.comm import p2p
from shardwise.parallel.context import kernels
from shardwise.models.layers import document_ids
from shardwise.parallel.context.layout import (Range, rank_positions, rank_ranges, shard_sequence,
                                               unshard_sequence)

__all__ = ["CP_IMPLS", "ContextParallel", "kernel_calls"]

CP_IMPLS = ("ring", "ulysses", "hybrid")


@dataclasses.dataclass(eq=False)
class ContextParallel:
    """The context-parallel layout and groups a model was given by ``apply_cp``.

    Attributes:
        impl: ``"ring"``, ``"ulysses"`` or ``"hybrid"``.
        load_balance: ``"zigzag"`` or ``"none"``.
        ranks: global ranks of this rank's cp group, in cp order.
        group: their process group.
        ring_ranks / ring_group: the ranks a key/value block visits, in ring order (this
            rank alone for ``ulysses``).
        a2a_ranks / a2a_group: the all-to-all group (this rank alone for ``ring``).
        handle: this object's index in the operator registry (ops.py).
    """

    impl: str
    load_balance: str
    ranks: tuple[int, ...]
    group: object
    ring_ranks: tuple[int, ...]
    ring_group: object
    a2a_ranks: tuple[int, ...]
    a2a_group: object
    handle: int = -1
    _positions: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def cp(self) -> int:
        """The context-parallel degree."""
        return len(self.ranks)

    @property
    def cp_rank(self) -> int:
        """This rank's index in the cp group."""
        return self.ranks.index(dist.get_rank()) if dist.is_initialized() else 0

    @property
    def ring_size(self) -> int:
        return len(self.ring_ranks)

    @property
    def a2a_size(self) -> int:
        return len(self.a2a_ranks)

    # ---- the layout -------------------------------------------------------------------

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a whole-sequence tensor (tokens, labels, position ids)."""
        return shard_sequence(x, self.cp_rank, self.cp, self.load_balance, dim)

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens (cached per length)."""
        key = (local_len, str(device))
        if key not in self._positions:
            self._positions[key] = rank_positions(local_len * self.cp, self.cp_rank, self.cp,
                                                  self.load_balance, device)
        return self._positions[key]

    def documents(self, positions: torch.Tensor) -> torch.Tensor:
        """The WHOLE sequence's document ids from this rank's part of the position ids
        (``(B, T / cp)``): one all-gather over the cp group per forward, not per layer."""
        parts = torch.empty((self.cp, *positions.shape), dtype=positions.dtype,
                            device=positions.device)
        comm.all_gather_into_tensor(parts, positions.contiguous(), group=self.group,
                                    label="cp.positions")
        return document_ids(unshard_sequence(list(parts.unbind(0)), self.load_balance))

    def ring_ranges(self, ring_index: int, seq_len: int) -> tuple[Range, ...]:
        """The global ranges a ring member holds once its all-to-all group's sequences are
        gathered (its own ranges for ``ring``, every rank's for ``ulysses``)."""
        n = self.a2a_size
        return tuple(r for u in range(n)
                     for r in rank_ranges(seq_len, ring_index * n + u, self.cp,
                                          self.load_balance))

    # ---- ring --------------------------------------------------------------------------

    def _pass_on(self, block: torch.Tensor, nxt: int, prev: int, label: str
                 ) -> tuple[torch.Tensor, list]:
        """Send ``block`` to the next ring member and receive the previous one's into a
        fresh buffer (never one a later step still reads); returns (buffer, handles)."""
        incoming = torch.empty_like(block)
        works = p2p.batch_isend_irecv([p2p.Message(block, nxt, True, label),
                                       p2p.Message(incoming, prev, False, label)],
                                      group=self.ring_group)
        return incoming, works

    def _neighbours(self) -> tuple[int, int, int]:
        me = self.ring_ranks.index(dist.get_rank()) if dist.is_initialized() else 0
        n = self.ring_size
        return me, self.ring_ranks[(me + 1) % n], self.ring_ranks[(me - 1) % n]

    def ring_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     documents: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of this rank's queries against every rank's keys (see [Note: ring
        attention]); ``q``: ``(B, H, Tr, hd)``, ``k``, ``v``: ``(B, KV, Tr, hd)``, ``Tr``
        the ring member's tokens. Returns ``(out, lse)``."""
        n = self.ring_size
        me, nxt_rank, prev_rank = self._neighbours()
        seq_len = q.shape[2] * n
        q_ranges = self.ring_ranges(me, seq_len)
        scale = q.shape[-1] ** -0.5
        acc: list = [None] * len(q_ranges)
        kv = torch.stack([k, v]) if n > 1 else None
        cur_k, cur_v = k, v
        for step in range(n):
            works = []
            if step < n - 1:
                incoming, works = self._pass_on(kv, nxt_rank, prev_rank, f"cp.kv{step}")
            src = (me - step) % n
            _forward_block(acc, q, cur_k, cur_v, q_ranges, self.ring_ranges(src, seq_len),
                           documents, scale)
            for w in works:
                w.wait()
            if step < n - 1:
                kv = incoming
                cur_k, cur_v = kv[0], kv[1]
        out = torch.cat([a[0] for a in acc], dim=2).to(q.dtype)
        lse = torch.cat([a[1] for a in acc], dim=2)
        return out, lse

    def ring_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      documents: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gradients of :meth:`ring_forward` (see [Note: ring attention])."""
        n = self.ring_size
        me, nxt_rank, prev_rank = self._neighbours()
        seq_len = q.shape[2] * n
        q_ranges = self.ring_ranges(me, seq_len)
        scale = q.shape[-1] ** -0.5
        f = kernels.acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=f, device=q.device)
        kv = torch.stack([k, v]) if n > 1 else None
        cur_k, cur_v = k, v
        dkv_in = dkv_recv = None
        sends = []
        for step in range(n):
            kv_works = []
            if step < n - 1:
                incoming, kv_works = self._pass_on(kv, nxt_rank, prev_rank,
                                                   f"cp.bwd_kv{step}")
            src = (me - step) % n
            dkv = torch.zeros((2, *k.shape), dtype=f, device=k.device)
            _backward_block(dq, dkv, dout, q, cur_k, cur_v, out, lse, q_ranges,
                            self.ring_ranges(src, seq_len), documents, scale)
            if n > 1:
                if dkv_recv is not None:
                    dkv_recv.wait()
                    dkv += dkv_in
                dkv_in, (send, dkv_recv) = self._pass_on(dkv, nxt_rank, prev_rank,
                                                         f"cp.dkv{step}")
                sends.append((send, dkv))
            for w in kv_works:
                w.wait()
            if step < n - 1:
                kv = incoming
                cur_k, cur_v = kv[0], kv[1]
        if n > 1:
            dkv_recv.wait()
            for send, _ in sends:
                send.wait()
            dkv = dkv_in
        # copy=True: an operator's outputs may not alias each other (dK, dV share dkv)
        return dq.to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)

    # ---- all-to-all --------------------------------------------------------------------

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, H, T, hd)`` (all heads, this rank's tokens) -> ``(B, H / n, n T, hd)``
        (a head group, the all-to-all group's tokens in rank order)."""
        n = self.a2a_size
        b, h, t, hd = x.shape
        self.check_heads(h, "heads")
        send = x.reshape(b, n, h // n, t, hd).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)
        comm.all_to_all_single(recv, send, group=self.a2a_group, label="cp.seq_to_heads")
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, hd)

    def heads_to_seq(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`seq_to_heads`."""
        n = self.a2a_size
        b, hn, nt, hd = y.shape
        send = y.reshape(b, hn, n, nt // n, hd).permute(2, 0, 1, 3, 4).contiguous()
        recv = torch.empty_like(send)
        comm.all_to_all_single(recv, send, group=self.a2a_group, label="cp.heads_to_seq")
        return recv.transpose(0, 1).reshape(b, n * hn, nt // n, hd)

    def check_heads(self, heads: int, what: str) -> None:
        """Raise a ValueError naming ``heads`` unless the all-to-all degree divides it."""
        n = self.a2a_size
        if heads % n:
            raise ValueError(f"context parallelism impl={self.impl!r} splits attention heads "
                             f"over {n} ranks, but this attention has {heads} {what} "
                             f"(key/value heads bound the Ulysses degree); use a degree "
                             f"dividing the key/value heads or impl='ring'")


@functools.lru_cache(maxsize=4096)
def kernel_calls(q_ranges: tuple[Range, ...], k_ranges: tuple[Range, ...]) -> tuple:
    """The kernel calls of a query block against a key block: ``(q offsets, q range, k
    offsets, k ranges, mode)`` per call. Consecutive key chunks that a query chunk sees whole
    (``full``) go into one call, so a ring step costs one call per query chunk where it
    can (host arithmetic, cached)."""
    calls = []
    q_offsets, k_offsets = _offsets(q_ranges), _offsets(k_ranges)
    for qo, qr in zip(q_offsets, q_ranges):
        run: list[int] = []
        for j, kr in enumerate(k_ranges):
            mode = kernels.pair_mode(qr, kr)
            if mode == "full":
                run.append(j)
                continue
            if run:
                calls.append(_call(qo, qr, k_offsets, k_ranges, run, "full"))
                run = []
            if mode != "skip":
                calls.append(_call(qo, qr, k_offsets, k_ranges, [j], mode))
        if run:
            calls.append(_call(qo, qr, k_offsets, k_ranges, run, "full"))
    return tuple(calls)


def _call(qo, qr, k_offsets, k_ranges, js: list[int], mode: str) -> tuple:
    return (qo, qr, (k_offsets[js[0]][0], k_offsets[js[-1]][1]),
            tuple(k_ranges[j] for j in js), mode)


def _forward_block(acc: list, q, k, v, q_ranges, k_ranges, documents, scale) -> None:
    index = {qr: i for i, qr in enumerate(q_ranges)}
    for (qa, qb), qr, (ka, kb), krs, mode in kernel_calls(tuple(q_ranges), tuple(k_ranges)):
        mask = kernels.block_mask(mode, qr, krs, documents)
        out, lse = kernels.block_forward(q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb], mode,
                                         mask, scale)
        i = index[qr]
        acc[i] = kernels.merge(acc[i], out, lse)


def _backward_block(dq, dkv, dout, q, k, v, out, lse, q_ranges, k_ranges, documents,
                    scale) -> None:
    for (qa, qb), qr, (ka, kb), krs, mode in kernel_calls(tuple(q_ranges), tuple(k_ranges)):
        mask = kernels.block_mask(mode, qr, krs, documents)
        g_q, g_k, g_v = kernels.block_backward(
            dout[:, :, qa:qb], q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb],
            out[:, :, qa:qb], lse[:, :, qa:qb], mode, mask, scale)
        dq[:, :, qa:qb] += g_q
        dkv[0, :, :, ka:kb] += g_k
        dkv[1, :, :, ka:kb] += g_v


def _offsets(ranges: tuple[Range, ...]) -> list[tuple[int, int]]:
    out, at = [], 0
    for s, e in ranges:
        out.append((at, at + e - s))
        at += e - s
    return out
