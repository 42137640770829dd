"""``shardwise generate``: text from a trained run, on one process or tensor-parallel ranks.

    shardwise generate --checkpoint runs/debug --prompt "def " --max-new-tokens 64
    shardwise generate --checkpoint runs/debug --prompt "def " --tp 2        # 2 local ranks
    torchrun --nproc_per_node 2 -m shardwise.train.cli generate --checkpoint runs/debug ...
    shardwise generate --checkpoint hf_folder --prompt-ids 1,2,3            # no tokenizer

Every check on the arguments runs here, before any rank exists (exit 2, one line naming the
value); the ranks get the prompts as token ids. Exit codes as ``shardwise train``'s.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardwise.inference.sampling import Sampling
from shardwise.inference.session import GenerateRequest, decode_rank, in_torchrun, run_single

__all__ = ["add_generate_parser", "run_generate", "request_from_args", "run_tokenizer"]

_DESCRIPTION = """\
Generate text after one or more prompts with a trained model: a run directory (its newest
intact checkpoint), a checkpoint folder, or Hugging Face safetensors. Prints the text as it
comes, then a line with the prompt tokens, new tokens, prefill time and decode tokens/s.
Greedy unless --temperature > 0. --tp N splits the model over N local ranks (each reads only
its rows of a checkpoint); under torchrun every rank of the job is one tensor rank."""


def add_generate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``generate`` subcommand on ``sub``."""
    p = sub.add_parser("generate", help="generate text with a trained model (KV cache, tp)",
                       description=_DESCRIPTION, allow_abbrev=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="run directory, checkpoint folder (step_N) or safetensors")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="prompt text (repeat for a batch)")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                   help="prompt as comma-separated token ids, e.g. 1,2,3 (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="most new tokens per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1.0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--stop", action="append", default=[], metavar="TOKEN",
                   help="stop token: an id or a text that is one token (repeatable; default "
                        "none)")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor-parallel degree: N local ranks (default 1; under torchrun "
                        "the job's size)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto (default): cuda when available")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads per rank (default: cores / ranks)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="weights and compute dtype (default fp32)")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="a tokenizer JSON (default: the run's, from its config.toml)")
    p.add_argument("--stream-weights", action="store_true",
                   help="keep the weights on disk and stream each block in as it runs")
    p.add_argument("--weights", default=None, choices=("int8", "int4"),
                   help="low-bit weight store (weight-only quantisation)")
    return p


def _config_toml(run_dir: Path | None):
    if run_dir is None or not (run_dir / "config.toml").exists():
        return None
    from shardwise.train.config import load_config

    return load_config(run_dir / "config.toml")


def _run_dir(asked: Path, checkpoint: Path) -> Path | None:
    """The run directory: the path asked for when it holds a config.toml (its checkpoints
    may lie in a ``[checkpoint] dir`` elsewhere), else the one above ``checkpoints/step_N``."""
    if (asked / "config.toml").exists():
        return asked
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None


def run_tokenizer(asked: Path, checkpoint: Path, given: str | None) -> Any:
    """The tokenizer of the run ``checkpoint`` belongs to: ``given`` (a saved tokenizer
    JSON), else the run's ``tokenizer.json``, else rebuilt from its config.toml's ``[data]``
    (byte; or bpe trained again on the same corpus, as the trainer did); None when there is
    no run (a bare checkpoint folder or safetensors).

    Args:
        asked: the ``--checkpoint`` path as given (a run directory, or a checkpoint).
        checkpoint: the checkpoint it resolved to.
        given: ``--tokenizer``, or None.

    Raises:
        ValueError: an unreadable tokenizer file, or bpe without the ``tokenizers`` package.
    """
    from shardwise.data import build_tokenizer, load_corpus, load_tokenizer

    if given is not None:
        return load_tokenizer(given)
    run = _run_dir(asked, checkpoint)
    if run is not None and (run / "tokenizer.json").exists():
        return load_tokenizer(run / "tokenizer.json")
    cfg = _config_toml(run)
    if cfg is None:
        return None
    d = cfg.data
    if d.tokenizer != "bpe":
        return build_tokenizer(d.tokenizer)
    try:  # the trainer keeps no tokenizer file: train it again, deterministically, as it did
        return build_tokenizer("bpe", vocab_size=d.bpe_vocab_size,
                               text=load_corpus(d.source, max_bytes=d.max_bytes))
    except ImportError:
        raise ValueError("the run's tokenizer is bpe, which needs the 'tokenizers' package; "
                         "run: pip install 'shardwise[bpe]'") from None


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: expected comma-separated ints, e.g. "
                         f"1,2,3") from None
    if not ids:
        raise ValueError(f"--prompt-ids {text!r} is empty: expected at least one id")
    return ids


def _prompts(args: argparse.Namespace, tokenizer: Any, where: Path) -> list[list[int]]:
    if not args.prompt and not args.prompt_ids:
        raise ValueError("no prompt: pass --prompt TEXT (or --prompt-ids 1,2,3)")
    rows = [_ids(t) for t in args.prompt_ids]
    if args.prompt and tokenizer is None:
        raise ValueError(f"--prompt needs a tokenizer and {where} belongs to no run with a "
                         f"config.toml; pass --tokenizer FILE or the ids with --prompt-ids "
                         f"1,2,3")
    for text in args.prompt:
        ids = tokenizer.encode(text).tolist()
        if not ids:
            raise ValueError(f"--prompt {text!r} is empty: expected at least one token")
        rows.append(ids)
    return rows


def _stop_ids(stops: list[str], tokenizer: Any) -> tuple[int, ...]:
    out = []
    for s in stops:
        if s.strip().lstrip("-").isdigit():
            out.append(int(s))
            continue
        ids = tokenizer.encode(s).tolist() if tokenizer is not None else []
        if len(ids) != 1:
            raise ValueError(f"--stop {s!r} is {len(ids)} tokens, expected one token (its "
                             f"text or its id)" if tokenizer is not None else
                             f"--stop {s!r}: no tokenizer to read text with; pass its id")
        out.append(ids[0])
    return tuple(out)


def _check_lengths(rows: list[list[int]], n: int, config) -> None:  # noqa: ANN001
    if n < 1:
        raise ValueError(f"--max-new-tokens {n}: expected an int >= 1")
    longest, limit = max(len(r) for r in rows), config.max_seq_len
    if longest + n - 1 > limit:
        raise ValueError(f"--max-new-tokens {n} is too large: the longest prompt ({longest} "
                         f"tokens) plus {n} new tokens needs {longest + n - 1} positions, over "
                         f"the model's max_seq_len={limit}; expected --max-new-tokens <= "
                         f"{max(limit - longest + 1, 0)}")
    bad = [(i, t) for i, r in enumerate(rows) for t in r if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"prompt {bad[0][0]} has token {bad[0][1]} outside the model's "
                         f"vocabulary [0, {config.vocab_size})")


def _degree(args: argparse.Namespace) -> int:
    if in_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.tp is not None and args.tp != world:
            raise ValueError(f"--tp {args.tp} but torchrun started {world} ranks; every rank "
                             f"is one tensor-parallel rank (omit --tp)")
        return world
    tp = 1 if args.tp is None else args.tp
    if tp < 1:
        raise ValueError(f"--tp {tp}: expected an int >= 1")
    return tp


def request_from_args(args: argparse.Namespace) -> GenerateRequest:
    """Check every argument and build the request the ranks run (no rank started yet).

    Raises:
        ValueError: a missing or damaged checkpoint (saying how to get one), a degree the
            model cannot be split by, prompts or --max-new-tokens that do not fit the model,
            bad sampling values or stop tokens.
    """
    import torch

    from shardwise.inference.checkpoint import read_model_config, resolve_checkpoint
    from shardwise.inference.tensor_parallel import check_tp_degree

    path = resolve_checkpoint(args.checkpoint)
    config = read_model_config(path)
    tp = _degree(args)
    check_tp_degree(config, tp)
    tokenizer = run_tokenizer(Path(args.checkpoint).expanduser(), path, args.tokenizer)
    rows = _prompts(args, tokenizer, path)
    _check_lengths(rows, args.max_new_tokens, config)
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed)
    stops = _stop_ids(args.stop, tokenizer)
    bad = [t for t in stops if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"--stop {bad[0]} is outside the model's vocabulary "
                         f"[0, {config.vocab_size})")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available on this machine; use cpu")
    if device == "cuda" and tp > torch.cuda.device_count() and not in_torchrun():
        raise ValueError(f"--tp {tp} on cuda needs {tp} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    threads = args.threads
    if threads is not None and threads < 1:
        raise ValueError(f"--threads {threads}: expected an int >= 1")
    if threads is None and tp > 1 and not in_torchrun():
        threads = max(1, (os.cpu_count() or 1) // tp)  # the ranks share this machine's cores
    return GenerateRequest(str(path), rows, args.max_new_tokens, sampling, stops, device,
                           args.dtype, threads, tokenizer, tp)


def run_generate(args: argparse.Namespace) -> int:
    """Carry out ``shardwise generate`` (see the module doc); returns the exit code."""
    from shardwise.train.launch import launch_local

    req = request_from_args(args)
    if args.stream_weights or args.weights:  # checked before any rank starts
        req.model_source = _weights_source(args, req)
    if req.tp == 1:  # also a torchrun job of one rank: no process group needed
        run_single(req)
    elif in_torchrun():
        decode_rank(req)
    else:
        launch_local(decode_rank, req.tp, args=(req,))
    return 0



@contextmanager
def _streamed(req: GenerateRequest, device, dtype, kind: str | None):  # noqa: ANN001
    """The model with its weights streamed from the checkpoint (``kind`` None) or from an
    int8 / int4 store written from it into a temporary folder first."""
    import torch

    from shardwise.inference.checkpoint import read_model_config
    from shardwise.inference.weights import quantize_checkpoint, stream_weights
    from shardwise.models import build_model

    model = build_model(read_model_config(req.checkpoint), device="meta").to(dtype)
    with tempfile.TemporaryDirectory(prefix="shardwise-weights-") as tmp:
        source = req.checkpoint
        if kind is not None:
            source = quantize_checkpoint(req.checkpoint, Path(tmp) / kind, kind=kind)
        with stream_weights(model, source, prefetch=1), torch.no_grad():
            yield model.eval()


def _weights_source(args: argparse.Namespace, req: GenerateRequest):
    """The ``model_source`` of ``--stream-weights`` / ``--weights`` (tp 1, CPU).

    Raises:
        ValueError: with --tp > 1 or a CUDA device (the stream's buffers are CPU memory and
            it reads whole tensors).
    """
    flag = "--stream-weights" if args.stream_weights else f"--weights {args.weights}"
    if req.tp > 1:
        raise ValueError(f"{flag} runs on one process; --tp {req.tp} reads each rank's rows "
                         f"itself: drop one of them")
    if req.device != "cpu":
        raise ValueError(f"{flag} streams into CPU memory; pass --device cpu")
    return functools.partial(_streamed, kind=args.weights)
