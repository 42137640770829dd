"""Vision-language-action parity: train a ``VisionLanguageAction`` under ZeRO, tensor or expert
parallelism and one process on the same global batches, reusing parity.py's loop.

Batches are synthetic samples in the VLA interface's layout (``[BOS] [IMAGE] * P per frame,
words, [ACT]``, the action id as the label at ``[ACT]``, frames sample-major), made from a
seed on every rank. The loop of parity.py slices a tensor of *sample indices* per data rank,
and the loss collates the samples it is handed, so the batch convention (data rank ``r``
takes its slice of each global micro-batch) is parity.py's. With ``text_only`` every sample
data rank 0 gets in micro-batch 0 has no frame: that rank's vision tower runs on ``N = 0``
frames while the others see images.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.distributed.mesh import ParallelDims
from shardwise.models import ModelBlock, VLAConfig, finish_moe_step, moe_aux_loss
from shardwise.parallel import apply_ep, apply_global_balance, apply_tp
from shardwise.parallel import vocab_parallel_cross_entropy
from shardwise.testing.parity import ParityConfig, RunResult, _null, _optimizer, _train_dp
from shardwise.testing.parity import reference_run

__all__ = ["VLALayout", "VLASamples", "vla_reference", "vla_run"]

BOS = 1


@dataclass(frozen=True)
class VLALayout:
    """One layout to compare with one process."""

    stage: int = 3
    tp: int = 1
    ep: int = 1
    freeze_vision: bool = False
    text_only: bool = False
    steps: int = 3

    @property
    def accum(self) -> int:
        return 2 if self.text_only else 1  # micro-batch 0 text-only on rank 0, 1 with images

    @property
    def name(self) -> str:
        parts = [f"stage{self.stage}"] + [f"tp{self.tp}"] * (self.tp > 1)
        parts += [f"ep{self.ep}"] * (self.ep > 1) + ["frozen"] * self.freeze_vision
        return "-".join(parts + ["textonly"] * self.text_only)

    def parity(self) -> ParityConfig:
        return ParityConfig(stage=self.stage, accum=self.accum, steps=self.steps)


class VLASamples:
    """Synthetic samples of ``cfg``'s shapes for ``steps x accum x global_batch`` slots.

    ``batches`` is the ``(steps, accum, global_batch, 1)`` tensor of sample indices that
    parity.py's loop slices; :meth:`collate` turns a slice into ``(tokens, labels, images)``
    right-padded to one length for the whole run.
    """

    def __init__(self, cfg: VLAConfig, steps: int, accum: int, global_batch: int,
                 data_ranks: int, text_only: bool, seed: int = 0, max_frames: int = 2) -> None:
        g = torch.Generator().manual_seed(seed)
        self.cfg, self.samples = cfg, []
        per_rank = global_batch // data_ranks
        for slot in range(steps * accum * global_batch):
            micro, pos = (slot // global_batch) % accum, slot % global_batch
            blank = text_only and micro == 0 and pos < per_rank
            frames = 0 if blank else int(torch.randint(1, max_frames + 1, (), generator=g))
            words = torch.randint(5, cfg.first_action_id, (int(torch.randint(2, 5, (),
                                                                               generator=g)),),
                                  generator=g).tolist()
            action = int(torch.randint(0, cfg.num_action_tokens, (), generator=g))
            ids = [BOS] + [cfg.image_token_id] * (frames * cfg.num_patches) + words
            ids.append(cfg.act_token_id)
            images = torch.rand(frames, cfg.channels, cfg.image_size, cfg.image_size,
                                generator=g)
            self.samples.append((ids, cfg.first_action_id + action, images))
        self.seq_len = max(len(s[0]) for s in self.samples)
        self.batches = torch.arange(len(self.samples)).view(steps, accum, global_batch, 1)

    def collate(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens (B, T), labels (B, T), images (N, C, H, W))`` of the indexed samples."""
        rows = [self.samples[i] for i in index.flatten().tolist()]
        tokens = torch.full((len(rows), self.seq_len), self.cfg.pad_id, dtype=torch.long)
        labels = torch.full_like(tokens, -100)
        for b, (ids, action, _) in enumerate(rows):
            tokens[b, :len(ids)] = torch.tensor(ids)
            labels[b, len(ids) - 1] = action
        return tokens, labels, torch.cat([r[2] for r in rows])


def _loss_fn(data: VLASamples, tp_mesh=None, moe: bool = False):  # noqa: ANN001, ANN202
    def loss(model: nn.Module, index: torch.Tensor) -> torch.Tensor:
        tokens, labels, images = data.collate(index)
        logits = model(tokens, images)  # (B, T, V[/tp])
        if tp_mesh is not None:
            lm = vocab_parallel_cross_entropy(logits, labels, tp_mesh)
        else:
            lm = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        aux = moe_aux_loss(model) if moe else None
        return lm if aux is None else lm + aux
    return loss


def _after(moe: bool):  # noqa: ANN202
    return (lambda model: finish_moe_step(model)) if moe else None


def _build(build, layout: VLALayout) -> nn.Module:  # noqa: ANN001
    model = build()
    if layout.freeze_vision:
        model.vision.requires_grad_(False)
    return model


def vla_reference(build, data: VLASamples, layout: VLALayout) -> RunResult:  # noqa: ANN001
    """One process on the whole global batches."""
    moe = layout.ep > 1
    return reference_run(lambda: _build(build, layout), data.batches, layout.parity(),
                         loss_fn=_loss_fn(data, moe=moe), after_step=_after(moe))


def vla_run(build, data: VLASamples, layout: VLALayout, mesh_cache: dict) -> RunResult:  # noqa: ANN001
    """Train as ``layout`` lays the model out (call on every rank); blocks of both towers
    are units (``wrap={ModelBlock}``)."""
    import torch.distributed as dist

    dims = ParallelDims(world_size=dist.get_world_size(), tp=layout.tp, ep=layout.ep).resolved()
    if dims not in mesh_cache:  # building a mesh is collective: once per layout
        mesh_cache[dims] = dims.build_mesh()
    mesh = mesh_cache[dims]
    model = _build(build, layout)
    tp_mesh = None
    if layout.tp > 1:
        apply_tp(model, mesh["tp"], sequence_parallel=False)
        tp_mesh = mesh["tp"]
    moe = layout.ep > 1
    if moe:
        apply_ep(model, mesh)
    shardwise.shard(model, stage=layout.stage, wrap={ModelBlock}, mesh=mesh)
    if moe:
        apply_global_balance(model, mesh.group("dp"))
    cfg = layout.parity()
    opt = _optimizer(cfg.optimizer, model.parameters())
    return _train_dp(model, opt, data.batches, cfg, mesh.local_rank("dp"), mesh.size("dp"),
                     sync=lambda last: shardwise.no_sync(model) if not last else _null(),
                     clip=lambda: shardwise.clip_grad_norm_(model, cfg.clip or float("inf")),
                     full_state=lambda: shardwise.full_state_dict(model),
                     loss_fn=_loss_fn(data, tp_mesh, moe), after_step=_after(moe),
                     loss_group=mesh.group("dp"))

