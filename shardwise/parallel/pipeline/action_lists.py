"""A pipeline schedule as data: per rank, an ordered list of actions; CSV and text forms.

The same :class:`Schedule` drives the executor on real ranks and the simulator (docs/design.md,
principle 4). A stage is a contiguous slice of the model's layers; there are ``pp * virtual``
of them and ``placement[stage]`` names the rank that holds each:

    looped (interleaved 1F1B, looped BFS)   stage s on rank s % pp
    V-shaped (ZB-V, DualPipeV; virtual 2)   stage s on rank s for s < pp, else 2 pp - 1 - s

CSV form: one row per rank, one action per cell (``0F0,0SEND_F0,0F1,...``); blank lines and
lines starting with ``#`` are ignored. A CSV with no communication actions gets them inserted.

[Note: engine actions] Where a stage's data-parallel engine gathers, frees and reduces is
part of the schedule too, as ``torch.distributed.pipelining``'s UNSHARD / RESHARD /
REDUCE_GRAD actions are: :func:`add_engine_actions` inserts them into a rank's training list
by one rule, which the executor runs ([Note: pipeline engine controls] in executor.py) and
the planner counts (:func:`gather_rounds`):

* ``UNSHARD`` before a stage's first compute action and ``RESHARD`` after its last, when the
  stage keeps its parameters gathered through the step (``keep_gathered``): its units are
  gathered once, by their own hooks as the first pass reaches them, and freed at RESHARD;
  without it the engine's hooks gather and free them around every pass (once per
  micro-batch, twice when it reshards after forward);
* ``REDUCE_GRAD`` before a stage's last weight-gradient pass (its last ``B`` or ``W``): that
  pass reduces the gradients every earlier pass only accumulated. Our engine launches the
  reductions from the pass's own hooks, overlapping it, so the action comes before the
  pass (torch's comes after its last backward, which it then reduces).

Engine actions take no time in a replay and carry the micro-batch of the pass they attach
to (``0UNSHARD0``, ``0REDUCE_GRAD7``).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.parallel.pipeline.actions import Action, Kind
from shardwise.parallel.pipeline.messages import add_communication
from shardwise.parallel.pipeline.validate import validate_schedule

__all__ = ["Schedule", "looped_placement", "v_placement", "add_engine_actions", "gather_rounds"]


def looped_placement(pp: int, virtual: int) -> tuple[int, ...]:
    """Stage s on rank ``s % pp`` (``virtual`` stages per rank, interleaved)."""
    return tuple(s % pp for s in range(pp * virtual))


def v_placement(pp: int) -> tuple[int, ...]:
    """Two stages per rank in a V: rank r holds stages r and ``2 pp - 1 - r``."""
    return tuple(range(pp)) + tuple(reversed(range(pp)))


def add_engine_actions(actions: Sequence[Action], keep_gathered: bool) -> tuple[Action, ...]:
    """One rank's training list with its engine actions ([Note: engine actions]).

    Args:
        actions: the rank's actions (compute and communication) for one step.
        keep_gathered: each stage keeps its parameters gathered from its first action to
            its last (UNSHARD / RESHARD inserted), else the engine gathers per pass.

    Returns:
        The list with UNSHARD, RESHARD and REDUCE_GRAD actions inserted.
    """
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    last_grad: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.is_compute:
            first.setdefault(a.stage, i)
            last[a.stage] = i
            if a.kind in (Kind.B, Kind.W):
                last_grad[a.stage] = i
    out: list[Action] = []
    for i, a in enumerate(actions):
        if keep_gathered and first.get(a.stage) == i:
            out.append(Action(a.stage, Kind.UNSHARD, a.microbatch))
        if last_grad.get(a.stage) == i:
            out.append(Action(a.stage, Kind.REDUCE_GRAD, a.microbatch))
        out.append(a)
        if keep_gathered and last.get(a.stage) == i:
            out.append(Action(a.stage, Kind.RESHARD, a.microbatch))
    return tuple(out)


def gather_rounds(keep_gathered: bool, microbatches: int) -> int:
    """How many times a stage's parameters are gathered for its forward passes in one step
    of :func:`add_engine_actions`' lists: once between UNSHARD and RESHARD when kept
    gathered, else once per micro-batch (the engine's hooks; a stage that reshards after
    forward gathers again for each backward)."""
    return 1 if keep_gathered else microbatches


@dataclass(frozen=True)
class Schedule:
    """Per pipeline rank, the ordered actions it runs for one training step.

    Attributes:
        name: schedule name (``"1f1b"``, ..., or ``"csv"`` for a loaded one).
        pp: number of pipeline ranks.
        microbatches: micro-batches per step.
        virtual: stages per rank (``pp * virtual`` stages in all).
        placement: ``placement[stage]`` = the rank holding that stage.
        ranks: ``ranks[r]`` = rank r's actions in order (compute and communication).
    """

    name: str
    pp: int
    microbatches: int
    virtual: int
    placement: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        for field in ("pp", "microbatches", "virtual"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Schedule {field}={value!r}: expected an integer >= 1")
        if len(self.placement) != self.pp * self.virtual:
            raise ValueError(f"Schedule placement has {len(self.placement)} stages; expected "
                             f"pp * virtual = {self.pp * self.virtual}")
        for rank in range(self.pp):
            held = self.placement.count(rank)
            if held != self.virtual:
                raise ValueError(f"Schedule placement {list(self.placement)} puts {held} stages "
                                 f"on rank {rank}; every rank must hold virtual={self.virtual}")
        if len(self.ranks) != self.pp:
            raise ValueError(f"Schedule has {len(self.ranks)} action lists; expected one per "
                             f"pipeline rank (pp={self.pp})")

    @property
    def num_stages(self) -> int:
        """``pp * virtual``."""
        return len(self.placement)

    @property
    def split_backward(self) -> bool:
        """Whether any backward is split into I and W (zero-bubble schedules)."""
        return any(a.kind.value == "I" for acts in self.ranks for a in acts)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in increasing order."""
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def compute_only(self) -> Schedule:
        """The same schedule without its communication actions."""
        ranks = tuple(tuple(a for a in acts if a.is_compute) for acts in self.ranks)
        return Schedule(self.name, self.pp, self.microbatches, self.virtual, self.placement,
                        ranks)

    def validate(self) -> Schedule:
        """Check completeness, dependencies, message pairing and deadlock freedom.

        Returns:
            ``self``, so that ``Schedule(...).validate()`` chains.

        Raises:
            ValueError: naming the rank, the action and the missing dependency.
        """
        validate_schedule(self)
        return self

    @classmethod
    def from_compute(cls, name: str, pp: int, microbatches: int, virtual: int,
                     placement: Sequence[int],
                     ranks: Sequence[Sequence[Action]]) -> Schedule:
        """Build from compute-only lists, inserting the sends and receives they need.

        Raises:
            ValueError: on inconsistent sizes, or if the lists already hold communication.
        """
        return cls(name, pp, microbatches, virtual, tuple(placement),
                   add_communication(ranks, placement))

    # ---- CSV ---------------------------------------------------------------------------
    def to_csv(self) -> str:
        """One row per rank, one action per cell (loadable by :meth:`from_csv`)."""
        return "".join(",".join(str(a) for a in acts) + "\n" for acts in self.ranks)

    @classmethod
    def from_csv(cls, text: str, name: str = "csv") -> Schedule:
        """Load and validate a schedule written as CSV (one row per rank).

        pp is the number of rows; the stages, micro-batches and placement are read from the
        compute actions (each stage's actions must all be on one rank, and every rank must hold
        the same number of stages). Rows without any SEND/RECV get them inserted.

        Args:
            text: the CSV text.
            name: the name to give the schedule.

        Returns:
            The validated schedule.

        Raises:
            ValueError: naming the row and cell of an unreadable action, an inconsistent
                placement, or (from the validator) the rank, action and missing dependency.
        """
        rows = _read_rows(text)
        actions = [a for row in rows for a in row]
        computes = [(r, a) for r, row in enumerate(rows) for a in row if a.is_compute]
        if not computes:
            raise ValueError("the CSV schedule has no compute actions (F, B, I, W)")
        num_stages = 1 + max(a.stage for a in actions)
        microbatches = 1 + max(a.microbatch for a in actions)
        placement = _infer_placement(computes, num_stages, len(rows))
        pp = len(rows)
        if num_stages % pp:
            raise ValueError(f"the CSV schedule has {num_stages} stages over {pp} ranks; every "
                             f"rank must hold the same number of stages")
        virtual = num_stages // pp
        ranks = tuple(tuple(row) for row in rows)
        if not any(a.is_comm for a in actions):
            ranks = add_communication(ranks, placement)
        return cls(name, pp, microbatches, virtual, placement, ranks).validate()

    # ---- text --------------------------------------------------------------------------
    def to_text(self, comm: bool = True) -> str:
        """A readable listing: one line per rank; a batch of messages is shown in braces.

        Args:
            comm: include the communication actions (default True).
        """
        head = (f"schedule {self.name}: pp={self.pp} microbatches={self.microbatches} "
                f"virtual={self.virtual} stages={self.num_stages}")
        lines = [head]
        for rank, acts in enumerate(self.ranks):
            words: list[str] = []
            batch: list[str] = []
            for a in acts:
                if a.is_comm:
                    batch.append(str(a))
                    continue
                if batch and comm:
                    words.append("{" + " ".join(batch) + "}")
                batch = []
                words.append(str(a))
            if batch and comm:
                words.append("{" + " ".join(batch) + "}")
            stages = ",".join(map(str, self.stages_of(rank)))
            lines.append(f"rank {rank} (stage {stages}): " + " ".join(words))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()


def _read_rows(text: str) -> list[list[Action]]:
    rows = []
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    for r, cells in enumerate(csv.reader(io.StringIO("\n".join(lines)))):
        row = []
        for c, cell in enumerate(cells):
            if not cell.strip():
                continue  # torch.distributed.pipelining writes empty cells for idle slots
            try:
                row.append(Action.parse(cell))
            except ValueError as exc:
                raise ValueError(f"CSV row {r + 1} (rank {r}), cell {c + 1}: {exc}") from None
        rows.append(row)
    if not rows:
        raise ValueError("the CSV schedule is empty: expected one row of actions per rank")
    return rows


def _infer_placement(computes: list[tuple[int, Action]], num_stages: int,
                     pp: int) -> tuple[int, ...]:
    owner: dict[int, int] = {}
    for rank, a in computes:
        if owner.setdefault(a.stage, rank) != rank:
            raise ValueError(f"stage {a.stage} has compute actions on rank {owner[a.stage]} and "
                             f"on rank {rank} ({a}); each stage must live on one rank")
    missing = [s for s in range(num_stages) if s not in owner]
    if missing:
        raise ValueError(f"stages {missing} have no compute actions; a schedule with "
                         f"{num_stages} stages must run every stage")
    idle = [r for r in range(pp) if r not in owner.values()]
    if idle:
        raise ValueError(f"CSV rows {idle} (ranks) hold no stage; every rank must run one")
    return tuple(owner[s] for s in range(num_stages))
