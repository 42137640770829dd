"""What a ``selective`` activation-checkpointing policy replays, by software stack.

[Note: selective policies] ``ac=selective`` means "recompute the cheap part", and stacks
differ in what that part is. The workload's ``selective_ac`` names the policy the
software runs; the cost model (stage_cost.py) prices each the same way, from the
layer's own list of work (work.py):

* ``"ops"`` (default, shardwise's policy, ``parallel/checkpointing.py``): every matrix
  multiply's and the attention kernel's outputs are kept; the bandwidth-bound ops (norms,
  RoPE, the activation function; with unfused attention, the attention core as in
  Korthikanti et al. 2022) are replayed. See [Note: selective recomputation] in work.py.
* ``"alternate_mm"``: torchtitan's op-level policy (``selective_ac_option = "op"``,
  2024: ``_save_list`` in ``parallelize_llama.py``) keeps the attention kernel's and
  reduce-scatters' outputs and every *other* ``aten.mm`` output, counting the block's
  multiplies in execution order (wq, wk, wv, wo, w1, w3, w2 in a Llama block: wk, wo and
  w3 are replayed), and recomputes the rest, the bandwidth-bound ops and the tensor-
  parallel all-gathers included. :func:`replayed_matmuls` lists the replayed multiplies.
* ``"layers:N"``: torchtitan's layer policy (``selective_ac_option = "N"``) checkpoints
  every N-th block fully (the 1-based block count divisible by N) and leaves the others
  unchecked: :func:`layer_ac` resolves each block's policy.
"""

from __future__ import annotations

import math

__all__ = ["check_selective", "layer_ac", "replayed_matmuls", "alternate_mm_saved",
           "stack_saved_delta", "up_projection_flops", "FP8_CACHE_BYTES", "E5M6_BYTES"]

FP8_CACHE_BYTES = 1 + 4 / 128
"""Bytes per element of an activation cached in fp8 with DeepSeek-V3's fine-grained
quantisation (arXiv:2412.19437 Section 3.3.2: one fp32 scale per 1 x 128 tile)."""
E5M6_BYTES = 12 / 8 + 4 / 128
"""Bytes per element of the inputs of the linear after attention, which DeepSeek-V3 caches
in its 12-bit E5M6 format (Section 3.3.3, exception (1)), with a scale per 128."""


def check_selective(policy: str) -> None:
    """Validate a ``selective_ac`` value.

    Raises:
        ValueError: not "ops", "alternate_mm" or "layers:N" with an integer N >= 1.
    """
    if policy in ("ops", "alternate_mm"):
        return
    head, _, n = policy.partition(":")
    if head == "layers" and n.isdigit() and int(n) >= 1:
        return
    raise ValueError(f"selective_ac={policy!r}, expected 'ops', 'alternate_mm' or "
                     f"'layers:N' with an integer N >= 1")


def layer_ac(ac: str, policy: str, index: int) -> str:
    """The checkpointing block ``index`` (0-based) runs under layout policy ``ac`` and
    the workload's ``selective_ac`` ``policy`` (full / none for a layer policy)."""
    if ac != "selective" or not policy.startswith("layers:"):
        return ac
    every = int(policy.partition(":")[2])
    return "full" if (index + 1) % every == 0 else "none"


def _block_matmuls(spec, tp: int) -> list[tuple[int, int]]:
    """(out, in) of a dense block's linears on one tensor-parallel rank, in the order
    torchtitan's Llama block runs them (q, k, v, o, then w1, w3, w2 / fc1, fc2)."""
    attn = [s for s in spec.attention_shapes(tp) if len(s) == 2]
    ffn = [s for s in spec.ffn_shapes(0, tp, experts=False) if len(s) == 2]
    if spec.mlp == "swiglu":
        ffn = [ffn[0], ffn[2], ffn[1]]  # registered w1, w2, w3; run w1, w3, then w2
    return attn + ffn


def replayed_matmuls(spec, moe: bool, tokens: float, tp: int, gemms) -> list[float]:
    """FLOPs of each multiply ``alternate_mm`` replays in one layer's recomputation.

    Args:
        spec: the ModelSpec; moe: the layer's feed-forward is a mixture of experts.
        tokens: tokens of the micro-batch on this rank; tp: tensor-parallel degree.
        gemms: the layer's ``LayerWork.gemms`` ((FLOPs, count), ...), used for blocks
            whose multiplies are not plain linears (MLA, experts): every second one of
            that list, in its order.
    """
    if moe or spec.is_mla:
        flat = [f for f, n in gemms for _ in range(n)]
        return flat[1::2]
    return [2 * tokens * math.prod(s) for s in _block_matmuls(spec, tp)[1::2]]


def alternate_mm_saved(spec, tokens: float, tp: int, sp: bool, act_bytes: int) -> float:
    """Bytes one dense block keeps for backward under torchtitan's op-level policy.

    [Note: what alternate_mm keeps] ``selective_ac_option = "op"`` (parallelize_llama.py
    at pytorch/torchtitan 9dec370, ``_apply_ac_to_transformer_block``) wraps each block in
    a non-reentrant checkpoint whose policy marks ``MUST_SAVE`` only the outputs of
    ``_save_list`` ops: every odd ``aten.mm`` in the block's forward (the count restarts
    per block: wq, wv, w1, w2 of a Llama block), the SDPA kernel's outputs (its output and
    fp32 log-sum-exp) and, with sequence parallelism, the reduce-scatters' outputs. All
    else is ``PREFER_RECOMPUTE``: autograd's saved tensors inside the block are dropped
    and replayed in backward, so between forward and backward the block holds just those
    outputs and its input (what the checkpoint wrapper keeps). This is much less than
    shardwise's "ops" policy, which keeps every multiply's inputs and outputs.

    Args:
        spec: the ModelSpec (a dense, non-MLA block). tokens: tokens of the micro-batch on
            this rank; tp: tensor-parallel degree; sp: sequence parallelism on.
        act_bytes: bytes of an activation element.
    """
    h = spec.n_heads // tp
    kept = sum(out for out, _ in _block_matmuls(spec, tp)[0::2])  # 1st, 3rd, ... outputs
    rep = spec.dim / (tp if sp else 1)  # the block's input (checkpoint input)
    scattered = 2 * spec.dim / tp if (tp > 1 and sp) else 0.0  # wo's and w2's RS outputs
    return tokens * (act_bytes * (kept + h * spec.v_dim + rep + scattered) + 4 * h)


def stack_saved_delta(spec, wl, moe: bool, tokens: float, tp: int, sp: bool) -> float:
    """Change in a layer's saved bytes per micro-batch under ``ac=selective`` from the
    workload's storage options (negative: less kept).

    [Note: DeepSeek-V3's activation storage] arXiv:2412.19437 describes what its layers
    keep for backward beyond a plain selective recomputation:

    * ``mla_up_recompute`` (Section 3.2.3, "Recomputation of RMSNorm and MLA
      Up-Projection"): the per-head queries, keys and values that MLA's up-projections
      produce are not kept; the backward replays the up-projections from the kept latent
      vectors (priced as replayed multiplies by the stage coster: :func:`up_projection_flops`).
      RMSNorm outputs are replayed too, which the "ops" policy already does.
    * ``fp8_activations`` (Section 3.3.3, "Low-Precision Activations"): the inputs of the
      linears are cached in fp8 with a scale per 128 elements, except (1) the input of the
      linear after attention (the attention output), kept in E5M6 (12 bits) because the
      attention backward reads it too, and (2) the SwiGLU inputs of the MoE (experts and
      shared expert), cached in fp8 with the SwiGLU output replayed. What stays 16-bit:
      the norms' inputs (the residual stream, for the replayed RMSNorm), MLA's latent
      vectors, the routed experts' outputs awaiting the bf16 combine (Section 3.3.3,
      "Low-Precision Communication": combine in BF16) and the dense layers' SwiGLU inputs.
      The dispatched tokens (the experts' up-projection input) arrive in fp8 and are kept so.
    * ``moe_gate_in_activation``: the gate weights multiply the SwiGLU output (Megatron-
      Core's weighted SwiGLU), whose backward takes the weights' gradient from the SwiGLU
      output it replays anyway, so the routed experts' outputs (``dim x top_k`` 16-bit
      values a token) are not kept for the gate's gradient.
    """
    a = wl.act_bytes
    h = spec.n_heads // tp
    delta = 0.0
    if wl.mla_up_recompute and spec.is_mla:
        delta -= a * h * (2 * spec.qk_dim + spec.v_dim)  # q, k, v per head
    if wl.fp8_activations:
        delta -= (a - E5M6_BYTES) * h * spec.v_dim  # the linear after attention
        if moe:
            split = tp if sp else 1
            delta -= (a - FP8_CACHE_BYTES) * spec.dim * spec.top_k / split  # dispatched
            f = spec.moe_ffn_dim // tp
            delta -= (a - FP8_CACHE_BYTES) * 2 * f * (spec.top_k + spec.n_shared_experts)
    if wl.moe_gate_in_activation and moe:  # the experts' outputs, kept for the gate
        delta -= a * spec.dim * spec.top_k / (tp if sp else 1)
    return delta * tokens


def up_projection_flops(spec, gemms) -> list[float]:
    """FLOPs of MLA's up-projections in a layer's ``LayerWork.gemms`` (the multiplies
    ``mla_up_recompute`` replays): the query's (with a query low-rank) and the key-value's,
    in the order ``work._attention`` lists them."""
    flat = [f for f, n in gemms for _ in range(n)]
    return [flat[1], flat[3]] if spec.q_lora_rank else [flat[2]]
