"""The watchdog's settings and the error it raises on every rank (see watchdog.py)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODES", "CollectiveError", "WatchdogConfig"]

MODES = ("on", "debug", "off")


class CollectiveError(RuntimeError):
    """Raised on every rank when the watchdog trips; ``str(exc)`` is the whole report.

    Attributes:
        report: the report (identical on every rank).
        rank: the rank that raised this.
        reporter: whether this rank's composition became the report (print it once).
        exited_siblings: the ranks this rank saw exit abnormally under its own launcher
            (ending.py: [Note: the launcher names a dead rank]).
    """

    def __init__(self, report: str, rank: int = -1, reporter: bool = False,
                 exited_siblings: tuple[int, ...] = ()) -> None:
        super().__init__(report)
        self.report, self.rank, self.reporter = report, rank, reporter
        self.exited_siblings = tuple(exited_siblings)


# Users catch and see it as part of the watchdog's public API (and pickle it there).
CollectiveError.__module__ = "shardwise.distributed.watchdog"


@dataclass(frozen=True)
class WatchdogConfig:
    """Timing of the watchdog.

    Attributes:
        timeout_s: a collective waited on for longer than this is a hang (default 600 s;
            the process group's own timeout should be the same).
        mode: "on", "debug" (also compare every collective's fingerprint across the ranks
            before running it) or "off".
        poll_s: heartbeat / alarm polling interval (default: timeout / 20, in [0.05, 1] s).
        grace_s: how long to wait for the other ranks' states (default: 5 polls, >= 1 s).
        exit_grace_s: how long the main thread may take to pick the report up before the
            process is ended (default: grace_s + 2 s).
    """

    timeout_s: float = 600.0
    mode: str = "on"
    poll_s: float | None = None
    grace_s: float | None = None
    exit_grace_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"watchdog mode must be one of {MODES}, got {self.mode!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"watchdog timeout_s must be > 0, got {self.timeout_s!r}")

    @property
    def poll(self) -> float:
        return self.poll_s or min(1.0, max(0.05, self.timeout_s / 20))

    @property
    def grace(self) -> float:
        return self.grace_s or max(1.0, 5 * self.poll)

    @property
    def exit_grace(self) -> float:
        return self.exit_grace_s or self.grace + 2.0

