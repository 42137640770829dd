"""The sections of the training configuration that say how the model is spread over ranks
and in what numbers: parallel degrees and the planner, mixed precision, quantised
communication, offload and mixture-of-experts routing (config.py holds the rest and the
loading; io.py reads every section's field docstrings for ``--help``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelConfig", "PrecisionConfig", "CommConfig", "OffloadConfig", "MoEConfig"]


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks and how the model is spread over them."""

    nproc: int = 2
    """Local ranks to launch when not started by torchrun or SLURM (1: run in this process)."""
    stage: int = 3
    """ZeRO stage: 0 plain data parallel, 1 shard optimizer state, 2 + gradients, 3 + params."""
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP outer axis); pp x dp_replicate x dp_shard x cp x tp =
    world size."""
    dp_shard: int = -1
    """Ranks each replica is sharded over (-1: world size // (pp x dp_replicate x cp x tp));
    parameters are sharded over dp_shard x cp."""
    tp: int = 1
    """Tensor-parallel degree: ranks each layer's matrices are split over (Megatron style,
    consecutive ranks of one node); heads, vocabulary and feed-forward width must divide."""
    sequence_parallel: bool | None = None
    """With tp > 1, split norms and residual activations along the sequence between
    tensor-parallel regions (1/tp of their memory; seq_len must divide). Unset: on if tp > 1."""
    cp: int = 1
    """Context-parallel degree: ranks each sequence is split over (attention sees the whole
    sequence through cp_impl; every token-wise activation is 1/cp). The cp ranks of one data
    rank share its sequences, like tp ranks: pp x dp_replicate x dp_shard x cp x tp = world
    size, and cp does not multiply the global batch. data.seq_len must divide by 2 x cp
    (cp_load_balance "zigzag") or cp ("none")."""
    cp_impl: str = "ring"
    """Context-parallel attention: "ring" (key/value blocks passed around the cp ranks),
    "ulysses" (all-to-all from sequence to head shards: cp must divide the key/value heads
    per tensor rank) or "hybrid" (all-to-all inside groups of consecutive cp ranks, ring
    across them)."""
    cp_load_balance: str = "zigzag"
    """How a sequence is cut over the cp ranks: "zigzag" (2 x cp chunks, rank r holding
    chunks r and 2 cp - 1 - r: equal causal work) or "none" (cp contiguous pieces)."""
    ep: int = 1
    """Expert-parallel degree: ranks each MoE layer's experts are split over, carved out of
    the data ranks (it divides dp_shard x cp and the number of experts; does not multiply the
    world size). Expert weights are ZeRO-sharded over the dp_shard x cp / ep ranks holding
    them.
    With pp > 1 it splits each stage's experts over that stage's data ranks."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (stage 3) and gather them again for backward."""
    prefetch: int = 1
    """Units whose parameters are gathered ahead of use (0: no prefetch)."""
    backend: str = "auto"
    """c10d backend: "auto" (nccl with CUDA, else gloo), "gloo" or "nccl"."""
    timeout_s: float = 600.0
    """Collective timeout in seconds; a collective that outlives it fails instead of hanging."""
    watchdog: str = "on"
    """Collective watchdog: "on" (hangs, divergence and dead ranks fail every rank with one
    report, docs/failures.md), "debug" (also compare every collective's shapes across ranks
    before it runs: slower) or "off"."""
    pp: int = 1
    """Pipeline-parallel degree: ranks the layers are split over in stages (pp outermost;
    pp x dp_replicate x dp_shard x cp x tp = world size; docs/parallelism.md)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: "gpipe", "1f1b", "interleaved_1f1b", "zb1" (ZB-H1), "zbv",
    "dualpipev" or "looped_bfs"."""
    pp_microbatches: int = 0
    """Micro-batches each rank's train.batch_size sequences are split into (must divide it).
    0: chosen for throughput: the fewest dividing batch_size, at least pp x virtual and the
    schedule's minimum (2 pp for dualpipev), whose simulated bubble is at most 25%; else one
    sequence per micro-batch (e.g. 4 of 1 sequence for 1f1b or zbv at pp 2 and batch 4)."""
    pp_virtual: int = 0
    """Stages per pipeline rank (0: the schedule's own, 1 for gpipe/1f1b/zb1 and 2 for
    interleaved_1f1b/zbv/dualpipev; zbv and dualpipev run exactly 2)."""
    pp_layers_per_stage: tuple[int, ...] = ()
    """Transformer blocks per stage, e.g. 3,2,2: pp x virtual counts summing to the model's
    layers (empty: as even as possible, earlier stages taking the remainder)."""
    plan: str = "off"
    """"off" (the layout as configured) or "auto": the planner chooses the layout (stage,
    dp_replicate / dp_shard / tp / pp, sequence parallelism, pipeline schedule and
    micro-batches, batch_size x grad_accum for the same global batch, activation
    checkpointing) for this world size and memory, measures the first steps, refits its
    constants and switches layout (checkpoint, rebuild, resume) when another is predicted
    faster by more than replan_threshold (docs/planner.md). Keys set in the TOML or on the
    command line stay as given (see plan_fixed)."""
    replan_threshold: float = 0.10
    """With plan = "auto": switch only to a layout predicted faster than the measured one by
    more than this fraction of its step time (0 <= x < 1)."""
    replan_steps: int = 3
    """With plan = "auto": steps measured in each layout before deciding (after one warm-up
    step, not counted); at least 1."""
    plan_fixed: tuple[str, ...] = ()
    """With plan = "auto": the layout keys the planner keeps as configured (parallel.stage,
    dp_replicate, dp_shard, tp, sequence_parallel, pp, pp_schedule, pp_microbatches,
    pp_virtual; train.batch_size, grad_accum, activation_checkpoint; as dotted keys). Unset in
    the TOML and on the command line: the keys of that list given there (a TOML spelling
    every key, like configs/debug.toml, sets plan_fixed = [] to leave them to the planner)."""
    plan_hardware: str = "local"
    """With plan = "auto": the planner's device ("local": this machine, from the calibration
    of `shardwise plan --hardware local --calibrate`; or a catalogue name such as h100)."""
    plan_calibration: str = ""
    """With plan = "auto": calibration file of the "local" device ("": $SHARDWISE_CALIBRATION,
    else ~/.cache/shardwise/calibration.toml)."""
    fault_tolerant: bool = False
    """Keep training when replica groups fail (docs/failures.md): each of the dp_replicate
    groups shards inside itself (dp_shard ranks), a step commits the gradients of the groups
    alive for all of it, a lost group leaves the others running and heals from a live peer
    when it comes back (torchft: a quorum per step). tp, cp and pp stay 1; with plan = "auto"
    each group's layout is planned for its ranks when it starts."""
    ft_lighthouse: str = ""
    """With fault_tolerant: the quorum server's address (http://host:port), started once for
    the job (`torchft_lighthouse`); "": the launcher starts one on this machine."""
    ft_min_groups: int = 1
    """With fault_tolerant: replica groups a step needs to commit (fewer alive: it waits)."""
    ft_timeout_s: float = 10.0
    """With fault_tolerant: how long a collective across groups, a quorum or a healing may
    take before the groups that did not answer are dropped (a frozen group costs this)."""
    ft_heartbeat_ms: int = 1000
    """With fault_tolerant and the launcher's quorum server: a group silent this long is out
    of the next quorum."""
    ft_max_restarts: int = 100
    """With fault_tolerant and local ranks: how often the launcher restarts a failed group,
    which then rejoins and heals."""


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute and communication dtypes; masters and optimizer state stay fp32."""

    param_dtype: str = "fp32"
    """Dtype of gathered parameters and compute: "fp32", "bf16" or "fp16"."""
    reduce_dtype: str = "fp32"
    """Dtype gradients are reduced in: "fp32", "bf16" or "fp16"."""
    loss_scale: float = 65536.0
    """fp16 only: initial dynamic loss scale (halved on overflow, the step skipped)."""
    loss_scale_growth_interval: int = 2000
    """fp16 only: clean steps before the loss scale doubles."""
    matmul: str = "bf16"
    """Matmuls of the blocks' linear layers (attention, MLP, experts): "bf16" (no low-bit
    matmuls: they run in param_dtype), or a low-bit recipe: "fp8_tensorwise", "fp8_rowwise",
    "fp8_rowwise_gw_hp", "fp8_blockwise", "mxfp8", "nvfp4" (docs/precision.md)."""
    matmul_skip: tuple[str, ...] = ()
    """With a low-bit matmul: module-name patterns (fnmatch) kept in high precision, e.g.
    layers.0.*,layers.7.* (embedding, head, norms and routers always are)."""


@dataclass(frozen=True)
class CommConfig:
    """Quantised communication (ZeRO++) and the hierarchical partition; stages 1-3."""

    weights: str = "fp"
    """Parameter all-gathers: "fp" (the compute dtype), "int8" or "fp8" (blockwise scales)."""
    grads: str = "fp"
    """Gradient reduce-scatters: "fp" (the reduce dtype), "int8" or "int4" (fp32 sums)."""
    block_size: int = 256
    """Elements per quantisation block (one fp32 scale each)."""
    hierarchy: int = 0
    """Stage 3: ranks per node keeping a secondary partition for backward (0: off)."""


@dataclass(frozen=True)
class OffloadConfig:
    """CPU or disk offload of fp32 masters and optimizer state."""

    device: str = "none"
    """Where optimizer state lives: "none", "cpu" or "disk" (files under path)."""
    path: str = ""
    """Disk offload: an existing, writable directory with room for the optimizer state."""
    buffer_mb: float = 64.0
    """Disk offload: RAM for streaming optimizer state, in MiB (the bound it stays under)."""
    budget_mb: float = 0.0
    """CPU offload on an accelerator: MiB of masters + state moved to the host (0: all)."""
    prefetch: bool = True
    """Disk offload: read the next chunk's state while the current one steps."""


@dataclass(frozen=True)
class MoEConfig:
    """Routing and load balancing of mixture-of-experts models (docs/moe.md); only for a
    model with MoE layers (e.g. --model.name debug-moe)."""

    capacity_factor: float | None = None
    """Unset: dropless routing. A number > 0: each expert keeps at most ceil(capacity_factor
    x tokens x top_k / num_experts) assignments per rank's micro-batch; the rest are dropped."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch/GShard balance loss added to the objective (balance "aux")."""
    z_loss_coef: float = 0.001
    """Weight of the router z loss mean(logsumexp(router logits)^2) (ST-MoE), any balance."""
    balance: str = "aux"
    """"aux" (auxiliary loss), "bias" (DeepSeek-V3: a routing bias nudged every step, no
    auxiliary loss) or "none"."""
    bias_update_rate: float = 0.001
    """With balance "bias": the bias change per optimizer step of an overloaded (minus) or
    underloaded (plus) expert."""


@dataclass(frozen=True)
class VLADataConfig:
    """Vision-language-action runs (a model such as debug-vla): demonstrations and evaluation
    in the environment (docs/multimodal.md)."""

    level: str = "BabyAI-GoToLocal-v0"
    """BabyAI level the demonstrations come from and the policy is evaluated on."""
    episodes: int = 1000
    """Expert demonstrations (episodes) in the training dataset."""
    dir: str = ""
    """Dataset folder, made on first use ("": data/vla/<level>-<episodes>)."""
    frames: int = 1
    """Frames per sample: the last k observations before each action (0: text only)."""
    val_fraction: float = 0.05
    """Share of the episodes held out for validation loss and action accuracy (0 < x < 1)."""
    eval_episodes: int = 200
    """Episodes the policy acts in at each validation, on held-out seeds (success rate)."""
    text_only_share: float = 0.0
    """Probability that a training sample carries no frame (instruction only; 0 <= x <= 1)."""
    strip: bool = True
    """Write a PNG strip of one evaluation episode to <log.dir>/rollout.png."""
