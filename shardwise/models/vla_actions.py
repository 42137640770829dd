"""Actions as tokens: the top ``num_action_tokens`` ids of the decoder's vocabulary.

    tok = ActionTokenizer(vocab_size=128, num_action_tokens=16)          # discrete (BabyAI)
    tok.encode(torch.tensor([0, 6]))       # -> tensor([112, 118])
    tok.decode(torch.tensor([112, 118]))   # -> tensor([0, 6])

    arm = ActionTokenizer(32000, 256, low=[-1.0] * 7, high=[1.0] * 7)    # continuous (OpenVLA)
    ids = arm.encode(values)               # (..., 7) floats -> (..., 7) ids in [31744, 32000)
    arm.decode(ids)                        # (..., 7) bin centres

Discrete actions ``0 <= a < num_action_tokens`` map to id ``vocab_size - num_action_tokens +
a``. Continuous actions are binned as OpenVLA does: each dimension ``d`` is cut into ``bins``
uniform bins over ``[low[d], high[d]]`` (bin ``i`` covers ``[low + i * w, low + (i + 1) * w)``
with ``w = (high - low) / bins``; ``high`` itself falls in the last bin), bin ``i`` is action
token ``i``, and decoding returns the bin's centre ``low + (i + 0.5) * w``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ActionTokenizer"]


class ActionTokenizer:
    """Encode actions to token ids in the reserved top range and decode them back.

    Args:
        vocab_size: the decoder's vocabulary (text and action tokens).
        num_action_tokens: ids reserved for actions at the top of the vocabulary.
        low: continuous actions only: the lower bound of each dimension (a sequence of
            floats); None (default) for discrete actions.
        high: the upper bound of each dimension (with ``low``), each above its ``low``.
        bins: bins per dimension (default None: ``num_action_tokens``; OpenVLA: 256); at most
            ``num_action_tokens``.

    Raises:
        ValueError: sizes that do not fit, bounds given alone, of different lengths or not
            increasing, naming them.
    """

    def __init__(self, vocab_size: int, num_action_tokens: int,
                 low: Sequence[float] | None = None, high: Sequence[float] | None = None,
                 bins: int | None = None) -> None:
        for name, value in (("vocab_size", vocab_size), ("num_action_tokens", num_action_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ActionTokenizer: {name}={value!r}, expected a positive int")
        if num_action_tokens >= vocab_size:
            raise ValueError(f"ActionTokenizer: num_action_tokens={num_action_tokens} leaves no "
                             f"text ids in vocab_size={vocab_size}")
        self.vocab_size, self.num_action_tokens = vocab_size, num_action_tokens
        self.first_id = vocab_size - num_action_tokens
        if (low is None) != (high is None):
            raise ValueError(f"ActionTokenizer: low={low!r}, high={high!r}; give both bounds "
                             f"(continuous actions) or neither (discrete)")
        self.bins = num_action_tokens if bins is None else bins
        if isinstance(self.bins, bool) or not isinstance(self.bins, int) \
                or not 0 < self.bins <= num_action_tokens:
            raise ValueError(f"ActionTokenizer: bins={bins!r}, expected an int in [1, "
                             f"num_action_tokens={num_action_tokens}]")
        self.low = self.high = None
        if low is not None:
            self.low = torch.tensor(list(low), dtype=torch.float64)
            self.high = torch.tensor(list(high), dtype=torch.float64)
            if self.low.dim() != 1 or self.low.shape != self.high.shape or not len(self.low):
                raise ValueError(f"ActionTokenizer: low={list(low)} and high={list(high)} must "
                                 f"be non-empty sequences of the same length")
            if not bool((self.high > self.low).all()):
                raise ValueError(f"ActionTokenizer: high={list(high)} must exceed low="
                                 f"{list(low)} in every dimension")

    @property
    def continuous(self) -> bool:
        """Whether actions are binned floats (True) or discrete indices (False)."""
        return self.low is not None

    def encode(self, actions: torch.Tensor) -> torch.Tensor:
        """Token ids of ``actions``.

        Args:
            actions: discrete: integer actions in ``[0, num_action_tokens)``, any shape;
                continuous: floats of shape ``(..., dims)`` within ``[low, high]``.

        Returns:
            int64 ids of the same shape, in ``[vocab_size - num_action_tokens, vocab_size)``.

        Raises:
            ValueError: a value out of range (naming the first one), or a wrong shape / dtype.
        """
        actions = torch.as_tensor(actions)
        if not self.continuous:
            if actions.is_floating_point() or actions.is_complex():
                raise ValueError(f"ActionTokenizer.encode: discrete actions must be integers, "
                                 f"got dtype {actions.dtype}")
            bad = (actions < 0) | (actions >= self.num_action_tokens)
            if bool(bad.any()):
                raise ValueError(f"ActionTokenizer.encode: action {int(actions[bad][0])} is "
                                 f"outside [0, {self.num_action_tokens})")
            return actions.long() + self.first_id
        x = self._check_dims(actions, "encode").double()
        low, high = self.low.to(x.device), self.high.to(x.device)
        bad = ~((x >= low) & (x <= high))  # also catches nan
        if bool(bad.any()):
            where = bad.nonzero()[0].tolist()
            raise ValueError(f"ActionTokenizer.encode: value {x[tuple(where)].item()} at index "
                             f"{tuple(where)} is outside [low, high] = [{low[where[-1]].item()}, "
                             f"{high[where[-1]].item()}]")
        index = ((x - low) / (high - low) * self.bins).floor().long().clamp_(max=self.bins - 1)
        return index + self.first_id

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """Actions of token ids: discrete indices, or continuous bin centres.

        Args:
            ids: integer ids in the action range (continuous: the bins' range, shape
                ``(..., dims)``).

        Returns:
            int64 actions, or float64 bin centres of the same shape.

        Raises:
            ValueError: an id outside the action range (naming it), or a wrong shape.
        """
        ids = torch.as_tensor(ids)
        if ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"ActionTokenizer.decode: ids must be integers, got {ids.dtype}")
        top = self.first_id + (self.bins if self.continuous else self.num_action_tokens)
        bad = (ids < self.first_id) | (ids >= top)
        if bool(bad.any()):
            raise ValueError(f"ActionTokenizer.decode: id {int(ids[bad][0])} is not an action "
                             f"token; expected ids in [{self.first_id}, {top})")
        index = ids.long() - self.first_id
        if not self.continuous:
            return index
        self._check_dims(ids, "decode")
        low, high = self.low.to(ids.device), self.high.to(ids.device)
        return low + (index.double() + 0.5) * (high - low) / self.bins

    def _check_dims(self, x: torch.Tensor, what: str) -> torch.Tensor:
        dims = self.low.shape[0]
        if x.dim() == 0 or x.shape[-1] != dims:
            raise ValueError(f"ActionTokenizer.{what}: shape {tuple(x.shape)}, expected "
                             f"(..., {dims}) for {dims} action dimensions")
        return x
