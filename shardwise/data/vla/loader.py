"""Rank-aware, resumable batches of VLA samples from a demonstration dataset.

Every time step of every training episode is one sample. As in
:class:`shardwise.data.TokenLoader` (whose rules this mirrors), each epoch visits the samples
in a permutation drawn from (seed, epoch); global batch g is the next
``world_size * batch_size`` samples of that order and rank r takes positions
``[r * batch_size, (r + 1) * batch_size)`` of it; a remainder smaller than one global batch
is dropped. The position (epoch, samples consumed, batches taken) is the same on every rank
and at every world size, so a state saved at world size 2 resumes at world size 1 with a
doubled batch onto the same global stream.

A sample holds the last ``frames`` frames up to its step (fewer at an episode's start).
``text_only_share`` makes a seeded share of samples text-only (0 frames; drawn per epoch
position, so identical on every rank and after a resume); ``text_only_ranks`` /
``text_only_steps`` make whole batches of given ranks text-only on given steps (tests of
the rule that a rank without images still takes part in the vision tower's collectives).

Validation: the ``floor(episodes * val_fraction)`` episodes with the largest seeds are held
out (never trained on); :meth:`VLALoader.val_batches` yields them unshuffled for action
accuracy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np
import torch

from shardwise.data.vla.batch import VLABatch, collate
from shardwise.data.vla.samples import SampleSpec, build_sample
from shardwise.data.vla.store import VLADataset
from shardwise.data.vla.tokens import MissionTokenizer

__all__ = ["VLALoader"]

_STATE_KEYS = ("epoch", "consumed", "step", "seed", "frames", "num_samples")


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch); hashed so (s, e+1) and (s+1, e) differ."""
    digest = hashlib.blake2b(f"shardwise.data.vla:{seed}:{epoch}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _step_table(lengths: list[int], episodes: np.ndarray) -> np.ndarray:
    """``(S, 2)`` int64 rows (episode, t) for every step of ``episodes``, in order."""
    rows = [np.stack([np.full(lengths[e], e), np.arange(lengths[e])], axis=1) for e in episodes]
    return np.concatenate(rows).astype(np.int64) if rows else np.zeros((0, 2), np.int64)


class VLALoader:
    """Shuffled, rank-sliced, resumable :class:`VLABatch` es from a demonstration dataset.

    Args:
        dataset_dir: a directory written by ``write_dataset`` / ``ensure_dataset``.
        batch_size: samples per rank per batch.
        rank: this process's data-parallel rank, in ``[0, world_size)``.
        world_size: data-parallel ranks sharing the global batch.
        seed: base seed of the per-epoch orders (and of the text-only draw). Default 0.
        frames: frames per sample, the last k up to the step (0 = text only). Default 1.
        spec: vocabulary / patch sizes (:class:`SampleSpec`). Default debug-vla's.
        val_fraction: share of episodes (largest seeds) held out, in [0, 1). Default 0.
        text_only_share: probability in [0, 1] that a training sample has no frame. Default 0.
        text_only_ranks: ranks whose samples are all text-only on ``text_only_steps``.
        text_only_steps: batch indices (0-based, counted over the whole run, kept by
            ``state_dict``) where ``text_only_ranks`` apply; None = every step.
        shuffle: permute samples each epoch (False: episode order). Default True.
        pad_to: fixed padded length passed to :func:`collate`; None pads to the longest.

    Raises:
        ValueError: bad sizes, rank or shares; a validation split that holds no episode or
            takes every episode; fewer training samples than one global batch; see
            :class:`VLADataset` and :class:`SampleSpec`.
    """

    def __init__(self, dataset_dir: str, batch_size: int, rank: int, world_size: int,
                 seed: int = 0, frames: int = 1, *, spec: SampleSpec | None = None,
                 val_fraction: float = 0.0, text_only_share: float = 0.0,
                 text_only_ranks: Collection[int] = (),
                 text_only_steps: Collection[int] | None = None,
                 shuffle: bool = True, pad_to: int | None = None) -> None:
        _check_int("batch_size", batch_size, 1)
        _check_int("world_size", world_size, 1)
        _check_int("frames", frames, 0)
        _check_int("seed", seed, -(1 << 62))
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) \
                or not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be a number in [0, 1), got {val_fraction!r}")
        if isinstance(text_only_share, bool) or not isinstance(text_only_share, (int, float)) \
                or not 0.0 <= text_only_share <= 1.0:
            raise ValueError(f"text_only_share must be a number in [0, 1], got "
                             f"{text_only_share!r}")
        bad = [r for r in text_only_ranks if not 0 <= r < world_size]
        if bad:
            raise ValueError(f"text_only_ranks {bad} are outside [0, world_size={world_size})")
        self.dataset = VLADataset(dataset_dir)
        self.spec = spec or SampleSpec()
        self.spec.num_patches(self.dataset.frame_shape)  # refuses frames the patches don't tile
        self.tokenizer = MissionTokenizer()
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.global_batch_size = batch_size * world_size
        self.frames, self.shuffle, self.pad_to = frames, shuffle, pad_to
        self.text_only_share = float(text_only_share)
        self._text_only_here = rank in set(text_only_ranks)
        self._text_only_steps = None if text_only_steps is None else set(text_only_steps)
        self._split(val_fraction)
        self.seed, self.epoch, self.consumed, self.step = seed, 0, 0, 0
        self._order: tuple[torch.Tensor, torch.Tensor] | None = None
        self._order_epoch = -1

    def _split(self, val_fraction: float) -> None:
        num = self.dataset.num_episodes
        num_val = int(num * val_fraction)
        if val_fraction > 0 and not 0 < num_val < num:
            raise ValueError(f"val_fraction={val_fraction} of {num} episodes holds out "
                             f"{num_val}; expected at least 1 and fewer than {num}")
        by_seed = np.argsort(np.asarray(self.dataset.seeds), kind="stable")
        self.val_episodes = np.sort(by_seed[num - num_val:]) if num_val else by_seed[:0]
        self.train_episodes = np.sort(by_seed[:num - num_val])
        self._train = _step_table(self.dataset.lengths, self.train_episodes)
        self._val = _step_table(self.dataset.lengths, self.val_episodes)
        if len(self._train) < self.global_batch_size:
            raise ValueError(
                f"{len(self.train_episodes)} training episodes hold {len(self._train)} steps; "
                f"one global batch needs world_size*batch_size={self.world_size}*"
                f"{self.batch_size}={self.global_batch_size} (use more episodes or a smaller "
                "batch)")

    @property
    def num_samples(self) -> int:
        """Training samples (time steps of the training episodes)."""
        return int(self._train.shape[0])

    @property
    def num_val_samples(self) -> int:
        """Held-out samples (time steps of the validation episodes)."""
        return int(self._val.shape[0])

    @property
    def val_seeds(self) -> list[int]:
        """Env seeds of the held-out episodes."""
        return [self.dataset.seeds[e] for e in self.val_episodes]

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def _epoch_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sample permutation, text-only draw per order position), once per epoch."""
        if self._order_epoch != self.epoch:
            gen = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
            order = (torch.randperm(self.num_samples, generator=gen) if self.shuffle
                     else torch.arange(self.num_samples))
            text_only = torch.rand(self.num_samples, generator=gen) < self.text_only_share
            self._order, self._order_epoch = (order, text_only), self.epoch
        assert self._order is not None
        return self._order

    def _sample(self, table: np.ndarray, row: int, text_only: bool):  # -> VLASample
        episode, t = (int(v) for v in table[row])
        k = 0 if text_only else min(self.frames, t + 1)
        frames = self.dataset.frames(episode, t + 1 - k, t + 1)
        return build_sample(self.tokenizer, self.spec, frames, self.dataset.mission(episode),
                            self.dataset.action(episode, t))

    def next_batch(self) -> VLABatch:
        """This rank's slice of the next global batch (``batch_size`` samples)."""
        order, text_only = self._epoch_order()
        start = self.consumed + self.rank * self.batch_size
        forced = self._text_only_here and (self._text_only_steps is None
                                           or self.step in self._text_only_steps)
        samples = [self._sample(self._train, int(order[i]), forced or bool(text_only[i]))
                   for i in range(start, start + self.batch_size)]
        self.consumed += self.global_batch_size
        self.step += 1
        if self.num_samples - self.consumed < self.global_batch_size:  # eager, as TokenLoader
            self.epoch, self.consumed = self.epoch + 1, 0
        return collate(samples, self.pad_to)

    def __iter__(self) -> Iterator[VLABatch]:
        """Endless iterator over :meth:`next_batch` (epochs wrap; stop by step count)."""
        return self

    def __next__(self) -> VLABatch:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The position in the global stream; identical on every rank and world size.

        Returns:
            ``{"epoch", "consumed", "step", "seed", "frames", "num_samples"}`` as plain ints.
        """
        return {"epoch": self.epoch, "consumed": self.consumed, "step": self.step,
                "seed": self.seed, "frames": self.frames, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` output, possibly saved at another world size.

        The saved seed replaces this loader's (the state defines the stream).

        Raises:
            ValueError: a key is missing; ``frames`` or ``num_samples`` differ from this
                loader's (another dataset, split or frame count); a position is out of range.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"loader state is missing keys {missing}; got keys {sorted(state)}")
        values = {k: int(state[k]) for k in _STATE_KEYS}
        for key, mine in (("frames", self.frames), ("num_samples", self.num_samples)):
            if values[key] != mine:
                raise ValueError(
                    f"loader state has {key}={values[key]} but this loader has {key}={mine}: "
                    "the state was saved for a different dataset, split or frames")
        if values["epoch"] < 0 or values["step"] < 0 \
                or not 0 <= values["consumed"] <= self.num_samples:
            raise ValueError(
                f"loader state position epoch={values['epoch']}, consumed={values['consumed']}"
                f", step={values['step']} is out of range for {self.num_samples} samples")
        self.seed, self.epoch = values["seed"], values["epoch"]
        self.consumed, self.step = values["consumed"], values["step"]
        self._order_epoch = -1
        if self.num_samples - self.consumed < self.global_batch_size:
            self.epoch, self.consumed = self.epoch + 1, 0

    def val_batches(self, max_batches: int | None = None) -> Iterator[VLABatch]:
        """Unshuffled batches of the held-out episodes, each rank its slice; every rank
        yields the same number (a partial last global batch is dropped). Frames as for
        training, never text-only. Does not move the training position.

        Raises:
            ValueError: no validation split (``val_fraction`` was 0); it holds fewer steps
                than one global batch; ``max_batches`` is not a positive int or None.
        """
        if max_batches is not None:
            _check_int("max_batches", max_batches, 1)
        num = len(self._val) // self.global_batch_size
        if num == 0:
            raise ValueError(f"the validation split holds {len(self._val)} steps, fewer than "
                             f"one global batch of {self.global_batch_size} (raise "
                             "val_fraction)")
        num = num if max_batches is None else min(num, max_batches)

        def batches() -> Iterator[VLABatch]:
            for g in range(num):
                start = g * self.global_batch_size + self.rank * self.batch_size
                yield collate([self._sample(self._val, i, False)
                               for i in range(start, start + self.batch_size)], self.pad_to)
        return batches()

    def __repr__(self) -> str:
        return (f"VLALoader({str(self.dataset.path)!r}, num_samples={self.num_samples}, "
                f"batch_size={self.batch_size}, rank={self.rank}, world_size={self.world_size},"
                f" frames={self.frames}, seed={self.seed}, epoch={self.epoch}, "
                f"consumed={self.consumed}, step={self.step})")
