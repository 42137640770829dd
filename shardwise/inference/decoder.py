"""Prefill and decode on a built-in decoder: the model's own modules, run with a KV cache.

    dec = Decoder(model)
    logits = dec.prefill([[1, 2, 3], [4, 5]], max_new_tokens=16)   # (2, vocab): next tokens
    logits = dec.step(next_tokens)                                  # one token per row

Prompts of different lengths are left-padded ([Note: left padding] in cache.py). The model
runs as it trains (the same blocks, so under tensor parallelism, streamed or low-bit
weights too); only the last position's hidden state goes through the final norm and the
head.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from shardwise.inference.cache import KVCache

__all__ = ["Decoder", "check_prompts"]

_PIECES = ("tok_embeddings", "rope", "layers", "norm", "output")


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """The prompts as lists of ints, checked.

    Raises:
        ValueError: no prompt, an empty prompt, or a token outside ``[0, vocab_size)``,
            naming the row.
    """
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
    rows = [[int(t) for t in p] for p in prompts]
    if not rows:
        raise ValueError("no prompt: expected a list of token lists, e.g. [[1, 2, 3]]")
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {i} is empty: expected at least one token")
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token {bad[0]} outside the vocabulary "
                             f"[0, {vocab_size})")
    return rows


class Decoder:
    """Runs a built-in decoder (a shardwise ``Transformer``; a Hugging Face Llama imported
    into one) one forward at a time with a :class:`KVCache`.

    Args:
        model: the decoder, in eval mode for deterministic results (dropout-free anyway).
        compile: run each decode step as one ``torch.compile``'d function of fixed shapes
            ([Note: a static-shape step] in cache.py): the same tokens; the first steps of a
            new batch / length / model pay the compile. The prefill stays eager.

    Raises:
        ValueError: ``model`` lacks the decoder's pieces.
    """

    def __init__(self, model: nn.Module, compile: bool = False) -> None:
        missing = [p for p in _PIECES if not hasattr(model, p)]
        if missing:
            raise ValueError(f"{type(model).__name__} has no {missing}: expected a shardwise "
                             f"Transformer (a decoder with {', '.join(_PIECES)})")
        self.model = model
        self.max_seq_len = model.rope.max_seq_len
        self.vocab_size = model.tok_embeddings.num_embeddings
        self.cache: KVCache | None = None
        self.lengths: list[int] = []
        self.compile = bool(compile)

    @property
    def device(self) -> torch.device:
        return self.model.rope.cos.device

    def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                pad_id: int = 0) -> torch.Tensor:
        """Allocate the cache for ``max_new_tokens`` more tokens and run the prompts.

        Args:
            prompts: token lists (of different lengths, left-padded here).
            max_new_tokens: how many :meth:`step` calls the cache must hold.
            pad_id: the token written into padding slots (never attended to).

        Returns:
            ``(B, vocab)`` logits of each row's next token (fp32).

        Raises:
            ValueError: bad prompts, or prompt + new tokens over the model's ``max_seq_len``.
        """
        rows = check_prompts(prompts, self.vocab_size)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}, expected an int >= 0")
        longest = max(len(r) for r in rows)
        if longest + max_new_tokens > self.max_seq_len:
            raise ValueError(f"the longest prompt ({longest} tokens) plus max_new_tokens="
                             f"{max_new_tokens} is {longest + max_new_tokens} tokens, over the "
                             f"model's max_seq_len={self.max_seq_len}")
        tokens = torch.full((len(rows), longest), pad_id, dtype=torch.int64)
        for i, row in enumerate(rows):
            tokens[i, longest - len(row):] = torch.tensor(row)
        start = torch.tensor([longest - len(r) for r in rows], dtype=torch.int64)
        self.lengths = [len(r) for r in rows]
        self.cache = KVCache(self.model, len(rows), longest + max_new_tokens,
                             start.to(self.device), static=self.compile)
        return self._forward(tokens.to(self.device))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run one new token per row.

        Args:
            tokens: ``(B,)`` int64, each row's latest token.

        Returns:
            ``(B, vocab)`` logits of the token after it (fp32).

        Raises:
            ValueError: before :meth:`prefill`, a wrong shape, or a full cache.
        """
        if self.cache is None:
            raise ValueError("Decoder.step before Decoder.prefill")
        if tokens.dim() != 1 or tokens.shape[0] != self.cache.batch:
            raise ValueError(f"Decoder.step: tokens has shape {tuple(tokens.shape)}, expected "
                             f"({self.cache.batch},): one token per row")
        return self._forward(tokens.view(-1, 1))

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cache, t = self.cache, tokens.shape[1]
        positions = cache.begin(t)  # (B, t)
        run = _compiled_run() if cache.slot is not None else _run
        with torch.inference_mode(), cache.attached():
            logits = run(self.model, tokens, positions)
        cache.end(t)
        return logits


def _run(m: nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The decoder's forward over ``tokens`` at ``positions``; ``(B, V)`` fp32 logits of the
    last position only."""
    t = tokens.shape[1]
    h = m.tok_embeddings(tokens)  # (B, t, C)
    cos, sin = m.rope(t, positions)  # (B, t, hd/2) each
    for layer in m.layers:
        h = layer(h, cos, sin)
    return m.output(m.norm(h[:, -1:]))[:, -1].float()  # (B, V): only the next token's


_COMPILED: dict[str, Callable] = {}
COMPILE_BACKEND = "inductor"  # tests of the traced step's tokens use "aot_eager": seconds


def _compiled_run() -> Callable:
    """:func:`_run` compiled for static shapes, once per process and backend (the compiler
    keeps one graph per model, batch and cache length under its guards)."""
    if COMPILE_BACKEND not in _COMPILED:
        _COMPILED[COMPILE_BACKEND] = torch.compile(_run, dynamic=False,
                                                   backend=COMPILE_BACKEND)
    return _COMPILED[COMPILE_BACKEND]
