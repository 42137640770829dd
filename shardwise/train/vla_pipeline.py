"""A pipelined vision-language-action model in the trainer: its micro-batches, its validation
and its policy (issue 34).

    shardwise train --config configs/vla.toml --parallel.nproc 2 --parallel.pp 2

The model's pieces (``VisionLanguageAction.pipeline_pieces``: vision tower, projector and
token embedding on the first stage) are split like any model's; what is the VLA's here is
the data: a :class:`~shardwise.data.vla.VLABatch` is cut by samples into the schedule's
micro-batches, each with its own frames (``VLABatch.split``; a micro-batch may hold none),
given to the executor as a list of ``(tokens, images)`` inputs with a list of labels, which
reach the last stage's loss as text targets do (the executor's cross-entropy ignores the
-100 labels, as ``vla_loss`` does).

[Note: the pipelined policy] Validation needs the last stage's logits, not only its loss:
the forward-only run of the schedule (``PipelineExecutor.evaluate``) is given a loss
function of its own that, on the last stage, counts the greedy action's accuracy or keeps the
logits at each row's ``ACT`` position. For a rollout every pipeline rank of a data rank steps
the same environments (the same seeds, so the same episodes while the actions agree); the
batch is padded with frameless rows to a multiple of the micro-batches, and the last stage's
``(B, vocab)`` logits at ``ACT`` are broadcast over the pipeline group so that every rank
takes the same actions. The policy reads only the ``ACT`` positions, so the ``(B, T, vocab)``
logits it is given are that row broadcast along ``T`` (a view: nothing of size ``T x vocab``
is sent or held).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shardwise.distributed import comm

__all__ = ["vla_microbatches", "is_last_stage", "pipeline_accuracy", "PipelineLogits"]


def vla_microbatches(batch: Any, microbatches: int, device: torch.device
                     ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """A VLA batch as the executor's list form: ``microbatches`` inputs ``(tokens, images)``
    (each micro-batch's samples and their frames, possibly none) and their labels.

    Args:
        batch: a :class:`~shardwise.data.vla.VLABatch` (on the CPU: the split reads the rows'
            frame counts on the host).
        microbatches: the schedule's micro-batches (dividing the batch's samples).
        device: where the micro-batches go.

    Returns:
        ``(inputs, labels)``, one entry per micro-batch.

    Raises:
        ValueError: the samples do not split into ``microbatches`` equal parts.
    """
    parts = [b.to(device) for b in batch.split(microbatches)]
    return [(b.tokens, b.images) for b in parts], [b.labels for b in parts]


def is_last_stage(pipe: Any) -> bool:
    """Whether this rank holds the pipeline's last stage (whose loss function sees logits)."""
    return any(st.is_last for st in pipe.part.stages)


@torch.no_grad()
def pipeline_accuracy(pipe: Any, batch: Any, first_action: int, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One validation batch through the schedule's forward-only path: the batch's mean
    cross-entropy at its labelled positions, the greedy action's correct count (argmax over
    the ids from ``first_action``) and the labelled positions, as the non-pipelined path
    in vla.py computes them. Zeros except on the last stage's rank.

    Args:
        pipe: the model's executor.
        batch: a :class:`~shardwise.data.vla.VLABatch` on the CPU.
        first_action: the first action id.
        device: this rank's device.

    Returns:
        ``(batch mean loss, correct, counted)``, float64 0-d tensors.
    """
    zero = torch.zeros((), dtype=torch.float64, device=device)
    ce, correct, counted = zero.clone(), zero.clone(), zero.clone()

    def count(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        nonlocal ce, correct, counted
        at = labels != -100  # (b, T): the ACT positions
        rows = logits.float()[at]  # (n, vocab)
        ce = ce + F.cross_entropy(rows, labels[at], reduction="sum")
        correct = correct + (rows[:, first_action:].argmax(-1) + first_action
                             == labels[at]).sum()
        counted = counted + at.sum()
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    pipe.evaluate(*vla_microbatches(batch, pipe.schedule.microbatches, device), loss_fn=count)
    return ce / counted.clamp_min(1), correct, counted


class PipelineLogits:
    """``(tokens, images) -> logits`` of a pipelined VLA for the greedy policy, on every
    pipeline rank ([Note: the pipelined policy]): the last stage's logits at each row's
    ``ACT`` position, broadcast over the pipeline group, as a ``(B, T, vocab)`` view.

    Args:
        pipe: the model's executor.
        vocab_size: the model's vocabulary.
        act_id, bos_id: the ``ACT`` and ``BOS`` ids (a padding row is ``[BOS, ACT, PAD..]``).
    """

    def __init__(self, pipe: Any, vocab_size: int, act_id: int, bos_id: int) -> None:
        self.pipe, self.vocab_size, self.act_id, self.bos_id = pipe, vocab_size, act_id, bos_id

    def _padded(self, tokens: torch.Tensor, images: torch.Tensor) -> Any:
        from shardwise.data.vla import VLABatch

        m = self.pipe.schedule.microbatches
        extra = -tokens.shape[0] % m
        if extra:  # frameless rows: every micro-batch holds at least one sample
            pad = torch.zeros(extra, tokens.shape[1], dtype=tokens.dtype, device=tokens.device)
            pad[:, 0], pad[:, 1] = self.bos_id, self.act_id
            tokens = torch.cat([tokens, pad])
        labels = torch.where(tokens == self.act_id, 0, -100)  # marks the ACT positions
        return VLABatch(tokens, labels, images).to("cpu")

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        device = tokens.device
        batch = self._padded(tokens, images)
        kept: list[torch.Tensor] = []

        def keep(logits: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
            kept.append(logits[marks != -100].float())  # (rows, vocab): one ACT per row
            return logits.new_zeros((), dtype=torch.float32)

        self.pipe.evaluate(*vla_microbatches(batch, self.pipe.schedule.microbatches, device),
                           loss_fn=keep)
        groups = self.pipe.groups
        at_act = (torch.cat(kept) if kept else
                  torch.zeros(batch.batch_size, self.vocab_size, device=device))
        if groups.pp is not None and groups.pp_size > 1:
            last = groups.global_rank(self.pipe.part.placement[-1])
            comm.broadcast(at_act, last, groups.pp, label="vla.rollout_logits")
        return at_act[:b, None, :].expand(b, t, self.vocab_size)  # read at ACT only
