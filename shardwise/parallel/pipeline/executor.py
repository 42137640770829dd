"""Run a :class:`Schedule` on real ranks: ``PipelineExecutor(part, schedule).step(x, y)``.

    schedule = build_schedule("zb1", pp=2, microbatches=4)
    part = shard_stages(split_stages(model, mesh, schedule.virtual,
                                     placement=schedule.placement), stage=1)
    pipe = PipelineExecutor(part, schedule)
    loss = pipe.step(tokens, targets)      # the batch's mean loss, on every pipeline rank
    clip_grad_norm_(part, 1.0); optimizer.step(); optimizer.zero_grad()

Each rank runs its own action list of the very schedule the simulator reads, step by step
(``messages.steps``): a compute action alone, a run of communication actions as one batch posted
together, sends eager and waited at the end of the step ([Note: communication semantics] in
messages.py, [Note: agreed shapes] in mailbox.py). The batch of ``B`` sequences is cut into the
schedule's ``microbatches`` equal micro-batches; the last stage's loss of each is divided by
their number, so the step's gradients and loss are the whole batch's mean, as with pp 1.
A stage with MoE layers adds the balance losses of each forward to that micro-batch's
backward ([Note: balance losses in a pipeline] in moe.py); the returned loss stays the LM
loss.

[Note: pipeline engine controls] The executor drives the ZeRO engine of each stage only
through its per-micro-batch controls ([Note: per-micro-batch controls] in controls.py), at
the engine actions of its training list ([Note: engine actions] in action_lists.py):

* gradient sync is off from the start of the step; ``REDUCE_GRAD`` turns it on before the
  stage's last ``B`` or ``W``, so gradients are reduced once per step, after the last
  micro-batch, however many passes ran. An ``I`` pass computes the stage input's gradient
  and defers the weight-gradient work, which its ``W`` pass does later and accumulates into
  ``graph_parameters`` in one backward call ([Note: split backward] in split_backward.py;
  the ``grad`` calls before it run under ``paused_backward_hooks``);
* stage 3 (``keep_gathered=True``, the default): ``UNSHARD`` keeps a stage's parameters
  gathered from its first action (``set_reshard_after_forward/backward(False)``) and
  ``RESHARD`` frees them after its last (``reshard``): one all-gather per piece per step,
  and the stage's full parameters (1/pp of the model's, or 1/(pp v) per stage) in memory
  through the step. ``keep_gathered=False`` inserts neither and leaves the engine's
  defaults, which free them after each pass: memory between actions drops to the shards,
  at the price of re-gathering for every micro-batch's forward (its ``I`` or ``B`` reads
  the weights gathered in the pass's hooks; a split ``W`` reads only saved activations and
  gathers nothing, the ``W`` of an activation-checkpointed stage re-gathers): about M (2M
  with checkpointing and a zero-bubble schedule) all-gathers per piece per step instead
  of 1.

A rank's watchdog context (``watchdog.active().context["pp action"]``) names the action it
is on, so a rank that fails or hangs inside a schedule is reported with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.distributed import comm, watchdog
from shardwise.parallel.pipeline.actions import Action, Kind
from shardwise.parallel.pipeline.mailbox import Mailbox
from shardwise.parallel.pipeline.moe import stage_balance_roots
from shardwise.parallel.pipeline.messages import steps
from shardwise.parallel.pipeline.action_lists import Schedule, add_engine_actions
from shardwise.parallel.checkpointing import checkpointed_blocks
from shardwise.parallel.pipeline.split import PipelinePart, StageModule
from shardwise.parallel.pipeline.split_backward import DeferredWeights, input_pass, weight_pass
from shardwise.parallel.pipeline.ties import TiedWeights
from shardwise.parallel.tensor import tp_context, vocab_parallel_cross_entropy
from shardwise.shard import controls
from shardwise.shard.registry import engine_states

__all__ = ["PipelineExecutor", "forward_schedule", "cross_entropy_loss", "default_loss",
           "split_microbatches", "ActionTime"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the micro-batch (fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def default_loss(part: PipelinePart) -> LossFn:
    """The loss of a part's last stage: :func:`cross_entropy_loss`, or the vocab-parallel
    cross-entropy over the tensor ranks when the head returns vocab-sharded logits (a model
    parallelised with ``apply_tp(..., loss_parallel=True)``)."""
    ctx = tp_context(part)
    if ctx is None or not ctx.loss_parallel:
        return cross_entropy_loss
    group = ctx.tp.group

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, group)
    return loss


def forward_schedule(schedule: Schedule) -> Schedule:
    """The forward-only schedule for validation: each rank's forwards in the order
    ``schedule`` runs them, with their messages."""
    ranks = [[a for a in acts if a.kind is Kind.F] for acts in schedule.compute_only().ranks]
    return Schedule.from_compute(f"{schedule.name}-forward", schedule.pp,
                                 schedule.microbatches, schedule.virtual, schedule.placement,
                                 ranks).validate()


def split_microbatches(batch: Any, microbatches: int) -> list[Any]:
    """``batch`` cut along dim 0 into ``microbatches`` equal parts.

    Args:
        batch: a tensor, a tuple or dict of tensors (each cut along dim 0), or a list of the
            ``microbatches`` micro-batches themselves (returned as they are: micro-batches
            that differ, e.g. one with no image).
        microbatches: how many.

    Returns:
        One input per micro-batch.

    Raises:
        ValueError: the batch size is not a multiple of ``microbatches``, or a list of
            another length (naming both).
    """
    if isinstance(batch, list):
        if len(batch) != microbatches:
            raise ValueError(f"a list of {len(batch)} micro-batches was given; the schedule "
                             f"runs pp_microbatches={microbatches}")
        return batch
    if isinstance(batch, tuple):
        return list(zip(*(split_microbatches(t, microbatches) for t in batch)))
    if isinstance(batch, dict):
        cut = {k: split_microbatches(v, microbatches) for k, v in batch.items()}
        return [{k: v[i] for k, v in cut.items()} for i in range(microbatches)]
    size = batch.shape[0]
    if size % microbatches:
        raise ValueError(f"a batch of {size} sequences does not split into "
                         f"pp_microbatches={microbatches} equal micro-batches; the batch size "
                         f"must be a multiple of {microbatches}")
    return list(batch.chunk(microbatches))


@dataclass(frozen=True)
class ActionTime:
    """When one step of the rank's list ran (``time.perf_counter`` seconds)."""

    text: str
    compute: bool
    start: float
    end: float


@dataclass
class _Program:
    """One action list, prepared: its steps (engine actions included, for training)."""

    steps: list[tuple[Action, ...]]
    next_comm: dict[int, int] = field(default_factory=dict)
    """Communication step index -> index of the next communication step."""

    @classmethod
    def of(cls, actions) -> _Program:
        prog = cls(steps(actions))
        comm_steps = [i for i, step in enumerate(prog.steps) if step[0].is_comm]
        prog.next_comm = dict(zip(comm_steps, comm_steps[1:]))
        return prog


class PipelineExecutor:
    """Runs a schedule's action lists on this rank's stages (see the module docstring).

    Args:
        part: this rank's stages (:func:`split_stages`, sharded or not).
        schedule: the schedule; its placement must be the one ``part`` was split with.
        loss_fn: ``(logits, targets) -> scalar`` mean loss of one micro-batch (default:
            next-token cross-entropy, vocab-parallel for a tensor-parallel model with loss
            parallelism: :func:`default_loss`).
        keep_gathered: stage 3: gather each stage once per step (True, default) or per
            micro-batch (False); see [Note: pipeline engine controls].
        record_times: keep the timestamps of every step of the list (``last_times``).

    Raises:
        ValueError: the schedule does not fit the part (pp, stages or placement), or it
            splits backward passes (``W`` actions) while a stage holds selectively
            checkpointed blocks (on every pipeline rank alike).
    """

    def __init__(self, part: PipelinePart, schedule: Schedule, loss_fn: LossFn | None = None,
                 *, keep_gathered: bool = True, record_times: bool = False) -> None:
        groups = part.groups
        if (schedule.pp, schedule.placement) != (groups.pp_size, part.placement):
            raise ValueError(f"schedule {schedule.name!r} places its {schedule.num_stages} "
                             f"stages {list(schedule.placement)} over pp={schedule.pp}; the "
                             f"part was split into {list(part.placement)} over "
                             f"pp={groups.pp_size}: split with placement=schedule.placement")
        self.part, self.schedule, self.groups = part, schedule, groups
        self.loss_fn = loss_fn or default_loss(part)
        self.keep_gathered, self.record_times = keep_gathered, record_times
        self.train_program = _Program.of(add_engine_actions(schedule.ranks[groups.pp_rank],
                                                            keep_gathered))
        self.eval_program = _Program.of(forward_schedule(schedule).ranks[groups.pp_rank])
        self.sharded = {st.index: bool(engine_states(st)) for st in part.stages}
        # [Note: split backward]: checkpointed stages recompute once per autograd call.
        self.splittable = {st.index: not checkpointed_blocks(st) for st in part.stages}
        device = next(part.parameters()).device
        self.mailbox = Mailbox(part.placement, groups.pp_rank, groups.global_rank, groups.pp,
                               device)
        self.ties = TiedWeights(part)
        self.last_times: list[ActionTime] = []
        refused = _selective_under_split(schedule, part)
        if groups.pp is not None and groups.pp_size > 1:
            # NCCL: the first point-to-point call on a group must involve all its ranks. It
            # also carries the refusal below, so every pipeline rank refuses alike.
            flag = torch.tensor([float(refused)], device=comm.group_device(groups.pp))
            comm.all_reduce(flag, groups.pp, label="pp.init")
            refused = bool(flag.item())
        if refused:
            raise ValueError(
                f"schedule {schedule.name!r} splits each backward into input- and "
                f"weight-gradient passes, and blocks checkpointed with policy 'selective' "
                f"allow one backward: checkpoint them with policy 'full', or use a schedule "
                f"without W passes ([Note: refused on every pipeline rank])")

    # ------------------------------------------------------------------ public
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One training step's forward and backward passes (no optimizer step).

        Args:
            inputs: the batch, ``(B, T)`` token ids, on every pipeline rank (every stage
                rebuilds its side inputs from its micro-batch: the Transformer reads only its
                shape); or any model's inputs, a tuple or dict of tensors or a list of the
                micro-batches (:func:`split_microbatches`).
            targets: ``(B, T)`` next-token ids (or a list per micro-batch), on every
                pipeline rank.

        Returns:
            The mean loss over the whole batch (a 0-d fp32 tensor), on every pipeline rank.
            The gradients are in the parameters' ``.grad`` (reduced over each stage's data
            axes, tied weights summed).

        Raises:
            ValueError: ``B`` is not a multiple of the schedule's micro-batches.
        """
        return self._run(self.train_program, inputs, targets, train=True)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor,
                 loss_fn: LossFn | None = None) -> torch.Tensor:
        """The batch's mean loss from a forward-only run of the schedule (validation).

        Same arguments and result as :meth:`step`; no gradient is computed.

        Args:
            loss_fn: this run's ``(logits, targets) -> loss`` on the last stage, in place of
                the executor's (default None: the executor's); it sees each micro-batch's
                logits, e.g. to count accuracy or keep what a policy acts on.
        """
        return self._run(self.eval_program, inputs, targets, train=False, loss_fn=loss_fn)

    # ------------------------------------------------------------------ running
    def _run(self, prog: _Program, inputs, targets, train: bool,
             loss_fn: LossFn | None = None) -> torch.Tensor:
        m = self.schedule.microbatches
        xs, ts = split_microbatches(inputs, m), split_microbatches(targets, m)
        self.mailbox.begin([_signature(x) for x in xs])
        self.ties.sync_weights()
        if train:
            self._begin_controls()
        run = _Run(xs, ts, train, loss_fn or self.loss_fn)
        wd = watchdog.active()
        times: list[ActionTime] = []
        for i, step in enumerate(prog.steps):
            text = _describe(step) if wd is not None or self.record_times else ""
            if wd is not None:  # left in place if the action raises: the report names it
                wd.context["pp action"] = text
            start = time.perf_counter()
            if step[0].is_comm:
                self.mailbox.run_batch(step)
                if i in prog.next_comm:  # [Note: early receives] in mailbox.py
                    self.mailbox.prepost(prog.steps[prog.next_comm[i]])
            elif step[0].is_engine:
                self._engine(step[0])
            else:
                self._compute(step[0], run)
            if self.record_times:
                times.append(ActionTime(text, step[0].is_compute, start, time.perf_counter()))
        if wd is not None:
            wd.context["pp action"] = "end of step"
        self.mailbox.finish()
        if wd is not None:
            wd.context.pop("pp action", None)
        if train:
            self.ties.reduce_grads()
        self.last_times = times
        return self._mean_loss(run.losses)

    def _begin_controls(self) -> None:
        for st in self.part.stages:
            if self.sharded[st.index]:
                controls.set_gradient_sync(st, False)

    def _engine(self, a: Action) -> None:
        """An engine action ([Note: pipeline engine controls]); nothing for an unsharded
        stage."""
        st = self.part.stage(a.stage)
        if not self.sharded[st.index]:
            return
        if a.kind is Kind.REDUCE_GRAD:
            controls.set_gradient_sync(st, True)
            return
        if a.kind is Kind.RESHARD:
            controls.reshard(st)
        keep = a.kind is Kind.UNSHARD  # RESHARD restores the engine's defaults
        controls.set_reshard_after_forward(st, not keep)
        controls.set_reshard_after_backward(st, not keep)

    def _compute(self, a: Action, run: _Run) -> None:
        st = self.part.stage(a.stage)
        if a.kind is Kind.F:
            self._forward(a, st, run)
        else:
            self._backward(a, st, run)

    def _forward(self, a: Action, st: StageModule, run: _Run) -> None:
        s, mb = a.stage, a.microbatch
        x = run.xs[mb] if st.is_first else self.mailbox.take(("F", s - 1, mb))
        if run.train and not st.is_first:
            x.requires_grad_()
        out = st(x, run.xs[mb])  # the micro-batch's inputs: each stage's side inputs
        if st.is_last:
            loss = run.loss_fn(out, run.ts[mb])
            run.losses.append(loss.detach().float())
            out = loss / self.schedule.microbatches
        else:
            self.mailbox.post(("F", s, mb), out)
        if run.train:
            run.acts[(s, mb)] = (x, out)
            # taken now: the stage's next forward overwrites them (moe.py's Note)
            run.roots[(s, mb)] = stage_balance_roots(st, self.schedule.microbatches)

    def _backward(self, a: Action, st: StageModule, run: _Run) -> None:
        s, mb = a.stage, a.microbatch
        if a.kind is Kind.W:  # [Note: split backward]
            pause = (lambda: controls.paused_backward_hooks(st)) if self.sharded[s] else None
            weight_pass(run.split.pop((s, mb)), self._weight_groups(st), pause)
            return
        x, out = run.acts.pop((s, mb))
        grad = None if st.is_last else self.mailbox.take(("B", s + 1, mb))
        extra = run.roots.pop((s, mb), [])  # the forward's MoE balance losses (moe.py)
        outs, grads = [out, *extra], [grad, *[None] * len(extra)]
        if a.kind is Kind.B:
            torch.autograd.backward(outs, grads)
        elif st.is_first:  # I: no input gradient to send; W runs the whole backward
            run.split[(s, mb)] = DeferredWeights(whole=(outs, grads))
        else:  # I: the input's gradient now, the weights' later (W)
            run.split[(s, mb)] = input_pass(outs, grads, x, split=self.splittable[s])
        if not st.is_first:
            self.mailbox.post(("B", s, mb), x.grad)

    def _weight_groups(self, st: StageModule) -> list[list[torch.Tensor]]:
        if self.sharded[st.index]:
            return controls.graph_parameter_groups(st)
        return [[p for p in st.parameters() if p.requires_grad]]

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The batch's mean loss, summed from the last stage's rank to every pipeline rank."""
        device = comm.group_device(self.groups.pp) if dist.is_initialized() else \
            torch.device("cpu")
        total = torch.zeros((), dtype=torch.float32, device=device)
        for loss in losses:
            total += loss.to(device)
        total /= self.schedule.microbatches
        if self.groups.pp is not None and self.groups.pp_size > 1:
            comm.all_reduce(total, self.groups.pp, label="pp.loss")
        return total


def _selective_under_split(schedule: Schedule, part: PipelinePart) -> bool:
    """Whether this rank's stages hold selectively checkpointed blocks under a schedule
    with weight-gradient (``W``) passes.

    [Note: refused on every pipeline rank] A checkpointed stage's ``W`` pass is a second
    backward through its blocks ([Note: split backward]), which torch's selective
    checkpoint refuses mid-step, and only on the ranks whose stages run one: the first
    stage's rank went on to the loss all-reduce, and a caller that went on in the same
    processes paired the next build's group creation with it (bench/planner_choice.py).
    So every pipeline rank refuses alike at build time (the flag rides on ``pp.init``).
    """
    has_w = any(a.kind is Kind.W for actions in schedule.ranks for a in actions)
    return has_w and any(policy == "selective" for st in part.stages
                         for policy in checkpointed_blocks(st).values())


def _signature(x: Any) -> tuple:
    """The shapes and dtypes of a micro-batch's inputs ([Note: agreed shapes] in
    mailbox.py): ``(shape, dtype)`` for a tensor, a tuple of those for a tuple, list or dict."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), str(x.dtype))
    if isinstance(x, dict):
        return tuple((k, _signature(v)) for k, v in x.items())
    if isinstance(x, (tuple, list)):
        return tuple(_signature(v) for v in x)
    return (repr(x),)


def _describe(step: tuple[Action, ...]) -> str:
    return " ".join(map(str, step)) if step[0].is_comm else step[0].describe()


class _Run:
    """What one run of the list keeps between actions."""

    def __init__(self, xs, ts, train: bool, loss_fn: LossFn) -> None:
        self.xs, self.ts, self.train, self.loss_fn = xs, ts, train, loss_fn
        self.losses: list[torch.Tensor] = []
        self.acts: dict[tuple[int, int], tuple] = {}   # (stage, mb) -> (input, output)
        self.roots: dict[tuple[int, int], list] = {}   # (stage, mb) -> extra backward roots
        self.split: dict[tuple[int, int], tuple] = {}  # after I: (input, output, out grad)
