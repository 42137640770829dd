"""The trainer's side of vision-language-action models (issue 34): data, loss, checks
(evaluation: vla_eval.py).

    shardwise train --config configs/vla.toml        # debug-vla on BabyAI-GoToLocal

A model whose config is a :class:`~shardwise.models.VLAConfig` (``debug-vla``,
``debug-vla-moe``, ``vla-7b``) trains on demonstrations of a BabyAI level made by
minigrid's expert bot (``shardwise.data.vla``), written once to ``vla.dir`` (made by the
launcher before any rank starts when it is missing). Each step's batches are
:class:`~shardwise.data.vla.VLABatch` es: frames, the mission's words, and the expert's action
as a token of the reserved top of the vocabulary; the loss is the cross-entropy of that
action token.

Validation reports, besides the loss on held-out demonstrations, ``action_accuracy`` (the
greedy action over the reserved ids against the expert's) and ``success_rate``: the policy
acting in the environment on ``vla.eval_episodes`` held-out seeds (greedy actions, the level's
step limit), in ``metrics.jsonl``, the summary and the plot, and a PNG strip of one episode
(``<log.dir>/rollout.png``).

[Note: the VLA under context parallelism] The cp ranks of a data rank hold the whole batch
(like tensor ranks). Each embeds the whole sequence (the tower and the merge on every frame:
cheap, and the same collectives on every rank), then decodes only its part in the layout of
``apply_cp`` (the batch right-padded to a length the layout cuts into equal chunks), whose
RoPE places the part at its global positions. The action labels are not spread evenly (one
per sample, wherever its ACT falls), so a rank's plain mean would weigh its few labels like
another's many: each rank's loss is instead ``cp x`` (its labels' summed cross-entropy) /
(the whole batch's labels), and the mean over the cp ranks, the engine's gradient average
over ``dp_cp`` and the loop's average of the logged losses are the batch's mean, as for text
([Note: the loss under context parallelism] in context.py). Validation and rollouts gather
the parts' logits over the cp group, so every cp rank sees the whole sequences and acts alike
(one of them speaks for the data rank, like a tensor rank's leader).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.parallel.context import chunk_count, cp_context, unshard_sequence
from shardwise.train.config import Config
from shardwise.train.freeze import apply_freeze
from shardwise.train.parallelize import cross_entropy

__all__ = ["VLAData", "is_vla", "vla_model_config", "build_vla_data", "build_vla_loader",
           "check_vla_data", "sample_spec", "vla_validation_note", "vla_loss", "check_vla",
           "describe_vla_data"]

IGNORE = -100  # the label of a position with no action (the data side's IGNORE_INDEX)


@dataclass(frozen=True)
class VLAData:
    """The demonstration dataset of a VLA run, made once before any rank starts.

    Attributes:
        path: the dataset directory (``vla.dir``).
        index: its JSON index (level, seeds, episodes, steps).
        vocab_size: None (the model's vocabulary is its own; the trainer keeps it).
    """

    path: Path
    index: dict
    vocab_size: None = None


def is_vla(model_cfg: Any) -> bool:
    """Whether ``model_cfg`` describes a vision-language-action model."""
    from shardwise.models import VLAConfig

    return isinstance(model_cfg, VLAConfig)


def vla_model_config(base: Any, overrides: dict[str, Any]) -> Any:
    """A VLA config with the ``[model]`` shape overrides applied to its decoder (the keys of
    ``[model]`` are the decoder's: ``dim``, ``n_layers``, ``num_experts`` ...)."""
    overrides = {k: v for k, v in overrides.items() if k != "vocab_size"}
    if not overrides:
        return base
    return dataclasses.replace(base, decoder=dataclasses.replace(base.decoder, **overrides))


def dataset_dir(cfg: Config) -> Path:
    """``vla.dir``, or ``data/vla/<level>-<episodes>`` when it is empty."""
    v = cfg.vla
    return Path(v.dir) if v.dir else Path("data") / "vla" / f"{v.level}-{v.episodes}"


def build_vla_data(cfg: Config) -> VLAData:
    """Make the dataset if it is missing (idempotent), before any rank starts.

    Raises:
        ValueError: a dataset in ``vla.dir`` made for another level or episode count.
        ImportError: minigrid is missing and the dataset must be generated
            (``pip install shardwise[vla]``).
    """
    from shardwise.data.vla import ensure_dataset, read_index

    path = dataset_dir(cfg)
    fresh = not (path / "index.json").exists()
    if fresh:
        print(f"vla: generating {cfg.vla.episodes} demonstrations of {cfg.vla.level} with "
              f"minigrid's expert bot into {path} (once)", flush=True)
    path = ensure_dataset(path, cfg.vla.level, cfg.vla.episodes)
    return VLAData(path=path, index=read_index(path))


def check_vla_data(cfg: Config, data: VLAData, model_cfg: Any) -> None:
    """The dataset against the batch, before any rank starts: at least one global batch of
    training samples and, since every validation reads them, of held-out samples.

    Raises:
        ValueError: too few samples in either split (naming the counts and what to raise).
    """
    par = cfg.parallel
    ranks = max(par.dp_replicate * par.dp_shard, 1)
    loader = build_vla_loader(cfg, data, model_cfg, 0, ranks)  # checks the training split
    need = cfg.train.batch_size * ranks
    if loader.num_val_samples < need:
        raise ValueError(f"vla.val_fraction={cfg.vla.val_fraction} of {cfg.vla.episodes} "
                         f"episodes holds out {loader.num_val_samples} samples, fewer than one "
                         f"global batch of {need} (train.batch_size x data ranks); expected a "
                         "larger vla.val_fraction or vla.episodes")


def describe_vla_data(data: VLAData) -> str:
    """The start line's data part."""
    idx = data.index
    return (f"{idx.get('episodes', '?')} {idx.get('level', '?')} demonstrations "
            f"({idx.get('steps', '?')} steps) in {data.path}")


def vla_validation_note(cfg: Config) -> tuple[str, str]:
    """What a VLA run's validation is: a short label, and the line printed at start."""
    share = f"{cfg.vla.val_fraction * 100:g}%"
    label = f"{share} of the episodes held out"
    line = (f"validation: loss and action accuracy on {share} of the episodes (vla."
            f"val_fraction), never trained on; success rate of the greedy policy acting on "
            f"{cfg.vla.eval_episodes} held-out seeds of {cfg.vla.level} (vla.eval_episodes)")
    return label, line


def sample_spec(model_cfg: Any):  # -> SampleSpec
    """The sample layout of the model's vocabulary and patches."""
    from shardwise.data.vla import SampleSpec

    return SampleSpec(vocab_size=model_cfg.vocab_size,
                      num_action_tokens=model_cfg.num_action_tokens,
                      patch_size=model_cfg.patch_size)


def build_vla_loader(cfg: Config, data: VLAData, model_cfg: Any, rank: int, ranks: int):
    """This data rank's resumable loader of the run's demonstrations."""
    from shardwise.data.vla import VLALoader

    return VLALoader(str(data.path), batch_size=cfg.train.batch_size, rank=rank,
                     world_size=ranks, seed=cfg.data.seed, frames=cfg.vla.frames,
                     spec=sample_spec(model_cfg), val_fraction=cfg.vla.val_fraction,
                     text_only_share=cfg.vla.text_only_share)


def full_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The whole vocabulary's logits: gathered along the vocabulary when tensor parallelism
    left them vocab-sharded (loss parallelism)."""
    from shardwise.parallel.tensor import tp_context

    ctx = tp_context(model)
    if ctx is None or not ctx.loss_parallel:
        return logits
    from shardwise.distributed.comm.dims import all_gather_dim

    return all_gather_dim(logits.contiguous(), -1, ctx.tp.group, label="vla.logits")


def _cp_padded(model: nn.Module, ctx: Any, tokens: torch.Tensor, labels: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens`` and ``labels`` right-padded to a length the cp layout cuts into equal
    chunks (padding never changes earlier positions: causal attention), and this rank's
    part of that length (its global positions)."""
    extra = -tokens.shape[1] % chunk_count(ctx.cp, ctx.load_balance)
    if extra:
        tokens = F.pad(tokens, (0, extra), value=model.config.pad_id)
        labels = F.pad(labels, (0, extra), value=IGNORE)
    return tokens, labels, ctx.positions(tokens.shape[1] // ctx.cp, tokens.device)


def vla_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean cross-entropy of the action tokens of ``batch`` (a VLABatch on the device).

    Under context parallelism ([Note: the VLA under context parallelism]) this cp rank's
    share of it: the ranks' shares average to the batch's mean."""
    ctx = cp_context(model)
    if ctx is None:
        logits = model(batch.tokens, batch.images)  # (B, T, vocab) or vocab-sharded
        return cross_entropy(model, logits, batch.labels)
    tokens, labels, part = _cp_padded(model, ctx, batch.tokens, batch.labels)
    logits = model(tokens, batch.images, part)  # (B, T / cp, vocab)
    summed = F.cross_entropy(logits.flatten(0, 1).float(), labels[:, part].flatten(),
                             ignore_index=IGNORE, reduction="sum")
    return summed * ctx.cp / (labels != IGNORE).sum().clamp_min(1)


def whole_logits(model: nn.Module, tokens: torch.Tensor, images: torch.Tensor
                 ) -> torch.Tensor:
    """The ``(B, T, vocab)`` logits of the whole sequences, on every rank (validation and
    rollouts): under context parallelism each cp rank decodes its part and the parts are
    gathered, so the cp ranks of a data rank see the same logits and act alike."""
    ctx = cp_context(model)
    if ctx is None:
        return full_logits(model, model(tokens, images))
    from shardwise.distributed.comm.dims import all_gather_dim

    seq_len = tokens.shape[1]
    tokens, _, part = _cp_padded(model, ctx, tokens, torch.zeros_like(tokens))
    local = full_logits(model, model(tokens, images, part)).contiguous()  # (B, T / cp, V)
    parts = all_gather_dim(local, 1, ctx.group, label="vla.cp_logits").chunk(ctx.cp, dim=1)
    return unshard_sequence(list(parts), ctx.load_balance)[:, :seq_len]


# Longest BabyAI mission in words (PutNextLocal / PickupLoc stay far below), with BOS and ACT.
_TEXT_ROOM = 32


def check_vla(cfg: Config, model_cfg: Any) -> None:
    """The checks of a VLA run, before any rank starts (the decoder's own checks are the
    text models').

    Raises:
        ValueError: a layout the VLA path does not take yet (a pipeline with tensor or
            expert parallelism or a frozen tower, context parallelism with a pipeline,
            tensor or expert parallelism, sequence parallelism, the planner's layout), a
            vision tower the tensor degree
            does not divide, a ``[vla]`` value out of range, samples longer than the
            decoder's ``max_seq_len``, a ``model.freeze`` name that is not a submodule.
    """
    par, v = cfg.parallel, cfg.vla
    pipelined = par.pp > 1
    refusals = [(pipelined and par.tp > 1, f"parallel.pp={par.pp} with parallel.tp={par.tp}",
                 "one of them 1"),
                (pipelined and par.ep > 1, f"parallel.pp={par.pp} with parallel.ep={par.ep}",
                 "one of them 1"),
                (pipelined and bool(cfg.model.freeze),
                 f"parallel.pp={par.pp} with model.freeze={list(cfg.model.freeze)}",
                 "one of them unset"),
                *((par.cp > 1 and getattr(par, axis) > 1,
                   f"parallel.cp={par.cp} with parallel.{axis}={getattr(par, axis)}",
                   "one of them 1") for axis in ("pp", "tp", "ep")),
                (par.tp > 1 and par.sequence_parallel is True,
                 "parallel.sequence_parallel=true", "false or unset"),
                (par.plan == "auto", "parallel.plan='auto'", "'off'")]
    for bad, value, expected in refusals:
        if bad:
            raise ValueError(f"{value} is not supported with the vision-language-action model "
                             f"{cfg.model.name!r} yet; expected {expected}")
    hidden = int(model_cfg.vision_dim * model_cfg.vision_mlp_ratio)
    for name, size in (("vision_heads", model_cfg.vision_heads), ("vision MLP width", hidden)):
        if par.tp > 1 and size % par.tp:
            raise ValueError(f"parallel.tp={par.tp} does not divide the {name} {size} of "
                             f"{cfg.model.name!r}; expected a tp that divides it")
    for name, value, ok, expected in (
            ("episodes", v.episodes, v.episodes >= 1, ">= 1"),
            ("frames", v.frames, v.frames >= 0, ">= 0"),
            ("val_fraction", v.val_fraction, 0 < v.val_fraction < 1, "0 < x < 1"),
            ("eval_episodes", v.eval_episodes, v.eval_episodes >= 0, ">= 0"),
            ("text_only_share", v.text_only_share, 0 <= v.text_only_share <= 1, "0 <= x <= 1"),
            ("level", v.level, v.level.startswith("BabyAI-"), "a BabyAI level id")):
        if not ok:
            raise ValueError(f"vla.{name}={value!r}; expected {expected}")
    longest = v.frames * model_cfg.num_patches + _TEXT_ROOM
    if par.cp > 1:  # padded to the cp layout's chunks
        longest += -longest % chunk_count(par.cp, par.cp_load_balance)
    if longest > model_cfg.max_seq_len:
        raise ValueError(f"vla.frames={v.frames} makes samples of up to {longest} tokens "
                         f"({model_cfg.num_patches} per frame), more than max_seq_len="
                         f"{model_cfg.max_seq_len} of {cfg.model.name!r}; expected fewer frames "
                         "or a larger model.max_seq_len")
    if cfg.model.freeze:
        from shardwise.models import build_model

        apply_freeze(build_model(model_cfg, device="meta"), cfg.model.freeze)
