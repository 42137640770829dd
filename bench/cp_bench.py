"""Context parallelism on CPU ranks: shardwise's ring, Ulysses and hybrid attention beside
PyTorch's own ``context_parallel`` and beside one process (cp 1), on the same model and
global batch.

    python bench/cp_bench.py                  # 3 rounds, cp 1 / 2 / 4, T 2048 and 8192 (~40 min)
    python bench/cp_bench.py --quick          # 1 round, T 1024, 3 steps, 256 MiB cap (~2-4 min)
    python bench/cp_bench.py --from-json bench/results/cp_bench.json   # re-render the tables

Model: the debug Llama (dim 256, 4 layers, 8 heads / 4 key/value heads, vocab 256) with
``max_seq_len`` = the sequence length, fp32, AdamW, gradients averaged over the cp ranks by
``shardwise.replicate`` for every row (the same data-parallel code under every attention:
the rows differ only in how attention sees the sequence). Gloo, one intra-op thread per
rank; cp 4 runs 4 ranks on however many cores there are (labelled oversubscribed).

Rows (one job holds every row of a cp degree, built from the same seed, and runs them
step by step in an order rotated every step, so machine load hits all alike; rounds
repeat the jobs in a rotated order):

- ``cp1``: one process, the whole sequence, plain SDPA (``is_causal=True``).
- ``sw-ring`` / ``sw-ring-none``: ``apply_cp(impl="ring")``, zigzag / contiguous layout.
- ``sw-ulysses``: ``impl="ulysses"`` (cp must divide the 4 key/value heads: cp 2 and 4).
- ``sw-hybrid``: ``impl="hybrid"`` at cp 4 (2-way all-to-all, 2-rank ring).
- ``torch-allgather`` / ``torch-alltoall``: ``torch.distributed.tensor.experimental.
  context_parallel`` (head-tail load balancing, its default) with key/value rotation by
  all-gather (its default) / all-to-all. As shipped it does not run on the CPU (see
  [Note: torch context parallel on CPU] in bench/cp_torch.py: the error is recorded in the
  results); these rows run torch's own ring through a labelled ~50-line shim that registers
  the CPU flash kernels in its dispatch table.

Reported (bench/results/cp_bench.{md,json}):

1. Step time (forward + loss + backward + AdamW step; a barrier before each step, the
   slowest rank's time counts), median per round, ratios per round against torch and
   against cp 1; CPU time (``time.process_time`` of the rank's process, the slowest rank's)
   beside it, and the load average before every job.
2. Activations saved for backward per rank (distinct storages reached by
   ``saved_tensors_hooks`` in one forward, parameters excluded) at cp 1, 2, 4 against
   1/cp of cp 1's; and the longest sequence one fwd+bwd step fits in a per-rank memory cap
   (peak RSS growth during the step, ``--cap-mib``), cp 1 against cp 4.
3. Causal balance: unmasked score entries per rank (``attention_entries``), zigzag against
   contiguous, and the measured spread of the ranks' CPU time per step.
4. Bytes each rank sends per attention layer (``comm_stats``, forward and backward) against
   ``bytes_per_layer``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.launch import JobFailure, run_job  # noqa: E402

OUT = Path(ROOT) / "bench" / "results"
HEADS, KV_HEADS, DIM, LAYERS = 8, 4, 256, 4
# name -> (framework, impl or rotate method, load balance)
ROWS = {
    "cp1": ("plain", None, None),
    "sw-ring": ("shardwise", "ring", "zigzag"),
    "sw-ulysses": ("shardwise", "ulysses", "zigzag"),
    "sw-hybrid": ("shardwise", "hybrid", "zigzag"),
    "sw-ring-none": ("shardwise", "ring", "none"),
    "torch-allgather": ("torch", "allgather", "head-tail"),
    "torch-alltoall": ("torch", "alltoall", "head-tail"),
}
PER_CP = {1: ["cp1"],
          2: ["sw-ring", "sw-ulysses", "sw-ring-none", "torch-allgather", "torch-alltoall"],
          4: ["sw-ring", "sw-ulysses", "sw-hybrid", "sw-ring-none", "torch-allgather"]}
PEER = "torch-allgather"  # torch's default rotation: the row the speed target compares with


def model_config(seq: int):
    from shardwise.models import get_model_config
    return get_model_config("debug", max_seq_len=seq)


# ----------------------------------------------------------------------------- rank side


class _Row:
    """One row's model, optimizer and step on this rank."""

    def __init__(self, name: str, seq: int, mesh) -> None:
        import torch

        import shardwise
        from shardwise.models import build_model
        self.name = name
        self.framework, self.how, self.balance = ROWS[name]
        self.model = build_model(model_config(seq), seed=0)
        self.cp_mesh = None
        if self.framework == "shardwise":
            shardwise.apply_cp(self.model, mesh["cp"], impl=self.how,
                               load_balance=self.balance)
        if self.framework == "torch":
            self.cp_mesh = mesh["cp"]
        if mesh is not None:
            shardwise.replicate(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                     weight_decay=0.1)

    def forward_backward(self, x, y, pack=None, after_forward=None):
        """Loss of this rank's tokens, forward and backward (``pack``: a saved-tensor pack
        hook around the forward; ``after_forward``: called between forward and backward)."""
        import contextlib

        import torch
        import torch.nn.functional as F

        import shardwise
        hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if pack
                 else contextlib.nullcontext())
        if self.framework == "torch":
            from bench import cp_torch
            cp_torch.set_rotate(self.how)
            x, y = x.clone(), y.clone()
            with cp_torch.cp_region(self.model, self.cp_mesh, x, y):
                with hooks:
                    loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
                if after_forward:
                    after_forward()
                loss.backward()
            return loss.detach()
        if self.framework == "shardwise":
            cp = shardwise.cp_context(self.model)
            x, y = cp.shard(x), cp.shard(y)
        with hooks:
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        if after_forward:
            after_forward()
        loss.backward()
        return loss.detach()

    def step(self, x, y):
        loss = self.forward_backward(x, y)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


def _saved_pack(seen: dict):
    """A pack hook adding each saved floating tensor's storage bytes to ``seen`` once
    (parameters and their views excluded; a DTensor counts its local shard)."""
    from torch import nn

    from bench.measure import local_tensor

    def pack(t):
        base = t._base if t._base is not None else t
        if not isinstance(base, nn.Parameter) and not isinstance(t, nn.Parameter):
            local = local_tensor(t)
            local = getattr(local, "elem", local)
            if local.is_floating_point() and local.device.type != "meta":
                st = local.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return t
    return pack


def _batch(step: int, batch: int, seq: int):
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    t = torch.randint(0, 256, (batch, seq + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _cp_bytes(stats) -> dict[str, int]:
    """Context-parallel bytes this rank sent: point-to-point sends and all-to-alls (the
    gradient averaging is all-reduce, reported apart)."""
    return {"cp": stats["send"].bytes_sent + stats["all_to_all"].bytes_sent,
            "all_reduce": stats["all_reduce"].bytes_sent}


def speed_job(cp: int, names: list[str], seq: int, batch: int, steps: int, warmup: int,
              offset: int, extras: bool) -> dict:
    """Every row of one cp degree on this job's ranks, interleaved step by step; with
    ``extras`` also each row's saved activations, bytes per layer and (torch rows) the
    as-shipped probe. Returns this rank's measurements."""
    import torch.distributed as dist

    import shardwise
    from bench import cp_torch
    mesh = shardwise.ParallelDims(world_size=cp, cp=cp).build_mesh() if cp > 1 else None
    out: dict = {"rank": dist.get_rank(), "rows": {}}
    if any(ROWS[n][0] == "torch" for n in names):
        if extras:
            probe = _Row(names[[ROWS[n][0] for n in names].index("torch")], seq, mesh)
            x, y = _batch(0, batch, seq)
            out["torch_as_shipped"] = cp_torch.probe_as_shipped(probe.model, mesh["cp"], x, y)
            del probe
        cp_torch.install_cpu_shim()
    rows = {n: _Row(n, seq, mesh) for n in names}
    rec = {n: {"wall": [], "cpu": [], "loss": []} for n in names}
    for i in range(warmup + steps):
        x, y = _batch(i, batch, seq)
        k = (i + offset) % len(names)
        for n in names[k:] + names[:k]:
            if cp > 1:
                dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            loss = rows[n].step(x, y)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            rec[n]["loss"].append(float(loss))
            if i >= warmup:
                rec[n]["wall"].append(wall)
                rec[n]["cpu"].append(cpu)
    for n in names:
        out["rows"][n] = rec[n]
        if not extras:
            continue
        row = rows[n]
        x, y = _batch(warmup + steps, batch, seq)
        gc.collect()
        seen: dict[int, int] = {}
        marks = {}
        shardwise.reset_comm_stats()

        def after_forward(marks=marks):
            marks["fwd"] = _cp_bytes(shardwise.comm_stats())
            shardwise.reset_comm_stats()
        row.forward_backward(x, y, pack=_saved_pack(seen), after_forward=after_forward)
        marks["bwd"] = _cp_bytes(shardwise.comm_stats())
        row.opt.zero_grad(set_to_none=True)
        out["rows"][n].update({"saved_bytes": sum(seen.values()), "bytes": marks})
    return out


def peak_job(name: str, cp: int, seq: int, batch: int) -> dict:
    """One fwd+bwd step of ``name`` at ``seq`` on fresh ranks: this rank's peak RSS growth
    during the step (VmHWM after resetting it, minus VmRSS before) and saved bytes."""
    import torch.distributed as dist

    import shardwise
    from bench.measure import reset_hwm, rss_hwm, rss_now
    mesh = shardwise.ParallelDims(world_size=cp, cp=cp).build_mesh() if cp > 1 else None
    row = _Row(name, seq, mesh)
    x, y = _batch(0, batch, seq)
    gc.collect()
    if cp > 1:
        dist.barrier()
    before = rss_now()
    reset_hwm()
    seen: dict[int, int] = {}
    start = time.perf_counter()
    row.forward_backward(x, y, pack=_saved_pack(seen))
    return {"peak_growth": rss_hwm() - before, "saved_bytes": sum(seen.values()),
            "step_s": time.perf_counter() - start, "rss_before": before}


# ----------------------------------------------------------------------------- driver


def _slowest(per_rank: list[list[float]]) -> list[float]:
    """Per step, the slowest rank's value."""
    return [max(vals) for vals in zip(*per_rank)]


def aggregate(res: list[dict], names: list[str], extras: bool) -> tuple[dict, dict]:
    """The per-rank results of one :func:`speed_job` as one round's record (per step the
    slowest rank's wall and CPU time, every rank's CPU time, the mean loss over the ranks)
    and the extras (per-rank saved bytes and bytes sent, the as-shipped probe)."""
    rec: dict = {"rows": {}}
    extra: dict = {"rows": {}}
    if "torch_as_shipped" in res[0]:
        extra["torch_as_shipped"] = res[0]["torch_as_shipped"]
    for n in names:
        per = [r["rows"][n] for r in res]
        rec["rows"][n] = {"wall": _slowest([p["wall"] for p in per]),
                          "cpu": _slowest([p["cpu"] for p in per]),
                          "cpu_ranks": [p["cpu"] for p in per],
                          "loss": [statistics.mean(v) for v in zip(*[p["loss"] for p in per])]}
        if extras:
            extra["rows"][n] = {"saved_bytes": [p["saved_bytes"] for p in per],
                                "bytes": [p["bytes"] for p in per]}
    return rec, extra


def _speed_round(cp: int, seq: int, args, offset: int, extras: bool) -> tuple[dict, dict]:
    """One job of every row at ``cp``: (this round's per-row record, the extras)."""
    names = [n for n in PER_CP[cp] if n in args.rows]
    load = os.getloadavg()
    start = time.perf_counter()
    res = run_job(speed_job, cp, args=(cp, names, seq, args.batch, args.steps, args.warmup,
                                       offset, extras),
                  with_deepspeed=False, timeout_s=1800)
    rec, extra = aggregate(res, names, extras)
    rec.update({"load": list(load), "job_s": time.perf_counter() - start})
    return rec, extra


def _max_len(name: str, cp: int, args, log) -> dict:
    """The longest sequence (a multiple of ``--grain``) whose one fwd+bwd step on fresh ranks
    grows no rank's RSS by more than ``--cap-mib``: doubling, then bisection."""
    cap = args.cap_mib * 2**20
    trials: list[dict] = []

    def fits(seq: int) -> bool:
        res = run_job(peak_job, cp, args=(name, cp, seq, args.batch), with_deepspeed=False,
                      timeout_s=1800)
        t = {"seq": seq, "peak_growth": max(r["peak_growth"] for r in res),
             "saved_bytes": max(r["saved_bytes"] for r in res),
             "step_s": max(r["step_s"] for r in res)}
        t["fits"] = t["peak_growth"] <= cap
        trials.append(t)
        log(f"  max length {name} cp {cp}: T {seq}: peak growth "
            f"{t['peak_growth'] / 2**20:.0f} MiB, saved {t['saved_bytes'] / 2**20:.0f} MiB, "
            f"{t['step_s']:.1f} s -> {'fits' if t['fits'] else 'over the cap'}")
        return t["fits"]

    g = args.grain
    lo, hi = 0, g
    while fits(hi):
        lo = hi
        if hi * 2 > args.max_seq:  # fits at the longest length tried: a lower bound
            return {"name": name, "cp": cp, "max_seq": lo, "bounded": True, "trials": trials}
        hi *= 2
    while hi - lo > g:
        mid = (lo + hi) // 2 // g * g
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return {"name": name, "cp": cp, "max_seq": lo, "bounded": False, "trials": trials}


def wait_for_quiet(minutes: float, below: float) -> float:
    """Wait up to ``minutes`` for the 1-minute load average to drop below ``below``;
    returns the load average then."""
    deadline = time.time() + 60 * minutes
    while os.getloadavg()[0] >= below and time.time() < deadline:
        time.sleep(15)
    return os.getloadavg()[0]


def run(args, log=print) -> dict:
    if args.wait_load > 0:
        log(f"waiting up to {args.wait_load} min for a load average below {args.load_below}")
        wait_for_quiet(args.wait_load, args.load_below)
    started = time.time()
    data: dict = {"meta": _meta(args), "speed": {}, "extras": {}, "max_len": {}}
    cps = [c for c in (1, 2, 4) if c in args.cp]
    for r in range(args.rounds):
        for seq in args.seq:
            order = cps[r % len(cps):] + cps[:r % len(cps)]
            for cp in order:
                rec, extra = _speed_round(cp, seq, args, offset=r, extras=r == 0)
                data["speed"].setdefault(str(seq), {}).setdefault(str(cp), []).append(rec)
                if r == 0:
                    if "torch_as_shipped" in extra:
                        data.setdefault("torch_as_shipped", {})[f"cp{cp}"] = \
                            extra.pop("torch_as_shipped")
                    data["extras"].setdefault(str(seq), {})[str(cp)] = extra["rows"]
                log(f"round {r + 1} T {seq} cp {cp}: " + ", ".join(
                    f"{n} {statistics.median(v['wall']) * 1e3:.0f} ms "
                    f"(cpu {statistics.median(v['cpu']) * 1e3:.0f})"
                    for n, v in rec["rows"].items()) + f"; load {rec['load'][0]:.1f}")
        data["meta"]["rounds_done"] = r + 1
        data["meta"]["minutes"] = (time.time() - started) / 60
        _write(data, args.out)
    if args.cap_mib > 0:
        for name, cp in (("cp1", 1), ("sw-ring", 4)):
            if cp in cps:
                data["max_len"][f"{name}@cp{cp}"] = _max_len(name, cp, args, log)
    data["meta"]["minutes"] = (time.time() - started) / 60
    data["meta"]["load_at_end"] = list(os.getloadavg())
    _write(data, args.out)
    return data


def _write(data: dict, out: str) -> None:
    Path(out + ".json").write_text(json.dumps(data, indent=1))
    Path(out + ".md").write_text(to_markdown(data))


def _meta(args) -> dict:
    import torch
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "shardwise"], capture_output=True,
                           text=True, cwd=ROOT).stdout.strip()
    import shardwise
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
            "commit": commit + ("+dirty" if dirty else ""),
            "shardwise_from": os.path.dirname(shardwise.__file__),
            "cores": os.cpu_count(), "machine": platform.platform(), "quick": args.quick,
            "seq": args.seq, "batch": args.batch, "steps": args.steps,
            "warmup": args.warmup, "rounds": args.rounds, "cap_mib": args.cap_mib,
            "grain": args.grain, "load_at_start": list(os.getloadavg())}



# ----------------------------------------------------------------------------- report


def _per_round(values: list[float], fmt: str = "{:.2f}") -> str:
    return " / ".join(fmt.format(v) for v in values) if values else "-"


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.2f}" if len(values) == 1 else f"{min(values):.2f}-{max(values):.2f}"


def verdict(ratios: list[float]) -> str:
    """"met" when every round holds ratio <= 1.00, "not met" when no round does, else
    "not settled"."""
    if not ratios:
        return "no peer"
    if max(ratios) <= 1.0:
        return "met"
    if min(ratios) > 1.0:
        return "not met"
    return "not settled (rounds on both sides of 1.00)"


def _medians_ms(rounds: list[dict], name: str, key: str) -> list[float]:
    return [1e3 * statistics.median(r["rows"][name][key]) for r in rounds
            if name in r["rows"]]


def _ratio(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b)] if a and b else []


def speed_rows(data: dict, seq: str) -> list[dict]:
    """Per (cp, row) at length ``seq``: per-round medians (ms) and per-round ratios against
    torch's default rotation in the same job and against cp 1 in the same round."""
    by_cp = data["speed"].get(seq, {})
    base = by_cp.get("1", [])
    cp1 = {k: _medians_ms(base, "cp1", k) for k in ("wall", "cpu")}
    out = []
    for cp, rounds in sorted(by_cp.items(), key=lambda kv: int(kv[0])):
        names = list(rounds[0]["rows"])
        for n in names:
            row = {"cp": int(cp), "name": n,
                   "wall": _medians_ms(rounds, n, "wall"), "cpu": _medians_ms(rounds, n, "cpu"),
                   "load": [r["load"][0] for r in rounds]}
            for k in ("wall", "cpu"):
                peers = {p: _medians_ms(rounds, p, k) for p in names if ROWS[p][0] == "torch"}
                row[f"{k}_vs"] = ({p: _ratio(row[k], v) for p, v in peers.items()}
                                  if ROWS[n][0] == "shardwise" else {})
                row[f"{k}_vs_cp1"] = _ratio(row[k], cp1[k]) if cp != "1" else []
            out.append(row)
    return out


def _describe(name: str) -> str:
    fw, how, balance = ROWS[name]
    if fw == "plain":
        return "one process, plain SDPA"
    if fw == "shardwise":
        return f"shardwise {how}, {balance}"
    return f"torch ring, {how} rotation, {balance} (CPU shim)"


def _speed_section(data: dict, seq: str) -> list[str]:
    rows = speed_rows(data, seq)
    cores = data["meta"]["cores"]
    lines = [f"### Step time, T = {seq}", "",
             "| cp | row | what | step ms | vs torch | vs cp 1 | CPU ms | CPU vs torch | "
             "CPU vs cp 1 | load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cp = f"{r['cp']}" + (" (oversubscribed)" if r["cp"] > cores else "")
        vs = r["wall_vs"].get(PEER, [])
        cvs = r["cpu_vs"].get(PEER, [])
        lines.append(f"| {cp} | {r['name']} | {_describe(r['name'])} | "
                     f"{_per_round(r['wall'], '{:.0f}')} | {_per_round(vs)} | "
                     f"{_per_round(r['wall_vs_cp1'])} | {_per_round(r['cpu'], '{:.0f}')} | "
                     f"{_per_round(cvs)} | {_per_round(r['cpu_vs_cp1'])} | "
                     f"{_per_round(r['load'], '{:.1f}')} |")
    return lines + [""]


def _loss_check(data: dict) -> str:
    worst, found = 0.0, False
    for by_cp in data["speed"].values():
        ref = by_cp.get("1", [{}])[0].get("rows", {}).get("cp1", {}).get("loss")
        if not ref:
            continue
        found = True
        for rounds in by_cp.values():
            for row in rounds[0]["rows"].values():
                worst = max(worst, abs(row["loss"][0] - ref[0]) / abs(ref[0]))
    if not found:
        return ""
    return (f"Same numbers: every row's first loss (same weights, same batch) is cp 1's "
            f"within {worst:.1e} relative.")


def _torch_section(data: dict) -> list[str]:
    shipped = data.get("torch_as_shipped")
    if not shipped:
        return []
    lines = ["## PyTorch's context_parallel on CPU / Gloo", "",
             f"As shipped (torch {data['meta']['torch']}) it does not run on the CPU. "
             "`context_parallel(mesh, buffers=[tokens, labels, rope.cos, rope.sin], "
             "buffer_seq_dims=[1, 1, 0, 0])` around forward and backward of the same model "
             "(our `Attention` calls `F.scaled_dot_product_attention(q, k, v, "
             "is_causal=True)`, which the context manager patches):", ""]
    for cp, attempts in shipped.items():
        for what, err in attempts.items():
            lines.append(f"- {cp}, {what}: `{err}`")
    lines += ["", "Why: the patched SDPA wraps q, k, v as DTensors sharded on the sequence "
              "dim, and torch's context-parallel DTensor handlers (`_sdpa_handler`) and "
              "sharding rules cover exactly `aten._scaled_dot_product_{flash,efficient,cudnn}"
              "_attention` and their backwards, the CUDA kernels. On the CPU, SDPA dispatches "
              "`aten._scaled_dot_product_flash_attention_for_cpu`, which has no handler and "
              "no sharding strategy, so DTensor's sharding propagation raises; forcing the "
              "math backend decomposes attention into DTensor ops and fails on the causal "
              "mask, a plain tensor added to DTensor scores.", "",
              "The `torch-*` rows run torch's own ring (`_templated_ring_attention` and its "
              "backward, its head-tail load balancer, rotation and merge, unchanged) through "
              "`bench/cp_torch.py`: a ~50-line shim registering a sequence-sharded strategy "
              "and a handler for the CPU flash kernel pair (results exact: the same first "
              "loss as cp 1). They are PyTorch's algorithm on the CPU, not a configuration "
              "PyTorch ships. Its backward always rotates dK/dV by all-to-all, whatever "
              "`set_rotate_method` says.", ""]
    return lines


def _targets(data: dict) -> list[str]:
    lines = ["## Targets (issue 32)", "",
             "Speed: shardwise no slower than PyTorch's at cp 2 in every round (ratio <= "
             "1.00 in each round: met; > 1.00 in each: not met; else not settled). Wall time "
             "is what a user waits for and moved with the load of other jobs; CPU time is "
             "the work the ranks did and moves little with it.", "",
             f"Primary: `sw-ring` (shardwise's default: ring, zigzag) against `{PEER}` "
             f"(torch's default: all-gather rotation, head-tail), cp 2, ratios per round:", ""]
    table = []
    for seq in data["speed"]:
        for r in speed_rows(data, seq):
            if r["cp"] != 2 or not r["wall_vs"]:
                continue
            for peer in r["wall_vs"]:
                w, c = r["wall_vs"][peer], r["cpu_vs"][peer]
                if r["name"] == "sw-ring" and peer == PEER:
                    lines.append(f"- T {seq}: step time {_per_round(w)}: **{verdict(w)}**; "
                                 f"CPU time {_per_round(c)}: **{verdict(c)}**")
                table.append(f"| {seq} | {r['name']} | {peer} | {_span(w)} | {verdict(w)} | "
                             f"{_span(c)} | {verdict(c)} |")
    lines += ["", "Every shardwise row at cp 2 against each torch row (range over the rounds):",
              "", "| T | row | against | step time | verdict | CPU time | verdict |",
              "|---|---|---|---|---|---|---|", *table]
    lines += ["", "Memory: activations saved for backward per rank at cp N within 10% of "
              "1/N of cp 1's (ratio = saved at cp N / (cp 1's / N), the rank that saves "
              "most):", ""]
    for seq, ratios in _memory_ratios(data).items():
        text = ", ".join(f"{name} cp {cp} {ratio:.3f}" for name, cp, ratio in ratios
                         if ROWS[name][0] == "shardwise")
        ok = all(abs(ratio - 1) <= 0.1 for name, _, ratio in ratios
                 if ROWS[name][0] == "shardwise")
        lines.append(f"- T {seq}: {text}: **{'met' if ok else 'not met'}**")
    return lines + [""]


def _memory_ratios(data: dict) -> dict[str, list[tuple[str, int, float]]]:
    out = {}
    for seq, by_cp in data["extras"].items():
        base = by_cp.get("1", {}).get("cp1")
        if not base:
            continue
        ref = max(base["saved_bytes"])
        out[seq] = [(n, int(cp), max(row["saved_bytes"]) / (ref / int(cp)))
                    for cp, rows in sorted(by_cp.items(), key=lambda kv: int(kv[0]))
                    if cp != "1" for n, row in rows.items()]
    return out


def _memory_section(data: dict) -> list[str]:
    lines = ["## Memory", "",
             "Activations saved for backward per rank: the distinct storages the "
             "saved-tensor hooks see in one forward (floating tensors, parameters and their "
             "views excluded, a DTensor as its local shard), max / min over the ranks.", "",
             "| T | cp | row | saved MiB (max rank) | min rank | cp 1 / cp | ratio |",
             "|---|---|---|---|---|---|---|"]
    for seq, by_cp in data["extras"].items():
        base = by_cp.get("1", {}).get("cp1")
        ref = max(base["saved_bytes"]) if base else None
        for cp, rows in sorted(by_cp.items(), key=lambda kv: int(kv[0])):
            for n, row in rows.items():
                hi, lo = max(row["saved_bytes"]), min(row["saved_bytes"])
                ideal = ref / int(cp) if ref else None
                lines.append(f"| {seq} | {cp} | {n} | {hi / 2**20:.2f} | {lo / 2**20:.2f} | "
                             + (f"{ideal / 2**20:.2f} | {hi / ideal:.3f} |" if ideal
                                else "- | - |"))
    lines += ["", "The torch rows' ranks differ: every rank but the last keeps one more "
              "output-sized fp32 tensor (B x 8 heads x T / cp x 32) per layer; those are the "
              "ranks that take torch's partial-query path (ring steps after their own "
              "index), whose merge rebuilds the output.", ""]
    ml = data.get("max_len") or {}
    if ml:
        meta = data["meta"]
        lines += [f"Longest sequence one forward + backward step trains at (batch "
                  f"{meta['batch']}) with every rank's peak RSS growth during the step (VmHWM "
                  f"after resetting it, minus VmRSS before the step, on fresh ranks) within a "
                  f"cap of **{meta['cap_mib']} MiB per rank**; lengths are multiples of "
                  f"{meta['grain']}, doubled then bisected, one fresh job per length. The "
                  f"growth at one length varies by about 10% between runs (allocator, Gloo), "
                  f"so a longest T near the cap is good to about one step of the grid.", "",
                  "| layout | longest T | peak growth there (MiB, max rank) | saved there "
                  "(MiB) | step s there | first T over the cap | its peak (MiB) |",
                  "|---|---|---|---|---|---|---|"]
        for res in ml.values():
            at = [t for t in res["trials"] if t["seq"] == res["max_seq"]]
            over = sorted((t for t in res["trials"] if not t["fits"]), key=lambda t: t["seq"])
            at = at[0] if at else None
            label = ("cp 1 (one process)" if res["cp"] == 1 else
                     f"cp {res['cp']}, {res['name']} ({_describe(res['name'])})")
            lines.append(
                f"| {label} | {res['max_seq']}{' (or more)' if res.get('bounded') else ''} | "
                + (f"{at['peak_growth'] / 2**20:.0f} | {at['saved_bytes'] / 2**20:.0f} | "
                   f"{at['step_s']:.1f} | " if at else "- | - | - | ")
                + (f"{over[0]['seq']} | {over[0]['peak_growth'] / 2**20:.0f} |" if over
                   else "- | - |"))
        if len(ml) == 2:
            a, b = (r["max_seq"] for r in ml.values())
            if a:
                lines += ["", f"cp 4 trains at {b / a:.2f}x cp 1's longest sequence under the "
                          f"same per-rank cap. Below 4x: at equal saved bytes a cp 4 rank's "
                          f"peak grows more than one process's (the trials are in the JSON): "
                          f"the ring's transient buffers (received K/V blocks, fp32 dQ / dK / "
                          f"dV accumulators) and what every rank holds whole (the model's "
                          f"gradients, Gloo's buffers)."]
        lines.append("")
    return lines


def _balance_section(data: dict) -> list[str]:
    from shardwise.parallel.context import attention_entries
    seqs = list(data["speed"])
    if not seqs:
        return []
    seq = seqs[0]
    lines = ["## Causal balance", "",
             f"Unmasked causal score entries each rank computes per sequence and head "
             f"(`attention_entries`), T = {seq}:", "",
             "| cp | layout | entries per rank | max / min |", "|---|---|---|---|"]
    for cp in (2, 4):
        for lb in ("zigzag", "none"):
            e = [attention_entries(int(seq), r, cp, lb) for r in range(cp)]
            lines.append(f"| {cp} | {lb} | {', '.join(str(x) for x in e)} | "
                         f"{max(e) / min(e):.3f} |")
    lines += ["", "Measured: each rank's CPU ms per step (median over every timed step of "
              "every round); the ranks wait for each other at the ring's messages, so the "
              "step time follows the busiest rank.", "",
              "| T | cp | row | CPU ms per rank | max / min |", "|---|---|---|---|---|"]
    for seq, by_cp in data["speed"].items():
        for cp, rounds in sorted(by_cp.items(), key=lambda kv: int(kv[0])):
            if cp == "1":
                continue
            for n in ("sw-ring", "sw-ring-none", PEER):
                if n not in rounds[0]["rows"]:
                    continue
                per_rank = [statistics.median([v for r in rounds
                                               for v in r["rows"][n]["cpu_ranks"][k]])
                            for k in range(int(cp))]
                lines.append(f"| {seq} | {cp} | {n} | "
                             f"{', '.join(f'{1e3 * v:.0f}' for v in per_rank)} | "
                             f"{max(per_rank) / min(per_rank):.2f} |")
    return lines + [""]


def expected_bytes(name: str, seq: int, cp: int, batch: int) -> dict[str, int]:
    """``bytes_per_layer`` for a shardwise row of the debug model (fp32)."""
    from shardwise.parallel.context import bytes_per_layer, ulysses_degree
    _, impl, _ = ROWS[name]
    return bytes_per_layer(impl, batch=batch, seq_len=seq, cp=cp, heads=HEADS,
                           kv_heads=KV_HEADS, head_dim=DIM // HEADS, elem=4,
                           ulysses=ulysses_degree(impl, cp, KV_HEADS))


def _bytes_section(data: dict) -> list[str]:
    batch = data["meta"]["batch"]
    lines = ["## Bytes per rank per attention layer", "",
             "`comm_stats()` around one forward and one backward (point-to-point sends and "
             "all-to-alls; the gradient all-reduce apart), divided by the 4 layers, against "
             "`bytes_per_layer` ([Note: context-parallel bytes]). KiB; one value when every "
             "rank sent the same.", "",
             "| T | cp | row | forward | formula | backward | formula | equal | "
             "grad all-reduce KiB/step |", "|---|---|---|---|---|---|---|---|---|"]

    def kib(values: list[float]) -> str:
        lo, hi = min(values) / 1024, max(values) / 1024
        return f"{lo:.0f}" if lo == hi else f"{lo:.0f}-{hi:.0f}"

    for seq, by_cp in data["extras"].items():
        for cp, rows in sorted(by_cp.items(), key=lambda kv: int(kv[0])):
            for n, row in rows.items():
                if ROWS[n][0] != "shardwise":
                    continue
                fwd = [b["fwd"]["cp"] / LAYERS for b in row["bytes"]]
                bwd = [b["bwd"]["cp"] / LAYERS for b in row["bytes"]]
                ar = [b["bwd"]["all_reduce"] for b in row["bytes"]]
                exp = expected_bytes(n, int(seq), int(cp), batch)
                ok = all(f == exp["forward"] for f in fwd) and \
                    all(b == exp["backward"] for b in bwd)
                lines.append(f"| {seq} | {cp} | {n} | {kib(fwd)} | {exp['forward'] / 1024:.0f} "
                             f"| {kib(bwd)} | {exp['backward'] / 1024:.0f} | "
                             f"{'yes' if ok else 'NO'} | {kib(ar)} |")
    lines += ["", "torch rows: not counted (its functional collectives bypass shardwise's "
              "counters). By its code, per rank and layer it sends one all-gather of K and V "
              "forward ((n - 1) x 2K, as the ring), the same again backward plus n all-to-all "
              "rotations of fp32 dK, dV: the ring's formula, but on the K and V that reach "
              "SDPA, which the model has already repeated to the 8 query heads: twice the "
              "bytes of shardwise's rows, which send the 4 key/value heads.", ""]
    return lines


NOT_MEASURED = [
    "## Not measured here",
    "",
    "- Overlap of the ring's transfers with attention compute: shardwise posts the next "
    "block's transfer before computing the current one, but on 2 CPU cores Gloo moves the "
    "bytes through loopback TCP on threads that compete with the compute for the same cores; "
    "these step times say nothing about how much of the transfer a GPU with NCCL would hide.",
    "- GPU kernels (flash / efficient / cuDNN SDPA), NCCL, bf16: none ran. PyTorch's "
    "context_parallel as shipped targets exactly those; the comparison here is its algorithm "
    "on CPU kernels.",
    "- cp 4 runs 4 ranks on 2 cores: two ranks share a core, so its step times measure "
    "contention, not scaling.",
]


def to_markdown(data: dict) -> str:
    meta = data["meta"]
    seqs = ", ".join(str(s) for s in meta["seq"])
    lines = [f"# Context parallelism on CPU ranks: shardwise vs PyTorch's context_parallel "
             f"({meta['date']})", "",
             f"debug Llama (dim {DIM}, {LAYERS} layers, {HEADS} heads / {KV_HEADS} key/value "
             f"heads, vocab 256), fp32, AdamW, gradients averaged over the cp ranks by "
             f"`shardwise.replicate` in every row; global batch {meta['batch']} x T tokens, "
             f"T = {seqs}; Gloo, 1 intra-op thread per rank, {meta['cores']} cores "
             f"({meta['machine']}); torch {meta['torch']}, shardwise {meta['commit']}. "
             f"{meta.get('rounds_done', meta['rounds'])} round(s); per round and row "
             f"{meta['warmup']} warm-up + {meta['steps']} timed steps, the rows of a cp degree "
             f"interleaved step by step in one job; a step is forward + loss + backward + "
             f"AdamW, after a barrier, the slowest rank's time. "
             f"{'Quick run' if meta['quick'] else 'Full run'}: "
             f"{meta.get('minutes', 0):.1f} minutes.", ""]
    load = meta.get("load_at_start")
    if load:
        end = meta.get("load_at_end")
        lines += [f"Load average (1/5/15 min) at the start {', '.join(f'{x:.1f}' for x in load)}"
                  + (f", at the end {', '.join(f'{x:.1f}' for x in end)}" if end else "")
                  + (": other jobs shared the machine, so wall times are noisy; CPU time is "
                     "the steadier figure." if load[0] >= 1 else "."), ""]
    check = _loss_check(data)
    if check:
        lines += [check, ""]
    lines += _torch_section(data)
    lines += _targets(data)
    if data["speed"]:
        lines += ["## Speed", "",
                  "Per round: the median over the round's timed steps (ms); per-round values "
                  "are separated by `/`. Ratios per round: against `" + PEER + "` in the same "
                  "job (torch's default rotation), against cp 1 in the same round (below 1 is "
                  "faster than one process). CPU: `time.process_time()` of the slowest rank's "
                  "process in the step (all its threads, Gloo's included). Load: the 1-minute "
                  "load average before each round's job.", ""]
        for seq in data["speed"]:
            lines += _speed_section(data, seq)
    lines += _memory_section(data)
    lines += _balance_section(data)
    lines += _bytes_section(data)
    lines += NOT_MEASURED
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="1 round, T 1024, 1 + 3 steps, 256 MiB cap (~2-4 min on 2 cores)")
    p.add_argument("--seq", type=int, nargs="+", default=None,
                   help="global sequence lengths (default 2048 8192; quick 1024)")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names")
    p.add_argument("--rounds", type=int, default=None, help="default 3; quick 1")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 6; quick 3)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cap-mib", type=int, default=None,
                   help="per-rank memory cap of the longest-sequence search (default 512; "
                        "quick 256; 0 skips it)")
    p.add_argument("--grain", type=int, default=None, help="default 1024; quick 512")
    p.add_argument("--max-seq", type=int, default=65536)
    p.add_argument("--wait-load", type=float, default=0.0,
                   help="first wait up to this many minutes for a quieter machine")
    p.add_argument("--load-below", type=float, default=2.0,
                   help="the 1-minute load average --wait-load waits for (default 2)")
    p.add_argument("--out", default=None,
                   help="output stem (default bench/results/cp_bench; quick: cp_bench_quick)")
    p.add_argument("--from-json", default="", help="re-render the tables of an earlier run")
    args = p.parse_args(argv)
    q = args.quick
    args.seq = args.seq or ([1024] if q else [2048, 8192])
    args.rounds = args.rounds or (1 if q else 3)
    args.steps = args.steps or (3 if q else 6)
    args.cap_mib = args.cap_mib if args.cap_mib is not None else (256 if q else 512)
    args.grain = args.grain or (512 if q else 1024)
    args.rows = args.rows.split(",")
    if args.out is None and args.from_json:  # re-render beside the JSON it reads
        args.out = str(Path(args.from_json).with_suffix(""))
    args.out = args.out or str(OUT / ("cp_bench_quick" if q else "cp_bench"))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        Path(args.out + ".md").write_text(to_markdown(json.loads(
            Path(args.from_json).read_text())))
        return 0
    try:
        data = run(args, log=lambda s: print(s, flush=True))
    except JobFailure as exc:
        print(exc, file=sys.stderr)
        return 1
    print(to_markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
