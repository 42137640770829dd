"""One ``shardwise generate`` run: load, generate, print as the tokens come, report the rate.

The command-line layer (shardwise/train/generate_cli.py) checks the arguments, tokenizes the
prompts and hands a :class:`GenerateRequest` to :func:`run_single` (one process) or to
:func:`decode_rank` on every tensor-parallel rank (local ranks it launched, or torchrun's).
Only rank 0 prints.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

import torch

from shardwise.inference.generate import Generation, generate
from shardwise.inference.sampling import Sampling

__all__ = ["GenerateRequest", "TextStream", "run_single", "decode_rank", "rate_line"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class GenerateRequest:
    """Everything a rank needs (picklable: it travels to spawned ranks).

    Attributes:
        checkpoint: a run directory, checkpoint folder or safetensors.
        prompts: token ids of each prompt.
        max_new_tokens: the most new tokens per row.
        sampling: greedy or seeded sampling.
        stop_tokens: ids that end a row.
        device: ``"cpu"`` or ``"cuda"`` (each rank takes ``cuda:LOCAL_RANK``).
        dtype: ``"fp32"`` or ``"bf16"``.
        threads: intra-op CPU threads per rank (None: torch's default).
        tokenizer: decodes ids to text for printing (None: print ids).
        tp: tensor-parallel degree (1: one process).
        model_source: at tp 1, a callable ``(request, device, dtype)`` returning a context
            manager that yields the model (weights streamed from disk, a low-bit store) and
            releases it on exit; None: the model is loaded whole.
    """

    checkpoint: str
    prompts: list[list[int]]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_tokens: tuple[int, ...] = ()
    device: str = "cpu"
    dtype: str = "fp32"
    threads: int | None = None
    tokenizer: Any = None
    tp: int = 1
    model_source: Callable | None = None


class TextStream:
    """Prints one row's new tokens as text as they come, never half a character.

    The ids decoded so far are decoded again after each token (a byte-level BPE or a byte
    tokenizer decodes a sequence to the concatenation of its tokens' bytes, invalid UTF-8 as
    U+FFFD); the text is printed up to a trailing U+FFFD, which may be the start of a
    character whose next bytes have not come yet. :meth:`close` prints the rest.

    Args:
        tokenizer: has ``decode(ids) -> str`` and ``vocab_size``; None: ids are printed.
        out: where to print.
    """

    def __init__(self, tokenizer: Any, out: TextIO) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.shown = ""

    def text(self, ids: list[int]) -> str:
        """``ids`` as text; ids the tokenizer does not know appear as ``<id N>``."""
        if self.tokenizer is None:
            return "".join(f" {i}" for i in ids)
        vocab, parts, run = self.tokenizer.vocab_size, [], []
        for i in ids:
            if 0 <= i < vocab:
                run.append(i)
                continue
            parts += [self.tokenizer.decode(run) if run else "", f"<id {i}>"]
            run = []
        parts.append(self.tokenizer.decode(run) if run else "")
        return "".join(parts)

    def add(self, token: int) -> None:
        self.ids.append(int(token))
        text = self.text(self.ids)
        ready = text.rstrip("\ufffd")
        if ready.startswith(self.shown) and len(ready) > len(self.shown):
            self.out.write(ready[len(self.shown):])
            self.out.flush()
            self.shown = ready

    def close(self) -> None:
        text = self.text(self.ids)
        rest = text[len(self.shown):] if text.startswith(self.shown) else ""
        self.out.write(rest + "\n")
        self.out.flush()
        self.shown = text


def rate_line(gen: Generation) -> str:
    """The closing line: prompt tokens, new tokens, prefill ms, decode tokens/s."""
    new = sum(len(row) for row in gen.tokens)
    return (f"prompt tokens {gen.prompt_tokens}, new tokens {new}, prefill "
            f"{gen.prefill_s * 1e3:.1f} ms, decode {gen.tokens_per_s:.1f} tokens/s")


def _generate_and_print(req: GenerateRequest, model: torch.nn.Module,
                        choose: Callable | None, main: bool) -> Generation:
    """Run :func:`generate`; on the main rank print the text (streamed for one prompt, each
    row at the end for several) and the rate line."""
    stream = sys.stdout
    live = TextStream(req.tokenizer, stream) if main and len(req.prompts) == 1 else None
    if live is not None:
        prompt = TextStream(req.tokenizer, stream).text(req.prompts[0])
        stream.write(prompt)
        stream.flush()
    on_tokens = (lambda step, toks: live.add(toks[0])) if live is not None else None
    gen = generate(model, req.prompts, max_new_tokens=req.max_new_tokens,
                   sampling=req.sampling, stop_tokens=req.stop_tokens, on_tokens=on_tokens,
                   choose=choose)
    if main:
        if live is not None:
            live.close()
        else:
            for i, (p, row) in enumerate(zip(req.prompts, gen.tokens)):
                t = TextStream(req.tokenizer, stream)
                stream.write(f"[{i}] {t.text(p)}{t.text(row)}\n")
        stream.write(rate_line(gen) + "\n")
        stream.flush()
    return gen


def _summary(gen: Generation) -> dict[str, Any]:
    return {"tokens": gen.tokens, "finished": gen.finished, "prefill_s": gen.prefill_s,
            "decode_s": gen.decode_s, "tokens_per_s": gen.tokens_per_s}


def run_single(req: GenerateRequest) -> dict[str, Any]:
    """Generate in this process (tp 1) and print; returns the tokens and timings."""
    from shardwise.inference.checkpoint import load_model

    if req.threads:
        torch.set_num_threads(req.threads)
    device = torch.device(req.device)
    if req.model_source is not None:
        with req.model_source(req, device, DTYPES[req.dtype]) as model:
            return _summary(_generate_and_print(req, model, None, True))
    loaded = load_model(req.checkpoint, device=device, dtype=DTYPES[req.dtype])
    return _summary(_generate_and_print(req, loaded.model, None, True))


def decode_rank(req: GenerateRequest) -> dict[str, Any] | None:
    """The entry point of one tensor-parallel rank (every rank of the job is one tensor
    rank): join the process group, load this rank's pieces, generate with rank 0's token
    choices ([Note: one token choice for all ranks] in tensor_parallel.py); rank 0 prints.

    Returns:
        Rank 0: the tokens and timings; other ranks: None.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.distributed.comm import objects as comm_objects
    from shardwise.distributed import env as dist_env
    from shardwise.inference.tensor_parallel import load_tp_model, rank0_tokens

    if req.threads:
        torch.set_num_threads(req.threads)
    env = dist_env.init(backend="nccl" if req.device == "cuda" else "gloo")
    try:
        if env.world_size != req.tp:
            raise ValueError(f"--tp {req.tp} but the job has {env.world_size} ranks "
                             f"(WORLD_SIZE); every rank is one tensor-parallel rank")
        mesh = init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("tp",))
        loaded = load_tp_model(req.checkpoint, mesh["tp"], device=env.device,
                               dtype=DTYPES[req.dtype])
        choose = rank0_tokens(mesh["tp"].get_group(), env.device)
        gen = _generate_and_print(req, loaded.model, choose, env.is_main)
        # Rank 0 is the source of the last broadcast and can be done first: without this
        # barrier it may tear its group down while a peer is still receiving from it.
        comm_objects.barrier(mesh["tp"].get_group(), label="decode.done")
        return _summary(gen) if env.is_main else None
    finally:
        dist_env.destroy()


def in_torchrun() -> bool:
    """This process is one rank of a torchrun / elastic job (RANK and WORLD_SIZE set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
