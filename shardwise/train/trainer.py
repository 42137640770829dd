"""The training loop, assembled from small ``build_*`` functions.

    cfg, data = preflight(cfg, world_size)     # shardwise.train.preflight: no rank trains yet
    env = build_env(cfg)                       # process group (torchrun / SLURM / single)
    summary = train(cfg, data, env)            # model -> parallel model -> optimizer -> loop

``shardwise train`` (shardwise.train.cli) wires these together for each way of launching.

Parallelism lives in shardwise.train.parallelize only: the sharded model, the optimizer
wrapper for offload, the no-communication context for accumulation micro-batches and
gradient clipping.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardwise
from shardwise.distributed import env as dist_env
from shardwise.distributed import watchdog
from shardwise.parallel.lowbit.recipes import RECIPES
from shardwise.train.config import Config
from shardwise.train.parallelize import (build_loss_scaler, build_parallel_model,
                                         data_leader, data_rank, describe_layout, describe_matmul,
                                         layout_record, wrap_optimizer)
from shardwise.train.metrics import (
    MetricsLogger, format_summary, peak_rss_mib, plot_losses)
from shardwise.train.moe import describe_moe
from shardwise.train.pipeline import describe_pipeline
from shardwise.train.preflight import build_model_config
from shardwise.train.resume_checks import RUN_KEY, run_record
from shardwise.train.lr_schedule import apply_schedule_horizon, build_lr_schedule, lr_factor
from shardwise.train.step import evaluate, gather_stats, train_step
from shardwise.train.stepguard import StepGuard
from shardwise.train.vla_eval import evaluate_vla
from shardwise.train.vla import (build_vla_loader, describe_vla_data, is_vla,
                                 vla_validation_note)

__all__ = [
    "build_env", "build_optimizer", "lr_factor", "build_lr_schedule", "train_step", "evaluate",
    "train", "build_checkpointer", "resume_or_import", "validation_note",
]


# ----------------------------------------------------------------------------- building


def build_env(cfg: Config) -> dist_env.DistEnv:
    """Join (or create) the process group, and give each local rank its share of the cores.

    Raises:
        ValueError: from :func:`shardwise.distributed.env.init` (bad backend, SLURM without
            MASTER_ADDR / MASTER_PORT).
    """
    backend = None if cfg.parallel.backend == "auto" else cfg.parallel.backend
    env = dist_env.init(backend=backend, timeout_s=cfg.parallel.timeout_s,
                        watchdog=cfg.parallel.watchdog)
    if env.device.type == "cpu":
        # N ranks each using every core oversubscribe the CPU several times over.
        import os

        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    return env


def build_optimizer(model: nn.Module, optim: Any) -> torch.optim.Optimizer:
    """AdamW with two parameter groups: decayed, and names matching ``optim.no_decay``.

    Args:
        model: the (parallel) model; parameter names as ``named_parameters()`` gives them.
        optim: the ``[optim]`` section.

    Returns:
        A ``torch.optim.AdamW``; each group's ``initial_lr`` is the peak lr.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            skip = any(pattern in name for pattern in optim.no_decay)
            (no_decay if skip else decay).append(param)
    groups = [{"params": decay, "weight_decay": optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=optim.lr,
                             betas=optim.betas, eps=optim.eps)


# ----------------------------------------------------------------------------- checkpoints


def build_checkpointer(cfg: Config) -> Any:
    """The run's :class:`shardwise.checkpoint.Checkpointer` under ``checkpoint.dir`` (default
    ``<log.dir>/checkpoints``); collective: it makes its own process group."""
    from shardwise.checkpoint import Checkpointer

    c = cfg.checkpoint
    root = Path(c.dir or Path(cfg.log.dir) / "checkpoints").expanduser()
    return Checkpointer(root, keep_last=c.keep_last, async_save=c.async_save,
                        timeout_s=max(cfg.parallel.timeout_s, 1800.0))


def resume_or_import(cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer,
                     stateful: dict[str, Any], env: dist_env.DistEnv
                     ) -> tuple[Any, int, str | None]:
    """The Checkpointer, then ``checkpoint.resume``, else ``checkpoint.import_safetensors``
    (see :func:`shardwise.checkpoint.run.resume_or_import`).

    Returns:
        ``(checkpointer, steps already done, a line saying what was loaded, or None)``.
    """
    from shardwise.checkpoint.run import resume_or_import as load

    c, ckpt = cfg.checkpoint, build_checkpointer(cfg)
    done, note = load(ckpt, model, optimizer, stateful, resume=c.resume,
                      import_path=c.import_safetensors)
    return ckpt, done, note


def _checkpoint_summary(ckpt: Any, done: int) -> dict[str, Any]:
    return {"resumed_from_step": done, "saved": [str(r.path) for r in ckpt.results],
            "peak_snapshot_mib": round(ckpt.peak_snapshot_bytes / 2**20, 2)}


def _checkpoint_due(step: int, cfg: Config) -> bool:
    interval = cfg.checkpoint.interval
    return interval > 0 and (step % interval == 0 or step == cfg.train.steps)


# ----------------------------------------------------------------------------- the loop


def describe_features(cfg: Config) -> str:
    """The rest of the start line: activation checkpointing, compile, what the collectives
    send, where optimizer state lives."""
    t, c, o = cfg.train, cfg.comm, cfg.offload
    weights, recipe = c.weights, RECIPES.get(cfg.precision.matmul)
    if weights == "fp8" and recipe is not None and recipe.gathers_weight_codes:
        # [Note: fp8 weight gathers]: not the blockwise codec
        weights = f"fp8 ({recipe.name} layers as their matmul's codes, the rest unquantised)"
    wire = "full precision" if (c.weights, c.grads) == ("fp", "fp") else (
        f"weights {weights}, gradients {c.grads} (blocks of {c.block_size})")
    if c.hierarchy:
        wire += f", hierarchy {c.hierarchy}"
    return (f"activation checkpointing {t.activation_checkpoint}; compile "
            f"{'on (' + t.compile_backend + ')' if t.compile else 'off'}; communication "
            f"{wire}; optimizer offload {o.device}")


def validation_note(cfg: Config) -> tuple[str, str]:
    """What the validation split is: a short label for each validation line, and the line
    printed at start (the split is the corpus's tail, not a random sample)."""
    from shardwise.data.corpus import STDLIB_SOURCE

    share = f"{cfg.data.val_fraction * 100:g}%"
    label = f"the last {share} of the corpus, held out"
    line = f"validation: the last {share} of the corpus (data.val_fraction), never trained on"
    if cfg.data.source == STDLIB_SOURCE:
        line += ("; for stdlib these are other modules than the training text, so expect "
                 "validation loss above train loss")
    return label, line


def _eval_due(step: int, cfg: Config) -> bool:
    interval = cfg.train.eval_interval
    return step == cfg.train.steps or (interval > 0 and step % interval == 0)


def _start_logger(cfg: Config, env: dist_env.DistEnv, model_cfg: Any, data: Any, done: int,
                  notes: list[str | None]) -> MetricsLogger:
    """Rank 0's metrics sink, and the lines that open the run: model, layout, data, the
    validation split, what was resumed or imported (``notes``)."""
    val_label, val_line = (vla_validation_note(cfg) if is_vla(model_cfg)
                           else validation_note(cfg))
    logger = MetricsLogger(cfg.log.dir, cfg.train.steps, enabled=env.is_main,
                           progress=cfg.log.progress, tensorboard=cfg.log.tensorboard,
                           refresh_every=cfg.train.log_interval, resume_step=done,
                           val_label=val_label)
    shape = model_cfg.decoder if is_vla(model_cfg) else model_cfg
    vision = (f"vision {model_cfg.vision_layers} x {model_cfg.vision_dim}, " if
              is_vla(model_cfg) else "")
    described = (describe_vla_data(data) if is_vla(model_cfg) else
                 f"{data.train_ids.numel():,} train / {data.val_ids.numel():,} val tokens")
    logger.echo(f"model {cfg.model.name!r} ({vision}dim {shape.dim}, {shape.n_layers} layers, "
                f"vocab {model_cfg.vocab_size}): {model_cfg.num_params():,} parameters; "
                f"{env.world_size} rank{'s' if env.world_size > 1 else ''} ({env.launcher}, "
                f"{env.backend}); data {described}")
    logger.echo(val_line)
    logger.echo(f"layout {describe_layout(cfg, env.world_size)}; compute "
                f"{cfg.precision.param_dtype}, reduce {cfg.precision.reduce_dtype}, masters "
                f"fp32; {describe_features(cfg)}")
    for note in notes:
        if note:
            logger.echo(note)
    return logger


@watchdog.guarded  # an exception here stops the other ranks at once, naming this one
def train(cfg: Config, data: Any, env: dist_env.DistEnv, replan: Any = None
          ) -> dict[str, Any] | None:
    """Train ``cfg.train.steps`` steps on this rank; rank 0 writes the outputs.

    Args:
        cfg: the resolved config (:func:`preflight`).
        data: the :class:`~shardwise.train.preflight.TokenData` (identical on every rank).
        env: this process's place in the job (:func:`build_env`).

        replan: ``parallel.plan = "auto"``'s :class:`~shardwise.train.replan.Replanner`
            (default None: the layout is fixed); when it asks to switch, a checkpoint is
            saved and this returns None (the caller resumes in the new layout).

    Returns:
        The run summary on rank 0, None elsewhere.

    Raises:
        RuntimeError: non-finite loss (naming the rank and step).
    """
    from shardwise.data import TokenLoader

    start = time.perf_counter()
    model_cfg = build_model_config(cfg, data.vocab_size)
    model = build_parallel_model(cfg, model_cfg, env)
    optimizer = wrap_optimizer(build_optimizer(model, cfg.optim), model)
    scaler = build_loss_scaler(cfg)
    schedule = build_lr_schedule(optimizer, cfg.optim, cfg.train.steps)
    rank, ranks = data_rank(cfg, env)  # tensor ranks of one data rank share its batches
    vla = is_vla(model_cfg)
    loader = (build_vla_loader(cfg, data, model_cfg, rank, ranks) if vla else
              TokenLoader(data.train_ids, seq_len=cfg.data.seq_len,
                          batch_size=cfg.train.batch_size, rank=rank, world_size=ranks,
                          seed=cfg.data.seed))
    stateful = {"schedule": schedule, "scaler": scaler, "loader": loader}
    ckpt, done, note = resume_or_import(cfg, model, optimizer, stateful, env)
    horizon = apply_schedule_horizon(schedule, cfg.optim.schedule_horizon, cfg.train.steps, done)
    shape = model_cfg.decoder if vla else model_cfg
    notes = [describe_matmul(model), describe_moe(shape, cfg), describe_pipeline(cfg, model),
             note, horizon]
    logger = _start_logger(cfg, env, model_cfg, data, done, notes)
    saved = {**stateful, RUN_KEY: run_record(cfg)}  # the batch, for a later resume's check
    train_time = 0.0
    guard = StepGuard(cfg, env, model)
    try:
        for step in range(done + 1, cfg.train.steps + 1):
            guard.begin(step)
            record = train_step(model, optimizer, loader, cfg, env, step, scaler, guard)
            schedule.step()
            train_time += record["step_time_s"]
            logger.log_step(record)
            if _eval_due(step, cfg):
                logger.log_eval(evaluate_vla(model, loader, model_cfg, cfg, env, step, rank,
                                             ranks, leader=data_leader(cfg, env)) if vla
                                else evaluate(model, data.val_ids, cfg, env, step))
            if _checkpoint_due(step, cfg):
                ckpt.save(step, model, optimizer, extra=saved)
            if replan is not None and replan.after_step(record, model, optimizer, logger):
                if not _checkpoint_due(step, cfg):  # re-plan: resume from here, re-laid out
                    ckpt.save(step, model, optimizer, extra=saved)
                break
    finally:
        logger.close()
        guard.close()
    ckpt.close()  # the last background save, if any, is committed before the summary
    if replan is not None and replan.switching is not None:
        return None
    mem = shardwise.memory_report(model, optimizer)
    if hasattr(optimizer, "close"):  # offloaded optimizer state: remove its files now
        optimizer.close()
    peak = gather_stats([peak_rss_mib(), mem.model_state_bytes / 2**20], env)
    if not env.is_main:
        return None
    return _finish(cfg, env, logger, peak[:, 0].tolist(), train_time,
                   time.perf_counter() - start, model_state_mib=peak[:, 1].tolist(),
                   skipped_steps=scaler.skipped_steps + len(guard.skipped),
                   checkpoint=_checkpoint_summary(ckpt, done))


def _finish(cfg: Config, env: dist_env.DistEnv, logger: MetricsLogger,
            peak_mib: list[float], train_time: float, elapsed: float,
            model_state_mib: list[float], skipped_steps: int,
            checkpoint: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank 0: loss plot (the whole history, a resumed run's earlier steps included),
    summary.json (this run's steps), and the summary printed."""
    import json

    log_dir = Path(cfg.log.dir)
    steps = [r for r in logger.records if "loss" in r]
    vals = [r for r in logger.all_records if "val_loss" in r]
    outputs = ["config.toml", "metrics.jsonl"]
    if cfg.log.plot:
        plot_losses(logger.all_records, log_dir / "loss.png")
        outputs.append("loss.png")
    if (log_dir / "rollout.png").exists():  # a VLA policy's evaluation episode
        outputs.append("rollout.png")
    if cfg.log.tensorboard:
        outputs.append("tb/")
    outputs.append("summary.json")
    tokens = sum(r["tokens"] for r in steps)
    # The first step builds what later steps reuse (compiled graphs, pooled buffers, the
    # optimizer state): the steady state is the median of the steps after it.
    later = [r["tokens_per_s"] for r in steps[1:]] or [r["tokens_per_s"] for r in steps]
    summary = {
        "final_train_loss": steps[-1]["loss"] if steps else None,
        "first_train_loss": steps[0]["loss"] if steps else None,
        "final_val_loss": vals[-1]["val_loss"] if vals else None,
        "val_split": logger.val_label,
        "steps": len(steps), "tokens": tokens,
        "tokens_per_s": tokens / train_time if train_time > 0 else None,
        "steady_tokens_per_s": statistics.median(later) if later else None,
        "world_size": env.world_size, "zero_stage": cfg.parallel.stage,
        "layout": layout_record(cfg, env.world_size),
        "peak_rss_mib": [round(m, 1) for m in peak_mib],
        "model_state_mib": [round(m, 2) for m in model_state_mib],
        "skipped_steps": skipped_steps,
        "train_time_s": train_time, "elapsed_s": elapsed,
        "log_dir": str(log_dir), "outputs": outputs,
    }
    if vals and "success_rate" in vals[-1]:  # a VLA policy's last evaluation
        summary["final_success_rate"] = vals[-1]["success_rate"]
        summary["final_action_accuracy"] = vals[-1]["action_accuracy"]
    if checkpoint is not None:
        summary["checkpoint"] = checkpoint
    (log_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="ascii")
    print(format_summary(summary), flush=True)
    return summary
