"""Numerics of the low-bit recipes on the models' own matmul shapes, against float64.

    python -m bench.lowbit_numerics            # writes bench/results/lowbit_numerics.{md,json}
    python -m bench.lowbit_numerics --quick    # 256 tokens, no timing, nothing written

For every recipe and every distinct linear of a ``small`` block (``wq``; ``wk``/``wv``;
``wo``; ``w1``/``w3``; ``w2``) at 4 x 512 tokens, and of a ``debug-moe`` expert
(``w1``/``w3``, ``w2``) at 256 tokens (its average load: 4 x 256 tokens, top-2 of 8
experts), one forward and backward of the low-bit linear (``lowbit_linear``, the emulated
kernel, bit for bit the CPU's where it has one) and the signal-to-quantisation-noise ratio
``10 log10(sum ref^2 / sum (out - ref)^2)`` of the output, the input gradient and the
weight gradient, the reference computed in float64 from the same fp32 operands.

Operands (fixed seed per layer; drawn in float64, rounded to fp32):

* block inputs (``wq``, ``wk``, ``wv``, ``w1``, ``w3``, expert ``w1``/``w3``): standard
  normal with 4 outlier channels 20x larger, the few massive channels LLM activations show
  (Dettmers et al., LLM.int8(); Sun et al., "Massive activations");
* ``wo``'s input (attention output): normal, half the scale, with the same outlier pattern;
* ``w2``'s input: ``silu(a) * b`` of two such activations, the gated product (heavy tails);
* weights: normal with the model's ``init_std`` 0.02;
* output gradients: normal times a per-token log-normal scale ``exp(N(0, 1))`` at 1e-4
  (gradients vary over tokens by orders of magnitude).

The timing table (``--timing``, on by default) says nothing about GPU speed: it compares the
CPU's ``torch._scaled_mm`` ("real") with the emulation for the recipes the CPU takes, and the
emulated recipes with the fp32 matmul, on one thread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models import build_model, get_model_config
from shardwise.models.experts import GroupedExperts
from shardwise.parallel.lowbit import (RECIPE_NAMES, LowBitState, get_recipe, lowbit_linear,
                                       set_kernel_policy)

__all__ = ["LAYERS", "QUANTITIES", "layer_shapes", "draw", "sqnr_db", "measure",
           "numerics", "torchao_section", "timing", "to_markdown", "main"]

QUANTITIES = ("output", "grad_input", "grad_weight")
TOKENS, EXPERT_TOKENS = 4 * 512, 256
OUTLIERS, OUTLIER_SCALE, GRAD_SCALE = 4, 20.0, 1e-4
# table column: (model, module names in one block that share it, input kind)
LAYERS = {"wq": ("small", ("attention.wq",), "block"),
          "wk/wv": ("small", ("attention.wk", "attention.wv"), "block"),
          "wo": ("small", ("attention.wo",), "attn"),
          "w1/w3": ("small", ("feed_forward.w1", "feed_forward.w3"), "block"),
          "w2": ("small", ("feed_forward.w2",), "gated"),
          "expert w1/w3": ("debug-moe", ("feed_forward.experts.w1", "feed_forward.experts.w3"),
                           "block"),
          "expert w2": ("debug-moe", ("feed_forward.experts.w2",), "gated")}
RESULTS = os.path.join(os.path.dirname(__file__), "results")


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of every linear of block 0 of ``model`` (built on the
    meta device), an expert's projections named ``feed_forward.experts.w1`` and so on."""
    with torch.device("meta"):
        net = build_model(get_model_config(model))
    shapes = {}
    for name, mod in net.layers[0].named_modules():
        if isinstance(mod, nn.Linear) and not name.endswith("router.gate"):
            shapes[name] = (mod.in_features, mod.out_features)
        elif isinstance(mod, GroupedExperts):
            _, dim, hidden = mod.w1.shape
            shapes.update({f"{name}.w1": (dim, hidden), f"{name}.w3": (dim, hidden),
                           f"{name}.w2": (hidden, dim)})
    return shapes


def _activation(m: int, k: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen, dtype=torch.float64) * scale
    channels = torch.randperm(k, generator=gen)[:OUTLIERS]
    x[:, channels] *= OUTLIER_SCALE
    return x


def draw(kind: str, m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """fp32 ``(x (m, k), weight (n, k), grad_out (m, n))`` of an input ``kind`` ("block",
    "attn" or "gated", the module docstring's distributions) with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "gated":
        x = F.silu(_activation(m, k, gen)) * _activation(m, k, gen)
    else:
        x = _activation(m, k, gen, 0.5 if kind == "attn" else 1.0)
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) * 0.02
    token_scale = torch.exp(torch.randn(m, 1, generator=gen, dtype=torch.float64))
    dy = torch.randn(m, n, generator=gen, dtype=torch.float64) * token_scale * GRAD_SCALE
    return x.float(), w.float(), dy.float()


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``10 log10(sum ref^2 / sum (out - ref)^2)`` in float64; inf when they are equal."""
    ref = ref.double()
    noise = (out.double() - ref).square().sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.square().sum().item() / noise)


def _run(recipe: str, x, w, dy):
    """Output, input gradient and weight gradient of one linear under ``recipe`` ("fp32" and
    "bf16": F.linear in that dtype)."""
    if recipe in ("fp32", "bf16"):
        dt = torch.float32 if recipe == "fp32" else torch.bfloat16
        xx, ww = x.detach().to(dt).requires_grad_(), w.detach().to(dt).requires_grad_()
        y = F.linear(xx, ww)
        y.backward(dy.to(dt))
    else:
        xx, ww = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = lowbit_linear(xx, ww, None, LowBitState(get_recipe(recipe), "bench"))
        y.backward(dy)
    return y.detach(), xx.grad, ww.grad


def _references(x, w, dy) -> tuple[torch.Tensor, ...]:
    xd, wd, dyd = x.double(), w.double(), dy.double()
    return xd @ wd.t(), dyd @ wd, dyd.t() @ xd


def _sqnrs(recipe: str, operands, refs, policy: str) -> dict[str, float]:
    old = set_kernel_policy(policy)
    try:
        outs = _run(recipe, *operands)
    finally:
        set_kernel_policy(old)
    return {q: sqnr_db(o, r) for q, o, r in zip(QUANTITIES, outs, refs)}


def measure(recipe: str, kind: str, m: int, k: int, n: int, seed: int,
            policy: str = "emulated") -> dict[str, float]:
    """SQNR (dB) of the output and both gradients of one ``(m, k) x (n, k)^T`` linear."""
    operands = draw(kind, m, k, n, seed)
    return _sqnrs(recipe, operands, _references(*operands), policy)


def numerics(recipes=("fp32", "bf16") + RECIPE_NAMES, layers=tuple(LAYERS),
             tokens: int = TOKENS, expert_tokens: int = EXPERT_TOKENS) -> dict:
    """``{recipe: {layer: {quantity: dB}}}`` over the table's layers (seed = column index;
    operands and float64 references drawn once per layer)."""
    shapes = {model: layer_shapes(model) for model in {LAYERS[c][0] for c in layers}}
    out = {r: {} for r in recipes}
    for col in layers:
        model, names, kind = LAYERS[col]
        k, n = shapes[model][names[0]]
        m = expert_tokens if "experts" in names[0] else tokens
        operands = draw(kind, m, k, n, seed=list(LAYERS).index(col))
        refs = _references(*operands)
        for recipe in recipes:
            out[recipe][col] = _sqnrs(recipe, operands, refs, "emulated")
    return out


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timing(reps: int = 5) -> dict:
    """CPU milliseconds of one linear's forward + backward, one thread: real vs emulated
    kernels at 256 x 512 -> 512 (the CPU's e4m3 x e4m3 tensorwise kernel is a reference
    loop), every recipe emulated at the ``w1`` shape (4 x 512 tokens, 512 -> 1536)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = {"real_vs_emulated": {"shape": [256, 512, 512], "ms": {}},
               "emulated": {"shape": [TOKENS, 512, 1536], "ms": {}}}
        for key, (m, k, n), recipes in (
                ("real_vs_emulated", (256, 512, 512),
                 ("fp32", "fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp")),
                ("emulated", (TOKENS, 512, 1536), ("fp32",) + RECIPE_NAMES)):
            x, w, dy = draw("block", m, k, n, seed=0)
            policies = ("real", "emulated") if key == "real_vs_emulated" else ("emulated",)
            for recipe in recipes:
                row = res[key]["ms"][recipe] = {}
                for policy in policies if recipe != "fp32" else ("emulated",):
                    old = set_kernel_policy(policy)
                    try:
                        row[policy] = _median_ms(
                            lambda r=recipe, ops=(x, w, dy): _run(r, *ops), reps)
                    finally:
                        set_kernel_policy(old)
        return res
    finally:
        torch.set_num_threads(threads)


READING = [
    "Reading the tables: every fp8 recipe keeps about 28.5 dB (4.7 bits) where its casts are "
    "e4m3, whatever the outlier channels do to the scale: a floating-point code's relative "
    "error does not grow as a tile's scale is set by a larger element, until values reach "
    "e4m3's subnormals 2^15 below the amax. fp8_tensorwise's gradients are e5m2 (one "
    "mantissa bit fewer, about 4 dB lower). fp8_blockwise gains about 2 dB in the forward: "
    "its fp32 multipliers map each 128-element tile's amax exactly onto 448. mxfp8 loses 1-2.5 "
    "dB to rowwise: its e8m0 scales round down to a power of two (OCP's rule, torchao's "
    "FLOOR), so a tile's amax lands in [256, 512) and what lands above 448 saturates. "
    "fp8_rowwise_gw_hp's weight gradient is the fp32 matmul's. nvfp4 keeps about 17.5 dB "
    "(2.9 bits), 11 dB under fp8; bf16 about 50.8 dB.", ""]


def _fmt(v: float) -> str:
    return "exact" if math.isinf(v) else f"{v:.2f}"


def to_markdown(saved: dict) -> str:
    """The committed table: one block per quantity, then the CPU timing table."""
    num, meta = saved["numerics"], saved["meta"]
    cols = list(next(iter(num.values())))
    lines = ["# Low-bit recipes: signal-to-quantisation noise against float64", "",
             "Regenerate: `python -m bench.lowbit_numerics` (writes this file and "
             "`lowbit_numerics.json`).", "",
             f"torch {meta['torch']}, {meta['machine']}; one forward and backward of "
             "`lowbit_linear` per cell, emulated kernel (bit for bit the CPU's rowwise "
             "kernel; the tensorwise kernel within fp32 accumulation order); `small` layers "
             f"at {meta['tokens']} tokens, `debug-moe` experts at {meta['expert_tokens']}; "
             "inputs and gradients drawn as bench/lowbit_numerics.py's docstring says (4 "
             "outlier channels at 20x, gated products, log-normal per-token gradient "
             "scales). SQNR in dB, higher is better; each 6.02 dB is one bit. fp32 is "
             "`F.linear` in fp32, bf16 `F.linear` with bf16 operands and output.", ""]
    for q in QUANTITIES:
        lines += [f"## {q.replace('_', ' ')}", "",
                  "| recipe | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        lines += [f"| {r} | " + " | ".join(_fmt(num[r][c][q]) for c in cols) + " |"
                  for r in num]
        lines.append("")
    lines += READING
    if "torchao" in saved:
        lines += _torchao_markdown(saved["torchao"])
    if "timing" in saved:
        lines += _timing_markdown(saved["timing"])
    return "\n".join(lines)


def torchao_section(m: int = 256) -> dict:
    """bench/lowbit_torchao.py's comparisons on the ``w1`` operands at ``m`` tokens."""
    from bench import lowbit_torchao as tao

    x, w, dy = draw("block", m, 512, 1536, seed=list(LAYERS).index("w1/w3"))
    gen = torch.Generator().manual_seed(0)  # tokens 2^0 .. 2^-20 apart: some tiles floor
    wide = x * torch.exp2(-20 * torch.rand(m, 1, generator=gen))
    return {"shape": [m, 512, 1536], "fp8": tao.fp8_comparison(x, w, dy),
            "mxfp8": tao.mx_comparison(x, w, dy),
            "nvfp4": {n: tao.nvfp4_comparison(t) for n, t in (("x", x), ("w", w), ("dy", dy),
                                                                 ("x, tokens 2^20 apart", wide))},
            "fp8_blockwise": tao.BLOCKWISE_WHY}


def _cell(res: dict, q: str) -> str:
    v = res[q]
    if v == "bitwise":
        return v
    bound = "bf16 bound" if res["bound"] == "bf16 rounding" else "bound"
    return f"{v}, {res[q + '_of_bound']:.3f} of {bound}"


def _torchao_markdown(t: dict) -> list[str]:
    m, k, n = t["shape"]
    lines = ["## Against torchao 0.18 (same inputs)", "",
             f"The `w1/w3` operands at {m} x {k} -> {n}. \"of bound\": the largest difference "
             "as a fraction of the fp32 accumulation bound `(2K + 8) u (|A| @ |B|^T)` "
             "([Note: accumulation bound] in bench/lowbit_torchao.py); \"bf16 bound\": that plus "
             "one bf16 rounding of the result, `2^-8 |out|`, for torchao's real rowwise path, "
             "which rounds an fp32 model's matmul results to bf16 (its workaround for "
             "`torch._scaled_mm`'s rowwise fp32 output); \"rel\": relative to the largest "
             "magnitude.", "",
             "| recipe | torchao vs ours | output | grad input | grad weight |",
             "|---|---|---|---|---|"]
    for recipe, rows in t["fp8"].items():
        lines += [f"| {recipe} | {key} | " + " | ".join(_cell(res, q) for q in QUANTITIES)
                  + " |" for key, res in rows.items()]
    lines.append("| mxfp8 | torchao MX (emulated) vs ours emulated | "
                 + " | ".join(_cell(t["mxfp8"], q) for q in QUANTITIES) + " |")
    lines += ["", "NVFP4 codes against torchao's `nvfp4_quantize` (two-level, per-tensor "
              "scale): " + "; ".join(
                  f"{name}: {r['codes_differ']} of {r['elements']} differ"
                  + (f" ({r['floored_elements']} elements in tiles whose scale torchao floors "
                     "at e4m3's smallest normal, 2^-6, where ours takes a subnormal e4m3 "
                     "scale; " + ("all" if r["all_differences_in_floored_tiles"] else "not all")
                     + " differences there)" if r["codes_differ"] else "")
                  for name, r in t["nvfp4"].items()) + ".", "",
              "fp8_blockwise: " + t["fp8_blockwise"], ""]
    return lines


def _timing_markdown(t: dict) -> list[str]:
    rv, em = t["real_vs_emulated"]["ms"], t["emulated"]["ms"]
    fp32_rv, fp32_em = rv["fp32"]["emulated"], em["fp32"]["emulated"]
    m, k, n = t["real_vs_emulated"]["shape"]
    lines = ["## CPU timing (CPU: measures nothing about GPU speed)", "",
             f"Forward + backward of one linear, median ms, one thread. Real vs emulated "
             f"kernels at {m} x {k} -> {n} (fp32 `F.linear`: {fp32_rv:.2f} ms):", "",
             "| recipe | real `torch._scaled_mm` ms | emulated ms | real / emulated |",
             "|---|---|---|---|"]
    for r, row in rv.items():
        if r != "fp32":
            lines.append(f"| {r} | {row['real']:.2f} | {row['emulated']:.2f} | "
                         f"{row['real'] / row['emulated']:.1f}x |")
    m, k, n = t["emulated"]["shape"]
    lines += ["", f"Every recipe emulated at {m} x {k} -> {n} (fp32 `F.linear`: "
              f"{fp32_em:.1f} ms):", "", "| recipe | emulated ms | vs fp32 |", "|---|---|---|"]
    lines += [f"| {r} | {row['emulated']:.1f} | {row['emulated'] / fp32_em:.2f}x |"
              for r, row in em.items() if r != "fp32"]
    return lines + [""]


def _torchao_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("torchao")
    except Exception:  # noqa: BLE001 - the optional extra is absent
        return None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 tokens, no timing, no files")
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args(argv)
    tokens = 256 if args.quick else TOKENS
    saved = {"meta": {"torch": torch.__version__, "torchao": _torchao_version(),
                      "machine": platform.machine(), "load_1min": os.getloadavg()[0],
                      "tokens": tokens, "expert_tokens": EXPERT_TOKENS,
                      "command": "python -m bench.lowbit_numerics"},
             "numerics": numerics(tokens=tokens)}
    if not args.quick:
        saved["torchao"] = torchao_section()
    if not (args.quick or args.no_timing):
        saved["timing"] = timing()
    md = to_markdown(saved)
    print(md)
    if not args.quick:
        with open(os.path.join(RESULTS, "lowbit_numerics.json"), "w") as f:
            json.dump(saved, f, indent=1, default=str)
        with open(os.path.join(RESULTS, "lowbit_numerics.md"), "w") as f:
            f.write(md)
    return saved


if __name__ == "__main__":
    main()
