"""The collectives shardwise issues, counted and labelled.

Every collective the library runs goes through this module so that
:func:`comm_stats` can say, per collective kind, how many calls this rank made and how many
bytes it sent and received, and so that each call carries a label (``"unit3.all_gather"``)
and a per-group sequence number that the watchdog and error messages can name.

[Note: byte accounting] Bytes (computed by :mod:`shardwise.distributed.comm.byte_counts`, which the
planner prices too) are the per-rank volume of the bandwidth-optimal (ring)
algorithm, the figure the ZeRO paper reasons with, for a group of ``n`` ranks:

* all-gather of a ``b``-byte shard: sends and receives ``(n - 1) * b``;
* reduce-scatter to a ``b``-byte shard: sends and receives ``(n - 1) * b``;
* all-reduce of ``B`` bytes: sends and receives ``2 * (n - 1) * B / n``;
* broadcast of ``B`` bytes: the source sends ``(n - 1) * B``, every other rank receives ``B``;
* all-to-all: exactly the bytes addressed to / received from other ranks.

A group of one rank moves nothing. The counters are process-wide telemetry (like the
``logging`` registry): :func:`reset_comm_stats` zeroes them. Besides per kind, they are kept
per operation: the label's last dotted component (``"layers.0.attention.wo.tp_g_all_reduce"``
counts under ``"tp_g_all_reduce"``), so tensor- and sequence-parallel collectives
(``tp_*`` / ``sp_*``) can be told from the engine's ``all_gather`` / ``reduce_scatter``.
"""

from __future__ import annotations

import copy
import threading
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardwise.distributed.comm import byte_counts as comm_bytes
from shardwise.distributed.comm.gloo import SumAfterAllToAll, gather_by_sends
from shardwise.distributed.compiled import refuse_in_compiled_region
from shardwise.sizes import nbytes as _nbytes

__all__ = [
    "CollectiveStats",
    "CommStats",
    "comm_stats",
    "reset_comm_stats",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
    "all_to_all_single",
    "reduce_scatter_needs_scratch",
    "group_size",
    "group_rank",
    "served_devices",
    "group_device",
    "check_devices",
    "recent_ops",
    "set_tracker",
    "set_device_audit",
]


@dataclass
class CollectiveStats:
    """Calls and bytes of one collective kind on this rank."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass
class CommStats:
    """Per-kind collective counters of this rank (see [Note: byte accounting])."""

    by_kind: dict[str, CollectiveStats] = field(default_factory=dict)
    by_label: dict[str, CollectiveStats] = field(default_factory=dict)

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.by_kind.values())

    @property
    def bytes_received(self) -> int:
        return sum(s.bytes_received for s in self.by_kind.values())

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.by_kind.values())

    def __getitem__(self, kind: str) -> CollectiveStats:
        return self.by_kind.get(kind, CollectiveStats())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: vars(v).copy() for k, v in sorted(self.by_kind.items())}

    def label(self, op: str) -> CollectiveStats:
        """Counters of the collectives whose label ends in ``op`` (e.g. ``"sp_all_gather"``)."""
        return self.by_label.get(op, CollectiveStats())


class _Recorder:
    """Counters plus a short history of labelled ops (for error messages)."""

    def __init__(self, history: int = 64) -> None:
        self.lock = threading.Lock()
        self.stats = CommStats()
        self.seq: dict[int, int] = {}
        self.history: deque[tuple[int, str, str, int]] = deque(maxlen=history)
        # The watchdog's per-collective bookkeeping (optrack.OpTracker); None when no
        # watchdog runs, which leaves every collective below exactly as it was.
        self.tracker = None
        # Device types each process group serves, by group object ([Note: device check]).
        self.served: dict[int, tuple[object, frozenset[str]]] = {}
        # A test's stand-in for an accelerator run ([Note: device audit]); None otherwise.
        self.audit = None

    def record(self, kind: str, group, label: str, sent: int, received: int) -> int:
        gid = id(group) if group is not None else 0
        with self.lock:
            s = self.stats.by_kind.setdefault(kind, CollectiveStats())
            s.calls += 1
            s.bytes_sent += sent
            s.bytes_received += received
            op = label.rsplit(".", 1)[-1] if label else kind
            s = self.stats.by_label.setdefault(op, CollectiveStats())
            s.calls += 1
            s.bytes_sent += sent
            s.bytes_received += received
            seq = self.seq.get(gid, 0)
            self.seq[gid] = seq + 1
            self.history.append((seq, kind, label, sent))
            return seq


_RECORDER = _Recorder()


def comm_stats() -> CommStats:
    """A snapshot of this rank's collective counters since the last reset."""
    with _RECORDER.lock:
        return copy.deepcopy(_RECORDER.stats)


def reset_comm_stats() -> None:
    """Zero this rank's collective counters."""
    with _RECORDER.lock:
        _RECORDER.stats = CommStats()


def recent_ops() -> list[tuple[int, str, str, int]]:
    """The last collectives issued: (sequence number, kind, label, bytes sent)."""
    with _RECORDER.lock:
        return list(_RECORDER.history)


def set_tracker(tracker) -> None:
    """Route every collective that reaches the backend through ``tracker.run`` (None: stop).

    Used by :mod:`shardwise.distributed.watchdog`; see [Note: tracking cost] in optrack.py.
    """
    _RECORDER.tracker = tracker


def set_device_audit(audit) -> None:
    """Let ``audit`` answer :func:`group_device` and check every collective's tensors (None:
    stop). Test-only: see [Note: device audit] in shardwise/testing/device_audit.py."""
    _RECORDER.audit = audit


def _issue(kind: str, pg, label: str, tensor, is_async: bool, fn, /, *args, **kwargs):
    """Call the c10d collective ``fn``, through the watchdog's tracker when one runs.

    Refused inside a region torch.compile is tracing ([Note: collectives outside compiled
    regions] in compiled.py): every collective of the library passes here.
    """
    refuse_in_compiled_region(f"the collective {label!r} ({kind})")
    tracker = _RECORDER.tracker
    if tracker is None:
        return fn(*args, **kwargs)
    return tracker.run(kind, pg, label, tensor, is_async, fn, *args, **kwargs)


def group_size(group=None) -> int:
    """Size of ``group`` (the world when None); 1 when not initialised."""
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group=None) -> int:
    """This rank's index inside ``group``; 0 when not initialised."""
    if not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def served_devices(group=None) -> frozenset[str]:
    """Device types whose tensors ``group``'s backends take ("cpu", "cuda", ...).

    [Note: device check] A process group runs a collective with the backend registered for
    the tensors' device type: NCCL serves only CUDA tensors, a plain Gloo group both CPU and
    CUDA, a group created as ``"cuda:gloo"`` only CUDA. Handing a backend a tensor of a
    device it does not serve fails inside c10d with "No backend type associated with device
    type cpu" (or, on NCCL, worse); every collective here checks its tensors first and
    names the collective, the tensor's device and the group's devices instead. Small
    reductions are therefore built on :func:`group_device`.
    """
    if _RECORDER.audit is not None:
        return _RECORDER.audit.served_devices(group)
    if not dist.is_initialized():
        return frozenset({"cpu", "cuda", "meta"})
    key = id(group)
    hit = _RECORDER.served.get(key)
    if hit is not None and hit[0] is group:
        return hit[1]
    config = dist.get_backend_config(group)
    types = frozenset(part.split(":")[0] for part in config.split(",") if ":" in part)
    if not types:  # a bare backend name: what it conventionally serves
        types = frozenset({"cuda"}) if config == "nccl" else frozenset({"cpu", "cuda"})
    _RECORDER.served[key] = (group, types)
    return types


def group_device(group=None) -> torch.device:
    """The device small tensors handed to ``group`` should live on: the current CUDA device
    for groups that do not serve the CPU (NCCL, ``"cuda:gloo"``), else the CPU."""
    if _RECORDER.audit is not None:
        return _RECORDER.audit.group_device(group)
    if "cpu" in served_devices(group):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cuda")


def check_devices(kind: str, group, label: str, *tensors: torch.Tensor | None) -> None:
    """Raise if a tensor's device is one ``group`` does not serve ([Note: device check]).

    Raises:
        RuntimeError: naming the collective, its label, the tensor's device and the group's.
    """
    if _RECORDER.audit is not None:
        _RECORDER.audit.check(kind, group, label, tensors)
        return
    served = served_devices(group)
    for t in tensors:
        if t is not None and t.device.type not in served:
            name = getattr(group, "group_name", "default") if group is not None else "default"
            raise RuntimeError(
                f"{kind} {label!r}: a tensor on {t.device} was handed to process group "
                f"{name!r}, which serves {', '.join(sorted(served))} tensors only; build it "
                f"on comm.group_device(group) ({group_device(group)})")


# torch 2.13 deprecates the *_tensor spellings in favour of *_single; older releases lack them.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _wire(t: torch.Tensor) -> torch.Tensor:
    # Gloo rejects fp8 dtypes; their bits travel unchanged as uint8.
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t


def all_gather_into_tensor(output: torch.Tensor, shard: torch.Tensor, group=None, *,
                           label: str = "", async_op: bool = False):
    """Gather equal ``shard``s of every rank into ``output`` (rank-major), counted.

    [Note: all-gather on Gloo] Gloo's all-gather allocates two output-sized temporaries per
    call, and those per-call allocations of the same large sizes fragment glibc's heap over
    a long run. On Gloo this function therefore sends ``shard`` to every peer and receives
    each peer's shard directly into its row of ``output`` (one ``batch_isend_irecv``): no
    temporary, the same ``(n - 1)`` shards sent per rank, and at least as fast as Gloo's own
    all-gather or an all-to-all of ``n`` copies (docs/engine.md, "Measurements behind the
    notes"). Peers' sends pair in issue order per group, like any collective.
    """
    check_devices("all_gather", group, label, output, shard)
    n = group_size(group)
    _RECORDER.record("all_gather", group, label, *comm_bytes.all_gather_bytes(n, _nbytes(shard)))
    if n == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard.view_as(output))
        return None
    if dist.get_backend(group) == "gloo":
        return _issue("all_gather", group, label, shard, async_op, gather_by_sends,
                      _wire(output), _wire(shard), group, async_op)
    return _issue("all_gather", group, label, shard, async_op, _ALL_GATHER, _wire(output),
                  _wire(shard), group=group, async_op=async_op)


def reduce_scatter_needs_scratch(group=None) -> bool:
    """Whether :func:`reduce_scatter_tensor` stages through a full-size scratch buffer."""
    return group_size(group) > 1 and dist.get_backend(group) == "gloo"


def reduce_scatter_tensor(output: torch.Tensor, full: torch.Tensor, group=None, *,
                          label: str = "", async_op: bool = False,
                          scratch: torch.Tensor | None = None):
    """Sum ``full`` over ranks and keep this rank's chunk in ``output``, counted.

    [Note: reduce-scatter on Gloo] Gloo's own reduce-scatter is markedly slower than an
    all-to-all of the same chunks followed by a local sum (docs/engine.md, "Measurements
    behind the notes"), while both move exactly (n - 1) chunks per rank. On Gloo this function
    therefore exchanges chunks with ``all_to_all_single`` into ``scratch`` (same size as
    ``full``; allocated when not given) and sums them in rank order when waited on, which
    also keeps the reduction in the tensors' own precision and deterministic.
    """
    check_devices("reduce_scatter", group, label, output, full, scratch)
    n = group_size(group)
    _RECORDER.record("reduce_scatter", group, label,
                     *comm_bytes.reduce_scatter_bytes(n, _nbytes(output)))
    if n == 1:
        if output.data_ptr() != full.data_ptr():
            output.copy_(full.view_as(output))
        return None
    if dist.get_backend(group) == "gloo":
        received = scratch if scratch is not None else torch.empty_like(full)
        work = _issue("reduce_scatter", group, label, full, True, dist.all_to_all_single,
                      received, full, group=group, async_op=True)
        handle = SumAfterAllToAll(work, received, output, n)
        if not async_op:
            handle.wait()
            return None
        return handle
    return _issue("reduce_scatter", group, label, full, async_op, _REDUCE_SCATTER, output, full,
                  op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group=None, *, label: str = "", async_op: bool = False,
               op=dist.ReduceOp.SUM):
    """Reduce ``tensor`` in place over ``group`` (sum by default), counted."""
    check_devices("all_reduce", group, label, tensor)
    n = group_size(group)
    _RECORDER.record("all_reduce", group, label, *comm_bytes.all_reduce_bytes(n, _nbytes(tensor)))
    if n == 1:
        return None
    return _issue("all_reduce", group, label, tensor, async_op, dist.all_reduce, tensor, op=op,
                  group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, *, label: str = "",
              async_op: bool = False):
    """Broadcast ``tensor`` from global rank ``src`` over ``group``, counted."""
    check_devices("broadcast", group, label, tensor)
    n = group_size(group)
    is_src = dist.is_initialized() and dist.get_rank() == src
    _RECORDER.record("broadcast", group, label,
                     *comm_bytes.broadcast_bytes(n, _nbytes(tensor), is_src))
    if n == 1:
        return None
    return _issue("broadcast", group, label, tensor, async_op, dist.broadcast, _wire(tensor),
                  src=src, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, inp: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group=None, *, label: str = "",
                      async_op: bool = False, kind: str = "all_to_all"):
    """All-to-all of dim-0 slices (uneven when split sizes are given), counted under
    ``kind`` (a reduce-scatter built on an all-to-all counts as "reduce_scatter")."""
    check_devices(kind, group, label, output, inp)
    n = group_size(group)
    me = group_rank(group)
    row_in = _nbytes(inp) // max(inp.shape[0], 1) if inp.dim() else _nbytes(inp)
    row_out = _nbytes(output) // max(output.shape[0], 1) if output.dim() else _nbytes(output)
    ins = input_split_sizes or [inp.shape[0] // n] * n
    outs = output_split_sizes or [output.shape[0] // n] * n
    _RECORDER.record(kind, group, label,
                     *comm_bytes.all_to_all_bytes(me, row_in, row_out, ins, outs))
    if n == 1:
        output.copy_(inp)
        return None
    # Per-rank split sizes make the shapes legitimately differ between ranks.
    agreed = inp if input_split_sizes is None and output_split_sizes is None else None
    return _issue(kind, group, label, agreed, async_op, dist.all_to_all_single, _wire(output),
                  _wire(inp), output_split_sizes, input_split_sizes, group=group,
                  async_op=async_op)
