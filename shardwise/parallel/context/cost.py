"""What context parallelism sends and computes per layer, in closed form (read by the tests
that count the messages and by the planner).

[Note: context-parallel bytes] Per rank, per attention layer, for ``B`` sequences of ``T``
tokens over ``cp`` ranks, ``KV`` key/value heads and ``H`` query heads of ``hd`` features,
elements of ``e`` bytes (``g`` for the ring's gradient blocks: fp32, fp64 for fp64), a
rank's key (or value) block is ``K = B KV (T / cp) hd e`` bytes:

- ring over ``n`` ranks: forward ``(n - 1) 2 K``; backward ``(n - 1) 2 K + n 2 K g / e``.
- Ulysses over ``n`` ranks: each all-to-all sends ``(n - 1) / n`` of its tensor: forward
  ``(n - 1) / n (Q + 2 K + O)``, backward the same (``dO``, ``dQ``, ``dK``, ``dV``), with
  ``Q = O = B H (T / cp) hd e``.
- hybrid (``u``-way all-to-all, ``r = cp / u`` ring): the Ulysses terms at ``u``, then the
  ring terms over ``r`` ranks on blocks of ``u T / cp`` tokens and ``KV / u`` heads, which
  is ``K`` again.
"""

from __future__ import annotations

from shardwise.parallel.context.layout import rank_ranges, unmasked_entries

__all__ = ["bytes_per_layer", "attention_entries"]


def bytes_per_layer(impl: str, *, batch: int, seq_len: int, cp: int, heads: int,
                    kv_heads: int, head_dim: int, elem: int, ulysses: int = 1
                    ) -> dict[str, int]:
    """Bytes one rank sends per attention layer, ``{"forward": .., "backward": ..}`` (see
    [Note: context-parallel bytes]); ``ulysses`` is the all-to-all degree (cp for
    ``ulysses``, 1 for ``ring``)."""
    grad = 8 if elem == 8 else 4
    tokens = seq_len // cp
    k = batch * kv_heads * tokens * head_dim * elem
    q = batch * heads * tokens * head_dim * elem
    u = {"ring": 1, "ulysses": cp}.get(impl, ulysses)
    ring = cp // u
    a2a = (u - 1) * (q + 2 * k + q) // u if u > 1 else 0
    fwd = a2a + (ring - 1) * 2 * k
    bwd = a2a + (ring - 1) * 2 * k + (ring * 2 * k * grad // elem if ring > 1 else 0)
    return {"forward": fwd, "backward": bwd}


def attention_entries(seq_len: int, cp_rank: int, cp: int, load_balance: str) -> int:
    """Unmasked causal score entries rank ``cp_rank`` computes per sequence and head."""
    return unmasked_entries(rank_ranges(seq_len, cp_rank, cp, load_balance))
