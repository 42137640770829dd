"""Fault injection for testing failure handling: kill, crash, hang or corrupt a rank on cue.

    SHARDWISE_FAULT="kill:rank=1:step=7:phase=backward" shardwise train ...
    SHARDWISE_FAULT="raise:rank=0:step=3;hang:rank=1:step=9:attempt=1" torchrun ... train
    shardwise train --parallel.fault_tolerant true --parallel.dp_replicate 3 --nproc 3 \
        --faults "kill:group=1:step=40;stop:group=2:step=90:seconds=8"

A spec is one or more faults separated by ``;``. Each is an action followed by ``key=value``
conditions, all of which must hold for it to fire (once):

actions
    ``kill`` (SIGKILL this process), ``exit`` (``os._exit(code)``, default 3: a crash without
    a Python traceback), ``raise`` (a :class:`InjectedFault` exception), ``oom`` (a real
    allocation that cannot succeed), ``hang`` (sleep forever in Python; ``native=1``: in one
    C call), ``nan`` / ``inf`` (corrupt the loss, phase ``loss``, one parameter's gradient,
    phase ``grad`` with ``param=FQN``, or one module's input, phase ``input`` with
    ``module=FQN``), ``enospc`` (the disk is full: a checkpoint file write fails with ENOSPC
    after writing part of its data), ``skip`` (do not issue the next collective whose label
    contains ``label=...``; needs the watchdog), ``stop`` (SIGSTOP: a frozen process, with
    ``parallel.fault_tolerant`` its whole replica group; ``seconds=S`` continues it after S
    seconds, default never). With ``parallel.fault_tolerant``,
    ``kill`` and ``exit`` take ``rejoin=N`` (the group's restart waits until another group
    has committed step N, as a node replaced later would) or ``rejoin=never`` (the group's
    capacity is gone for good: it leaves the run and the others finish without it), and
    ``ranks=M`` (the group's capacity is M ranks from its next attempt on, M dividing its
    original size: it comes back with M ranks training the same data; docs/failures.md).
conditions
    ``rank`` (default 0), ``step`` (an int, or ``random``: drawn from ``seed`` in
    [2, steps - 1]), ``phase``, ``attempt`` (the attempt it fires in: torchrun's restart
    count, continued across a resized group's relaunches; default 0, so a restarted job
    does not fail again; ``any``), ``param``, ``module``, ``label``, ``group`` (with
    ``parallel.fault_tolerant``: the replica group, in which ``rank`` is the rank inside the
    group; default any group).
phases
    ``start`` (default: as the step begins), ``forward`` / ``backward`` (in the middle of the
    model: at the middle transformer block), ``reduction`` (with ``parallel.fault_tolerant``:
    as the gradients are combined across replica groups), ``optimizer`` (just before the
    optimizer step), ``checkpoint`` (while this rank writes its checkpoint files),
    ``commit`` (rank 0 inside the checkpoint commit, before the rename), ``loss``, ``grad``
    and ``input`` (for ``nan`` / ``inf``; ``input``: the first element of the first tensor
    argument of the named module's first forward call in that step, e.g. to see a low-bit
    layer name the non-finite amax it casts).
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.train.attempts import ft_attempt

__all__ = ["Fault", "FaultPlan", "InjectedFault", "parse_faults", "ENV_VAR"]

ENV_VAR = "SHARDWISE_FAULT"
ACTIONS = ("kill", "exit", "raise", "oom", "hang", "stop", "nan", "inf", "enospc", "skip")
PHASES = ("start", "forward", "backward", "reduction", "optimizer", "checkpoint", "commit",
          "loss", "grad", "input")
_CRASHES = ("kill", "exit", "raise", "oom", "hang", "stop")
#: Set in every rank of a fault-tolerant replica group (its group id); ``stop`` then freezes
#: the group's whole process group.
GROUP_ENV = "SHARDWISE_FT_GROUP"
_DEFAULT_PHASE = {"nan": "loss", "inf": "loss", "enospc": "checkpoint", "skip": "start"}


class InjectedFault(RuntimeError):
    """The exception of a ``raise`` fault."""


@dataclass
class Fault:
    """One fault: ``action`` when every condition holds (fires at most once)."""

    action: str
    rank: int = 0
    step: int | str | None = None
    phase: str = "start"
    attempt: str = "0"
    group: int | None = None
    options: dict[str, str] = field(default_factory=dict)
    fired: bool = False

    def describe(self) -> str:
        opts = "".join(f":{k}={v}" for k, v in self.options.items())
        group = "" if self.group is None else f":group={self.group}"
        return (f"{self.action}{group}:rank={self.rank}:step={self.step}:phase={self.phase}"
                f"{opts}")


def parse_faults(spec: str) -> list[Fault]:
    """Parse a ``SHARDWISE_FAULT`` spec (see the module docstring).

    Raises:
        ValueError: an unknown action, phase or key, or a malformed value (named).
    """
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        action, *pairs = part.split(":")
        if action not in ACTIONS:
            raise ValueError(f"{ENV_VAR}: unknown action {action!r} in {part!r}; expected "
                             f"one of {', '.join(ACTIONS)}")
        fault = Fault(action, phase=_DEFAULT_PHASE.get(action, "start"))
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"{ENV_VAR}: expected key=value, got {pair!r} in {part!r}")
            if key in ("rank", "group") or (key == "step" and value != "random"):
                if not value.isdigit():
                    raise ValueError(f"{ENV_VAR}: {key} must be an int, got {value!r}")
                setattr(fault, key, int(value))
            elif key in ("step", "attempt"):  # step=random; attempt=N or any
                setattr(fault, key, value)
            elif key == "phase":
                if value not in PHASES:
                    raise ValueError(f"{ENV_VAR}: unknown phase {value!r}; expected one of "
                                     f"{', '.join(PHASES)}")
                fault.phase = value
            elif key == "seconds":
                try:
                    if float(value) < 0:
                        raise ValueError
                except ValueError:
                    raise ValueError(f"{ENV_VAR}: seconds must be a number >= 0, got {value!r}"
                                     ) from None
                fault.options[key] = value
            elif key in ("rejoin", "ranks"):
                if action not in ("kill", "exit"):
                    raise ValueError(f"{ENV_VAR}: {key}= applies to kill and exit (a group "
                                     f"that restarts), not {action!r} in {part!r}")
                if key == "rejoin" and value != "never" and not value.isdigit():
                    raise ValueError(f"{ENV_VAR}: rejoin must be a step (an int) or 'never', "
                                     f"got {value!r}")
                if key == "ranks" and (not value.isdigit() or int(value) < 1):
                    raise ValueError(f"{ENV_VAR}: ranks must be an int >= 1 (the group's "
                                     f"ranks from its next attempt on), got {value!r}")
                fault.options[key] = value
            elif key in ("param", "module", "label", "seed", "code", "native"):
                fault.options[key] = value
            else:
                raise ValueError(f"{ENV_VAR}: unknown key {key!r} in {part!r}")
        rejoin = fault.options.get("rejoin", "never")
        if rejoin != "never" and isinstance(fault.step, int) and int(rejoin) <= fault.step:
            raise ValueError(f"{ENV_VAR}: rejoin={rejoin} must come after the fault's step "
                             f"{fault.step} in {part!r}")
        faults.append(fault)
    return faults


class FaultPlan:
    """The faults of this rank, armed on a model and fired by the trainer's hooks.

    Args:
        faults: parsed faults (all ranks' ones; only this rank's fire).
        rank: this rank (inside its replica group under ``parallel.fault_tolerant``).
        steps: the run's total steps (to draw ``step=random``).
        group: this rank's replica group (fault tolerance), else None: faults naming a group
            fire only in that group.
    """

    def __init__(self, faults: list[Fault], rank: int, steps: int,
                 group: int | None = None) -> None:
        for key in ("rejoin", "ranks"):
            if group is None and any(key in f.options for f in faults):
                raise ValueError(f"{ENV_VAR}: {key}= needs parallel.fault_tolerant (a replica "
                                 f"group that restarts while the others train)")
        self.rank, self.step = rank, 0
        attempt = str(ft_attempt())
        self.faults = [f for f in faults if f.rank == rank
                       and (f.group is None or f.group == group)
                       and (f.attempt == "any" or f.attempt == attempt)]
        for f in self.faults:
            if f.step == "random":
                rng = random.Random(int(f.options.get("seed", "0")))
                f.step = rng.randint(2, max(2, steps - 1))
        self._patched: list[tuple[Any, str, Any]] = []
        self._handles: list[Any] = []

    @classmethod
    def from_env(cls, rank: int, steps: int) -> FaultPlan | None:
        """The plan of ``$SHARDWISE_FAULT`` for this rank (and ``$SHARDWISE_FT_GROUP``), or None."""
        spec = os.environ.get(ENV_VAR, "")
        group = os.environ.get(GROUP_ENV)
        plan = (cls(parse_faults(spec), rank, steps, None if group is None else int(group))
                if spec.strip() else None)
        return plan if plan is not None and plan.faults else None

    # ------------------------------------------------------------------ firing

    def _due(self, phase: str, actions: tuple[str, ...] = _CRASHES) -> Fault | None:
        for f in self.faults:
            if (not f.fired and f.phase == phase and f.action in actions
                    and (f.step is None or f.step == self.step)):
                f.fired = True
                return f
        return None

    def fire(self, phase: str) -> None:
        """Run the fault due now in ``phase``, if any (kill / exit / raise / oom / hang)."""
        f = self._due(phase)
        if f is not None:
            _act(f, self.step)

    def at_step(self, step: int) -> None:
        """The trainer begins ``step`` (1-based): fire the ``start`` faults."""
        self.step = step
        self.fire("start")

    def on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``nan`` / ``inf`` with phase ``loss``: the corrupted loss (else ``loss``)."""
        f = self._due("loss", ("nan", "inf"))
        if f is None:
            return loss
        return loss * float(f.action)

    def after_backward(self, model: nn.Module) -> None:
        """``nan`` / ``inf`` with phase ``grad``: write it into ``param``'s gradient."""
        f = self._due("grad", ("nan", "inf"))
        if f is None:
            return
        name = f.options.get("param")
        params = dict(model.named_parameters())
        if name not in params:
            raise ValueError(f"{ENV_VAR}: param {name!r} is not a parameter of the model")
        grad = params[name].grad
        if grad is not None and grad.numel():
            with torch.no_grad():
                grad.view(-1)[0] = float(f.action)

    # ------------------------------------------------------------------ arming

    def arm(self, model: nn.Module) -> FaultPlan:
        """Install the hooks the phases need: model hooks, checkpoint writes, collectives."""
        phases = {f.phase for f in self.faults}
        if phases & {"forward", "backward"}:
            self._arm_model(model)
        if "input" in phases:
            self._arm_inputs(model)
        if "checkpoint" in phases:
            self._arm_checkpoint_writes()
        if "commit" in phases:
            from shardwise.checkpoint import atomic

            self._wrap(atomic, "commit", lambda orig, *a, **k: (self.fire("commit"),
                                                                  orig(*a, **k))[1])
        if any(f.action == "skip" for f in self.faults):
            from shardwise.distributed import watchdog

            wd = watchdog.active()
            if wd is None:
                raise ValueError(f"{ENV_VAR}: 'skip' faults need the watchdog "
                                 "(parallel.watchdog = 'on')")
            wd.tracker.fault = self._on_collective
        return self

    def _arm_model(self, model: nn.Module) -> None:
        blocks = [m for m in model.modules() if type(m).__name__ == "TransformerBlock"]
        middle = blocks[len(blocks) // 2] if blocks else model

        def pre_forward(module, args):
            self.fire("forward")

        def post_forward(module, args, output):
            if torch.is_tensor(output) and output.requires_grad:
                output.register_hook(lambda grad: (self.fire("backward"), None)[1])

        middle.register_forward_pre_hook(pre_forward)
        middle.register_forward_hook(post_forward)

    def _arm_inputs(self, model: nn.Module) -> None:
        """Forward pre-hooks on the modules named by ``input`` faults: the due one replaces
        the first element of the call's first tensor argument (a copy: the caller's tensor
        is left alone)."""
        modules = dict(model.named_modules())
        for f in self.faults:
            if f.phase != "input":
                continue
            name = f.options.get("module")
            if name not in modules:
                raise ValueError(f"{ENV_VAR}: module {name!r} is not a module of the model")
            self._handles.append(modules[name].register_forward_pre_hook(
                lambda module, args, name=name: self._corrupt_input(name, args)))

    def _corrupt_input(self, name: str, args: tuple) -> tuple | None:
        due = [f for f in self.faults if f.phase == "input" and f.options.get("module") == name
               and not f.fired and f.action in ("nan", "inf") and f.step in (None, self.step)]
        at = next((i for i, a in enumerate(args) if torch.is_tensor(a) and a.numel()), None)
        if not due or at is None:
            return None
        due[0].fired = True
        x = args[at].clone(memory_format=torch.contiguous_format)  # still in the graph
        x.view(-1)[0] = float(due[0].action)
        return (*args[:at], x, *args[at + 1:])

    def _arm_checkpoint_writes(self) -> None:
        from torch.distributed.checkpoint import filesystem

        def write_item(orig, transforms, stream, data, *args, **kwargs):
            f = self._due("checkpoint", _CRASHES + ("enospc",))
            if f is None:
                return orig(transforms, stream, data, *args, **kwargs)
            # Leave a partly written file behind, as a real crash or a full disk would.
            stream.write(b"\0" * 4096)
            stream.flush()
            if f.action == "enospc":
                raise OSError(errno.ENOSPC, "No space left on device (injected by "
                                            f"{ENV_VAR}={f.describe()})")
            _act(f, self.step)
            return orig(transforms, stream, data, *args, **kwargs)

        self._wrap(filesystem, "_write_item", write_item)

    def _on_collective(self, kind: str, label: str) -> str | None:
        for f in self.faults:
            if (f.action == "skip" and not f.fired and f.step in (None, self.step)
                    and f.options.get("label", "") in label):
                f.fired = True
                return "skip"
        return None

    def _wrap(self, owner: Any, name: str, wrapper) -> None:
        orig = getattr(owner, name)

        def patched(*args, **kwargs):
            return wrapper(orig, *args, **kwargs)

        setattr(owner, name, patched)
        self._patched.append((owner, name, orig))

    def disarm(self) -> None:
        """Undo every patch and input hook :meth:`arm` made."""
        while self._handles:
            self._handles.pop().remove()
        while self._patched:
            owner, name, orig = self._patched.pop()
            setattr(owner, name, orig)


#: A file each fired crash appends one JSON line to (time, action, step, phase, group, rank,
#: pid, attempt, rejoin, ranks) before it acts: the fault-tolerant launcher times recoveries
#: from it, and a restarted group reads when to rejoin and with how many ranks.
LOG_ENV = "SHARDWISE_FAULT_LOG"


def _record(f: Fault, step: int) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = json.dumps({"time": time.time(), "action": f.action, "step": step,
                       "phase": f.phase, "group": os.environ.get(GROUP_ENV), "rank": f.rank,
                       "pid": os.getpid(), "fault": f.describe(),
                       "attempt": ft_attempt(), "rejoin": f.options.get("rejoin"),
                       "ranks": int(f.options["ranks"]) if "ranks" in f.options else None})
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write: lines from ranks never interleave
    finally:
        os.close(fd)


def _act(f: Fault, step: int) -> None:
    what = f"{ENV_VAR}={f.describe()} at step {step}"
    _record(f, step)
    if f.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.action == "exit":
        os._exit(int(f.options.get("code", "3")))
    elif f.action == "raise":
        raise InjectedFault(f"injected fault {what}")
    elif f.action == "oom":
        torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the allocator refuses
    elif f.action == "stop":
        _stop(float(f.options.get("seconds", "0")))
    elif f.action == "hang":
        if f.options.get("native") == "1":
            time.sleep(10**9)
        while True:
            time.sleep(0.05)


def _stop(seconds: float) -> None:
    """Freeze: SIGSTOP this process, or under fault tolerance its replica group's process
    group (every rank of the group and its launcher). A detached helper sends SIGCONT after
    ``seconds`` (0: never; the group stays frozen until something kills it)."""
    group = os.environ.get(GROUP_ENV) is not None
    target = -os.getpgrp() if group else os.getpid()
    if seconds > 0:
        # Its own session: the SIGSTOP below does not reach it.
        subprocess.Popen([sys.executable, "-c", f"import os, signal, time; time.sleep({seconds});"
                          f" os.kill({target}, signal.SIGCONT)"], start_new_session=True)
    os.kill(target, signal.SIGSTOP)
