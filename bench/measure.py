"""Framework-independent measurements: resident memory, loopback bytes, held tensor bytes.

[Note: resident memory]
``ru_maxrss`` (getrusage, KiB on Linux) is the process's high-water resident set: for a
rank forked from the benchmark's forkserver it includes the pages it shares with the
forkserver (interpreter, torch, shardwise, DeepSpeed: the same baseline for every
framework, reported as ``rss_entry``), the full fp32 model every framework builds eagerly
before wrapping it, and everything after. ``/proc/self/clear_refs`` (write "5") resets the
kernel's high-water mark so that ``VmHWM`` read after the steps is the peak *during
training* alone (``rss_train_peak``).

[Note: bytes on the wire]
``/proc/net/dev`` counts every byte the loopback interface carried (payload plus TCP/IP
headers, each packet once on transmit and once on receive). All ranks talk over loopback,
so the transmit counter's growth across the timed steps, divided by ranks and steps, is the
bytes each rank sent per step, whatever the framework (Gloo's own algorithms included).
The benchmark runs in a private network namespace when it can (``unshare -n``), so no
other process's loopback traffic is counted.

[Note: model-state bytes]
Bytes of the distinct storages of the tensors a framework holds, found by walking its
objects: parameters (DTensors as their local shard), ``.grad``, ``optimizer.state``, and,
for DeepSpeed, every tensor reachable from the ZeRO optimizer's attributes (flat parameter
groups, fp32 master partitions, gradient partitions), each storage counted once, the first
attribute that reaches it naming its category. Measured after backward and after the
optimizer step of one untimed step; each category's larger value is kept.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable

import torch

__all__ = ["rss_now", "rss_hwm", "ru_maxrss", "reset_hwm", "loopback_bytes",
           "TensorBytes", "local_tensor"]


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def rss_now() -> int:
    """Resident bytes now (VmRSS)."""
    return _status_kib("VmRSS") * 1024


def rss_hwm() -> int:
    """Resident high-water bytes since start or the last :func:`reset_hwm` (VmHWM)."""
    return _status_kib("VmHWM") * 1024


def ru_maxrss() -> int:
    """getrusage's peak resident bytes of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def loopback_bytes() -> tuple[int, int]:
    """(received, transmitted) byte counters of the loopback interface."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    return 0, 0


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s bytes on this rank (a DTensor's local shard)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


class TensorBytes:
    """Sum storage bytes per category, each storage counted once across categories."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.by_category: dict[str, int] = {}
        self.by_source: dict[str, int] = {}

    def add(self, category: str, t: torch.Tensor | None, source: str = "") -> None:
        if not isinstance(t, torch.Tensor):
            return
        t = local_tensor(t)
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = st.data_ptr()
        if st.nbytes() == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.by_category[category] = self.by_category.get(category, 0) + st.nbytes()
        src = source or category
        self.by_source[src] = self.by_source.get(src, 0) + st.nbytes()

    def add_all(self, category: str, tensors: Iterable, source: str = "") -> None:
        for t in tensors:
            self.add(category, t, source)

    def add_optimizer_state(self, optimizer: torch.optim.Optimizer, source: str = "") -> None:
        for st in optimizer.state.values():
            for v in st.values():
                self.add("optimizer", v, source or "optimizer.state")


def reachable_tensors(obj, depth: int = 4) -> list[torch.Tensor]:
    """Tensors inside nested lists, tuples, sets and dicts (not inside other objects)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0:
        return []
    out: list[torch.Tensor] = []
    if isinstance(obj, (list, tuple, set)):
        for x in obj:
            out += reachable_tensors(x, depth - 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            out += reachable_tensors(x, depth - 1)
    return out


def merge_max(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Per-key maximum of two byte dictionaries."""
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in sorted(set(a) | set(b))}
