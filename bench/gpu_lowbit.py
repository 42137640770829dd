"""The low-bit rows of ``bench/gpu_check.py`` (issue 33): what the CPU cannot measure.

1. per recipe, on the device: which path the matmuls take (the device's ``scaled_mm`` or the
   emulation) and, where the kernel runs, its forward and both gradients against the
   emulation of the same codes (relative difference: fp32 accumulation order only);
2. per recipe, tokens/s of a ~1B-parameter Llama (gpu_check's ``BILLION`` shape, one GPU,
   stage 3, bf16 compute) against the same model with bf16 matmuls, run back to back, and
   fp8_tensorwise once more with its weights gathered in fp8 (``CommQuant(weights="fp8")``);
   torchtitan's published Llama 3 8B figures beside them (8 H100: bf16 5,760 tokens/s/GPU,
   fp8 tensorwise with fp8 all-gathers 7,186 (1.25x), rowwise 6,424 (1.12x)).

On the CPU (``--device cpu``) the same code runs on a small shape, as a dry run.
"""

from __future__ import annotations

import torch

import shardwise
from bench.gpu_check import timed_steps
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.parallel import lowbit

PUBLISHED = {"fp8_tensorwise": "torchtitan 8B: 1.25x (with fp8 all-gather)",
             "fp8_rowwise": "torchtitan 8B: 1.12x"}
DRY = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64,
           multiple_of=128)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def kernel_rows(device: str) -> list[tuple[str, str, str]]:
    """Per recipe: the path taken on ``device`` and, for a real kernel, real vs emulated."""
    rows = []
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g).to(dev, torch.bfloat16).requires_grad_()
    w = (torch.randn(768, 512, generator=g) * 0.02).to(dev, torch.bfloat16).requires_grad_()
    for name in lowbit.RECIPE_NAMES:
        state = lowbit.LowBitState(lowbit.get_recipe(name), name)
        rec = state.recipe
        xq, _ = lowbit.quantize(x.detach(), rec.input)
        wq, _ = lowbit.quantize(w.detach(), rec.weight)
        old = lowbit.set_kernel_policy("real")
        try:
            real = lowbit.real_kernel_available(xq, wq, torch.bfloat16)
            if not real:
                rows.append((f"low-bit {name}: kernel", "emulated (no device kernel)", "ok"))
                continue
            outs = []
            for policy in ("real", "emulated"):
                lowbit.set_kernel_policy(policy)
                x.grad = w.grad = None
                y = lowbit.lowbit_linear(x, w, None, state)
                y.float().square().mean().backward()
                outs.append((y.detach(), x.grad.clone(), w.grad.clone()))
            diff = max(_rel(a, b) for a, b in zip(*outs))
            rows.append((f"low-bit {name}: kernel vs emulation",
                         f"max rel diff {diff:.1e} (fwd, dgrad, wgrad)",
                         "ok" if diff < 1e-2 else "FAIL"))
        finally:
            lowbit.set_kernel_policy(old)
    return rows


def _tokens_per_s(device: str, shape: dict, recipe: str | None, fp8_gather: bool,
                  steps: int, batch: int, seq: int) -> float:
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else "cpu"
    cfg = get_model_config("debug", **shape)
    model = build_model(cfg, device="meta")
    if recipe is not None:
        shardwise.apply_low_precision(model, recipe)
    comm = shardwise.CommQuant(weights="fp8") if fp8_gather else None
    shardwise.shard(model, stage=3, wrap={TransformerBlock}, device=dev, comm=comm,
                    mixed_precision=shardwise.MixedPrecision(param_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (steps + 3, batch, seq + 1), generator=g).to(dev)
    return batch * seq / timed_steps(model, opt, tokens, device)


def throughput_rows(device: str, billion: dict, steps: int) -> list[tuple[str, str, str]]:
    """bf16 matmuls, then every recipe (and fp8_tensorwise with fp8 gathers), tokens/s."""
    cuda = device == "cuda"
    shape, batch, seq = (billion, 4, 2048) if cuda else (DRY, 2, 32)
    steps = steps if cuda else 2
    base = _tokens_per_s(device, shape, None, False, steps, batch, seq)
    rows = [("low-bit bf16 matmuls (reference)", f"{base:,.0f} tokens/s", "ok")]
    runs = [(r, False) for r in lowbit.RECIPE_NAMES] + [("fp8_tensorwise", True)]
    for recipe, gather in runs:
        tps = _tokens_per_s(device, shape, recipe, gather, steps, batch, seq)
        label = f"low-bit {recipe}" + (" + fp8 all-gather" if gather else "")
        beside = PUBLISHED.get(recipe, "") if gather or recipe != "fp8_tensorwise" else ""
        rows.append((label, f"{tps:,.0f} tokens/s, {tps / base:.2f}x bf16"
                     + (f" ({beside})" if beside else ""), "ok"))
    return rows
