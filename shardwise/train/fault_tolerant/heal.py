"""Healing a group that is behind from a live one, in any two layouts, over memory: the
plan a checkpoint's resharding load makes, without the files.

[Note: healing across layouts] The quorum's ranks know every rank's holding (wide.py). The
source is the lowest-id group at the quorum's step; each of its ranks answers for its part
of every parameter (pieces.py) and sends each rank of a group behind the pieces that rank
holds: the parameter's values and, for every optimizer state tensor shaped like the
parameter (Adam's moments), the same elements; the state that is not per element (Adam's
``step``) comes from the source rank holding the first element the receiver holds. The
source group's rank 0 adds what is not per parameter: the buffers, the optimizer's
hyper-parameters, the learning-rate schedule's position, the data position, the lineage and
the step. Every message is a pickled header naming its pieces and their dtypes, then their
raw bytes, so a copy is bitwise whatever the dtype; two all-to-alls over the wide group move
them (the sizes, then the bytes). Two groups laid out alike exchange rank ``r``'s whole shard
with rank ``r``: the copy torchft's own healing made. A stage-1 or stage-2 group keeps its
gathered parameters between steps, so the healed group re-gathers them before its forward.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from shardwise.train.fault_tolerant.pieces import Piece, responsibilities, transfers
from shardwise.train.fault_tolerant.wide import Roster, WideGroup

__all__ = ["heal_behind"]


def _per_element(p: torch.Tensor, v: Any) -> bool:
    return torch.is_tensor(v) and p.dim() > 0 and v.shape == p.shape


def _bytes(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return t.detach().reshape(-1)[a:b].contiguous().view(torch.uint8).reshape(-1)


def _message(params: list[torch.Tensor], optimizer: Any, pieces: list[Piece],
             own: list[tuple[int, int]], anchors: set[int], extra: dict | None) -> torch.Tensor:
    """One source rank's message to one receiver: header, then raw bytes."""
    keys: dict[int, list[tuple[str, str]]] = {}
    scalars: dict[int, dict[str, Any]] = {}
    blobs = []
    for pc in pieces:
        p = params[pc.param]
        a, b = pc.start - own[pc.param][0], pc.stop - own[pc.param][0]
        blobs.append(_bytes(p, a, b))
        state = optimizer.state.get(p, {})
        ks = keys.setdefault(pc.param, [(k, str(v.dtype).removeprefix("torch."))
                                        for k, v in sorted(state.items())
                                        if _per_element(p, v)])
        blobs.extend(_bytes(state[k], a, b) for k, _ in ks)
    for i in anchors:
        state = optimizer.state.get(params[i], {})
        # (value, whether it lives on the host: Adam keeps ``step`` there unless fused)
        scalars[i] = {k: ((v.detach().cpu(), v.device.type == "cpu") if torch.is_tensor(v)
                          else (v, True))
                      for k, v in state.items() if not _per_element(params[i], v)}
    head = pickle.dumps({"pieces": [(pc.param, pc.start, pc.stop) for pc in pieces],
                         "keys": keys, "scalars": scalars, "extra": extra})
    length = torch.tensor([len(head)], dtype=torch.int64).view(torch.uint8)
    device = params[0].device if params else torch.device("cpu")
    return torch.cat([length.to(device), torch.frombuffer(bytearray(head), dtype=torch.uint8)
                      .to(device), *blobs])


def _extra(healable: Any, manager: Any, step: int) -> dict[str, Any]:
    """What the source's rank 0 adds: all that is not per parameter."""
    return {"buffers": [b.detach().cpu() for b in healable.model.buffers()],
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in healable.optimizer.param_groups],
            "schedule": {k: v for k, v in healable.schedule.state_dict().items()
                         if k != "lr_lambdas"},
            "loader": healable.loader.state_dict(), "lineage": healable.lineage,
            "step": step, "batches_committed": manager.batches_committed()}


def _apply(message: torch.Tensor, params: list[torch.Tensor], optimizer: Any,
           own: list[tuple[int, int]]) -> dict | None:
    """Copy one message's pieces into place; returns its ``extra`` (or None)."""
    n = int(message[:8].cpu().clone().view(torch.int64)[0])
    head = pickle.loads(message[8:8 + n].cpu().numpy().tobytes())
    at = 8 + n
    for i, start, stop in head["pieces"]:
        p = params[i]
        a, b = start - own[i][0], stop - own[i][0]
        size = (b - a) * p.element_size()
        with torch.no_grad():
            _bytes_view(p, a, b).copy_(message[at:at + size])
        at += size
        state = optimizer.state[p]
        for key, dt in head["keys"].get(i, []):
            dtype = getattr(torch, dt)
            if key not in state or state[key].dtype != dtype or state[key].shape != p.shape:
                state[key] = torch.zeros(p.shape, dtype=dtype, device=p.device)
            size = (b - a) * state[key].element_size()
            _bytes_view(state[key], a, b).copy_(message[at:at + size])
            at += size
    for i, values in head["scalars"].items():
        p = params[i]
        for key, (v, host) in values.items():
            optimizer.state[p][key] = v.to(p.device) if torch.is_tensor(v) and not host else v
    return head["extra"]


def _bytes_view(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return t.data.view(-1)[a:b].view(torch.uint8)


def heal_behind(wide: WideGroup, roster: Roster, healable: Any, manager: Any) -> bool:
    """Every rank of the quorum: the groups behind copy the source group's state
    ([Note: healing across layouts]). Collective over the wide group.

    Returns:
        True on a rank that healed.

    Raises:
        PeerLost: a group died or froze during the exchange.
    """
    behind = roster.behind()
    up = [g for g in roster.groups if g not in behind]
    if not behind or not up:
        return False
    source = roster.ranks_of(up[0])
    model, optimizer = healable.model, healable.optimizer
    params = list(model.parameters())
    me = roster.me
    own = list(roster.holdings[me].ranges)
    receivers = [w for g in behind for w in roster.ranks_of(g)]
    world = len(roster.holdings)
    send: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * world
    if me in source:
        answers = responsibilities([roster.holdings[w] for w in source])[source.index(me)]
        extra = _extra(healable, manager, roster.max_step) if me == source[0] else None
        for w in receivers:
            needs = roster.holdings[w].ranges
            anchors = {i for i, (a, b) in enumerate(needs)
                       if b > a and answers[i][0] <= a < answers[i][1]}
            send[w] = _message(params, optimizer, transfers(answers, needs), own, anchors,
                               extra)
    device = wide.device
    sizes = torch.tensor([t.numel() for t in send], dtype=torch.int64, device=device)
    got = wide.alltoall(sizes, [1] * world, [1] * world, "healing (message sizes)").tolist()
    out = wide.alltoall(torch.cat([t.to(device) for t in send]),
                        [t.numel() for t in send], got, "healing (state)")
    if me not in receivers:
        return False
    optimizer.state.clear()  # replaced whole: a parameter this rank holds none of has none
    extra, at = None, 0
    for size in got:
        if size:
            e = _apply(out[at:at + size], params, optimizer, own)
            extra = e if e is not None else extra
        at += size
    if extra is None:
        raise RuntimeError("healing: the source group's rank 0 sent no step or schedule")
    _load_extra(extra, healable, manager)
    return True


def _load_extra(extra: dict[str, Any], healable: Any, manager: Any) -> None:
    from shardwise.shard.registry import engine_states

    with torch.no_grad():
        for mine, theirs in zip(healable.model.buffers(), extra["buffers"]):
            mine.copy_(theirs)
    for group, values in zip(healable.optimizer.param_groups, extra["param_groups"]):
        group.update(values)
    sched = healable.schedule.state_dict()
    sched.update(extra["schedule"])
    healable.schedule.load_state_dict(sched)
    healable.loader.load_state_dict(extra["loader"])
    healable.lineage = int(extra["lineage"])
    healable.healed += 1
    manager.load_state_dict({"step": extra["step"],
                             "batches_committed": extra["batches_committed"]})
    for state in engine_states(healable.model):  # stages 1-2 keep gathered parameters
        state.mark_stale()
