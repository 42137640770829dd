"""``generate``: prompts in, new tokens out, with a KV cache, padding, sampling and stop tokens.

    from shardwise.inference import generate, Sampling
    out = generate(model, [[1, 72, 105], [1, 87]], max_new_tokens=32,
                   sampling=Sampling(temperature=0.8, top_p=0.9, seed=0), stop_tokens=[2])
    out.tokens          # the new tokens of each row (a stop token included, then nothing)
    out.tokens_per_s    # decode throughput: new tokens of all rows / decode seconds
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from shardwise.inference.decoder import Decoder
from shardwise.inference.sampling import Sampler, Sampling

__all__ = ["Generation", "generate"]


@dataclass
class Generation:
    """What :func:`generate` produced.

    Attributes:
        tokens: the new tokens of each row, up to and including its stop token.
        finished: per row, ``"stop"`` (a stop token came) or ``"length"`` (max_new_tokens).
        prefill_s: seconds of the prompts' forward (to the first new token).
        decode_s: seconds of the forwards after it.
        steps: decode forwards run (new tokens per row, after the first).
    """

    tokens: list[list[int]]
    finished: list[str]
    prefill_s: float
    decode_s: float
    steps: int
    prompt_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens the decode forwards produced, all rows, per second."""
        return self.steps * len(self.tokens) / self.decode_s if self.decode_s > 0 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # timings of queued kernels would be launch times
        torch.cuda.synchronize(device)


def generate(model: nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: Sampling | None = None, stop_tokens: Sequence[int] = (),
             pad_id: int = 0, on_tokens: Callable[[int, list[int]], None] | None = None,
             choose: Callable[[torch.Tensor], torch.Tensor] | None = None,
             compile: bool = False) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    Args:
        model: a built-in decoder (see :class:`~shardwise.inference.decoder.Decoder`), e.g.
            from :func:`shardwise.inference.load_model`, tensor-parallel or streamed.
        prompts: token lists, of different lengths if need be.
        max_new_tokens: the most new tokens per row.
        sampling: greedy (default) or seeded sampling.
        stop_tokens: a row stops after producing one of these; generation ends when every
            row has stopped.
        pad_id: the padding token of shorter prompts (never attended to).
        on_tokens: called after every forward with ``(step, tokens)``: the new token of each
            row (rows that stopped repeat their stop token), for printing as they come.
        choose: turns the ``(B,)`` tokens picked on this process into the ones every
            process uses (tensor-parallel ranks: rank 0's, broadcast); default: as picked.
        compile: ``torch.compile`` the decode step (:class:`Decoder`'s ``compile``): the
            same tokens; the first call for a batch / length pays the compile.

    Returns:
        A :class:`Generation`.

    Raises:
        ValueError: bad prompts, ``max_new_tokens``, stop tokens, or a model that is not a
            built-in decoder.
    """
    dec = Decoder(model, compile=compile)
    stops = {int(t) for t in stop_tokens}
    bad = [t for t in stops if not 0 <= t < dec.vocab_size]
    if bad:
        raise ValueError(f"stop token {bad[0]} is outside the vocabulary [0, {dec.vocab_size})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}, expected an int >= 1")
    longest = max((len(p) for p in prompts), default=0)
    if longest + max_new_tokens - 1 > dec.max_seq_len:  # the last new token is not fed back
        raise ValueError(f"the longest prompt ({longest} tokens) plus max_new_tokens="
                         f"{max_new_tokens} needs {longest + max_new_tokens - 1} positions "
                         f"(the last new token is not run), over the model's max_seq_len="
                         f"{dec.max_seq_len}")
    sampler = Sampler(sampling or Sampling(), dec.device)
    t0 = time.perf_counter()
    logits = dec.prefill(prompts, max_new_tokens - 1, pad_id=pad_id)
    b = logits.shape[0]
    out: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    prefill_s = decode_s = 0.0
    for step in range(max_new_tokens):
        tokens = sampler(logits)  # (B,)
        if choose is not None:
            tokens = choose(tokens)
        picked = tokens.tolist()  # one host read per step: the tokens are printed anyway
        # The stop bookkeeping stays on the host, in the list just read: no small device ops
        # per step, and a new tokens tensor only when a stopped row's token must be replaced.
        held = False
        for i, row in enumerate(out):
            if done[i]:  # a row that stopped repeats its stop token
                held |= picked[i] != row[-1]
                picked[i] = row[-1]
            else:
                row.append(picked[i])
                done[i] = picked[i] in stops
        if held:
            tokens = torch.tensor(picked, dtype=torch.int64, device=dec.device)
        if on_tokens is not None:
            on_tokens(step, picked)
        if step == 0:
            _sync(dec.device)
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
        if step == max_new_tokens - 1 or all(done):
            break
        logits = dec.step(tokens)
    _sync(dec.device)
    if step > 0:
        decode_s = time.perf_counter() - t0
    finished = ["stop" if row and row[-1] in stops else "length" for row in out]
    return Generation(out, finished, prefill_s, decode_s, step,
                      prompt_tokens=sum(dec.lengths))
