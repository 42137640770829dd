"""What a run reports: progress bar, metrics.jsonl, loss curve, TensorBoard, summary.

Only rank 0 writes; every rank contributes its memory through the trainer's per-step gather.
Files under ``log.dir``::

    metrics.jsonl   one JSON object per step {"step", "loss", "lr", "grad_norm",
                    "tokens_per_s", "step_time_s", "rss_mib": [per rank], ...} and one per
                    validation {"step", "val_loss", "val_tokens"}
    loss.png        train loss per step and validation loss (matplotlib, no display needed)
    summary.json    final losses, throughput, peak memory per rank, elapsed time, outputs
    tb/             TensorBoard event files when log.tensorboard = true
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any, TextIO

__all__ = ["rss_mib", "peak_rss_mib", "require_tensorboard", "MetricsLogger", "plot_losses",
           "format_summary", "format_memory"]


def rss_mib() -> float:
    """Resident set size of this process now, in MiB (peak RSS where /proc is unavailable)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return peak_rss_mib()


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB else


def require_tensorboard() -> None:
    """Check that TensorBoard logging can work, before any rank starts.

    Raises:
        ValueError: when the ``tensorboard`` package is missing, with the command to install it.
    """
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError("log.tensorboard = true needs the 'tensorboard' package, which is not "
                         "installed; run: pip install 'shardwise[tensorboard]' (or set "
                         "--log.tensorboard false)")


def format_memory(per_rank_mib: list[float]) -> str:
    """``"r0 312M r1 305M"``: one entry per rank."""
    return " ".join(f"r{r} {m:.0f}M" for r, m in enumerate(per_rank_mib))


class MetricsLogger:
    """Rank 0's sink for step and validation records; a no-op on other ranks.

    Progress: on a terminal, one tqdm bar, drawn from the first step on (so lines printed
    while the run starts are not interleaved with empty bars); otherwise (a file, a pipe, a
    CI log) a plain line every ``refresh_every`` steps and at the first and last step.

    Args:
        log_dir: output folder (already created and checked writable).
        total_steps: steps in the run (the progress bar's total).
        enabled: True on rank 0 only.
        progress: show progress (bar or plain lines).
        tensorboard: also write TensorBoard scalars under ``log_dir/tb``.
        refresh_every: refresh the bar's text, or print a plain line, every this many steps.
        resume_step: the step a resumed run starts after (0: a fresh run). The records of
            ``metrics.jsonl`` up to it are kept (later ones are dropped: they run again) and
            new records are appended, so the file holds one continuous history.
        val_label: what the validation split is, shown beside each validation loss.

    Attributes:
        history: the kept records of the run this one resumes (empty for a fresh run).
        records: this run's records.
    """

    def __init__(self, log_dir: str | os.PathLike, total_steps: int, enabled: bool,
                 progress: bool = True, tensorboard: bool = False, refresh_every: int = 1,
                 resume_step: int = 0, val_label: str = "held out") -> None:
        self.log_dir = Path(log_dir)
        self.val_label = val_label
        self.enabled = enabled
        self.refresh_every = refresh_every
        self.total_steps = total_steps
        self.resume_step = resume_step
        self.history: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []
        self._file: TextIO | None = None
        self._bar = None
        self._progress = progress
        self._tb = None
        if not enabled:
            return
        path = self.log_dir / "metrics.jsonl"
        if resume_step > 0:
            self.history = _keep_history(path, resume_step)
        self._file = open(path, "a" if resume_step > 0 else "w", encoding="ascii")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._tb = SummaryWriter(log_dir=str(self.log_dir / "tb"))

    @property
    def all_records(self) -> list[dict[str, Any]]:
        """The whole history: the resumed run's kept records, then this run's."""
        return self.history + self.records

    def _show_progress(self, record: dict[str, Any]) -> None:
        step = record["step"]
        text = (f"loss {record['loss']:.4f} | lr {record['lr']:.3g} | "
                f"{record['tokens_per_s']:,.0f} tok/s | mem "
                f"{format_memory(record.get('rss_mib', []))}")
        due = step % self.refresh_every == 0 or step == self.resume_step + 1 \
            or step == self.total_steps
        if not sys.stderr.isatty():
            if due:
                print(f"step {step}/{self.total_steps}: {text}", file=sys.stderr, flush=True)
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, initial=self.resume_step, desc="train",
                             unit="step", dynamic_ncols=True, mininterval=0.1)
        self._bar.update(1)
        if due:
            self._bar.set_postfix_str(text, refresh=False)

    def _write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def log_step(self, record: dict[str, Any]) -> None:
        """Record one optimizer step (``record`` has at least step, loss, lr, tokens_per_s)."""
        if not self.enabled:
            return
        self._write(record)
        step = record["step"]
        if self._tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                if isinstance(record.get(key), (int, float)):
                    self._tb.add_scalar(f"train/{key}", record[key], step)
        if self._progress:
            self._show_progress(record)

    def log_eval(self, record: dict[str, Any]) -> None:
        """Record one validation pass (``record`` has step and val_loss)."""
        if not self.enabled:
            return
        self._write(record)
        policy = [k for k in ("action_accuracy", "success_rate") if k in record]
        if self._tb is not None:
            self._tb.add_scalar("val/loss", record["val_loss"], record["step"])
            for key in policy:
                self._tb.add_scalar(f"val/{key}", record[key], record["step"])
        self.echo(f"step {record['step']}: val_loss {record['val_loss']:.4f} "
                  + "".join(f"{key} {record[key]:.3f} " for key in policy)
                  + f"({self.val_label})")

    def echo(self, text: str) -> None:
        """Print a line on rank 0 without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Close the bar and files (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._file is not None:
            self._file.close()
            self._file = None


def _keep_history(path: Path, step: int) -> list[dict[str, Any]]:
    """Cut ``path`` (metrics.jsonl) back to its records up to ``step``; return them."""
    if not path.exists():
        return []
    kept = [line for line in path.read_text(encoding="ascii").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="ascii")
    tmp.replace(path)  # atomic: a kill here leaves the old file or the cut one, never half
    return [json.loads(line) for line in kept]


def plot_losses(records: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Draw train loss per step and validation loss into a PNG.

    Uses matplotlib's object API with the Agg canvas, so no display and no change to the
    process-wide matplotlib backend.

    Args:
        records: metrics records as written to metrics.jsonl.
        path: the PNG to write.

    Returns:
        The written path.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train = [(r["step"], r["loss"]) for r in records if "loss" in r and math.isfinite(r["loss"])]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    success = [(r["step"], r["success_rate"]) for r in records if "success_rate" in r]
    fig = Figure(figsize=(11 if success else 7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1) if success else fig.add_subplot()
    if success:  # a policy: its success acting in the environment beside the loss
        right = fig.add_subplot(1, 2, 2)
        right.plot(*zip(*success), "o-", label="success rate (held-out seeds)", linewidth=1.2,
                   markersize=4)
        accuracy = [(r["step"], r["action_accuracy"]) for r in records
                    if "action_accuracy" in r]
        if accuracy:
            right.plot(*zip(*accuracy), "s--", label="action accuracy (held-out demos)",
                       linewidth=1.0, markersize=3)
        right.set_xlabel("step")
        right.set_ylim(0, 1.02)
        right.set_title("the policy")
        right.grid(alpha=0.3)
        right.legend()
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", linewidth=1.2, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title("shardwise training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run summary as a few human-readable lines."""
    def num(value: Any, fmt: str = ".4f") -> str:
        return "n/a" if value is None else format(value, fmt)

    lines = [
        "summary:",
        f"  final train loss {num(summary['final_train_loss'])}, "
        f"final val loss {num(summary['final_val_loss'])}"
        + (f" ({summary['val_split']})" if summary.get("val_split") else ""),
        f"  {summary['steps']} steps, {summary['tokens']:,} tokens, "
        f"{num(summary['tokens_per_s'], ',.0f')} tokens/s on {summary['world_size']} ranks"
        + (f" (steady state {num(summary['steady_tokens_per_s'], ',.0f')} tokens/s: the "
           f"median step after the first, which compiles and warms up)"
           if summary.get("steady_tokens_per_s") and summary["steps"] > 1 else ""),
        f"  peak memory per rank (RSS): {format_memory(summary['peak_rss_mib'])}",
        *([f"  model state per rank (ZeRO stage {summary['zero_stage']}: params + grads + "
           f"optimizer): {format_memory(summary['model_state_mib'])}"]
          if "model_state_mib" in summary else []),
        *([f"  policy: success rate {num(summary['final_success_rate'], '.3f')} on held-out "
           f"seeds, action accuracy {num(summary.get('final_action_accuracy'), '.3f')} on "
           f"held-out demonstrations"] if "final_success_rate" in summary else []),
        *([f"  fp16 loss scaling skipped {summary['skipped_steps']} step(s)"]
          if summary.get("skipped_steps") else []),
        f"  elapsed {summary['elapsed_s']:.1f} s (training {summary['train_time_s']:.1f} s)",
        f"  outputs in {summary['log_dir']}: " + ", ".join(summary["outputs"]),
    ]
    return "\n".join(lines)
