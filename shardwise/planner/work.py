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

[Note: context-parallel activations] ``shardwise.parallel.context``'s operator (ring,
Ulysses, hybrid) takes the keys and values unexpanded (it repeats each block for grouped
query heads in its kernels), so it saves them at the key/value heads' width, not every query
head's; and it returns its output in ``(B, H, T, hd)`` order, so the output projection's
input (``transpose(1, 2).reshape``) is a copy, saved beside the operator's own output
([Note: flash output] holds only for the one-rank kernel). Every token-wise tensor is
still this rank's ``tokens`` (micro-batch x seq / cp): activations per rank scale as 1/cp.
The attention core executes the causal entries of this rank's tokens (``cp_scores``, from
the layout's chunks: ``shardwise.parallel.context.attention_entries``), not half of its
rows against the whole sequence, and in ``cp_calls`` blocks. Llama 3's all-gather keeps
the one-rank kernel on the gathered keys and values, and is priced as it was.

[Note: fused and eager kernels] Bandwidth-bound ops cost what their kernels move. Fused
kernels (Megatron-LM's, Transformer Engine's, or what torch.compile generates) read their
inputs and write their outputs once. Eager PyTorch, which shardwise.models and torchtitan
run without compile, launches one kernel per operator and upcasts to fp32 where the code
does: RMSNorm (``x.float()``, ``pow``, ``mean``, ``* rsqrt``, ``type_as``, ``* weight``)
moves 36 bytes per bf16 element instead of 4 and keeps an fp32 copy for backward; RoPE
(upcast, four multiplies, two adds, ``stack``, ``type_as``) moves 48 instead of 4 but keeps
nothing of q and k: it multiplies by cos / sin tables that need no gradient, so autograd
saves the tables, not its inputs (measured with ``saved_tensors_hooks`` on
shardwise.models; torchtitan's complex rotation by ``freqs_cis`` saves the same); SwiGLU
(``silu`` then ``*``) moves 10 instead of 6. LayerNorm, GELU and dropout are single
kernels in eager PyTorch too.

[Note: flash output] The flash kernel's output is the output projection's input (a view:
``transpose(1, 2).reshape`` of an output laid out as ``(B, S, H, D)``), so it is one saved
tensor, listed with the projection's input; the kernel itself adds only its fp32
log-sum-exp.

[Note: selective recomputation] ``selective`` recomputes the activations that are large and
cheap to recompute. With unfused attention those are the score-sized tensors of the
attention core (softmax output, its dropout), exactly Korthikanti et al.'s selective
recomputation, and the recompute cost is the attention core's forward. Flash attention
stores nothing score-sized, so there ``selective`` recomputes the bandwidth-bound ops instead
(norms, RoPE, the activation function, dropout): the layer keeps its matmul inputs and
outputs and the attention kernel's inputs, and drops the norms' outputs, the eager fp32
copies and the activation function's outputs, at the cost of re-running those kernels'
forward. Megatron-Core's ``recompute_modules`` (layernorm, mlp activation) and torchtitan's
op-level policy keep about the same set.

Matrix multiplies are listed with their FLOPs (2 m n k) so that the hardware's efficiency
curve sees each one's size; the attention core is one batched multiply per micro-batch and
head group. Model FLOPs count the full ``s x s`` score matrix (PaLM / Megatron-LM's
convention); a causal flash kernel executes about half of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LayerWork", "layer_work", "saved_bytes", "head_work", "head_saved", "op_bytes",
           "fp8_cast_bytes"]


def op_bytes(op: str, a: int, fused: bool) -> float:
    """HBM bytes per element, forward, of a bandwidth-bound op ([Note: fused and eager
    kernels]); ``a`` is the activation element size (2: bf16/fp16, 4: fp32)."""
    up = 0 if a == 4 else a + 4  # an fp32 upcast (or cast back), absent in fp32
    table = {"rmsnorm": (2 * a, up + 8 + 4 + 8 + up + 2 * a),
             "rope": (2 * a, up + 36 + up), "swiglu": (3 * a, 5 * a), "gelu": (2 * a, 2 * a),
             "dropout": (a + 1, 2 * a + 1), "residual": (3 * a, 3 * a),
             "layernorm": (2 * a, 2 * a)}
    return table[op][0 if fused else 1]


def _norm_saved(spec, a: int, fused: bool) -> float:
    """Bytes per element a norm keeps (its input and output; eager RMSNorm: an fp32 copy)."""
    if spec.norm == "rmsnorm" and not fused:
        return 4 + 2 * a
    return 2 * a


@dataclass(frozen=True)
class LayerWork:
    """One layer, one micro-batch, one rank, forward pass.

    Attributes:
        gemms: ((FLOPs of one multiply, how many), ...), attention core excluded.
        attn_model_flops: attention core FLOPs counted for MFU (full score matrix).
        attn_exec_flops: attention core FLOPs the kernel executes.
        attn_unit_flops: FLOPs of the batched attention kernel (its efficiency size).
        elementwise_rep, elementwise_tp: HBM bytes of the bandwidth-bound kernels outside
            the tensor-parallel regions (norms, residual adds, dropout: split by sequence
            parallelism only) and inside them (activation function, RoPE, expert permutes).
        core_bytes: bandwidth-bound bytes inside the attention core (unfused softmax).
        saved_rep, saved_tp, saved_core, saved_input: saved activation bytes by place
            ([Note: activation accounting]).
        cheap_rep, cheap_tp: the parts of saved_rep / saved_tp that selective
            recomputation drops with flash attention (outputs of bandwidth-bound ops).
        tokens: tokens of the micro-batch on this rank (before sequence parallelism).
        linear_weights: weight elements of the layer's linears on this rank.
        linear_io: input + output widths of the linears a token passes through (what
            fp8 training casts per token).
        attn_calls: kernel calls the attention core runs as (1; context parallelism's
            blocks: [Note: context-parallel sends] in sends.py).
        attn_scores: causal score entries the attention core computes, summed over this
            rank's query heads (0: the one-rank causal half, ``tokens x seq x heads / 2``).
        attn_area: the context-parallel operator's calls' query x key rectangles, summed
            over this rank's query heads (what the CPU flash kernel computes per call).
        attn_queries: those calls' query tokens, summed over this rank's query heads (what
            the operator merges around each call).
        gemm_roles: per entry of ``gemms``, the linears it multiplies: "attention", "ffn",
            "shared" (shared experts), "experts" (routed) or "router" (the one multiply a
            low-bit recipe never converts); ``layer_work`` gives every entry one.
        lowbit: what the workload's low-bit recipe adds to the layer
            (``recipe_work.RecipeWork``: converted linears, casts, saved bytes), set by the
            stage coster; None without a recipe.
    """

    gemms: tuple[tuple[float, int], ...]
    attn_model_flops: float
    attn_exec_flops: float
    attn_unit_flops: float
    elementwise_rep: float
    elementwise_tp: float
    core_bytes: float
    saved_rep: float
    saved_tp: float
    saved_core: float
    cheap_rep: float
    cheap_tp: float
    saved_input: float
    tokens: float
    linear_weights: float = 0.0
    linear_io: float = 0.0
    attn_calls: int = 1
    attn_scores: float = 0.0
    attn_area: float = 0.0
    attn_queries: float = 0.0
    gemm_roles: tuple[str, ...] = ()
    lowbit: object = None

    @property
    def gemm_flops(self) -> float:
        return sum(f * n for f, n in self.gemms)

    @property
    def model_flops(self) -> float:
        """Forward FLOPs of this layer as MFU counts them."""
        return self.gemm_flops + self.attn_model_flops


def _attention(spec, t: float, seq: int, tp: int, attention: str, a: int, fused: bool,
               cp_scores: float = 0.0):
    """(gemms, model FLOPs, executed FLOPs, saved (rep, tp, core), rope bytes, core bytes);
    ``cp_scores`` > 0: the context-parallel operator ([Note: context-parallel
    activations])."""
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
        k_width = h  # MLA materialises per-head keys and values
        rep = 2 * 2 * (spec.q_lora_rank + spec.kv_lora_rank + spec.qk_rope_head_dim)
    else:
        kv = max(1, spec.kv_heads // tp)
        gemms.append((2 * t * d * (h + 2 * kv) * spec.hd, 1))
        # Llama code repeats grouped kv heads before the kernel, which then saves them
        # expanded (shardwise.models and torchtitan both do); GPT has kv == heads.
        k_width = h
        rep = 0.0
    gemms.append((2 * t * h * vd * d, 1))
    per_head = 2 * t * seq * (qk + vd)
    model = h * per_head
    executed = model * (0.5 if attention == "flash" else 1.0)
    saved_k = saved_v = k_width
    if cp_scores:  # [Note: context-parallel activations]
        if attention == "flash":
            executed = h * 2 * cp_scores * (qk + vd)
        saved_k = saved_v = max(1, spec.kv_heads // tp)
    saved_tp = a * (h * qk + saved_k * qk + saved_v * vd) + a * h * vd  # q, k, v, wo input
    if cp_scores:
        saved_tp += a * h * vd  # the operator's output, beside wo's input
    if attention == "flash":
        saved_core = 4 * h  # fp32 log-sum-exp; its output is wo's input ([Note: flash output])
        core_bytes = 0.0
    else:
        drop = 3 if spec.dropout else 0  # dropout mask (1 byte) and its output (2)
        saved_core = (a + drop) * h * seq  # softmax output (+ dropout), per token per head
        core_bytes = (4 * a + (2 * a + 1 if spec.dropout else 0)) * h * seq
    rope = cheap_tp = 0.0
    if spec.position == "rope":
        width = (h + k_width) * (spec.qk_rope_head_dim if spec.is_mla else spec.hd)
        rope = op_bytes("rope", a, fused) * width  # saves only its tables
    return gemms, model, executed, (rep, saved_tp, saved_core, cheap_tp), rope, core_bytes


def _ffn(spec, moe: bool, t: float, tp: int, ep: int, a: int, fused: bool):
    """(gemms, saved_tp, saved_rep, elementwise bytes, cheap_tp, gemm roles) of the
    feed-forward."""
    d = spec.dim
    mats = 3 if spec.mlp == "swiglu" else 2
    act_saved = 4 if spec.mlp == "swiglu" else 2  # tensors of width f the backward needs
    act_cheap = act_saved // 2  # silu output and product / GELU output: recomputable
    per_f = op_bytes(spec.mlp, a, fused)  # bytes per hidden element
    if not moe:
        f = spec.ffn_dim // tp
        return [(2 * t * d * f, mats)], a * act_saved * f, 0.0, per_f * f * t, \
            a * act_cheap * f, ["ffn"]
    f = spec.moe_ffn_dim // tp
    per_expert_tokens = t * ep * spec.top_k / spec.n_experts
    gemms = [(2 * t * d * spec.n_experts, 1),  # router
             (2 * per_expert_tokens * d * f, mats * spec.n_experts // ep)]
    roles = ["router", "experts"]
    saved_tp = a * act_saved * f * spec.top_k
    cheap = a * act_cheap * f * spec.top_k
    saved_rep = 2 * a * d * spec.top_k + 4 * spec.n_experts  # permuted in / out, router
    ew = per_f * f * spec.top_k * t + 4 * a * d * spec.top_k * t  # act, permutes
    if spec.n_shared_experts:
        fs = spec.n_shared_experts * spec.moe_ffn_dim // tp
        gemms.append((2 * t * d * fs, mats))
        roles.append("shared")
        saved_tp += a * act_saved * fs
        cheap += a * act_cheap * fs
        ew += per_f * fs * t
    return gemms, saved_tp, saved_rep, ew, cheap, roles


def layer_work(spec, moe: bool, tokens: float, seq: int, tp: int = 1, ep: int = 1,
               attention: str = "flash", act_bytes: int = 2, fused: bool = True,
               fused_norm: bool = False, cp_scores: float = 0.0, cp_calls: int = 1,
               cp_area: float = 0.0, cp_queries: float = 0.0) -> LayerWork:
    """The forward work of one layer (see the module docstring).

    Args:
        spec: the :class:`~shardwise.planner.spec.ModelSpec`.
        moe: whether the layer's feed-forward is a mixture of experts.
        tokens: tokens of the micro-batch on this rank (micro-batch x seq / cp).
        seq: keys each query attends to (the full sequence length).
        tp, ep: tensor- and expert-parallel degrees.
        attention: "flash" (fused, causal half executed) or "unfused" (scores in HBM).
        act_bytes: bytes per activation element (2 for bf16 / fp16).
        fused: fused bandwidth-bound kernels (True) or eager PyTorch ([Note: fused and
            eager kernels]).
        fused_norm: the norms alone run as fused kernels in an otherwise eager model
            (torchtitan's ``fused_rmsnorm``).
        cp_scores: with context parallelism's own operator (``shardwise.parallel.context``:
            ring, Ulysses, hybrid), the causal score entries this rank computes per query
            head over the micro-batch; 0 (default): attention on one rank, or Llama 3's
            all-gathered keys and values ([Note: context-parallel activations]).
        cp_calls: the blocks that operator computes them in (kernel calls per pass).
        cp_area: the query x key rectangles of those calls per query head over the
            micro-batch; cp_queries: their query tokens.
    """
    t, a, d = float(tokens), act_bytes, spec.dim
    lw, lio = _linears(spec, moe, tp, ep)
    gemms, model, executed, (rep_att, tp_att, core, cheap_att), rope, core_bytes = _attention(
        spec, t, seq, tp, attention, a, fused, cp_scores)
    f_gemms, tp_ffn, rep_ffn, f_bytes, cheap_ffn, f_roles = _ffn(spec, moe, t, tp, ep, a, fused)
    nf = fused or fused_norm
    norm_saved = _norm_saved(spec, a, nf) * d + (0 if spec.norm == "layernorm" else 4)
    flash = attention == "flash"  # selective then drops what bandwidth-bound ops saved
    cheap_rep = 2 * (_norm_saved(spec, a, nf) - a) * d if flash else 0.0
    drop_saved = d if spec.dropout else 0  # one-byte masks after attention and MLP
    saved_rep = 2 * norm_saved + 2 * drop_saved + rep_att + rep_ffn
    norms = 2 * op_bytes(spec.norm, a, nf) * d
    residual = 2 * op_bytes("residual", a, fused) * d
    dropout = 2 * op_bytes("dropout", a, fused) * d if spec.dropout else 0
    calls = cp_calls if cp_scores else 1
    return LayerWork(
        gemms=tuple(gemms + f_gemms), attn_model_flops=model, attn_exec_flops=executed,
        attn_unit_flops=executed / calls, elementwise_rep=(norms + residual + dropout) * t,
        elementwise_tp=rope * t + f_bytes,
        core_bytes=core_bytes * t, saved_rep=saved_rep * t, saved_tp=(tp_att + tp_ffn) * t,
        saved_core=core * t, cheap_rep=cheap_rep * t,
        cheap_tp=(cheap_att + cheap_ffn) * t if flash else 0.0, saved_input=a * d * t, tokens=t,
        linear_weights=lw, linear_io=lio, attn_calls=calls,
        attn_scores=spec.n_heads // tp * cp_scores,
        attn_area=spec.n_heads // tp * cp_area if cp_scores else 0.0,
        attn_queries=spec.n_heads // tp * cp_queries if cp_scores else 0.0,
        gemm_roles=tuple(["attention"] * len(gemms) + f_roles))


def _linears(spec, moe: bool, tp: int, ep: int) -> tuple[float, float]:
    """(weight elements, per-token input + output widths) of one layer's linears."""
    index = spec.n_layers - 1 if moe else 0  # a layer of the asked kind
    dense = [s for s in spec.attention_shapes(tp) + spec.ffn_shapes(index, tp, ep, experts=False)
             if len(s) == 2]
    weights = sum(math.prod(s) for s in dense)
    io = sum(s[0] + s[1] for s in dense)
    if moe:
        experts = [s for s in spec.expert_shapes(index, tp, ep) if len(s) == 2]
        weights += sum(math.prod(s) for s in experts)
        per_expert = experts[: 3 if spec.mlp == "swiglu" else 2]
        io += spec.top_k * sum(s[0] + s[1] for s in per_expert)
    return weights, io


def fp8_cast_bytes(w: LayerWork) -> tuple[float, float]:
    """(forward, backward) HBM bytes fp8 training spends casting a layer's linear operands:
    per operand an amax pass (read 2 bytes / element) and a cast (read 2, write 1); inputs
    and weights forward, output gradients backward, and transposed copies of inputs and
    weights (3 bytes / element) for the weight- and input-gradient multiplies."""
    fwd = 5 * w.linear_weights + 5 * w.tokens * w.linear_io / 2
    bwd = 3 * w.linear_weights + w.tokens * w.linear_io * (5 + 3) / 2
    return fwd, bwd


def saved_bytes(w: LayerWork, tp: int, sp: bool, ac: str) -> float:
    """Activation bytes one layer keeps for backward, per micro-batch.

    Args:
        w: the layer's :class:`LayerWork` (computed for the tensor-parallel rank).
        tp: tensor-parallel degree; sp: sequence parallelism on.
        ac: "none", "selective" or "full" (layer input only); see [Note: selective
            recomputation].
    """
    split = tp if sp else 1
    if ac == "full":
        return w.saved_input / split
    if ac == "selective":
        return (w.saved_rep - w.cheap_rep) / split + w.saved_tp - w.cheap_tp
    return w.saved_rep / split + w.saved_tp + w.saved_core


def head_work(spec, tokens: float, tp: int = 1, act_bytes: int = 2):
    """(output-head FLOPs, loss bytes, loss working bytes) for one micro-batch on one rank.

    The cross-entropy reads the logits, upcasts to fp32 and writes fp32 gradients: about 10
    bytes per logit element over forward and backward. While it runs the rank holds the
    logits and their fp32 gradient (``act_bytes + 4`` per logit, the working bytes);
    what it saves for backward is in :func:`head_saved`.
    """
    v = -(-spec.vocab_size // tp)
    logits = tokens * v
    return 2 * tokens * spec.dim * v, 10.0 * logits, (act_bytes + 4) * logits


def head_saved(spec, tokens: float, tp: int = 1, sp: bool = False, act_bytes: int = 2,
               fused: bool = False) -> float:
    """Bytes the last stage saves for backward per micro-batch outside its layers: the
    final norm's (as a layer's norm keeps them) and the fp32 log-softmax output of the
    cross-entropy (4 bytes per logit)."""
    v = -(-spec.vocab_size // tp)
    norm = (_norm_saved(spec, act_bytes, fused) * spec.dim
            + (0 if spec.norm == "layernorm" else 4)) * tokens / (tp if sp else 1)
    return norm + 4.0 * tokens * v
