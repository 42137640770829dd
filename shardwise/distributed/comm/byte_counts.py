"""Per-rank bytes of each collective: the formulas of [Note: byte accounting] in comm.py.

These pure functions are the one definition of how many bytes a collective moves. The
counted collectives in :mod:`shardwise.distributed.comm` record what they return, and the
planner's communication model (:mod:`shardwise.planner.comm_model`) prices what they return,
so the bytes planned for a layout are the bytes ``comm_stats`` reports when it runs.

Every function returns ``(sent, received)`` for one rank of a group of ``n`` ranks; a group
of one rank moves nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "broadcast_bytes",
           "all_to_all_bytes"]


def _check(n: int, nbytes: int) -> None:
    if n < 1 or nbytes < 0:
        raise ValueError(f"a collective needs a group of n >= 1 ranks and nbytes >= 0, got "
                         f"n={n}, nbytes={nbytes}")


def all_gather_bytes(n: int, shard_bytes: int) -> tuple[int, int]:
    """All-gather of a ``shard_bytes`` shard: ``(n - 1) * shard_bytes`` each way (ring)."""
    _check(n, shard_bytes)
    return (n - 1) * shard_bytes, (n - 1) * shard_bytes


def reduce_scatter_bytes(n: int, shard_bytes: int) -> tuple[int, int]:
    """Reduce-scatter to a ``shard_bytes`` shard: ``(n - 1) * shard_bytes`` each way."""
    _check(n, shard_bytes)
    return (n - 1) * shard_bytes, (n - 1) * shard_bytes


def all_reduce_bytes(n: int, nbytes: int) -> tuple[int, int]:
    """All-reduce of ``nbytes``: ``2 * (n - 1) * nbytes // n`` each way (ring)."""
    _check(n, nbytes)
    vol = 2 * (n - 1) * nbytes // n
    return vol, vol


def broadcast_bytes(n: int, nbytes: int, is_source: bool) -> tuple[int, int]:
    """Broadcast of ``nbytes``: the source sends ``(n - 1) * nbytes``, others receive it."""
    _check(n, nbytes)
    if is_source:
        return (n - 1) * nbytes, 0
    return 0, (0 if n == 1 else nbytes)


def all_to_all_bytes(rank: int, row_in: int, row_out: int, input_splits: Sequence[int],
                     output_splits: Sequence[int]) -> tuple[int, int]:
    """All-to-all of dim-0 slices: the rows addressed to / received from other ranks.

    Args:
        rank: this rank's index in the group.
        row_in, row_out: bytes of one input / output row.
        input_splits, output_splits: rows sent to / received from each rank.
    """
    sent = sum(s for i, s in enumerate(input_splits) if i != rank) * row_in
    received = sum(s for i, s in enumerate(output_splits) if i != rank) * row_out
    return sent, received
