"""What one transformer layer does for one micro-batch on one rank: matrix multiplies,
bandwidth-bound bytes and the activations autograd saves.

[Note: activation accounting] Saved activations follow Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", Section 4): every tensor a layer's
backward needs is listed with its bytes per token and where it lives. ``rep`` tensors sit
outside the tensor-parallel regions (norm inputs and outputs, dropout masks) and are split
across the ``tp`` ranks only by sequence parallelism; ``tp`` tensors (Q, K, V, the MLP's
hidden activations) are split by tensor parallelism; ``core`` tensors belong to the
attention core (softmax output, attention dropout, flash-attention's output and
log-sum-exp) and are what selective recomputation drops. For their GPT-3 block (LayerNorm,
GELU, dropout, unfused attention) the list sums to the paper's ``sbh (34 + 5as/h)`` bytes
per layer without parallelism, ``sbh (10 + 24/t + 5as/(ht))`` with tensor parallelism and
``sbh/t (34 + 5as/h)`` with sequence parallelism (the tests check all three); a Llama block
(RMSNorm, SwiGLU, flash attention, no dropout) is listed the same way. Full recomputation
keeps only each layer's input.

Matrix multiplies are listed with their FLOPs (2 m n k) so that the hardware's efficiency
curve sees each one's size; the attention core is one batched multiply per micro-batch and
head group. Model FLOPs count the full ``s x s`` score matrix (PaLM / Megatron-LM's
convention); a causal flash kernel executes about half of it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerWork", "layer_work", "saved_bytes", "head_work"]


@dataclass(frozen=True)
class LayerWork:
    """One layer, one micro-batch, one rank, forward pass.

    Attributes:
        gemms: ((FLOPs of one multiply, how many), ...), attention core excluded.
        attn_model_flops: attention core FLOPs counted for MFU (full score matrix).
        attn_exec_flops: attention core FLOPs the kernel executes.
        attn_unit_flops: FLOPs of the batched attention kernel (its efficiency size).
        elementwise_bytes: HBM bytes of the bandwidth-bound kernels.
        core_bytes: bandwidth-bound bytes inside the attention core (unfused softmax).
        saved_rep, saved_tp, saved_core, saved_input: saved activation bytes by place
            ([Note: activation accounting]).
        tokens: tokens of the micro-batch on this rank (before sequence parallelism).
    """

    gemms: tuple[tuple[float, int], ...]
    attn_model_flops: float
    attn_exec_flops: float
    attn_unit_flops: float
    elementwise_bytes: float
    core_bytes: float
    saved_rep: float
    saved_tp: float
    saved_core: float
    saved_input: float
    tokens: float

    @property
    def gemm_flops(self) -> float:
        return sum(f * n for f, n in self.gemms)

    @property
    def model_flops(self) -> float:
        """Forward FLOPs of this layer as MFU counts them."""
        return self.gemm_flops + self.attn_model_flops


def _attention(spec, t: float, seq: int, tp: int, attention: str, a: int):
    """(gemms, model FLOPs, executed FLOPs, saved (rep, tp, core), rope bytes, core bytes)."""
    d, h = spec.dim, spec.n_heads // tp
    qk, vd = spec.qk_dim, spec.v_dim
    gemms: list[tuple[float, int]] = []
    if spec.is_mla:
        if spec.q_lora_rank:
            gemms += [(2 * t * d * spec.q_lora_rank, 1), (2 * t * spec.q_lora_rank * h * qk, 1)]
        else:
            gemms.append((2 * t * d * h * qk, 1))
        gemms.append((2 * t * d * (spec.kv_lora_rank + spec.qk_rope_head_dim), 1))
        gemms.append((2 * t * spec.kv_lora_rank * h * (spec.qk_nope_head_dim + vd), 1))
        k_width = v_width = h  # MLA materialises per-head keys and values
        rep = 2 * 2 * (spec.q_lora_rank + spec.kv_lora_rank + spec.qk_rope_head_dim)
    else:
        kv = max(1, spec.kv_heads // tp)
        gemms.append((2 * t * d * (h + 2 * kv) * spec.hd, 1))
        # Llama code repeats grouped kv heads before the kernel, which then saves them
        # expanded (shardwise.models and torchtitan both do); GPT has kv == heads.
        k_width = v_width = h
        rep = 0.0
    gemms.append((2 * t * h * vd * d, 1))
    per_head = 2 * t * seq * (qk + vd)
    model = h * per_head
    executed = model * (0.5 if attention == "flash" else 1.0)
    saved_tp = a * (h * qk + k_width * qk + v_width * vd) + a * h * vd  # q, k, v, wo input
    if attention == "flash":
        saved_core = a * h * vd + 4 * h  # kernel output and fp32 log-sum-exp
        core_bytes = 0.0
    else:
        drop = 3 if spec.dropout else 0  # dropout mask (1 byte) and its output (2)
        saved_core = (a + drop) * h * seq  # softmax output (+ dropout), per token per head
        core_bytes = (4 * a + (2 * a + 1 if spec.dropout else 0)) * h * seq
    rope = 2 * a * (h + k_width) * (spec.qk_rope_head_dim if spec.is_mla else spec.hd) \
        if spec.position == "rope" else 0.0
    return gemms, model, executed, (rep, saved_tp, saved_core), rope, core_bytes


def _ffn(spec, moe: bool, t: float, tp: int, ep: int, a: int):
    """(gemms, saved_tp, saved_rep, elementwise bytes) of the feed-forward."""
    d = spec.dim
    mats = 3 if spec.mlp == "swiglu" else 2
    act_saved = 4 if spec.mlp == "swiglu" else 2  # tensors of width f the backward needs
    act_bytes = 5 if spec.mlp == "swiglu" else 2  # read/write passes of width f
    if not moe:
        f = spec.ffn_dim // tp
        return [(2 * t * d * f, mats)], a * act_saved * f, 0.0, a * act_bytes * f * t
    f = spec.moe_ffn_dim // tp
    per_expert_tokens = t * ep * spec.top_k / spec.n_experts
    gemms = [(2 * t * d * spec.n_experts, 1),  # router
             (2 * per_expert_tokens * d * f, mats * spec.n_experts // ep)]
    saved_tp = a * act_saved * f * spec.top_k
    saved_rep = 2 * a * d * spec.top_k + 4 * spec.n_experts  # permuted in / out, router
    ew = a * act_bytes * f * spec.top_k * t + 4 * a * d * spec.top_k * t  # act, permutes
    if spec.n_shared_experts:
        fs = spec.n_shared_experts * spec.moe_ffn_dim // tp
        gemms.append((2 * t * d * fs, mats))
        saved_tp += a * act_saved * fs
        ew += a * act_bytes * fs * t
    return gemms, saved_tp, saved_rep, ew


def layer_work(spec, moe: bool, tokens: float, seq: int, tp: int = 1, ep: int = 1,
               attention: str = "flash", act_bytes: int = 2) -> LayerWork:
    """The forward work of one layer (see the module docstring).

    Args:
        spec: the :class:`~shardwise.planner.spec.ModelSpec`.
        moe: whether the layer's feed-forward is a mixture of experts.
        tokens: tokens of the micro-batch on this rank (micro-batch x seq / cp).
        seq: keys each query attends to (the full sequence length).
        tp, ep: tensor- and expert-parallel degrees.
        attention: "flash" (fused, causal half executed) or "unfused" (scores in HBM).
        act_bytes: bytes per activation element (2 for bf16 / fp16).
    """
    t, a, d = float(tokens), act_bytes, spec.dim
    gemms, model, executed, (rep_att, tp_att, core), rope, core_bytes = _attention(
        spec, t, seq, tp, attention, a)
    f_gemms, tp_ffn, rep_ffn, f_bytes = _ffn(spec, moe, t, tp, ep, a)
    norm_saved = (a + a) * d + (0 if spec.norm == "layernorm" else 4)  # input, output, rstd
    drop_saved = d if spec.dropout else 0  # one-byte masks after attention and MLP
    saved_rep = 2 * norm_saved + 2 * drop_saved + rep_att + rep_ffn
    norms = 2 * (2 * a * d)
    residual = 2 * (3 * a * d)
    dropout = 2 * (2 * a + 1) * d if spec.dropout else 0
    elementwise = (norms + residual + dropout) * t + rope * t + f_bytes
    return LayerWork(
        gemms=tuple(gemms + f_gemms), attn_model_flops=model, attn_exec_flops=executed,
        attn_unit_flops=executed, elementwise_bytes=elementwise,
        core_bytes=core_bytes * t, saved_rep=saved_rep * t, saved_tp=(tp_att + tp_ffn) * t,
        saved_core=core * t, saved_input=a * d * t, tokens=t)


def saved_bytes(w: LayerWork, tp: int, sp: bool, ac: str) -> float:
    """Activation bytes one layer keeps for backward, per micro-batch.

    Args:
        w: the layer's :class:`LayerWork` (computed for the tensor-parallel rank).
        tp: tensor-parallel degree; sp: sequence parallelism on.
        ac: "none", "selective" (attention core recomputed) or "full" (layer input only).
    """
    split = tp if sp else 1
    if ac == "full":
        return w.saved_input / split
    core = 0.0 if ac == "selective" else w.saved_core
    return w.saved_rep / split + w.saved_tp + core


def head_work(spec, tokens: float, tp: int = 1, act_bytes: int = 2):
    """(output-head FLOPs, loss bytes, logits bytes held) for one micro-batch on one rank.

    The cross-entropy reads bf16 logits, upcasts to fp32 and writes fp32 gradients:
    about 10 bytes per logit element over forward and backward.
    """
    v = -(-spec.vocab_size // tp)
    logits = tokens * v
    return 2 * tokens * spec.dim * v, 10.0 * logits, (act_bytes + 4 + 4) * logits
