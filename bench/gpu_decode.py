"""The decode rows of ``bench/gpu_check.py`` (issue 35): tokens/s of
``shardwise.inference.generate`` on a Llama-2-7B-shaped model, beside gpt-fast's figure.

gpt-fast's published setup (pytorch-labs/gpt-fast README.md, "Benchmarks"): Llama-2-7B, batch
1, a 5-token prompt ("Hello, my name is"), 200 new tokens (its generate.py default), bf16,
``torch.compile``'d decode step, one A100-80GB power-limited to 330 W: 104.9 tokens/s (int8
weights 155.58, int4 G=32 196.80; Llama-2-70B over 8 A100s with tensor parallelism 62.50).

Our row: the same shape (dim 4096, 32 layers, 32 heads, ffn 11008, vocab 32000) with random
weights (decode speed does not depend on their values), built on meta, allocated in bf16 on
the device, greedy, batch 1, a 5-token prompt, 200 new tokens, eager, then with
``generate(..., compile=True)`` (the static-shape step through inductor). The ratio to
gpt-fast is information, not a pass mark: another GPU (and, eager, not compiled). On the CPU
(``--device cpu``) the same code runs on a tiny shape with 8 new tokens, as a dry run.
"""

from __future__ import annotations

import time

import torch

from shardwise.inference import generate
from shardwise.models import build_model, get_model_config

LLAMA2_7B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                 ffn_dim=11008, max_seq_len=512)
DRY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=128, ffn_dim=160,
           max_seq_len=64)
GPT_FAST_7B_BF16 = 104.9  # tokens/s, A100-80GB at 330 W, compiled, batch 1
PROMPT = [1, 15043, 29892, 590, 1024]  # 5 tokens, as gpt-fast's "Hello, my name is"


def decode_model(device: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The 7B shape on CUDA (:data:`DRY` on the CPU), random weights, allocated in ``dtype``
    straight from meta (no fp32 copy of 7B parameters)."""
    shape = LLAMA2_7B if device == "cuda" else DRY
    model = build_model(get_model_config("debug", **shape), device="meta").to(dtype)
    model.to_empty(device=device)  # the RoPE tables stay fp32 (RotaryEmbedding._apply)
    torch.manual_seed(0)
    model.init_weights()
    return model.eval()


def decode_rows(device: str, compile: bool = False, new_tokens: int | None = None,
                model: torch.nn.Module | None = None) -> list[tuple[str, str, str]]:
    """Decode tokens/s at batch 1, bf16, beside gpt-fast's compiled A100 figure.

    Args:
        device: ``"cuda"`` (the 7B shape) or ``"cpu"`` (the dry-run shape).
        compile: ``generate(..., compile=True)``; the compile happens in the warm-up run,
            whose seconds the row reports.
        new_tokens: new tokens of the timed run (default 200 on CUDA, 8 on the CPU).
        model: reuse this model (default: :func:`decode_model`).

    Returns:
        ``[(check, value, verdict)]``: one row, "ok" when it ran and produced every token.
    """
    new = new_tokens or (200 if device == "cuda" else 8)
    model = model if model is not None else decode_model(device)
    vocab = model.tok_embeddings.num_embeddings
    prompt = [t % vocab for t in PROMPT]
    start = time.perf_counter()
    # warm-up (kernels, allocator, cuBLAS; the compile): the timed run's shapes exactly
    generate(model, [prompt], max_new_tokens=new, compile=compile)
    warm = time.perf_counter() - start
    out = generate(model, [prompt], max_new_tokens=new, compile=compile)
    n_params = sum(p.numel() for p in model.parameters())
    name = "7B" if device == "cuda" else f"dry-run {n_params / 1e3:.0f}K"
    how = "compiled" if compile else "eager"
    value = (f"{out.tokens_per_s:.1f} tok/s {how} ({new} new, prefill {out.prefill_s * 1e3:.0f}"
             f" ms, warm-up {warm:.0f} s); gpt-fast A100 compiled {GPT_FAST_7B_BF16}: "
             f"{out.tokens_per_s / GPT_FAST_7B_BF16:.2f}x")
    ok = len(out.tokens[0]) == new and out.tokens_per_s > 0
    return [(f"decode {name} bf16 batch 1 {how}", value, "ok" if ok else "FAIL")]
