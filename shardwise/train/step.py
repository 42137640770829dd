"""One training step and one validation pass: what the loop in shardwise.train.trainer runs.

    record = train_step(model, optimizer, loader, cfg, env, step, scaler, guard)
    record = evaluate(model, val_ids, cfg, env, step)

Host syncs are a constant number per step (tests/test_host_syncs.py): the loss, the agreed
gradient norm and each rank's memory are read in one small all-gather. A pipelined model
runs its schedule instead of the accumulation loop; everything else is the same. Under
context parallelism each rank feeds its part of every sequence (``local_sequences``) and
the logged loss is still the global batch's ([Note: the loss under context parallelism] in
parallelize.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch
from torch import nn

from shardwise import LossScaler
from shardwise.distributed import env as dist_env
from shardwise.shard import clip_grads_with_norm_
from shardwise.train.config import Config
from shardwise.train.context import local_sequences
from shardwise.train.metrics import rss_mib
from shardwise.train.moe import finish_moe_record, with_moe_loss
from shardwise.train.parallelize import cross_entropy, data_rank, no_sync
from shardwise.train.pipeline import grad_norm as total_grad_norm
from shardwise.train.pipeline import pipeline_of
from shardwise.train.stats import gather_stats
from shardwise.train.stepguard import StepGuard
from shardwise.train.vla import vla_loss
from shardwise.train.vla_pipeline import vla_microbatches

__all__ = ["train_step", "forward_backward", "evaluate", "gather_stats", "sync_debug"]


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)  # (B, T, vocab), or (B, T, vocab / tp) under loss parallelism
    return cross_entropy(model, logits, targets)


def _micro_loss(model: nn.Module, batch: Any, env: dist_env.DistEnv) -> torch.Tensor:
    """One micro-batch's loss: a VLA batch (frames, tokens, action labels:
    shardwise.train.vla), or a text batch's whole sequences, of which this cp rank feeds
    its part."""
    if hasattr(batch, "images"):
        return vla_loss(model, batch.to(env.device))
    inputs, targets = local_sequences(model, *(t.to(env.device) for t in batch))
    return _loss(model, inputs, targets)


@contextlib.contextmanager
def sync_debug(mode: str, device: torch.device):
    """``torch.cuda.set_sync_debug_mode(mode)`` inside (``"warn"`` or ``"error"``: a host
    synchronisation warns or raises), the previous mode restored after; a no-op for
    ``"off"`` or off CUDA."""
    if mode == "off" or device.type != "cuda":
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _sync_debug(cfg: Config, env: dist_env.DistEnv):
    """``train.sync_debug`` around a region of the step (CUDA only)."""
    return sync_debug(cfg.train.sync_debug, env.device)


def forward_backward(model: nn.Module, loader: Any, cfg: Config, env: dist_env.DistEnv,
                      scaler: LossScaler, guard: StepGuard | None
                      ) -> tuple[torch.Tensor, int | None]:
    """The step's ``grad_accum`` micro-batches: the summed loss as a device tensor (read on
    the host once per step, with the other statistics), and the token positions this rank
    fed when the batches' lengths vary (VLA batches; None: ``batch_size x seq_len`` each)."""
    accum = cfg.train.grad_accum
    pipe = pipeline_of(model)
    if pipe is not None:  # the schedule's micro-batches are the accumulation (grad_accum 1)
        batch = loader.next_batch()
        if hasattr(batch, "images"):  # VLA: micro-batches of samples, each its own frames
            micro = vla_microbatches(batch, pipe.schedule.microbatches, env.device)
            return pipe.step(*micro).to(env.device), batch.tokens.numel()
        inputs, targets = local_sequences(model, *(t.to(env.device) for t in batch))
        return pipe.step(inputs, targets).to(env.device), None
    positions = None
    loss_sum = torch.zeros((), dtype=torch.float32, device=env.device)
    for micro in range(accum):
        batch = loader.next_batch()
        if hasattr(batch, "images"):  # lengths vary: count what was fed (shapes, no sync)
            positions = (positions or 0) + batch.tokens.numel()
        # Gradients are communicated once per step, on the last micro-batch.
        with no_sync(model) if micro < accum - 1 else contextlib.nullcontext():
            loss = _micro_loss(model, batch, env) / accum
            if guard is not None:
                loss = guard.on_loss(loss)
            scaler.scale(with_moe_loss(model, loss, accum)).backward()  # + MoE balance losses
        loss_sum += loss.detach().float()
    return loss_sum, positions


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any, cfg: Config,
               env: dist_env.DistEnv, step: int, scaler: LossScaler,
               guard: StepGuard | None = None) -> dict[str, Any]:
    """One optimizer step: ``grad_accum`` micro-batches, clip, update.

    Host syncs are a constant number per step, whatever the model's size: the loss, the
    global gradient norm (computed once, shared by the non-finite check and clipping) and
    the memory figures are read in one small all-gather before the update; fp16 loss
    scaling adds its overflow flag.

    Args:
        guard: failure handling (non-finite check before the update, injected faults).

    Returns:
        The step's record (loss averaged over micro-batches and ranks, lr used, grad norm,
        tokens/s, per-rank RSS and, on GPUs, peak allocated CUDA memory).

    Raises:
        RuntimeError: if the loss is not finite on some rank (naming the rank and the step);
            with a guard, :class:`~shardwise.shard.nonfinite.NonFiniteError` before the update.
    """
    start = time.perf_counter()
    accum = cfg.train.grad_accum
    lr = optimizer.param_groups[0]["lr"]
    with _sync_debug(cfg, env):
        loss_sum, positions = forward_backward(model, loader, cfg, env, scaler, guard)
    scaler.unscale_(model)  # fp16: reads the agreed overflow flag (one host read)
    if guard is not None:
        guard.after_backward(model)
    with _sync_debug(cfg, env):
        norm = total_grad_norm(model)  # over the pipeline ranks too
    cuda_mib = (torch.cuda.max_memory_allocated(env.device) / 2**20
                if env.device.type == "cuda" else 0.0)
    # One small all-gather per step: every rank's loss, the (agreed) gradient norm and each
    # rank's memory, read on the host once; what follows is decided on agreed values.
    stats = gather_stats([loss_sum, norm, rss_mib(), cuda_mib], env)
    grad_norm = float(stats[0, 1])
    losses = stats[:, 0].tolist()
    skip = None
    bad = [r for r, x in enumerate(losses) if not math.isfinite(x)]
    if guard is None and bad:
        raise RuntimeError(f"loss is {losses[bad[0]]} on rank {bad[0]} at step {step} "
                           f"(ranks with non-finite loss: {bad}); try a lower optim.lr")
    if guard is not None and (bad or not math.isfinite(grad_norm)):
        skip = guard.before_update(model, losses[env.rank], step, scaler.enabled)
    stepped = False
    if skip is None:
        if guard is not None:
            guard.before_optimizer()
        with _sync_debug(cfg, env):
            clip_grads_with_norm_(model, cfg.optim.grad_clip or math.inf, norm)
            stepped = scaler.step(model, optimizer)
        scaler.update()
    else:
        grad_norm = math.nan
    optimizer.zero_grad(set_to_none=True)
    moe = finish_moe_record(model, update_bias=skip is None and stepped)
    elapsed = time.perf_counter() - start
    ranks = data_rank(cfg, env)[1]
    tokens = (ranks * accum * cfg.train.batch_size * cfg.data.seq_len if positions is None
              else ranks * positions)  # VLA: this rank's positions, as if every rank's
    record = {"step": step, "loss": sum(losses) / len(losses), "lr": lr,
              "grad_norm": float(grad_norm), "tokens": tokens, "tokens_per_s": tokens / elapsed,
              "step_time_s": elapsed, "rss_mib": [round(m, 1) for m in stats[:, 2].tolist()]}
    if scaler.enabled:
        record.update(loss_scale=scaler.scale_value, skipped=not stepped,
                      skipped_steps=scaler.skipped_steps)
    if skip is not None:
        record.update(skipped=True, nonfinite=skip)
    if env.device.type == "cuda":
        record["cuda_peak_mib"] = [round(m, 1) for m in stats[:, 3].tolist()]
    record.update(moe)
    return record


@torch.no_grad()
def evaluate(model: nn.Module, val_ids: torch.Tensor, cfg: Config, env: dist_env.DistEnv,
             step: int) -> dict[str, Any]:
    """Mean loss over the first ``train.eval_batches`` held-out global batches, all ranks.

    The windows are unshuffled and the same at every evaluation, so the curve measures the
    model, not the sample.
    """
    from shardwise.data import iter_eval_batches

    rank, ranks = data_rank(cfg, env)  # tensor and cp ranks of one data rank share batches
    batches = iter_eval_batches(val_ids, seq_len=cfg.data.seq_len,
                                batch_size=cfg.train.batch_size, rank=rank,
                                world_size=ranks, max_batches=cfg.train.eval_batches)
    pipe = pipeline_of(model)  # a forward-only run of its schedule
    loss_fn = pipe.evaluate if pipe is not None else lambda x, y: _loss(model, x, y)
    model.eval()
    total, count = 0.0, 0
    for inputs, targets in batches:
        inputs, targets = local_sequences(model, inputs.to(env.device), targets.to(env.device))
        total += loss_fn(inputs, targets).item()
        count += 1
    model.train()
    mean = gather_stats([total / count], env)[:, 0].mean().item()
    tokens = ranks * count * cfg.train.batch_size * cfg.data.seq_len
    return {"step": step, "val_loss": mean, "val_tokens": tokens}
