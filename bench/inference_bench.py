"""Decode speed of ``shardwise.inference.generate`` against transformers' ``generate`` on the
same Llama, side by side in one run (issue 35).

    python bench/inference_bench.py                      # sizes 10m,100m,400m; batch 1 and 8
    python bench/inference_bench.py --sizes 10m --rounds 7 --dtype bf16 --out bench/results/x

Per size: a transformers ``LlamaForCausalLM`` is built from a config (random weights, no
download), saved with ``save_pretrained`` and imported into a shardwise ``Transformer`` with
the existing path (``config_from_hf`` + ``import_safetensors``). Both must give the same
greedy tokens. Then, per batch size and round, each of three runs once, in an order that
rotates every round: ours, transformers with a static cache (``cache_implementation=
"static"``, preallocated like ours) and with its default dynamic cache. Same prompts (no
padding), threads, dtype, greedy, exactly ``new`` tokens per row.

[Note: counting decode tokens the same way]
The prefill (the prompt's forward and the first new token) is excluded for both: ours
reports it (``Generation.prefill_s`` ends when the first tokens are picked,
``decode_s`` runs from there to the end); for transformers a streamer timestamps its first
``put`` of new tokens (also right after the first tokens are picked) and the decode ends
when ``generate`` returns. Decode tokens/s = ``batch * (new - 1) / decode seconds`` for both.
Process CPU seconds cover the whole call (prefill included), as ``time.process_time``.

``--compile`` adds a fourth peer, ours with ``generate(..., compile=True)`` (a static-shape
decode step through inductor; its compile is in the untimed warm-up run), whose ratio is
against our eager run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardwise.inference import generate  # noqa: E402

# hidden, layers, heads, kv heads, ffn, vocab: ~9M, ~124M, ~345M parameters
SIZES = {
    "tiny": (64, 2, 4, 2, 128, 101),
    "10m": (256, 6, 8, 4, 768, 8000),
    "100m": (768, 12, 12, 4, 2048, 32000),
    "400m": (1024, 24, 16, 8, 2816, 32000),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PEERS = ("shardwise", "hf_static", "hf_dynamic")
COMPILED = "shardwise_compiled"  # --compile: generate(..., compile=True), inductor on CPU


def hf_config(size: str, max_len: int):
    """A transformers ``LlamaConfig`` of one of :data:`SIZES`."""
    import transformers
    hidden, layers, heads, kv, ffn, vocab = SIZES[size]
    return transformers.LlamaConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
        max_position_embeddings=max_len, rms_norm_eps=1e-5, tie_word_embeddings=False)


def build_pair(size: str, dtype: torch.dtype, max_len: int, seed: int = 0):
    """(transformers model, shardwise model with its weights), both in ``dtype``, eval."""
    import transformers

    from shardwise.checkpoint.export import import_safetensors
    from shardwise.checkpoint.hf import config_from_hf
    from shardwise.models import build_model

    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(hf_config(size, max_len)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = build_model(config_from_hf(hf.config.to_dict()), seed=0)
        import_safetensors(tmp, ours)
    return hf.to(dtype), ours.to(dtype).eval()


class _FirstToken:
    """A transformers streamer that notes when the first new tokens are handed out."""

    def __init__(self) -> None:
        self.puts = 0
        self.at: float | None = None
        self.cpu_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.at, self.cpu_at = time.perf_counter(), time.process_time()

    def end(self) -> None:
        pass


def run_hf(hf, prompts: torch.Tensor, new: int, static: bool) -> dict:
    """One transformers ``generate``: its tokens, decode seconds and process CPU seconds."""
    timer = _FirstToken()
    extra = {"cache_implementation": "static"} if static else {}
    cpu0 = time.process_time()
    with torch.inference_mode():
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=0,
                          streamer=timer, **extra)
    end, cpu1 = time.perf_counter(), time.process_time()
    return {"tokens": out[:, prompts.shape[1]:].tolist(), "decode_s": end - timer.at,
            "cpu_s": cpu1 - cpu0, "decode_cpu_s": cpu1 - timer.cpu_at}


def run_ours(model, prompts: torch.Tensor, new: int, compile: bool = False) -> dict:
    """One shardwise ``generate``: its tokens, decode seconds and process CPU seconds."""
    cpu0, first = time.process_time(), []
    out = generate(model, prompts.tolist(), max_new_tokens=new, compile=compile,
                   on_tokens=lambda step, _: first.append(time.process_time()) if step == 0
                   else None)  # CPU clock at the first new tokens, as the streamer's
    cpu1 = time.process_time()
    return {"tokens": out.tokens, "decode_s": out.decode_s, "cpu_s": cpu1 - cpu0,
            "decode_cpu_s": cpu1 - first[0]}


def one(peer: str, models, prompts: torch.Tensor, new: int) -> dict:
    hf, ours = models
    if peer in ("shardwise", COMPILED):
        return run_ours(ours, prompts, new, compile=peer == COMPILED)
    return run_hf(hf, prompts, new, static=peer == "hf_static")


def bench_case(models, batch: int, prompt_len: int, new: int, rounds: int,
               vocab: int, peers: tuple[str, ...] = PEERS) -> dict:
    """``rounds`` rounds of every peer at one batch size; tokens/s and CPU per round."""
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(1, vocab, (batch, prompt_len), generator=g)
    first = {p: one(p, models, prompts, new) for p in peers}  # warm-up (compile), the tokens
    same = {p: first[p]["tokens"] == first["shardwise"]["tokens"] for p in peers[1:]}
    per = {p: {"tok_s": [], "cpu_s": [], "decode_s": [], "tok_cpu_s": []} for p in peers}
    for r in range(rounds):
        k = r % len(peers)
        order = peers[k:] + peers[:k]  # who goes first rotates
        for p in order:
            got = one(p, models, prompts, new)
            per[p]["decode_s"].append(got["decode_s"])
            per[p]["tok_s"].append(batch * (new - 1) / got["decode_s"])
            per[p]["cpu_s"].append(got["cpu_s"])
            per[p]["tok_cpu_s"].append(batch * (new - 1) / got["decode_cpu_s"])
    return {"batch": batch, "prompt_len": prompt_len, "new": new, "same_tokens": same,
            "per_round": per, "ratio": _ratios(per, "tok_s"),
            "ratio_cpu": _ratios(per, "tok_cpu_s")}


def _ratios(per: dict, key: str) -> dict[str, list[float]]:
    """Ours / each peer per round (the compiled peer: compiled / our eager)."""
    ours = per["shardwise"][key]
    ratios = {p: [a / b for a, b in zip(ours, per[p][key])]
              for p in per if p not in ("shardwise", COMPILED)}
    if COMPILED in per:
        ratios[COMPILED] = [a / b for a, b in zip(per[COMPILED][key], ours)]
    return ratios


def verdict(ratios: list[float]) -> str:
    """ours / theirs tokens/s per round -> the issue's target "at least as fast in every
    round"."""
    if not ratios:
        return "not settled (no rounds)"
    if min(ratios) >= 1.0:
        return "met in every round"
    if max(ratios) < 1.0:
        return "not met"
    return "not settled (the range straddles 1.0)"


def _fmt(xs: list[float], nd: int = 1) -> str:
    return " ".join(f"{x:.{nd}f}" for x in xs)


def _ratio_cell(ratio: list[float] | None) -> str:
    return f"{_fmt(ratio, 2)} ({min(ratio):.2f}-{max(ratio):.2f})" if ratio else "-"


def to_markdown(record: dict) -> str:
    """The record as the tables of bench/results/inference_bench.md: decode tokens per
    wall-clock second, then per process-CPU second (less moved by other processes)."""
    m = record["meta"]
    head = (f"{m['dtype']}, {m['threads']} thread(s), prompt {m['prompt_len']}, {m['new']} new "
            f"tokens per row, {m['rounds']} rounds")
    out = []
    for key, ratio_key, what in (("tok_s", "ratio", "decode tokens / wall second"),
                                 ("tok_cpu_s", "ratio_cpu", "decode tokens / CPU second")):
        out += [f"#### {what}: {head}", "",
                f"| size | params | batch | peer | same tokens | {what}, per round | "
                "ours / peer per round (compiled row: compiled / eager) | CPU s per call "
                "(median) | verdict |", "|---|---|---|---|---|---|---|---|---|"]
        for size, case in record["sizes"].items():
            for row in case["batches"]:
                per = row["per_round"]
                for p in per:
                    ratio = row[ratio_key].get(p)
                    cpu = sorted(per[p]["cpu_s"])[len(per[p]["cpu_s"]) // 2]
                    out.append(f"| {size} | {case['params'] / 1e6:.0f}M | {row['batch']} | {p} "
                               f"| {row['same_tokens'].get(p, '-')} | {_fmt(per[p][key])} | "
                               f"{_ratio_cell(ratio)} | {cpu:.2f} | "
                               f"{verdict(ratio) if ratio else '-'} |")
        out.append("")
    return "\n".join(out)


def _meta(args) -> dict:
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    import transformers
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "cores": os.cpu_count(), "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "dtype": args.dtype,
            "prompt_len": args.prompt_len, "new": args.new, "rounds": args.rounds,
            "compile": args.compile,
            "load_at_start": list(os.getloadavg())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10m,100m,400m", help=f"of {sorted(SIZES)}")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=64, help="new tokens per row")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--compile", action="store_true",
                   help=f"add {COMPILED}: generate(..., compile=True)")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    bad = [s for s in args.sizes.split(",") if s not in SIZES]
    if bad:
        p.error(f"--sizes: {bad[0]!r} is not one of {sorted(SIZES)}")
    return args


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    record = {"meta": _meta(args), "sizes": {}}
    max_len = args.prompt_len + args.new
    for size in args.sizes.split(","):
        models = build_pair(size, DTYPES[args.dtype], max_len)
        case = {"params": sum(p.numel() for p in models[1].parameters()), "batches": []}
        for batch in (int(b) for b in args.batches.split(",")):
            peers = PEERS + ((COMPILED,) if args.compile else ())
            row = bench_case(models, batch, args.prompt_len, args.new, args.rounds,
                             SIZES[size][5], peers)
            case["batches"].append(row)
            for p in peers:
                print(f"{size} b{batch} {p:<10} tok/s {_fmt(row['per_round'][p]['tok_s'])}"
                      f"  same={row['same_tokens'].get(p, '-')}", flush=True)
        record["sizes"][size] = case
        del models
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = run(args)
    md = to_markdown(record)
    print(md)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(record, indent=1))
        Path(args.out + ".md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
