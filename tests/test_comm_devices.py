"""Every collective goes through shardwise.distributed.comm, which checks devices (issue 10).

* A static check: no module of the package outside ``distributed/comm/``'s
  ``__init__.py``, ``objects.py``, ``gloo.py`` (Gloo's mechanics, called by comm) and
  ``p2p.py`` calls a ``torch.distributed`` collective directly (collectives, object collectives,
  barriers, point-to-point), so the device check, the counters and the watchdog see every
  one.
* The device check itself, on a Gloo group created as ``"cuda:gloo"``: like NCCL it refuses
  CPU tensors, and shardwise's message (naming the collective, its label, the tensor's
  device and the group's) comes before torch's "No backend type associated with device
  type cpu".
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.distributed import comm
from shardwise.distributed.comm import objects as comm_objects
from shardwise.testing import run_ranks

PACKAGE = Path(shardwise.__file__).parent
ALLOWED = {PACKAGE / "distributed" / "comm" / name
           for name in ("__init__.py", "objects.py", "gloo.py", "p2p.py")}
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce",
    "all_to_all", "all_to_all_single", "gather", "scatter", "barrier", "monitored_barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
    "recv_object_list",
}


def _direct_calls(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """``dist.X(...)`` / ``torch.distributed.X(...)`` calls and ``from torch.distributed import
    X`` of a collective ``X`` in one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = {"torch.distributed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                      if a.name in COLLECTIVES]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in COLLECTIVES and ast.unparse(node.func.value) in aliases:
            found.append(f"{path.relative_to(root)}:{node.lineno} calls "
                         f"{ast.unparse(node.func)}")
    return found


def test_no_collective_bypasses_comm():
    offenders = [c for p in sorted(PACKAGE.rglob("*.py")) if p not in ALLOWED
                 for c in _direct_calls(p)]
    assert not offenders, "collectives must go through shardwise.distributed.comm:\n" + \
        "\n".join(offenders)


def test_the_static_check_finds_a_direct_call(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as d\nfrom torch.distributed import barrier\n"
                   "def f(t):\n    d.all_reduce(t)\n")
    found = [c.split(" ", 1)[1] for c in _direct_calls(bad, tmp_path)]
    assert found == ["imports barrier", "calls d.all_reduce"]


def _cpu_tensor_on_a_cuda_only_group() -> list[str]:
    group = dist.new_group(backend="cuda:gloo")
    out = [",".join(sorted(comm.served_devices(group))),
           ",".join(sorted(comm.served_devices()))]
    calls = [
        lambda: comm.all_reduce(torch.ones(2), group, label="test.norm"),
        lambda: comm.all_gather_into_tensor(torch.empty(4), torch.ones(2), group,
                                            label="unit.all_gather"),
        lambda: comm.reduce_scatter_tensor(torch.empty(2), torch.ones(4), group,
                                           label="unit.reduce_scatter"),
        lambda: comm.broadcast(torch.ones(2), 0, group, label="sync"),
        lambda: comm.all_to_all_single(torch.empty(2), torch.ones(2), group=group, label="a2a"),
    ]
    for call in calls:
        try:
            call()
            out.append("no error")
        except RuntimeError as exc:
            out.append(str(exc))
    comm_objects.barrier(label="test.done")
    return out


def test_a_cpu_tensor_on_a_group_that_serves_cuda_only_is_named():
    for out in run_ranks(_cpu_tensor_on_a_cuda_only_group, 2, timeout_s=60):
        assert out[0] == "cuda" and out[1] == "cpu,cuda"
        assert out[2].startswith("all_reduce 'test.norm': a tensor on cpu was handed to "
                                 "process group"), out[2]
        assert "which serves cuda tensors only" in out[2]
        for kind, msg in zip(("all_gather 'unit.all_gather'", "reduce_scatter "
                              "'unit.reduce_scatter'", "broadcast 'sync'", "all_to_all 'a2a'"),
                             out[3:]):
            assert msg.startswith(kind + ": a tensor on cpu"), msg
        assert not any("No backend type" in m for m in out[2:])


def test_group_device_is_the_cpu_for_gloo_and_cuda_for_cuda_only_groups():
    assert comm.group_device() == torch.device("cpu")  # no process group: the CPU


@pytest.mark.parametrize("fn", [comm_objects.barrier])
def test_object_collectives_work_without_a_process_group(fn):
    fn(label="solo")
    assert comm_objects.all_gather_object({"a": 1}) == [{"a": 1}]
    assert comm_objects.broadcast_object("x", 0) == "x"
