"""One pipeline action: what a rank does next (compute or point-to-point communication).

An action names its kind, the stage it belongs to and the micro-batch it works on. Its text
form is ``{stage}{KIND}{microbatch}``, the format ``torch.distributed.pipelining`` also uses:

    0F3        forward of stage 0 on micro-batch 3
    2B0        full backward of stage 2 on micro-batch 0
    1I4 / 1W4  zero-bubble split backward: input gradient (I), then weight gradient (W)
    1SEND_F3   stage 1 sends its output of micro-batch 3 to stage 2
    2RECV_F3   stage 2 receives its input of micro-batch 3 from stage 1
    2SEND_B0   stage 2 sends the gradient of its input (micro-batch 0) to stage 1
    1RECV_B0   stage 1 receives the gradient of its output (micro-batch 0) from stage 2
    0UNSHARD0 / 0RESHARD7 / 0REDUCE_GRAD7   the data-parallel engine's actions on stage 0
               ([Note: engine actions] in action_lists.py), at micro-batch 0's forward and
               micro-batch 7's backward

Communication actions always carry the stage that owns the action's rank, so a SEND and its
RECV name neighbouring stages (``1SEND_F3`` pairs with ``2RECV_F3``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = ["Kind", "Action", "COMPUTE_KINDS", "COMM_KINDS", "ENGINE_KINDS"]


class Kind(enum.Enum):
    """What an action does. ``B`` is a full backward; ``I`` + ``W`` split it (zero bubble)."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the zero-bubble papers' name for the input-gradient pass
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
ENGINE_KINDS = frozenset({Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD})

_DESCRIPTIONS = {
    Kind.F: "forward",
    Kind.B: "full backward",
    Kind.I: "input-gradient backward",
    Kind.W: "weight-gradient backward",
    Kind.SEND_F: "send of the activation",
    Kind.RECV_F: "receive of the activation",
    Kind.SEND_B: "send of the input gradient",
    Kind.RECV_B: "receive of the output gradient",
    Kind.UNSHARD: "parameters kept gathered from here",
    Kind.RESHARD: "parameters freed",
    Kind.REDUCE_GRAD: "gradients reduced by the next backward",
}
# Longest names first so that "SEND_F" is not read as "S" + ...; "F" must come last.
_PATTERN = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD|F|B|I|W)"
                      r"(\d+)")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank's schedule.

    Attributes:
        stage: pipeline stage index (0 = the stage holding the embedding).
        kind: what is done (:class:`Kind`).
        microbatch: micro-batch index, 0-based.
    """

    stage: int
    kind: Kind
    microbatch: int

    @property
    def is_compute(self) -> bool:
        """True for F, B, I and W."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """True for SEND_F, RECV_F, SEND_B and RECV_B."""
        return self.kind in COMM_KINDS

    @property
    def is_engine(self) -> bool:
        """True for UNSHARD, RESHARD and REDUCE_GRAD."""
        return self.kind in ENGINE_KINDS

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def describe(self) -> str:
        """Human words, e.g. ``"1F3 (forward of stage 1, micro-batch 3)"``."""
        return (f"{self} ({_DESCRIPTIONS[self.kind]} of stage {self.stage}, "
                f"micro-batch {self.microbatch})")

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the text form (``"0F3"``, ``"1SEND_B2"``; surrounding spaces ignored).

        Raises:
            ValueError: naming the text when it is not ``{stage}{KIND}{microbatch}``.
        """
        match = _PATTERN.fullmatch(text.strip())
        if match is None:
            raise ValueError(
                f"cannot read action {text!r}: expected {{stage}}{{KIND}}{{microbatch}} with KIND "
                f"one of F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, UNSHARD, RESHARD, "
                f"REDUCE_GRAD (e.g. 0F3, 1I2, 2RECV_F0)")
        stage, kind, microbatch = match.groups()
        return cls(int(stage), Kind(kind), int(microbatch))
