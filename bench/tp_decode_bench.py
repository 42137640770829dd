"""Decode tokens/s of tensor-parallel decoding on this machine: tp 1 against tp 2, fp32.

    python bench/tp_decode_bench.py                                  # dims 256..2048, 3 rounds
    python bench/tp_decode_bench.py --dims 256,1024 --rounds 2 --new-tokens 16

Same total cores for both: tp 1 is one process with 2 intra-op threads, tp 2 is two Gloo
ranks with 1 thread each (``shardwise.testing.run_ranks``; no collective watchdog). A third
configuration, tp 1 on 1 thread, is the control: on a machine whose cores other jobs use,
a second intra-op thread waits for a busy core at every parallel region and can make tp 1
x 2 threads slower than 1 thread, which is then no fault of tensor parallelism. Each
size is a shardwise Llama of ``--layers`` blocks, ``dim / 64`` heads (half as many KV heads)
and a vocabulary of 4096, randomly initialised (the weights do not change the work). In
every round both configurations run side by side for every size, in alternating order; a
launch builds the model (split by ``apply_tp`` at tp 2), warms up with a short generation,
then times ``generate`` (greedy, rank 0's tokens broadcast every step, as ``shardwise
generate --tp``) at batch 1 and batch 8 after a 16-token prompt. Reported per
configuration: the median decode tokens/s over the rounds (all rows' new tokens per second
of decode) and the range of the rounds, the speed-up of tp 2 and whether both produced the
same tokens; and the median time of one all-reduce of a decode step's activation
``(B, 1, dim)`` between the two ranks, timed alone (a decode step issues ``2 x layers + 2``
all-reduces: one after each block's ``wo`` and ``w2``, one after the vocab-parallel
embedding, one all-gather of the logits; plus the broadcast of rank 0's tokens).

Writes ``bench/results/tp_decode.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # run as a script: the ranks import this module as bench.*
    sys.path.insert(0, ROOT)
RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = 16


def _model(dim: int, layers: int):
    from shardwise.models import build_model, get_model_config

    heads = max(dim // 64, 2)
    cfg = get_model_config("debug", dim=dim, n_layers=layers, n_heads=heads,
                           n_kv_heads=max(heads // 2, 1), vocab_size=4096, max_seq_len=512)
    return build_model(cfg, seed=0).eval()


def _decode(dim: int, layers: int, batches: list[int], new_tokens: int) -> dict:
    """One launch (tp = world size): tokens/s and tokens per batch size (rank 0's)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.inference import generate
    from shardwise.inference.tensor_parallel import parallelize_for_decode, rank0_tokens

    world = dist.get_world_size()
    model, choose = _model(dim, layers), None
    if world > 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))["tp"]
        parallelize_for_decode(model, mesh)
        choose = rank0_tokens(mesh.get_group(), "cpu")
    gen = torch.Generator().manual_seed(1)
    out = {}
    for b in batches:
        prompts = torch.randint(0, 4096, (b, PROMPT), generator=gen).tolist()
        generate(model, prompts, max_new_tokens=4, choose=choose)  # warm-up
        g = generate(model, prompts, max_new_tokens=new_tokens, choose=choose)
        out[b] = {"tokens_per_s": g.tokens_per_s, "tokens": g.tokens,
                  "prefill_ms": g.prefill_s * 1e3}
        if world > 1:  # what one of the decode step's all-reduces costs alone
            x = torch.zeros(b, 1, dim)
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                dist.all_reduce(x, group=mesh.get_group())
                times.append(time.perf_counter() - t0)
            out[b]["all_reduce_us"] = statistics.median(times) * 1e6
    return out


CONFIGS = ((1, 2), (2, 1), (1, 1))
"""(tp, threads per rank): tp 1 and tp 2 on the same 2 cores, and tp 1 on one thread, the
control that shows what a second thread is worth while other jobs share the cores."""


def _launch(tp: int, threads: int, dim: int, args) -> dict:
    from bench.tp_decode_bench import _decode  # picklable by name (not __main__'s)
    from shardwise.testing import run_ranks

    return run_ranks(_decode, tp, args=(dim, args.layers, args.batches, args.new_tokens),
                     threads=threads, timeout_s=900)[0]


def _cell(rates: list[float]) -> str:
    return f"{statistics.median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f})"


def _table(dims: list[int], batches: list[int], runs: dict) -> list[str]:
    lines = ["| dim | params | batch | tp 1 x 2 threads | tp 2 x 1 thread | tp 2 / tp 1 | "
             "control: tp 1 x 1 thread | tp 2 all-reduce (us) | same tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for dim in dims:
        for b in batches:
            rates = {c: [r[b]["tokens_per_s"] for r in runs[(*c, dim)]] for c in CONFIGS}
            ratio = statistics.median(rates[(2, 1)]) / statistics.median(rates[(1, 2)])
            ref = runs[(1, 2, dim)]
            same = all(a[b]["tokens"] == c[b]["tokens"] for cfg in CONFIGS[1:]
                       for a, c in zip(ref, runs[(*cfg, dim)]))
            params = runs[("params", dim)]
            ar = [r[b]["all_reduce_us"] for r in runs[(2, 1, dim)]]
            lines.append(f"| {dim} | {params / 1e6:.1f}M | {b} | {_cell(rates[(1, 2)])} | "
                         f"{_cell(rates[(2, 1)])} | {ratio:.2f} | {_cell(rates[(1, 1)])} | "
                         f"{_cell(ar)} | {'yes' if same else 'no'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", default="256,512,1024,2048")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    dims = [int(d) for d in args.dims.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    runs: dict = {}
    t0 = time.time()
    for r in range(args.rounds):
        for i, dim in enumerate(dims):
            order = CONFIGS if (r + i) % 2 == 0 else CONFIGS[::-1]
            for tp, threads in order:
                got = _launch(tp, threads, dim, args)
                runs.setdefault((tp, threads, dim), []).append(got)
                print(f"round {r} dim {dim} tp {tp} x {threads} threads: "
                      + ", ".join(f"b{b} {v['tokens_per_s']:.1f} tok/s" for b, v in got.items()),
                      flush=True)
            if r == 0:
                runs[("params", dim)] = sum(p.numel() for p in _model(dim, args.layers)
                                            .parameters())
    command = "python bench/tp_decode_bench.py " + " ".join(argv if argv is not None
                                                             else sys.argv[1:])
    lines = ["# Tensor-parallel decode on this machine: tp 1 vs tp 2 (fp32, CPU)", "",
             f"Command: `{command.strip()}` ({time.time() - t0:.0f} s, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).", "",
             f"Machine: {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} default threads, torch {torch.__version__}; "
             f"tp 1 = one process x 2 threads, tp 2 = two Gloo ranks x 1 thread (same 2 "
             f"cores); control: tp 1 x 1 thread. Model: {args.layers} blocks, dim / 64 heads, "
             f"half as many KV heads, vocab 4096; prompt {PROMPT} tokens, "
             f"{args.new_tokens} new tokens per row, "
             f"greedy, rank 0's tokens broadcast every step. Median of {args.rounds} rounds "
             f"(range of the rounds in brackets).", ""]
    lines += _table(dims, args.batches, runs)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tp_decode.md").write_text("\n".join(lines) + "\n")
    raw = {"-".join(map(str, k)): v for k, v in runs.items()}
    for rounds in raw.values():  # the tokens were compared above; the rates stay
        for r in rounds if isinstance(rounds, list) else ():
            for per_batch in r.values():
                per_batch.pop("tokens", None)
    (RESULTS / "tp_decode.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
