"""What a low-bit matmul recipe adds to one layer's work: the linears it converts, the bytes
of its casts, the activations it saves, the weights ZeRO-3 gathers as fp8 codes.

    rw = recipe_work(spec, False, 8192, 1, 1, "fp8_tensorwise", act_bytes=2, fused=True)
    rw.share["attention"], rw.cast_fwd, rw.cast_bwd, rw.saved_delta

The recipes are ``shardwise.parallel.lowbit``'s (recipes.py: the scaling each operand of a
linear's three multiplies gets); this module counts, from those scalings and the low-bit
linear's autograd function (linear.py), what a converted linear casts and keeps. The device
models price it (recipe_cost.py).

[Note: the linears a recipe converts] ``apply_low_precision`` converts every linear of the
blocks (attention's wq, wk, wv, wo, or multi-head latent attention's down and up
projections and wo; the MLP's w1, w3, w2; each routed expert's and the shared experts'
projections), never the embedding, the head, the norms or a router, and skips a linear
whose in or out features are not a multiple of the recipe's tile (``Recipe.shape_problem``,
on the full shapes, before tensor parallelism, as ``apply_low_precision`` checks them). The
layer's work (work.py) lists its multiplies by role; a role's ``share`` is the part of its
FLOPs the recipe converts (1 for every role but the router in the catalogue's models).

[Note: low-bit casts] A converted linear ``y = x W^T`` (``x`` ``M x K``, ``W`` ``N x K``)
casts, as the autograd function does: forward, ``x`` (the recipe's ``input`` scaling) and
``W`` (``weight``); backward, ``dy`` (``grad_output``), the weight of the input gradient
(``W`` cast again with ``weight`` when that scaling is transpose-invariant, since the forward
saved the high-precision weight; else ``W^T`` with ``weight_gi``), and for the weight
gradient ``dy^T`` (``dy``'s codes reused when ``grad_gw`` is ``grad_output`` and
transpose-invariant) and ``x^T`` (the saved codes of ``x`` reused where the recipe keeps
them: fp8_tensorwise). fp8_rowwise_gw_hp multiplies the weight gradient in high precision
and casts nothing for it. A weight ZeRO-3 gathered as fp8 codes (fp8_tensorwise with
``comm_weights=fp8``: [Note: offered weights] in linear.py) is not cast in the layer. Each
cast of ``E`` elements of an ``a``-byte tensor is a memory-bound pass:

* fused (``torch.compile``, torchao's kernels: the workload's ``fused_kernels``): read
  ``a E``, write the codes (``E`` bytes in fp8, ``E / 2`` in fp4) and the tile scales (4
  bytes each in fp32, 1 in e8m0 or e4m3, and NVFP4's fp32 tensor scale); a scaling with a
  tensor-wide scale (tensorwise, NVFP4's second level) first reads the tensor once more for
  its amax: 5 bytes an element of bf16 for tensorwise, 3 for rowwise;
* eager (``quantize`` in scaling.py, one kernel per operator: shardwise without compile):
  the upcast ``x.float()`` (``a + 4`` bytes an element, none in fp32), ``abs`` (8), the
  tile amax (``amax`` over the whole tensor, 4; a tile's columns first folded in halves
  with ``maximum``, 12 a fold's output element, until an odd width is left: just under 12
  more for any tile of 16 or more columns), the multiply by the broadcast multipliers (8),
  and in fp8 the saturating ``clamp_`` and the cast (13): 39 bytes an element of bf16 for
  tensorwise, 47 to 48 for rowwise, blockwise and MXFP8. NVFP4's e2m1 rounding is closed
  form on the exponent bits ([Note: closed-form e2m1 rounding] in lowbit/codes.py), nine
  operators of 8 to 12 bytes (``nan_to_num_`` included) and the e4m3 cast its codes are held
  in: 77. Each tile's scale takes a dozen fp64 and fp32 operators more (93 to 161 bytes a
  tile counted, NVFP4's to rowwise's power-of-two scales). Counted operator by operator with
  a dispatch mode (in-place operators included) on shapes the recipes take, these are within
  1% of what ``quantize`` moves (tests/test_planner_lowbit.py).

Copies of transposed codes into the layout a kernel takes are left out (fused casts write
both layouts; eager, a reused code is read and written once more, a byte each).

[Note: emulated low-bit multiplies] Where the device runs no kernel for the recipe
(``recipe_cost.recipe_path``), ``scaled_matmul`` dequantises both operands of each multiply
to fp32 (fused: read the codes and scales, write 4 bytes an element; eager: the codes'
bytes widened to indices and looked up in a 256-entry table, 13 bytes an element of fp8 or
e2m1 codes with one scale folded into the table, 21 with tile scales multiplied in place;
and 11 bytes a tile for the reciprocal multipliers), multiplies in fp32 and casts the
product to the compute dtype (``4 + a`` bytes an output element).

[Note: what a recipe saves] fp8_tensorwise saves each converted linear's input as its codes
(a byte an element and a 4-byte scale: [Note: what the low-bit linear saves] in linear.py);
the other recipes save the high-precision input, as a bf16 linear does. Without
checkpointing (``ac=none``) a layer then keeps the codes of every converted linear's input
(wq, wk and wv each cast the attention norm's output; w1 and w3 the MLP norm's) and no
longer the high-precision tensors only converted linears read: the norms' outputs (a
mixture of experts' router still reads the second), the SwiGLU product (w2's input), the
experts' permuted tokens and products, multi-head latent attention's normed latents, and
the attention output where the attention kernel does not keep it itself (unfused
attention; context parallelism's operator, whose output wo reads as a copy). A Llama block
in bf16 with flash attention and no tensor parallelism keeps ``2 dim`` bytes a token more
around attention (three codes for one bf16 tensor, wo's codes beside the kernel's output)
and ``ffn_dim`` fewer around the MLP. Selective checkpointing recomputes the casts (they are
not multiplies), so it keeps what it kept; full checkpointing keeps the layer's input.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from shardwise.parallel.lowbit.recipes import Recipe, get_recipe
from shardwise.parallel.lowbit.scaling import FORMATS, Scaling

__all__ = ["LowBitLinear", "RecipeWork", "block_linears", "recipe_work", "cast_bytes",
           "dequant_bytes", "keeps_codes", "unit_split"]

_SCALE_BYTES = {"fp32": 4, "pow2": 4, "e8m0": 1, "nvfp4": 1}
# nan_to_num_, then e2m1_round's clamp, exponent mask, clamp_, halving, divide, round and
# multiply, and the cast to the e4m3 values the codes are held in ([Note: low-bit casts])
_E2M1_EAGER = 8 + 8 + 8 + 8 + 8 + 12 + 8 + 12 + 5
# Bytes of the eager scale arithmetic: a tile's by scale kind, a dequantised tile's ([Note:
# low-bit casts], [Note: emulated low-bit multiplies]).
_EAGER_TILE = {"fp32": 136.0, "pow2": 161.0, "e8m0": 131.0, "nvfp4": 93.0}
_EAGER_DEQUANT_TILE = 11.0


@dataclass(frozen=True)
class LowBitLinear:
    """One block linear on one rank for one micro-batch.

    Attributes:
        name: the module's name in its block (wq, wk, wv, wo, w1, w2, w3; shared_experts.w1;
            experts.w1 for the routed experts' stacked w1).
        role: the ``LayerWork.gemm_roles`` entry its multiply belongs to.
        rows: rows of its input (tokens; per expert for routed experts).
        k, n: its in and out features on this rank.
        count: how many such linears (routed experts on this rank).
        reads: the high-precision tensor it reads ([Note: what a recipe saves]).
        full: (in, out) features before tensor parallelism, what the recipe checks.
    """

    name: str
    role: str
    rows: float
    k: int
    n: int
    count: int
    reads: str
    full: tuple[int, int]

    @property
    def flops(self) -> float:
        """Forward FLOPs of its multiplies (2 M K N each)."""
        return 2 * self.rows * self.k * self.n * self.count

    @property
    def shape(self) -> tuple[int, int]:
        """Its weight's shape on this rank, (out, in)."""
        return self.n, self.k


def _mlp(out: list, spec, role: str, hidden: int, rows: float, count: int, tp: int,
         reads: tuple[str, str]) -> None:
    d, f = spec.dim, hidden // tp
    ins = ("w1", "w3") if spec.mlp == "swiglu" else ("w1",)
    prefix = {"experts": "experts.", "shared": "shared_experts."}.get(role, "")
    for name in ins:
        out.append(LowBitLinear(prefix + name, role, rows, d, f, count, reads[0], (d, hidden)))
    out.append(LowBitLinear(prefix + "w2", role, rows, f, d, count, reads[1], (hidden, d)))


def _attention_linears(spec, t: float, tp: int) -> list[LowBitLinear]:
    d, h, heads = spec.dim, spec.n_heads // tp, spec.n_heads

    def lin(name: str, k: int, n: int, fk: int, fn: int, reads: str) -> LowBitLinear:
        return LowBitLinear(name, "attention", t, k, n, 1, reads, (fk, fn))

    if spec.is_mla:
        q, kv, rope = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim
        up = spec.qk_nope_head_dim + spec.v_head_dim
        out = ([lin("wq_a", d, q, d, q, "attn_in"),
                lin("wq_b", q, h * spec.qk_dim, q, heads * spec.qk_dim, "q_latent")] if q
               else [lin("wq", d, h * spec.qk_dim, d, heads * spec.qk_dim, "attn_in")])
        out += [lin("wkv_a", d, kv + rope, d, kv + rope, "attn_in"),
                lin("wkv_b", kv, h * up, kv, heads * up, "kv_latent")]
    else:
        kv, full_kv = max(1, spec.kv_heads // tp) * spec.hd, spec.kv_heads * spec.hd
        out = [lin("wq", d, h * spec.hd, d, heads * spec.hd, "attn_in"),
               lin("wk", d, kv, d, full_kv, "attn_in"), lin("wv", d, kv, d, full_kv, "attn_in")]
    return out + [lin("wo", h * spec.v_dim, d, heads * spec.v_dim, d, "wo_in")]


def block_linears(spec, moe: bool, tokens: float, tp: int = 1, ep: int = 1
                  ) -> list[LowBitLinear]:
    """Every linear of one block (the router excluded) on one (tp, ep) rank, for a micro-batch
    of ``tokens`` tokens, in the order the block runs them ([Note: the linears a recipe
    converts])."""
    t = float(tokens)
    out = _attention_linears(spec, t, tp)
    if not moe:
        _mlp(out, spec, "ffn", spec.ffn_dim, t, 1, tp, ("ffn_in", "ffn_act"))
        return out
    if spec.n_shared_experts:
        _mlp(out, spec, "shared", spec.n_shared_experts * spec.moe_ffn_dim, t, 1, tp,
             ("ffn_in", "shared_act"))
    per_expert = t * ep * spec.top_k / spec.n_experts  # as work.py routes them
    _mlp(out, spec, "experts", spec.moe_ffn_dim, per_expert, spec.n_experts // ep, tp,
         ("expert_in", "expert_act"))
    return out


def keeps_codes(recipe: Recipe) -> bool:
    """Whether the low-bit linear saves its input as codes (the forward's cast serves the
    weight gradient too: linear.py's ``keep_codes``)."""
    r = recipe
    return r.input_gw == r.input and r.input.transpose_invariant and r.input.fmt != "e2m1"


def _tiles(s: Scaling, rows: float, cols: float) -> float:
    if s.granularity == "tensor":
        return 1.0
    if s.granularity == "row":
        return rows
    br, bc = s.block
    return math.ceil(rows / br) * math.ceil(cols / bc)


def _scale_bytes(s: Scaling, rows: float, cols: float) -> float:
    """Bytes of a cast's scales: one per tile, NVFP4's fp32 tensor scale besides."""
    return _tiles(s, rows, cols) * _SCALE_BYTES[s.scale] + (4 if s.scale == "nvfp4" else 0)


def _code_bytes(s: Scaling) -> float:
    return FORMATS[s.fmt].bits / 8


def cast_bytes(s: Scaling, rows: float, cols: float, act_bytes: int, fused: bool) -> float:
    """HBM bytes of one cast of a ``rows x cols`` tensor of ``act_bytes``-byte elements with
    scaling ``s``, amax pass included ([Note: low-bit casts])."""
    e, a = rows * cols, act_bytes
    if fused:
        amax = a if s.granularity == "tensor" or s.scale == "nvfp4" else 0
        return e * (a + _code_bytes(s) + amax) + _scale_bytes(s, rows, cols)
    upcast = 0 if a == 4 else a + 4
    finish = _E2M1_EAGER if s.fmt == "e2m1" else 13.0  # clamp + cast, or e2m1's rounding
    tiles = _tiles(s, rows, cols) * _EAGER_TILE[s.scale]
    return (e * (upcast + _eager_amax_bytes(s, cols) + 8 + finish) + tiles
            + _scale_bytes(s, rows, cols))


def _eager_amax_bytes(s: Scaling, cols: float) -> float:
    """Bytes an element of ``quantize``'s tile amax: ``abs``, the folds in halves of a tile's
    columns with ``maximum`` while its width is even, the ``amax`` of what is left."""
    if s.granularity == "tensor":
        return 8 + 4.0
    width, folds = int(cols) if s.granularity == "row" else s.block[1], 0
    while width > 1 and width % 2 == 0:
        width, folds = width // 2, folds + 1
    return 8 + 12 * (1 - 2.0 ** -folds) + 4 * 2.0 ** -folds


def dequant_bytes(s: Scaling, rows: float, cols: float, fused: bool) -> float:
    """HBM bytes of dequantising a ``rows x cols`` tensor of codes to fp32 ([Note: emulated
    low-bit multiplies])."""
    e = rows * cols
    if fused:
        return e * (_code_bytes(s) + 4) + _scale_bytes(s, rows, cols)
    return (e * (13 + (8 if s.granularity != "tensor" else 0))
            + _tiles(s, rows, cols) * _EAGER_DEQUANT_TILE + _scale_bytes(s, rows, cols))


def _casts(r: Recipe, lin: LowBitLinear, a: int, fused: bool, offered: bool
           ) -> tuple[float, float]:
    """(forward, backward) cast bytes of one converted linear ([Note: low-bit casts])."""
    m, k, n = lin.rows, lin.k, lin.n

    def cast(s: Scaling, rows: float, cols: float) -> float:
        return cast_bytes(s, rows, cols, a, fused)

    weight = 0.0 if offered else cast(r.weight, n, k)
    fwd = cast(r.input, m, k) + weight
    bwd = cast(r.grad_output, m, n)
    if r.weight_gi == r.weight and r.weight.transpose_invariant:
        bwd += weight
    else:
        bwd += cast(r.weight_gi, k, n)
    if r.grad_gw is not None:
        if not (r.grad_gw == r.grad_output and r.grad_output.transpose_invariant):
            bwd += cast(r.grad_gw, n, m)
        if not keeps_codes(r):
            bwd += cast(r.input_gw, k, m)
    return lin.count * fwd, lin.count * bwd


def _dequants(r: Recipe, lin: LowBitLinear, a: int, fused: bool) -> tuple[float, ...]:
    """(forward, input-gradient, weight-gradient) bytes the emulation adds to one converted
    linear ([Note: emulated low-bit multiplies])."""
    m, k, n = lin.rows, lin.k, lin.n
    out = 0 if a == 4 else 4 + a  # the fp32 product cast to the compute dtype

    def dq(s: Scaling, rows: float, cols: float) -> float:
        return dequant_bytes(s, rows, cols, fused)

    fwd = dq(r.input, m, k) + dq(r.weight, n, k) + out * m * n
    gi = dq(r.grad_output, m, n) + dq(r.weight_gi, k, n) + out * m * k
    gw = 0.0 if r.grad_gw is None else dq(r.grad_gw, n, m) + dq(r.input_gw, k, m) + out * n * k
    return lin.count * fwd, lin.count * gi, lin.count * gw


@dataclass(frozen=True)
class RecipeWork:
    """What a recipe adds to one layer on one rank for one micro-batch (bytes).

    Attributes:
        recipe: the :class:`~shardwise.parallel.lowbit.Recipe`.
        converted: the linears it converts; skipped: (name, why) of those it cannot take.
        share: per ``LayerWork.gemm_roles`` role, the fraction of its FLOPs converted.
        cast_fwd, cast_bwd: the casts' and amax passes' bytes ([Note: low-bit casts]).
        dequant: (forward, input-gradient, weight-gradient) bytes of the emulation.
        saved_delta: activation bytes it adds (negative: saves) without checkpointing.
        skipped_flops: forward FLOPs of the skipped linears.
    """

    recipe: Recipe
    converted: tuple[LowBitLinear, ...]
    skipped: tuple[tuple[str, str], ...]
    share: dict[str, float] = field(default_factory=dict)
    cast_fwd: float = 0.0
    cast_bwd: float = 0.0
    dequant: tuple[float, float, float] = (0.0, 0.0, 0.0)
    saved_delta: float = 0.0
    skipped_flops: float = 0.0

    @property
    def converted_share(self) -> float:
        """The fraction of the block linears' FLOPs the recipe converts."""
        done = sum(x.flops for x in self.converted)
        total = done + self.skipped_flops
        return done / total if total else 0.0


def _eligible(r: Recipe, lins: list[LowBitLinear]):
    """(the linears ``r`` takes, those it skips) by their full shapes."""
    ok = [x for x in lins if r.shape_problem(*x.full) is None]
    return ok, [x for x in lins if x not in ok]


def _hp_elements(spec, tp: int, sp: bool) -> dict[str, float]:
    """High-precision elements a token saves of each tensor a linear reads, on this rank
    (work.py's accounting: outside the tensor-parallel regions split by ``sp``)."""
    split = tp if sp else 1
    d = spec.dim
    return {"attn_in": d / split, "ffn_in": d / split, "wo_in": spec.n_heads // tp * spec.v_dim,
            "q_latent": spec.q_lora_rank / split, "kv_latent": spec.kv_lora_rank / split,
            "ffn_act": spec.ffn_dim // tp, "expert_in": spec.top_k * d / split,
            "shared_act": spec.n_shared_experts * spec.moe_ffn_dim // tp,
            "expert_act": spec.top_k * spec.moe_ffn_dim // tp}


def _saved_delta(r: Recipe, spec, moe: bool, tokens: float, tp: int, sp: bool, a: int,
                 ok: list[LowBitLinear], skipped: list[LowBitLinear],
                 attn_keeps_output: bool) -> float:
    """[Note: what a recipe saves]: codes added, high-precision inputs freed."""
    if not keeps_codes(r):
        return 0.0
    codes = sum(x.count * (x.rows * x.k * _code_bytes(r.input) + 4) for x in ok)
    held = {x.reads for x in skipped} | ({"ffn_in"} if moe else set())  # router reads it
    held |= {"wo_in"} if attn_keeps_output else set()
    per_token = _hp_elements(spec, tp, sp)
    freed = sum(per_token[tag] for tag in {x.reads for x in ok} - held)
    return codes - a * tokens * freed


def recipe_work(spec, moe: bool, tokens: float, tp: int, ep: int, recipe, act_bytes: int,
                fused: bool, offered: bool = False, sp: bool = False,
                attn_keeps_output: bool = True) -> RecipeWork:
    """What ``recipe`` adds to one layer (see the module docstring).

    Args:
        spec: the ModelSpec; moe: the layer's feed-forward is a mixture of experts.
        tokens: tokens of the micro-batch on this rank; tp, ep: the degrees.
        recipe: a recipe name or :class:`~shardwise.parallel.lowbit.Recipe`.
        act_bytes: bytes of a compute-dtype element; fused: fused casts (compile) or eager.
        offered: the weights arrive as fp8 codes from ZeRO-3's gather (no weight casts).
        sp: sequence parallelism; attn_keeps_output: the attention kernel saves its output
            (flash attention on one rank), which wo reads.

    Raises:
        ValueError: an unknown recipe, or ``offered`` with a recipe other than
            fp8_tensorwise (the only one whose forward and backward weight codes agree).
    """
    r = get_recipe(recipe)
    if offered and r.name != "fp8_tensorwise":
        raise ValueError(f"offered fp8 weights need recipe fp8_tensorwise, got {r.name!r}")
    ok, skipped = _eligible(r, block_linears(spec, moe, tokens, tp, ep))
    role_total = Counter()
    role_done = Counter()
    for x in ok + skipped:
        role_total[x.role] += x.flops
    for x in ok:
        role_done[x.role] += x.flops
    share = {role: role_done[role] / total for role, total in role_total.items() if total}
    casts = [_casts(r, x, act_bytes, fused, offered) for x in ok]
    deq = [_dequants(r, x, act_bytes, fused) for x in ok]
    return RecipeWork(
        recipe=r, converted=tuple(ok),
        skipped=tuple((x.name, r.shape_problem(*x.full)) for x in skipped), share=share,
        cast_fwd=sum(f for f, _ in casts), cast_bwd=sum(b for _, b in casts),
        dequant=tuple(sum(d[i] for d in deq) for i in range(3)),
        saved_delta=_saved_delta(r, spec, moe, tokens, tp, sp, act_bytes, ok, skipped,
                                 attn_keeps_output),
        skipped_flops=sum(x.flops for x in skipped))


def unit_split(spec, layers, tp: int, ep: int, recipe) -> dict[tuple, tuple[list, list]]:
    """For each unit of a rank holding ``layers`` (keyed by its shapes, as
    ``CostModel.units`` lists them): (the weight shapes ``recipe`` converts, the other
    shapes): what ZeRO-3 gathers as fp8 codes with fp8_tensorwise."""
    r, out = get_recipe(recipe), {}
    for i in layers:
        ok, _ = _eligible(r, block_linears(spec, spec.is_moe_layer(i), 1, tp, ep))
        experts = list(spec.expert_shapes(i, tp, ep))
        for unit, conv in ((tuple(spec.block_shapes(i, tp, ep, experts=False)),
                            [x.shape for x in ok if x.role != "experts"]),
                           (tuple(experts), experts if any(x.role == "experts" for x in ok)
                            else [])):
            if unit and unit not in out:
                assert Counter(conv) <= Counter(unit), "converted shapes outside the unit"
                out[unit] = (conv, list((Counter(unit) - Counter(conv)).elements()))
    return out
