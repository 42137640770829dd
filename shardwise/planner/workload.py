"""The job a layout is planned for: batch, sequence, precision, optimizer, software stack.

The layout says how the job is split; the workload says what the job is and how the
software beneath it behaves. The defaults describe shardwise itself (flash attention,
data-parallel collectives overlapped with compute by prefetch and ordered bucketed
reductions, pipeline sends overlapped); a published run from another stack sets the flags
that differ (Megatron-LM 2021 did not overlap its gradient all-reduce, DeepSeek-V3 hides its
expert all-to-all behind DualPipe, torchtitan's AsyncTP overlaps tensor-parallel
collectives).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from shardwise.parallel.lowbit.recipes import RECIPE_NAMES
from shardwise.planner.recompute import check_selective

__all__ = ["Workload", "DTYPE_BYTES", "MATMUL_RECIPES", "PP_SPLITS", "parse_workload"]

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
ATTENTION_DTYPE = {"fp8": "bf16"}
"""The attention kernel's dtype when the matrix multiplies of the linears use another
(Float8 training keeps attention in bf16)."""
MATMUL_RECIPES = ("none",) + RECIPE_NAMES
"""``matmul_recipe`` values: no low-bit matmuls, or one of ``shardwise.parallel.lowbit``'s
recipes (the trainer's ``precision.matmul``, whose "bf16" is "none" here)."""
PP_SPLITS = ("even", "ends")
"""``pp_split`` values ([Note: stage splits] in stage_cost.py)."""


@dataclass(frozen=True)
class Workload:
    """What is trained, and the software's overlap behaviour.

    Attributes:
        seq_len: tokens per sequence.
        global_batch: sequences per optimizer step.
        compute_dtype: dtype of the matrix multiplies ("bf16", "fp16", "fp8", "fp32");
            activations and gathered parameters are 16-bit unless this is "fp32". "fp8"
            prices every multiply, the head's included, at the fp8 peak with a generic cast
            per linear (the published runs' coarse description of Float8 stacks);
            ``matmul_recipe`` prices a recipe as shardwise runs it.
        matmul_recipe: the low-bit recipe of the blocks' linear layers (attention, MLP,
            experts; never the embedding, head, norms or routers), "none" (default) or one
            of ``shardwise.parallel.lowbit.RECIPE_NAMES``; the other multiplies stay in
            ``compute_dtype`` ([Note: pricing a low-bit recipe] in recipe_cost.py).
        param_dtype: dtype of the parameters the optimizer updates (masters).
        optimizer: "adamw", "adam" or "sgd" (momentum).
        attention: "flash" (fused kernel, causal half executed) or "unfused".
        fused_kernels: bandwidth-bound ops run as fused kernels (Megatron-LM, Transformer
            Engine, torch.compile); False (default): eager PyTorch, as shardwise.models runs
            (see [Note: fused and eager kernels] in work.py).
        fused_norm: the norms alone run as fused kernels in an otherwise eager model
            (torchtitan's ``norm_type = "fused_rmsnorm"``), default False.
        overlap_dp: data-parallel collectives overlap compute (default True).
        overlap_tp: tensor-parallel collectives of the forward passes overlap the matrix
            multiplies they feed (torch's AsyncTP: what exceeds the multiplies stays exposed,
            and the backward's stay exposed; [Note: tensor-parallel collectives]).
        overlap_tp_fraction: with ``overlap_tp``, the share of those collectives the
            software actually fuses (default 1.0: all; a version whose pattern matching
            misses some fuses fewer: fitted per version, see docs/planner.md).
        overlap_pp: pipeline sends overlap compute in the steady state (default True).
        overlap_ep: expert all-to-alls overlap compute (DualPipe-style: what exceeds the
            layer's compute stays exposed), default False.
        ep_node_limit: expert routing sends each token to at most this many nodes, once
            per node (DeepSeek-V3: 4); 0 (default): one message per (token, expert).
        comm_sm_fraction: share of the device's cores that communication kernels occupy
            while they overlap compute, which the model's kernels then lack (DeepSeek-V3
            reserves 20 of the H800's 132 SMs: 0.15); default 0.
        dp_sync_after_backward: data-parallel gradients are reduced once per step, after
            the last micro-batch's backward and behind no compute, and stage-3 parameters
            stay gathered between micro-batches (torch.distributed.pipelining with FSDP2);
            default False (reductions overlap the last backward).
        reduce_fp32: data-parallel gradient reductions run in fp32 (FSDP2 with
            ``reduce_dtype=float32``, torchtitan's only choice in 2024); default False
            (the compute dtype at ZeRO stages 1-3).
        prefetch: units gathered ahead at ZeRO stage 3 (default 1).
        reshard_after_forward: ZeRO stage 3 frees gathered parameters after each unit's
            forward and gathers them again for its backward (True, the engine's default);
            False keeps them until the backward (one gather per micro-batch, the gathered
            parameters of every in-flight unit held).
        p2p_scatter_gather: without sequence parallelism, pipeline sends carry 1/tp of the
            activations and tensor-parallel ranks all-gather them over NVLink (Megatron-
            LM's optimisation); False sends the whole activation from every rank.
        selective_ac: what ``ac=selective`` replays in this software ([Note: selective
            policies] in recompute.py): "ops" (default, shardwise: the bandwidth-bound
            ops), "alternate_mm" (torchtitan's op policy: also every second matrix
            multiply) or "layers:N" (torchtitan's layer policy: every N-th block fully).
        autograd_accum: the weight gradients of a step's micro-batches accumulate through
            autograd's add into the compute-dtype ``.grad`` (True, the default: shardwise's
            engine, whose micro-batches before the last run without gradient sync, and
            Megatron-LM's fp16 default of 2021-22): every micro-batch after the first moves
            3 compute-dtype words per parameter (read 2, write 1), the first hands its
            gradient over for free ([Note: gradient accumulation] in stage_cost.py). False:
            the stack accumulates otherwise (``grad_accum_bytes``), or not at all.
        grad_accum_bytes: bytes per parameter that each micro-batch's backward moves, the
            first included (when a step has more than one), to accumulate the weight
            gradients in a pass of the stack's own (after ``autograd_accum``'s, when both
            are set), priced at the device's memory bandwidth on every pipeline rank.
            0 (default): none (Megatron-LM's gradient_accumulation_fusion, where the
            multiplies accumulate in place); 10:
            FSDP2's fp32 accumulation of bf16 gradients; 18: DeepSpeed's 2022 BF16_Optimizer
            casts each bf16 gradient to fp32 and adds it into an fp32 buffer (cast: read 2,
            write 4; add: read 4 + 4, write 4).
        dp_copies: the engine copies each gathered parameter out of the gather's flat
            buffer and packs the gradients into the reduction's (True, the default:
            shardwise, FSDP2), priced at the memory bandwidth ([Note: the engine's copies
            on GPUs] in devices/gpu.py); False: parameters and gradients live in the
            collectives' buffers (Megatron-LM, DeepSpeed, FSDP1's flat parameters).
        zero1_all_reduce: at ZeRO stage 1, gradients are reduced with a whole all-reduce
            (each rank then updates its own shard and the parameters are all-gathered),
            as DeepSpeed's pipeline engine does with its BF16_Optimizer
            (``_bf16_reduce_grads``: ``buffered_allreduce_fallback`` of the fp32
            gradients); default False: a reduce-scatter, as shardwise's engine does.
        mla_up_recompute: MLA's up-projections are replayed in backward instead of keeping
            the per-head queries, keys and values (DeepSeek-V3, arXiv:2412.19437 Section
            3.2.3; [Note: DeepSeek-V3's activation storage] in recompute.py); priced in
            memory and as replayed multiplies. Default False.
        fp8_activations: the linears' cached inputs are fp8 (attention output: E5M6; MoE
            SwiGLU inputs: fp8, output replayed), DeepSeek-V3 Section 3.3.3 (same Note).
            Default False.
        moe_gate_in_activation: the routing weights multiply the experts' SwiGLU output
            before the down-projection (Megatron-Core's ``WeightedSwiGLUFunction``,
            ``megatron/core/fusions/fused_bias_swiglu.py`` at NVIDIA/Megatron-LM b1030e9:
            it keeps the SwiGLU input, optionally in fp8, and the weights, and takes the
            weights' gradient from the replayed SwiGLU output), so the combine is a plain
            sum and the experts' outputs are not kept for the gate's gradient. Default
            False (the combine weighs the experts' outputs, which it then keeps).
        optimizer_state_dtype: dtype of the optimizer's moments ("" (default): the
            parameter dtype; DeepSeek-V3 keeps AdamW's moments in "bf16", Section 3.3.3).
        grad_accum_dtype: dtype of the whole gradients ZeRO stage 1 (or accumulation)
            holds across micro-batches ("" (default): the compute dtype, as shardwise's
            engine; DeepSeek-V3 accumulates them in "fp32", Section 3.3.3).
        ema: an exponential moving average of the parameters (a param-dtype copy of this
            rank's parameters): "none" (default), "device" (kept in device memory) or
            "cpu" (kept in host memory and updated asynchronously: DeepSeek-V3 Section
            3.2.3, no device bytes).
        loss_grad_fp32: the loss runs PyTorch's ``cross_entropy`` on logits upcast to
            fp32 (torchtitan ``train.py`` ``loss_fn`` at 9dec370, ``pred.float()``), priced
            at its backward's peak, with every activation still held: eager, the saved fp32
            log-probabilities, ``nll_loss``'s dense fp32 gradient and ``log_softmax``'s
            fp32 gradient (12 bytes a logit); with tensor parallelism, DTensor's
            ``loss_parallel`` (torchtitan's default then), whose fused backward
            (``_nll_loss_and_log_softmax_backward`` in torch/distributed/tensor/parallel/
            loss.py) holds the saved log-probabilities, a zero-filled fp32 gradient,
            ``exp`` of the log-probabilities and their sum (16 bytes a logit). Default
            False (the logits and one fp32 gradient while the loss runs, and the fp32
            log-probabilities saved: ``work.head_work``).
        pp_split: how the layers split over pipeline stages ([Note: stage splits] in
            stage_cost.py): "even" (default: the first ``layers % stages`` stages one
            layer longer) or "ends" (the embedding and the head each count as a layer, so
            the first and the last stage hold one layer fewer: Llama 3, torchtitan's
            generated split points, BLOOM).
    """

    seq_len: int
    global_batch: int
    compute_dtype: str = "bf16"
    matmul_recipe: str = "none"
    param_dtype: str = "fp32"
    optimizer: str = "adamw"
    attention: str = "flash"
    fused_kernels: bool = False
    fused_norm: bool = False
    overlap_dp: bool = True
    overlap_tp: bool = False
    overlap_tp_fraction: float = 1.0
    overlap_pp: bool = True
    overlap_ep: bool = False
    ep_node_limit: int = 0
    comm_sm_fraction: float = 0.0
    dp_sync_after_backward: bool = False
    reduce_fp32: bool = False
    prefetch: int = 1
    reshard_after_forward: bool = True
    p2p_scatter_gather: bool = False
    selective_ac: str = "ops"
    autograd_accum: bool = True
    grad_accum_bytes: float = 0.0
    zero1_all_reduce: bool = False
    dp_copies: bool = True
    mla_up_recompute: bool = False
    fp8_activations: bool = False
    moe_gate_in_activation: bool = False
    optimizer_state_dtype: str = ""
    grad_accum_dtype: str = ""
    ema: str = "none"
    loss_grad_fp32: bool = False
    pp_split: str = "even"

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name.replace('_', '-')}={v!r}, expected an integer >= 1")
        for name in ("compute_dtype", "param_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name}={getattr(self, name)!r}, expected one of "
                                 f"{', '.join(DTYPE_BYTES)}")
        if self.matmul_recipe not in MATMUL_RECIPES:
            close = difflib.get_close_matches(str(self.matmul_recipe), MATMUL_RECIPES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"matmul_recipe={self.matmul_recipe!r}{hint}, expected one of "
                             f"{', '.join(MATMUL_RECIPES)}")
        if self.matmul_recipe != "none" and self.compute_dtype == "fp8":
            raise ValueError(f"matmul_recipe={self.matmul_recipe!r} with compute_dtype='fp8': "
                             f"the recipe's high precision is the compute dtype; expected "
                             f"compute_dtype bf16, fp16 or fp32 with a recipe")
        for name in ("optimizer_state_dtype", "grad_accum_dtype"):
            if getattr(self, name) not in ("",) + tuple(DTYPE_BYTES):
                raise ValueError(f"{name}={getattr(self, name)!r}, expected '' or one of "
                                 f"{', '.join(DTYPE_BYTES)}")
        if self.pp_split not in PP_SPLITS:
            raise ValueError(f"pp_split={self.pp_split!r}, expected one of "
                             f"{', '.join(PP_SPLITS)}")
        if self.ema not in ("none", "device", "cpu"):
            raise ValueError(f"ema={self.ema!r}, expected none, device or cpu")
        if self.attention not in ("flash", "unfused"):
            raise ValueError(f"attention={self.attention!r}, expected flash or unfused")
        check_selective(self.selective_ac)
        if not 0 <= self.overlap_tp_fraction <= 1:
            raise ValueError(f"overlap_tp_fraction={self.overlap_tp_fraction!r}, expected a "
                             f"fraction in [0, 1]")
        if isinstance(self.grad_accum_bytes, bool) or not (
                isinstance(self.grad_accum_bytes, (int, float)) and self.grad_accum_bytes >= 0):
            raise ValueError(f"grad_accum_bytes={self.grad_accum_bytes!r}, expected a number "
                             f"of bytes >= 0")
        if not 0 <= self.comm_sm_fraction < 1:
            raise ValueError(f"comm_sm_fraction={self.comm_sm_fraction!r}, expected a fraction "
                             f"in [0, 1)")

    @property
    def act_bytes(self) -> int:
        """Bytes of an activation / gathered-parameter element."""
        return 4 if self.compute_dtype in ("fp32", "tf32") else 2

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def moment_bytes(self) -> int:
        """Bytes of an optimizer moment element."""
        return DTYPE_BYTES[self.optimizer_state_dtype or self.param_dtype]

    @property
    def accum_bytes(self) -> int:
        """Bytes of a whole-gradient element held across micro-batches."""
        return DTYPE_BYTES[self.grad_accum_dtype] if self.grad_accum_dtype else self.act_bytes

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.seq_len * self.global_batch


def parse_workload(text: str) -> dict[str, object]:
    """``--workload`` pairs (``overlap_ep=true,fused_kernels=true``) as Workload fields.

    Raises:
        ValueError: an unknown field (with the closest one) or a value of the wrong kind.
    """
    kinds = {f.name: f.type for f in dataclasses.fields(Workload)
             if f.name not in ("seq_len", "global_batch")}
    out: dict[str, object] = {}
    for item in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = (x.strip() for x in item.partition("="))
        if not sep:
            raise ValueError(f"--workload: {item!r} is not key=value")
        if key not in kinds:
            close = difflib.get_close_matches(key, list(kinds), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"--workload: unknown field {key!r}{hint}; fields: "
                             f"{', '.join(kinds)}")
        kind = kinds[key]
        if kind == "bool":
            if value.lower() not in ("true", "false"):
                raise ValueError(f"--workload: {key}={value!r}, expected true or false")
            out[key] = value.lower() == "true"
        elif kind in ("int", "float"):
            try:
                out[key] = int(value) if kind == "int" else float(value)
            except ValueError:
                raise ValueError(f"--workload: {key}={value!r}, expected a number") from None
        else:
            out[key] = value
    return out
