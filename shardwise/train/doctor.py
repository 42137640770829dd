"""Do the ranks of a job agree? Versions, device, backend and config, then a test all-reduce.

    shardwise doctor                        # the default 2 local ranks
    shardwise doctor --nproc 4 --config configs/debug.toml
    torchrun --nproc_per_node 8 -m shardwise.train.cli doctor

The trainer runs the same check (:func:`check_ranks`) on every rank right after the process
group is up, before the model is built: a rank with another torch or shardwise version, another
device type or backend, or another config (a different file on another node) fails the run
with its rank named and the differing value, instead of a silent divergence or a hang much
later. The test all-reduce proves every pair of ranks can talk (a hang here is caught by the
watchdog like any other) and measures the bandwidth.
"""

from __future__ import annotations

import hashlib
import json
import platform
import socket
import time
from typing import Any

import torch

import shardwise
from shardwise.distributed import comm
from shardwise.train.config import io as config_io

__all__ = ["rank_report", "config_hash", "check_ranks", "format_reports", "AGREED"]

# What must be identical on every rank (host and pid may differ).
AGREED = ("device", "backend", "torch", "shardwise", "python", "world_size", "config_hash")


def _config_values(cfg: Any) -> dict[str, str]:
    return {f"{s}.{k}": config_io.to_toml_value(v) if v is not None else "unset"
            for s, k, _h, v, _d in config_io.iter_fields(cfg)}


def config_hash(cfg: Any) -> str:
    """A short hash of every config value (identical configs, identical hashes)."""
    text = json.dumps(_config_values(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def rank_report(cfg: Any, env: Any) -> dict[str, Any]:
    """What this rank runs with (JSON-ready)."""
    return {"rank": env.rank, "host": socket.gethostname(), "pid": __import__("os").getpid(),
            "device": env.device.type, "backend": env.backend, "torch": str(torch.__version__),
            "shardwise": shardwise.__version__, "python": platform.python_version(),
            "world_size": env.world_size, "config_hash": config_hash(cfg),
            "config": _config_values(cfg)}


def _exchange(obj: Any, env: Any) -> list[Any]:
    """Every rank's JSON-able ``obj`` (two small all-gathers through comm)."""
    # on the group's device: NCCL serves only CUDA tensors (the host reads below are fine,
    # the doctor runs once, before the first step)
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = torch.empty(env.world_size, dtype=torch.int64, device=env.device)
    comm.all_gather_into_tensor(sizes, torch.tensor([data.numel()], device=env.device),
                                label="doctor.sizes")
    sizes = sizes.cpu()
    width = int(sizes.max())
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:data.numel()] = data
    table = torch.empty(env.world_size * width, dtype=torch.uint8, device=env.device)
    comm.all_gather_into_tensor(table, mine.to(env.device), label="doctor.reports")
    rows = table.cpu().view(env.world_size, width)
    return [json.loads(bytes(rows[r, :int(sizes[r])].tolist())) for r in range(env.world_size)]


def _mismatch(reports: list[dict[str, Any]]) -> str | None:
    for key in AGREED:
        values: dict[Any, list[int]] = {}
        for rep in reports:
            values.setdefault(rep[key], []).append(rep["rank"])
        if len(values) > 1:
            # The value most ranks have (rank 0's on a tie) is taken as the job's.
            ordered = sorted(values.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
            common, base = ordered[0]
            parts = []
            for value, ranks in ordered[1:]:
                what = f"{key} {value!r}"
                if key == "config_hash":
                    first = next(k for k, v in reports[ranks[0]]["config"].items()
                                 if reports[base[0]]["config"].get(k) != v)
                    what = (f"another config ({first} = {reports[ranks[0]]['config'][first]}, "
                            f"rank {base[0]}: {reports[base[0]]['config'].get(first)})")
                    common = None
                who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                parts.append(f"{who} {'run' if len(ranks) > 1 else 'runs'} {what}")
            against = f"; expected {key} {common!r} as on rank {base[0]}" if common else ""
            return "; ".join(parts) + against
    return None


def _test_all_reduce(env: Any, nbytes: int) -> dict[str, Any]:
    world = env.world_size
    probe = torch.tensor([float(env.rank + 1)], device=env.device)
    comm.all_reduce(probe, label="doctor.probe")
    expected = world * (world + 1) / 2
    payload = torch.ones(nbytes // 4, device=env.device)
    comm.all_reduce(payload, label="doctor.warmup")
    payload.fill_(1.0)
    start = time.perf_counter()
    comm.all_reduce(payload, label="doctor.bandwidth")
    seconds = time.perf_counter() - start
    ok = probe.item() == expected and bool((payload == world).all())
    return {"ok": ok, "sum": probe.item(), "expected": expected, "seconds": seconds,
            "nbytes": nbytes}


def check_ranks(cfg: Any, env: Any, test_bytes: int = 4 << 20) -> dict[str, Any]:
    """Compare every rank's report, then run a test all-reduce (collective; every rank).

    Args:
        cfg: this rank's config (compared by hash, the first differing key named).
        env: this rank's :class:`~shardwise.distributed.env.DistEnv`.
        test_bytes: size of the timed all-reduce (default 4 MiB).

    Returns:
        ``{"reports": [per-rank dicts], "all_reduce": {...}}``, the same on every rank.

    Raises:
        ValueError: on every rank alike, naming the ranks that differ and the value, or a
            test all-reduce that gave a wrong sum.
    """
    reports = _exchange(rank_report(cfg, env), env)
    problem = _mismatch(reports)
    if problem is not None:
        raise ValueError(f"the ranks of this job do not match: {problem}")
    result = _test_all_reduce(env, test_bytes)
    verdicts = _exchange([result["ok"], result["seconds"]], env)
    bad = [r for r, (ok, _) in enumerate(verdicts) if not ok]
    # The slowest rank's time, so every rank returns the same figures.
    result["seconds"] = max(s for _, s in verdicts)
    world = env.world_size
    result["bus_bytes_per_s"] = 2 * (world - 1) / world * test_bytes / result["seconds"]
    if bad:
        raise ValueError(f"test all-reduce gave a wrong result on rank(s) {bad} (rank "
                         f"{env.rank}: sum {result['sum']}, expected {result['expected']}); "
                         "the network or backend corrupts data")
    return {"reports": reports, "all_reduce": result}


def format_reports(outcome: dict[str, Any]) -> str:
    """The doctor's table (rank 0 prints it)."""
    cols = ("rank", "host", "pid", "device", "backend", "torch", "shardwise", "python",
            "config_hash")
    rows = [[str(r[c]) for c in cols] for r in outcome["reports"]]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    ar = outcome["all_reduce"]
    lines.append(f"test all-reduce: sum {ar['sum']:g} = {ar['expected']:g} on every rank; "
                 f"{ar['nbytes'] / 2**20:.0f} MiB in {ar['seconds'] * 1e3:.1f} ms "
                 f"({ar['bus_bytes_per_s'] / 1e6:.0f} MB/s bus bandwidth)")
    lines.append(f"ok: {len(rows)} rank(s) agree on device, backend, versions and config")
    return "\n".join(lines)
