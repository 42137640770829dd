"""The word-level tokenizer of BabyAI missions (the text part of the VLA vocabulary).

BabyAI's missions come from a closed grammar (minigrid's ``envs/babyai/core/verifier.py``):
instruction templates ("go to", "pick up", "open", "put ... next to", joined by ", then",
"after you", "and") over object descriptions ("the" / "a", a colour, a type or "object", a
location "on your left" / "in front of you" / "behind you"). So the vocabulary is a fixed,
sorted word list, written out here (no minigrid import: the model side reads
:attr:`MissionTokenizer.vocab_size` without the optional dependency) and checked against
minigrid's own constants and real missions by ``tests/test_vla_data.py``.

Ids (docs: the VLA interface)::

    PAD=0  BOS=1  IMAGE=2 (one per image patch)  ACT=3 (predicts the action)  UNK=4
    5 ...  the words of MISSION_WORDS, in order
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Sequence

__all__ = ["PAD_ID", "BOS_ID", "IMAGE_ID", "ACT_ID", "UNK_ID", "SPECIAL_TOKENS",
           "MISSION_WORDS", "MissionTokenizer", "split_mission"]

PAD_ID, BOS_ID, IMAGE_ID, ACT_ID, UNK_ID = 0, 1, 2, 3, 4
SPECIAL_TOKENS = ("<pad>", "<bos>", "<image>", "<act>", "<unk>")

# verifier.py: COLOR_NAMES (minigrid.core.constants), OBJ_TYPES + "object", LOC_NAMES.
_COLORS = ("blue", "green", "grey", "purple", "red", "yellow")
_OBJECTS = ("ball", "box", "door", "key", "object")
_LOCATIONS = ("behind", "front", "left", "right")
# The templates' own words: the surface() methods of the instructions and descriptions.
_TEMPLATE = (",", "a", "after", "and", "go", "in", "next", "of", "on", "open", "pick", "put",
             "the", "then", "to", "up", "you", "your")

MISSION_WORDS: tuple[str, ...] = tuple(sorted(set(_COLORS + _OBJECTS + _LOCATIONS + _TEMPLATE)))

# A word is a run of letters; the comma of ", then" is a token of its own.
_WORD = re.compile(r"[a-z]+|[^\sa-z]")


def split_mission(mission: str) -> list[str]:
    """The words of a mission, lower-cased; punctuation marks are words of their own.

    Args:
        mission: e.g. ``"go to the red ball, then open a door"``.

    Returns:
        e.g. ``["go", "to", "the", "red", "ball", ",", "then", "open", "a", "door"]``.
    """
    return _WORD.findall(mission.lower())


class MissionTokenizer:
    """Fixed word-level tokenizer over :data:`MISSION_WORDS` with the VLA special ids.

    Unknown words map to ``UNK_ID`` and are counted in ``unknown`` (a ``Counter`` of
    word -> occurrences), so a level whose grammar this list misses is noticed, not hidden.

    Attributes:
        vocab_size: number of text ids (specials + words); the decoder's vocabulary adds the
            reserved action tokens above its text part.
    """

    def __init__(self) -> None:
        self.words: tuple[str, ...] = SPECIAL_TOKENS + MISSION_WORDS
        # Only words map to ids: split_mission never yields "<pad>" and the like whole.
        self._ids = {w: i for i, w in enumerate(self.words) if i >= len(SPECIAL_TOKENS)}
        self.vocab_size: int = len(self.words)
        self.unknown: Counter[str] = Counter()

    def encode(self, mission: str) -> list[int]:
        """Ids of the mission's words (no BOS / ACT: the sample builder places those).

        Args:
            mission: a BabyAI mission string.

        Returns:
            One id per word of :func:`split_mission`; ``UNK_ID`` for words outside the list.
        """
        ids = []
        for word in split_mission(mission):
            i = self._ids.get(word)
            if i is None:
                self.unknown[word] += 1
                i = UNK_ID
            ids.append(i)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Words of ``ids`` joined by spaces (", " kept tight); specials shown as ``<name>``.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the mission vocabulary "
                                 f"[0, {self.vocab_size})")
            out.append(self.words[i])
        return " ".join(out).replace(" ,", ",")

    @property
    def vocab_hash(self) -> str:
        """A short hash of the id -> word table; datasets record it to catch a changed list."""
        return hashlib.sha256("\n".join(self.words).encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        unknown = sum(self.unknown.values())
        return f"MissionTokenizer(vocab_size={self.vocab_size}, unknown={unknown})"
