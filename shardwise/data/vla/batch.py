"""One VLA sample, a collated batch, and :func:`collate` (docs: the VLA interface).

A sample is one time step: ``[BOS] [IMAGE]*P per frame, mission words ..., [ACT]`` with the
action's token as the label at the ``ACT`` position. A batch right-pads the samples' tokens
with ``PAD`` (labels with -100) and concatenates their frames sample-major, so the frames
appear in the order of their ``IMAGE`` runs in ``tokens``::

    tokens  (B, T)  row 0: BOS I I I I w w ACT PAD PAD      (1 frame, P=4)
                    row 1: BOS w w w ACT PAD PAD PAD PAD PAD  (text only)
                    row 2: BOS I I I I I I I I w ACT          (2 frames)
    images  (N, 3, H, W)  N = 3: row 0's frame, then row 2's two (oldest first)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from shardwise.data.vla.tokens import IMAGE_ID, PAD_ID

__all__ = ["IGNORE_INDEX", "VLASample", "VLABatch", "collate"]

IGNORE_INDEX = -100  # cross_entropy's default ignore_index: no loss at this position


@dataclasses.dataclass
class VLASample:
    """One time step, ready to collate.

    Attributes:
        tokens: ``(L,)`` int64 ids.
        labels: ``(L,)`` int64; the action token at the ``ACT`` position, -100 elsewhere
            (all -100 when the action is unknown, as during a rollout).
        images: ``(n, 3, H, W)`` float32 in [0, 1], the sample's frames oldest first; n may be 0.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    images: torch.Tensor

    @property
    def num_frames(self) -> int:
        return int(self.images.shape[0])


@dataclasses.dataclass
class VLABatch:
    """A collated batch (the model's input plus its labels).

    Attributes:
        tokens: ``(B, T)`` int64, right-padded with ``PAD``; ``IMAGE`` ids where patches go.
        labels: ``(B, T)`` int64, the action id at each ``ACT`` position, -100 elsewhere.
        images: ``(N, 3, H, W)`` float32, every frame of the batch in the order of their
            ``IMAGE`` runs; N may be 0 (the model still runs its vision tower on it).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    images: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_images(self) -> int:
        """N, the frames of the batch."""
        return int(self.images.shape[0])

    @property
    def num_image_tokens(self) -> int:
        """``IMAGE`` ids in ``tokens``: N * P for a well-formed batch."""
        return int((self.tokens == IMAGE_ID).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> VLABatch:
        """The batch with every tensor on ``device`` (a new object; self is unchanged)."""
        return VLABatch(*(t.to(device, non_blocking=non_blocking)
                          for t in (self.tokens, self.labels, self.images)))

    def frames_per_sample(self) -> list[int]:
        """Frames of each row: its ``IMAGE`` ids over the patches per frame (every frame has
        the same patches, ``num_image_tokens / N``); all 0 when the batch has no frame."""
        per_row = (self.tokens == IMAGE_ID).sum(dim=1).tolist()
        if self.num_images == 0:
            return [0] * self.batch_size
        patches, rest = divmod(sum(per_row), self.num_images)
        if rest or any(r % patches for r in per_row):
            raise ValueError(f"VLABatch: rows hold {per_row} IMAGE ids, which {self.num_images} "
                             f"frames of equal patches do not fill")
        return [r // patches for r in per_row]

    def split(self, parts: int) -> list[VLABatch]:
        """The batch cut by samples into ``parts`` equal micro-batches, each with its own
        frames (those of its samples, in order; a micro-batch may hold none). Rows keep the
        batch's length ``T`` (right padding changes no earlier position).

        Args:
            parts: how many micro-batches (a pipeline's ``pp_microbatches``).

        Returns:
            ``parts`` batches of ``B / parts`` samples, in order.

        Raises:
            ValueError: ``parts`` is not a positive int dividing ``B`` (naming both), or
                rows whose IMAGE ids the frames do not fill.
        """
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1 \
                or self.batch_size % parts:
            raise ValueError(f"VLABatch.split: a batch of {self.batch_size} samples does not "
                             f"split into parts={parts!r} equal micro-batches")
        rows = self.batch_size // parts
        frames = self.frames_per_sample()
        out, first = [], 0
        for i in range(parts):
            n = sum(frames[i * rows:(i + 1) * rows])
            cut = slice(i * rows, (i + 1) * rows)
            out.append(VLABatch(self.tokens[cut], self.labels[cut],
                                self.images[first:first + n]))
            first += n
        return out


def collate(samples: Sequence[VLASample], pad_to: int | None = None) -> VLABatch:
    """Right-pad and stack ``samples`` into a :class:`VLABatch`.

    Args:
        samples: one or more samples whose frames share one (H, W).
        pad_to: pad every row to this length (e.g. a fixed length for compiled models);
            None (default) pads to the longest sample.

    Returns:
        The batch; ``T = pad_to or max(len(sample.tokens))``.

    Raises:
        ValueError: no samples; frame sizes differ; ``pad_to`` is shorter than a sample.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    shapes = {tuple(s.images.shape[1:]) for s in samples}
    if len(shapes) != 1:
        raise ValueError(f"samples have frames of different shapes {sorted(shapes)}")
    longest = max(int(s.tokens.numel()) for s in samples)
    if pad_to is None:
        pad_to = longest
    elif isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < longest:
        raise ValueError(f"pad_to must be an int >= the longest sample ({longest} tokens), "
                         f"got {pad_to!r}")
    tokens = torch.full((len(samples), pad_to), PAD_ID, dtype=torch.long)
    labels = torch.full((len(samples), pad_to), IGNORE_INDEX, dtype=torch.long)
    for row, s in enumerate(samples):
        tokens[row, :s.tokens.numel()] = s.tokens
        labels[row, :s.labels.numel()] = s.labels
    images = torch.cat([s.images for s in samples])  # keeps (0, 3, H, W) when all are text
    return VLABatch(tokens=tokens, labels=labels, images=images)
