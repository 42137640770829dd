"""Building one VLA sample from a time step: token layout, action token, frames.

The decoder's vocabulary is the mission text ids at the bottom and ``num_action_tokens``
reserved action ids at the top (action a -> ``vocab_size - num_action_tokens + a``, the
OpenVLA layout). :class:`SampleSpec` carries those sizes and the patch size, and refuses a
layout where text ids would reach the action ids.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from shardwise.data.vla.batch import IGNORE_INDEX, VLASample
from shardwise.data.vla.env import NUM_ACTIONS
from shardwise.data.vla.tokens import ACT_ID, BOS_ID, IMAGE_ID, MissionTokenizer

__all__ = ["SampleSpec", "build_sample", "frames_to_tensor"]


@dataclasses.dataclass(frozen=True)
class SampleSpec:
    """How samples map onto the decoder's vocabulary and the vision encoder's patches.

    Attributes:
        vocab_size: the decoder's whole vocabulary (text + actions). Default 128 (debug-vla).
        num_action_tokens: reserved action ids at the top. Default 16.
        patch_size: vision patch side in pixels; P = (H // patch) * (W // patch). Default 8.
    """

    vocab_size: int = 128
    num_action_tokens: int = 16
    patch_size: int = 8

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_action_tokens", "patch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        text = MissionTokenizer().vocab_size
        if self.text_limit < text:
            raise ValueError(
                f"vocab_size={self.vocab_size} - num_action_tokens={self.num_action_tokens} "
                f"leaves {self.text_limit} ids below the action tokens, but the mission "
                f"tokenizer needs {text}")
        if self.num_action_tokens < NUM_ACTIONS:
            raise ValueError(f"num_action_tokens={self.num_action_tokens} is fewer than "
                             f"BabyAI's {NUM_ACTIONS} actions")

    @property
    def text_limit(self) -> int:
        """The first action id; every text id is below it."""
        return self.vocab_size - self.num_action_tokens

    def action_token(self, action: int) -> int:
        """The decoder id of action ``action``."""
        if not 0 <= action < self.num_action_tokens:
            raise ValueError(f"action {action} is outside [0, {self.num_action_tokens})")
        return self.text_limit + action

    def num_patches(self, frame_shape: tuple[int, ...]) -> int:
        """P for frames of ``(H, W, 3)``.

        Raises:
            ValueError: H or W is not a multiple of ``patch_size``.
        """
        h, w = frame_shape[0], frame_shape[1]
        if h % self.patch_size or w % self.patch_size:
            raise ValueError(f"frames of {h}x{w} pixels do not split into "
                             f"patch_size={self.patch_size} patches")
        return (h // self.patch_size) * (w // self.patch_size)


def frames_to_tensor(frames: np.ndarray) -> torch.Tensor:
    """``(k, H, W, 3)`` uint8 -> ``(k, 3, H, W)`` float32 in [0, 1]."""
    return torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float() / 255.0


def build_sample(tokenizer: MissionTokenizer, spec: SampleSpec, frames: np.ndarray,
                 mission: str, action: int | None) -> VLASample:
    """``[BOS] [IMAGE]*P per frame, mission ids, [ACT]``; label = action token at ``ACT``.

    Args:
        tokenizer: the mission tokenizer.
        spec: vocabulary and patch sizes.
        frames: ``(k, H, W, 3)`` uint8, oldest first; k may be 0 (a text-only sample).
        mission: the mission string.
        action: the target action, or None for no label (a rollout step).

    Returns:
        The :class:`VLASample`.

    Raises:
        ValueError: see :meth:`SampleSpec.num_patches` and :meth:`SampleSpec.action_token`.
    """
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be (k, H, W, 3), got shape {frames.shape}")
    words = tokenizer.encode(mission)
    assert max(words, default=0) < spec.text_limit  # SampleSpec checked the vocabulary
    num_image = frames.shape[0] * spec.num_patches(frames.shape[1:])
    tokens = torch.tensor([BOS_ID] + [IMAGE_ID] * num_image + words + [ACT_ID],
                          dtype=torch.long)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    if action is not None:
        labels[-1] = spec.action_token(int(action))
    return VLASample(tokens=tokens, labels=labels, images=frames_to_tensor(frames))
