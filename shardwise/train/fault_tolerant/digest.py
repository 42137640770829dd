"""One sha256 of a replica group's whole state, the same for every layout of it.

Groups may be laid out differently ([Note: layouts across groups] in pieces.py), so a hash
of each rank's shards would differ between two groups holding the same state. Every rank of
the group sends its pieces (with their ranges) to every other, and each hashes the full
tensors: every parameter, every buffer, and per parameter its optimizer state in key order,
a per-element state as the full tensor, any other (Adam's ``step``) as the rank holding the
parameter's first element has it. A check at the end of a run (collective in the group);
for a large model it moves the whole state once.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from shardwise.distributed.comm import objects as comm_objects
from shardwise.train.fault_tolerant.pieces import RankHolding

__all__ = ["group_state_digest"]


def _flat_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _pieces(model: torch.nn.Module, optimizer: Any, holding: RankHolding) -> list[dict]:
    out = []
    for p, (start, stop) in zip(model.parameters(), holding.ranges):
        state = optimizer.state.get(p, {}) if stop > start else {}  # holds none: adds none
        elementwise = {k: _flat_bytes(v) for k, v in state.items()
                       if torch.is_tensor(v) and p.dim() > 0 and v.shape == p.shape}
        other = {k: (_flat_bytes(v) if torch.is_tensor(v) else repr(v).encode())
                 for k, v in state.items() if k not in elementwise}
        out.append({"range": (start, stop), "itemsize": p.element_size(),
                    "values": _flat_bytes(p), "elementwise": elementwise,
                    "itemsizes": {k: state[k].element_size() for k in elementwise},
                    "other": other})
    return out


def group_state_digest(model: torch.nn.Module, optimizer: Any, holding: RankHolding) -> str:
    """sha256 of the group's full state (collective over the group's ranks)."""
    everyone = comm_objects.all_gather_object(_pieces(model, optimizer, holding),
                                              label="ft.digest")
    h = hashlib.sha256()
    for i, numel in enumerate(holding.numels):
        ranks = [r[i] for r in everyone]
        full = bytearray(numel * ranks[0]["itemsize"])
        states: dict[str, bytearray] = {}
        first = None
        for r in ranks:
            a, b = r["range"]
            size = r["itemsize"]
            full[a * size:b * size] = r["values"]
            for k, v in r["elementwise"].items():
                isz = r["itemsizes"][k]
                buf = states.setdefault(k, bytearray(numel * isz))
                buf[a * isz:b * isz] = v
            if b > a and a == 0 and first is None:
                first = r
        h.update(bytes(full))
        other = first["other"] if first is not None else {}
        for k in sorted(set(states) | set(other)):
            h.update(k.encode())
            h.update(bytes(states[k]) if k in states else other[k])
    for b in model.buffers():
        h.update(_flat_bytes(b))
    return h.hexdigest()
