"""Rank-aware, resumable batches of token windows.

The token stream is cut into non-overlapping windows of ``seq_len + 1`` tokens; a window gives
one sample (inputs = its first ``seq_len`` tokens, targets = its last ``seq_len``). Each epoch
visits the windows in a permutation drawn from a ``torch.Generator`` seeded with (seed, epoch).
Global micro-batch g is the next ``world_size * batch_size`` windows of that order, and rank r
takes windows ``[r * batch_size, (r + 1) * batch_size)`` of it::

    order (epoch e):  w7 w2 w9 w0 | w4 w1 w8 w3 | w6 w5 ...     world_size=2, batch_size=2
                      rank0 rank1 | rank0 rank1 |  (dropped: fewer than 4 left)

So one process with ``batch_size * world_size`` sees exactly the union of what N ranks see, and
the position (epoch, windows consumed globally, seed) is the same number on every rank and at
every world size: ``state_dict()`` saved at world size 2 resumes at world size 1 with a doubled
batch onto the same global stream. Each loader holds all tokens but touches only its windows;
for corpora that do not fit in host memory use a memory-mapped tensor as ``tokens``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator

import torch

__all__ = ["split_tokens", "TokenLoader", "iter_eval_batches"]

Batch = tuple[torch.Tensor, torch.Tensor]

_STATE_KEYS = ("epoch", "consumed", "seed", "seq_len", "num_windows")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_tokens(tokens: Any) -> torch.Tensor:
    """``tokens`` as a 1-D integer tensor (numpy arrays and lists are converted)."""
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(tokens)
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must have an integer dtype, got {tokens.dtype}")
    return tokens


def _check_layout(seq_len: int, batch_size: int, rank: int, world_size: int) -> None:
    _check_positive_int("seq_len", seq_len)
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")


def _as_windows(tokens: torch.Tensor, seq_len: int, global_batch: int, what: str,
                world_size: int, batch_size: int) -> torch.Tensor:
    """View ``tokens`` as (num_windows, seq_len + 1); error if < one global batch of windows."""
    window = seq_len + 1
    num_windows = tokens.numel() // window
    if num_windows < global_batch:
        raise ValueError(
            f"{what} has {tokens.numel()} tokens -> {num_windows} windows of "
            f"seq_len+1={window}; one global batch needs world_size*batch_size="
            f"{world_size}*{batch_size}={global_batch} windows (use more text, a smaller "
            f"seq_len or batch_size, or fewer ranks)")
    # The tail shorter than a window is dropped; for contiguous tokens this is a view (no copy).
    return tokens[: num_windows * window].reshape(num_windows, window)


def _gather(windows: torch.Tensor, idx: torch.Tensor) -> Batch:
    """(inputs, targets), each (len(idx), seq_len) int64, for the windows ``idx``."""
    rows = windows[idx].long()  # (B, seq_len + 1)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def split_tokens(ids: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a token stream into contiguous train and validation parts (validation at the end).

    Args:
        ids: 1-D tensor of token ids.
        val_fraction: share of tokens for validation, in [0, 1);
            ``floor(len(ids) * val_fraction)`` tokens go to validation.

    Returns:
        ``(train_ids, val_ids)``, views of ``ids`` (no copy); ``val_ids`` is empty for 0.

    Raises:
        ValueError: ``ids`` is not 1-D, or ``val_fraction`` is outside [0, 1).
    """
    ids = _check_tokens(ids)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) \
            or not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be a number in [0, 1), got {val_fraction!r}")
    num_val = int(ids.numel() * val_fraction)
    num_train = ids.numel() - num_val
    return ids[:num_train], ids[num_train:]


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch).

    Hashing (rather than e.g. seed + epoch) keeps (s, e + 1) and (s + 1, e) from sharing an order.
    """
    digest = hashlib.blake2b(f"shardwise.data:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class TokenLoader:
    """Shuffled, rank-sliced, resumable (inputs, targets) batches from a token stream.

    Args:
        tokens: 1-D integer tensor of token ids (e.g. ``split_tokens(...)[0]``).
        seq_len: tokens per sample (the model's context length).
        batch_size: samples per rank per micro-batch.
        rank: this process's data-parallel rank, in ``[0, world_size)``.
        world_size: number of data-parallel ranks sharing the global batch.
        seed: base seed of the per-epoch window permutations. Default 0.
        shuffle: permute windows each epoch; if False the order is 0, 1, 2, ... Default True.

    Raises:
        ValueError: non-positive ``seq_len`` / ``batch_size`` / ``world_size``; ``rank``
            outside ``[0, world_size)``; ``tokens`` not 1-D integers; fewer windows than one
            global batch (the message gives the counts).
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, rank: int,
                 world_size: int, seed: int = 0, shuffle: bool = True) -> None:
        _check_layout(seq_len, batch_size, rank, world_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.global_batch_size = world_size * batch_size
        self._windows = _as_windows(_check_tokens(tokens), seq_len, self.global_batch_size,
                                    "corpus", world_size, batch_size)
        self.seed = seed
        self.epoch = 0
        self.consumed = 0  # windows of this epoch's order used by all ranks together
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    @property
    def num_windows(self) -> int:
        """Number of ``seq_len + 1`` windows in the token stream."""
        return self._windows.shape[0]

    @property
    def batches_per_epoch(self) -> int:
        """Global micro-batches per epoch (the remainder windows are dropped)."""
        return self.num_windows // self.global_batch_size

    def _epoch_order(self) -> torch.Tensor:
        """This epoch's window permutation, computed once per epoch."""
        if self._order_epoch != self.epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
                self._order = torch.randperm(self.num_windows, generator=gen)
            else:
                self._order = torch.arange(self.num_windows)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def _roll_epoch_if_done(self) -> None:
        # Eager, so state_dict() after an epoch's last batch already says "next epoch, 0".
        if self.num_windows - self.consumed < self.global_batch_size:
            self.epoch += 1
            self.consumed = 0

    def next_batch(self) -> Batch:
        """This rank's slice of the next global micro-batch.

        Returns:
            ``(inputs, targets)``, each ``(batch_size, seq_len)`` int64;
            ``targets[:, t] == inputs[:, t + 1]`` for ``t < seq_len - 1``.
        """
        start = self.consumed + self.rank * self.batch_size
        idx = self._epoch_order()[start: start + self.batch_size]
        self.consumed += self.global_batch_size
        self._roll_epoch_if_done()
        return _gather(self._windows, idx)

    def __iter__(self) -> Iterator[Batch]:
        """Endless iterator over :meth:`next_batch` (epochs wrap; stop by step count)."""
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The position in the global stream; identical on every rank and world size.

        Returns:
            ``{"epoch", "consumed", "seed", "seq_len", "num_windows"}`` as plain ints;
            ``consumed`` counts windows used by all ranks in the current epoch.
        """
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "seq_len": self.seq_len, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` output, possibly saved at another world size.

        The saved seed replaces this loader's seed (the state defines the stream). With the
        same global batch size (``world_size * batch_size``) the resumed global stream is
        exactly the one the saving run would have seen.

        Raises:
            ValueError: a key is missing; ``seq_len`` or ``num_windows`` differ from this
                loader's (different tokens or context length); a position is out of range.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"loader state is missing keys {missing}; got keys {sorted(state)}")
        values = {k: int(state[k]) for k in _STATE_KEYS}  # also accepts 0-d tensors
        for key, mine in (("seq_len", self.seq_len), ("num_windows", self.num_windows)):
            if values[key] != mine:
                raise ValueError(
                    f"loader state has {key}={values[key]} but this loader has {key}={mine}: "
                    "the state was saved for a different token stream or seq_len")
        if values["epoch"] < 0 or not 0 <= values["consumed"] <= self.num_windows:
            raise ValueError(
                f"loader state position epoch={values['epoch']}, consumed={values['consumed']}"
                f" is out of range for {self.num_windows} windows")
        self.seed = values["seed"]
        self.epoch = values["epoch"]
        self.consumed = values["consumed"]
        self._order_epoch = -1  # the seed may have changed: recompute the order
        self._roll_epoch_if_done()  # a smaller remainder may not fill this loader's batch

    def val_batches(self, max_batches: int | None = None) -> Iterator[Batch]:
        """Unshuffled evaluation batches over this loader's tokens; see :func:`iter_eval_batches`.

        Does not change the training position.

        Raises:
            ValueError: ``max_batches`` is not a positive int or None.
        """
        if max_batches is not None:
            _check_positive_int("max_batches", max_batches)
        # Reuses the validated window view, so no second size check can fail here.
        return _eval_batches(self._windows, self.batch_size, self.rank, self.world_size,
                             max_batches)

    def __repr__(self) -> str:
        return (f"TokenLoader(num_windows={self.num_windows}, seq_len={self.seq_len}, "
                f"batch_size={self.batch_size}, rank={self.rank}, "
                f"world_size={self.world_size}, seed={self.seed}, epoch={self.epoch}, "
                f"consumed={self.consumed})")


def _eval_batches(windows: torch.Tensor, batch_size: int, rank: int, world_size: int,
                  max_batches: int | None) -> Iterator[Batch]:
    global_batch = world_size * batch_size
    num_batches = windows.shape[0] // global_batch
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    for g in range(num_batches):
        start = g * global_batch + rank * batch_size
        yield _gather(windows, torch.arange(start, start + batch_size))


def iter_eval_batches(tokens: torch.Tensor, seq_len: int, batch_size: int, rank: int,
                      world_size: int, max_batches: int | None = None) -> Iterator[Batch]:
    """Deterministic, unshuffled evaluation batches, each rank its own slice.

    Windows are taken in order; global batch g is windows ``[g*G, (g+1)*G)`` with
    ``G = world_size * batch_size`` and rank r gets ``[g*G + r*batch_size, ... + batch_size)``.
    Every rank yields the same number of batches (a trailing partial global batch is
    dropped), so per-batch collectives in the eval loop stay matched.

    Args:
        tokens: 1-D integer tensor (e.g. ``split_tokens(...)[1]``).
        seq_len, batch_size, rank, world_size: as for :class:`TokenLoader`.
        max_batches: stop after this many global batches; None (default) for all.

    Returns:
        An iterator of ``(inputs, targets)``, each ``(batch_size, seq_len)`` int64.

    Raises:
        ValueError: as for :class:`TokenLoader` (checked at the call, before iterating), or
            ``max_batches`` is not a positive int.
    """
    _check_layout(seq_len, batch_size, rank, world_size)
    if max_batches is not None:
        _check_positive_int("max_batches", max_batches)
    windows = _as_windows(_check_tokens(tokens), seq_len, world_size * batch_size,
                          "validation set", world_size, batch_size)
    return _eval_batches(windows, batch_size, rank, world_size, max_batches)
