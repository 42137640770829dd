"""Which tokens of a sequence each context-parallel rank holds (pure arithmetic, no
communication).

[Note: causal load balance] Under a causal mask the token at position ``p`` attends to
``p + 1`` keys, so cutting a sequence of ``T`` tokens into ``cp`` contiguous pieces gives the
last rank about ``2 cp - 1`` times the score entries of the first, and every ring step waits
for it. ``zigzag`` cuts the sequence into ``2 cp`` equal chunks and gives rank ``r`` chunks
``r`` and ``2 cp - 1 - r``: a chunk near the start (cheap) paired with its mirror near the end
(dear). With chunk length ``c`` the unmasked entries of chunk ``i`` are ``c (2 i c + c + 1) /
2``, and those of chunks ``r`` and ``2 cp - 1 - r`` add up to ``c (2 (2 cp - 1) c + 2 c + 2) /
2`` whatever ``r`` is: every rank computes exactly the same number (a test asserts it).
``none`` keeps contiguous pieces, for comparison. The layout is a list of chunk ranges per
rank; the attention reads masks off those ranges (a key block entirely before a query block
needs no mask, one entirely after it is skipped, the diagonal is causal), so no layout makes
the attention inexact, only slower.
"""

from __future__ import annotations

import torch

from shardwise.models.layers import document_ids

__all__ = ["LOAD_BALANCES", "chunk_count", "rank_chunks", "rank_ranges", "rank_positions",
           "check_sequence_length", "shard_sequence", "unshard_sequence", "unmasked_entries",
           "document_ids"]

LOAD_BALANCES = ("zigzag", "none")
Range = tuple[int, int]


def _check_balance(load_balance: str) -> None:
    if load_balance not in LOAD_BALANCES:
        raise ValueError(f"load_balance={load_balance!r}, expected one of {LOAD_BALANCES}")


def chunk_count(cp: int, load_balance: str) -> int:
    """How many equal chunks a sequence is cut into: ``2 cp`` for zigzag, ``cp`` otherwise."""
    _check_balance(load_balance)
    return 2 * cp if load_balance == "zigzag" else cp


def rank_chunks(cp_rank: int, cp: int, load_balance: str) -> tuple[int, ...]:
    """The chunk indices rank ``cp_rank`` holds, in the order its local sequence lists them."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, cp={cp})")
    if chunk_count(cp, load_balance) == cp:
        return (cp_rank,)
    return (cp_rank, 2 * cp - 1 - cp_rank)


def check_sequence_length(seq_len: int, cp: int, load_balance: str,
                          what: str = "sequence length") -> None:
    """Raise a ValueError naming ``seq_len`` unless it cuts into the layout's equal chunks."""
    n = chunk_count(cp, load_balance)
    if seq_len < n or seq_len % n:
        how = f"2 x cp = 2 x {cp}" if load_balance == "zigzag" else f"cp = {cp}"
        raise ValueError(f"{what} {seq_len} does not divide by {how} = {n}: context "
                         f"parallelism with load_balance={load_balance!r} cuts every sequence "
                         f"into {n} equal chunks")


def rank_ranges(seq_len: int, cp_rank: int, cp: int, load_balance: str) -> tuple[Range, ...]:
    """The ``[start, stop)`` global position ranges of rank ``cp_rank``'s tokens, in order."""
    check_sequence_length(seq_len, cp, load_balance)
    c = seq_len // chunk_count(cp, load_balance)
    return tuple((i * c, (i + 1) * c) for i in rank_chunks(cp_rank, cp, load_balance))


def rank_positions(seq_len: int, cp_rank: int, cp: int, load_balance: str,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """The global positions (int64, ``seq_len / cp`` of them) of rank ``cp_rank``'s tokens."""
    return torch.cat([torch.arange(s, e, device=device)
                      for s, e in rank_ranges(seq_len, cp_rank, cp, load_balance)])


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int, load_balance: str = "zigzag",
                   dim: int = 1) -> torch.Tensor:
    """Rank ``cp_rank``'s part of ``x`` along ``dim`` (the whole sequence) in the layout.

    Args:
        x: any tensor whose ``dim`` is the sequence (tokens, labels, position ids).
        cp_rank, cp: this rank's index on the context-parallel axis and its size.
        load_balance: ``"zigzag"`` or ``"none"`` (see [Note: causal load balance]).
        dim: the sequence dimension (default 1: ``(batch, seq)``).

    Returns:
        A new contiguous tensor of ``x.shape[dim] / cp`` along ``dim``.
    """
    seq_len = x.shape[dim]
    check_sequence_length(seq_len, cp, load_balance)
    pieces = x.chunk(chunk_count(cp, load_balance), dim=dim)
    return torch.cat([pieces[i] for i in rank_chunks(cp_rank, cp, load_balance)],
                     dim=dim).contiguous()


def unshard_sequence(parts: list[torch.Tensor], load_balance: str = "zigzag",
                     dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (``parts[r]`` from cp rank ``r``)."""
    cp = len(parts)
    n = chunk_count(cp, load_balance)
    chunks: list[torch.Tensor | None] = [None] * n
    for r, part in enumerate(parts):
        mine = rank_chunks(r, cp, load_balance)
        for i, piece in zip(mine, part.chunk(len(mine), dim=dim)):
            chunks[i] = piece
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def unmasked_entries(ranges: tuple[Range, ...]) -> int:
    """Causal score entries (query ``q`` sees keys ``0..q``) of the queries in ``ranges``
    against the whole sequence: ``sum(q + 1)`` over those positions."""
    return sum((e * (e + 1) - s * (s + 1)) // 2 for s, e in ranges)
