"""Quantised-communication benchmark: bytes per step, step time and final loss of the debug
model at stage 3 (AdamW) on Gloo ranks in fp32, bf16, with int8 / fp8 weight all-gathers,
int8 / int4 gradient reduce-scatters, both, and with the hierarchical (secondary) partition;
DeepSpeed ZeRO-3 and its ZeRO++ settings (qwZ, qgZ, hpZ) beside them where they run on CPU.

    python -m bench.quant_bench                     # writes bench/results/quant_bench.{md,json}
    python -m bench.quant_bench --quick             # smoke run: 4 steps, 1 round, no wait, tmp
    python -m bench.quant_bench --engine-rev HEAD   # the engine as committed, not the tree

Every row is ``shardwise.shard(model, stage=3, wrap={TransformerBlock}, ...)`` with its
``mixed_precision`` / ``comm`` policy. The whole table runs at 2 ranks; the hierarchy rows
(``CommQuant(hierarchy=2)``: 2 "nodes" of 2 ranks), fp32 and int8 weights + int4 gradients
without it at 4 ranks.
Bytes: before each step ``shardwise.reset_comm_stats()``, then ``shardwise.comm_stats()``
after the forward, the backward and the optimizer step: per collective kind the bytes this
rank sent plus received in the ring-algorithm accounting of shardwise.distributed.comm; the
table shows the last step's (every step moves the same), largest rank. Backward all-gathers
are split by group from ``recent_ops()`` labels ("secondary_all_gather" runs in the node
group). Step time: in each of ``--rounds`` jobs every rank builds all shardwise
configurations of one world size side by side and steps them in rotating order, so a burst
of load on this shared machine slows all alike; per step the slowest rank counts, the
median is over all rounds. bf16 compute is slow on CPUs without native bf16 matmuls, so the
bf16 rows step in their own, shorter interleaved jobs beside fp32 (``--bf16-steps``).
DeepSpeed cannot share a process, so its rows are isolated jobs (one per configuration, fp32
shardwise isolated beside them as their reference; no gradient clipping on either). Ranks are
``shardwise.testing.run_ranks`` processes with one intra-op thread each; the data is a
learnable token stream (a noisy fixed permutation), the same for every row, so the final
loss (mean over ranks of the last step's) is a quality check. Before measuring, the
benchmark waits (up to ``--wait-s``) for the 1-minute load average to fall below
``--max-load``; the load is recorded either way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import traceback

import torch

from bench.offload_bench import ADAMW, BATCH, SEQ, _ds_config, _ds_version, _env, _wait_for_quiet
from bench.quant_report import markdown, notes, targets

__all__ = ["SHARDWISE", "DEEPSPEED", "GRID", "run_interleaved", "run_isolated", "main"]

# name: (label, bf16 compute, CommQuant kwargs or None)
SHARDWISE = {
    "fp32": ("shardwise stage 3, fp32", False, None),
    "bf16": ("bf16 (MixedPrecision param bf16, reduce fp32)", True, None),
    "w-int8": ("fp32 + CommQuant(weights='int8')", False, dict(weights="int8")),
    "w-fp8": ("fp32 + CommQuant(weights='fp8')", False, dict(weights="fp8")),
    "g-int8": ("fp32 + CommQuant(grads='int8')", False, dict(grads="int8")),
    "g-int4": ("fp32 + CommQuant(grads='int4')", False, dict(grads="int4")),
    "w-int8+g-int4": ("fp32 + CommQuant(weights='int8', grads='int4')", False,
                      dict(weights="int8", grads="int4")),
    "bf16+w-int8+g-int4": ("bf16 + CommQuant(weights='int8', grads='int4')", True,
                           dict(weights="int8", grads="int4")),
    "hier": ("fp32 + CommQuant(hierarchy=2)", False, dict(hierarchy=2)),
    "hier+w-int8+g-int4": ("fp32 + CommQuant(weights='int8', grads='int4', hierarchy=2)",
                           False, dict(weights="int8", grads="int4", hierarchy=2)),
}
# name: (label, extra zero_optimization keys)
DEEPSPEED = {
    "ds3": ("DeepSpeed ZeRO-3, fp32", {}),
    "ds-qwz": ("DeepSpeed ZeRO-3 + zero_quantized_weights (qwZ)", {"zero_quantized_weights": True}),
    "ds-qgz": ("DeepSpeed ZeRO-3 + zero_quantized_gradients (qgZ)",
               {"zero_quantized_gradients": True}),
    "ds-hpz": ("DeepSpeed ZeRO-3 + zero_hpz_partition_size=2 (hpZ)",
               {"zero_hpz_partition_size": 2}),
    "ds-zpp": ("DeepSpeed ZeRO++ (qwZ + qgZ + hpZ=2)", {"zero_quantized_weights": True,
                                                      "zero_quantized_gradients": True,
                                                      "zero_hpz_partition_size": 2}),
}
GRID = {2: ["fp32", "bf16", "w-int8", "w-fp8", "g-int8", "g-int4", "w-int8+g-int4",
            "bf16+w-int8+g-int4", "ds3", "ds-qwz", "ds-qgz"],
        4: ["fp32", "w-int8+g-int4", "hier", "hier+w-int8+g-int4", "ds3", "ds-hpz", "ds-zpp"]}
BF16 = ("bf16", "bf16+w-int8+g-int4")  # interleaved apart: bf16 compute is slow on AVX2


def _stream(n: int, rank: int, world: int) -> torch.Tensor:
    """(n, BATCH, SEQ + 1) tokens of this rank: a learnable stream (a fixed permutation of
    the 256-token vocabulary, 10% of tokens replaced by random ones)."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(256, generator=g)
    toks = [torch.randint(0, 256, (n, world * BATCH), generator=g)]
    for _ in range(SEQ):
        noise = torch.rand(toks[-1].shape, generator=g) < 0.1
        toks.append(torch.where(noise, torch.randint(0, 256, toks[-1].shape, generator=g),
                                perm[toks[-1]]))
    return torch.stack(toks, dim=-1)[:, rank * BATCH:(rank + 1) * BATCH]


def _build(name: str):
    """(model, optimizer, backward function, step function) for configuration ``name``."""
    import shardwise
    from shardwise.models import TransformerBlock, build_model, get_model_config
    model = build_model(get_model_config("debug"), seed=0)
    if name in DEEPSPEED:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        cfg = _ds_config(offload=False, cpu_adam=False)
        cfg["zero_optimization"].update(DEEPSPEED[name][1])
        cfg["gradient_clipping"] = 0.0  # DeepSpeed clips at 1.0 by default; shardwise does not
        engine, opt, _, _ = deepspeed.initialize(model=model, config=cfg,
                                                 model_parameters=model.parameters())
        return engine, opt, engine.backward, engine.step
    _, bf16, comm = SHARDWISE[name]
    mp = shardwise.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else None
    shardwise.shard(model, stage=3, wrap={TransformerBlock}, mixed_precision=mp,
                    comm=shardwise.CommQuant(**comm) if comm else None)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, lambda loss: loss.backward(), step


def _phase(after, before=None) -> dict:
    """{kind: [calls, bytes sent, bytes received]} between two comm_stats snapshots."""
    out = {}
    for kind, s in after.by_kind.items():
        b = before[kind] if before is not None else None
        d = [s.calls - (b.calls if b else 0), s.bytes_sent - (b.bytes_sent if b else 0),
             s.bytes_received - (b.bytes_received if b else 0)]
        if d[0]:
            out[kind] = d
    return out


def _step(model, backward, step, x) -> tuple[float, float, dict]:
    """Time forward + backward + optimizer step; (seconds, loss, bytes per phase)."""
    import torch.nn.functional as F

    import shardwise
    from shardwise.distributed.comm import recent_ops
    shardwise.reset_comm_stats()
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten())
    fwd = shardwise.comm_stats()
    backward(loss)
    bwd = shardwise.comm_stats()
    ops = recent_ops()
    step()
    dt = time.perf_counter() - t0
    end = shardwise.comm_stats()
    n_bwd = bwd.calls - fwd.calls
    assert n_bwd <= len(ops), f"op history ({len(ops)}) shorter than one backward ({n_bwd})"
    gathers = [op for op in ops[len(ops) - n_bwd:] if op[1] == "all_gather"] if n_bwd else []
    node = sum(2 * op[3] for op in gathers if op[2].endswith(".secondary_all_gather"))
    comm = {"forward": _phase(fwd), "backward": _phase(bwd, fwd), "optimizer": _phase(end, bwd),
            "backward_gather_node": node,
            "backward_gather_world": sum(2 * op[3] for op in gathers) - node}
    return dt, loss.detach().item(), comm


def run_interleaved(names: list[str], steps: int, warmup: int) -> dict:
    """One rank: every shardwise configuration in ``names`` built here and stepped in
    rotating order; step times, losses, last step's bytes and memory per configuration."""
    import torch.distributed as dist

    import shardwise
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {n: _build(n) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    comm = {}
    for i, x in enumerate(_stream(warmup + steps, rank, world)):
        for name in names[i % len(names):] + names[:i % len(names)]:
            model, _, backward, step = runs[name]
            dist.barrier()
            dt, loss, comm[name] = _step(model, backward, step, x)
            losses[name].append(loss)
            if i >= warmup:
                times[name].append(dt)
    mem = {n: shardwise.memory_report(r[0], r[1]).as_dict() for n, r in runs.items()}
    return {"times": times, "losses": losses, "comm": comm, "memory": mem,
            "shardwise_from": shardwise.__file__}


def run_isolated(name: str, steps: int, warmup: int) -> dict:
    """One rank: configuration ``name`` alone in this job; an exception (DeepSpeed's ZeRO++
    ops on CPU) is returned with where it happened instead of raised."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    where = "deepspeed.initialize" if name in DEEPSPEED else "shardwise.shard"
    times, losses = [], []
    try:
        model, _, backward, step = _build(name)
        for i, x in enumerate(_stream(warmup + steps, rank, world)):
            where = f"training step {i + 1}"
            dist.barrier()
            dt, loss, _ = _step(model, backward, step, x)
            losses.append(loss)
            if i >= warmup:
                times.append(dt)
    except Exception as e:  # noqa: BLE001 - reported in the table
        frames = traceback.extract_tb(e.__traceback__)[-2:]
        return {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}",
                "where": where, "frames": [f"{os.path.basename(f.filename)}:{f.lineno} "
                                           f"{f.name}: {f.line}" for f in frames]}
    return {"times": times, "losses": losses}


def _slowest(per_rank: list[list[float]]) -> list[float]:
    return [max(ts) for ts in zip(*per_rank)]


def _interleave(world: int, names: list[str], steps: int, warmup: int, rounds: int
                ) -> dict[str, dict]:
    """Rows of the shardwise configurations at ``world`` ranks, step times pooled over rounds."""
    from shardwise.testing import run_ranks
    pooled: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        ranks = run_ranks(run_interleaved, world, args=(names, steps, warmup), timeout_s=1800,
                          threads=1)
        for n in names:
            pooled[n] += _slowest([r["times"][n] for r in ranks])
    rows = {}
    for n in names:  # losses and bytes are deterministic: the last round's
        losses = [statistics.fmean(ls) for ls in zip(*(r["losses"][n] for r in ranks))]
        comm = [r["comm"][n] for r in ranks]
        total = [sum(c[1] + c[2] for ph in ("forward", "backward", "optimizer")
                     for c in cm[ph].values()) for cm in comm]
        kinds = {k: max(sum(cm[ph].get(k, [0, 0, 0])[1] + cm[ph].get(k, [0, 0, 0])[2]
                            for ph in ("forward", "backward", "optimizer")) for cm in comm)
                 for k in ("all_gather", "reduce_scatter")}
        rows[n] = {"world": world, "config": n, "label": SHARDWISE[n][0],
                   "framework": "shardwise",
                   "inter_ms": 1e3 * statistics.median(pooled[n]),
                   "inter_ms_min": 1e3 * min(pooled[n]), "bytes": max(total),
                   "bytes_per_rank": total, "kind_bytes": kinds, "comm_per_rank": comm,
                   "loss_first": losses[0], "loss": losses[-1], "losses": losses,
                   "memory_per_rank": [r["memory"][n] for r in ranks],
                   "ranks_shardwise_from": ranks[0]["shardwise_from"]}
    return rows


def _isolate(world: int, name: str, args) -> dict:
    from shardwise.testing import RankFailure, run_ranks
    label = DEEPSPEED[name][0] if name in DEEPSPEED else SHARDWISE[name][0]
    row = {"world": world, "config": name, "label": label,
           "framework": "deepspeed" if name in DEEPSPEED else "shardwise"}
    try:
        ranks = run_ranks(run_isolated, world, args=(name, args.steps, args.warmup),
                          timeout_s=args.ds_timeout_s, threads=1, env={"DS_ACCELERATOR": "cpu"})
    except RankFailure as e:  # a rank died or hung: keep the first line of the report
        return {**row, "error": str(e).splitlines()[0], "where": "job"}
    failed = next((r for r in ranks if "error" in r), None)
    if failed is not None:
        return {**row, **failed}
    per_step = _slowest([r["times"] for r in ranks])
    losses = [statistics.fmean(ls) for ls in zip(*(r["losses"] for r in ranks))]
    return {**row, "iso_ms": 1e3 * statistics.median(per_step), "iso_ms_min": 1e3 * min(per_step),
            "loss_first": losses[0], "loss": losses[-1], "losses": losses}


def _bf16_rows(world: int, names: list[str], args) -> dict[str, dict]:
    """The bf16 rows, interleaved with an fp32 reference of the same length."""
    if not names:
        return {}
    got = _interleave(world, ["fp32", *names], args.bf16_steps, args.bf16_warmup, args.rounds)
    ref = got.pop("fp32")
    return {n: {**r, "ref_inter_ms": ref["inter_ms"], "ref_loss": ref["loss"],
                "ref_losses": ref["losses"]} for n, r in got.items()}


def _git_engine() -> tuple[str | None, bool | None]:
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*a):
        p = subprocess.run(["git", "-C", root, *a], capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None
    dirty = git("status", "--porcelain", "--", "shardwise")
    return git("rev-parse", "HEAD"), (bool(dirty) if dirty is not None else None)


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved jobs per world size")
    ap.add_argument("--bf16-steps", type=int, default=5, help="timed steps of the bf16 job")
    ap.add_argument("--bf16-warmup", type=int, default=1)
    ap.add_argument("--configs", default=None, help="comma list of names (default: all)")
    ap.add_argument("--worlds", default="2,4", help="world sizes to run (default 2,4)")
    ap.add_argument("--out", default=None, help="default bench/results/quant_bench")
    ap.add_argument("--max-load", type=float, default=0.8)
    ap.add_argument("--wait-s", type=float, default=1200.0)
    ap.add_argument("--no-wait", action="store_true")
    ap.add_argument("--ds-timeout-s", type=float, default=300.0, help="per isolated job")
    ap.add_argument("--engine-rev", default=None, metavar="REV",
                    help="benchmark shardwise as committed at REV (git archive)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4 steps, 1 warm-up, 1 round, no wait, output in tmp")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds, args.no_wait = 4, 1, 1, True
        args.bf16_steps = min(args.bf16_steps, 2)
    args.out = args.out or (os.path.join(tempfile.gettempdir(), "quant_bench_quick")
                            if args.quick else "bench/results/quant_bench")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    if args.engine_rev:  # ranks fork from a server whose sys.path would start with the cwd
        from bench.launch import _pythonpath, use_engine_rev
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        use_engine_rev(args.engine_rev, root)
        _pythonpath(root, first=False)  # bench importable after the archived shardwise
        os.environ["PYTHONSAFEPATH"] = "1"  # no cwd entry to shadow the archive
    import shardwise
    commit, dirty = _git_engine()
    engine = (f"as committed at {args.engine_rev}" if args.engine_rev else
              "working tree" + (", with uncommitted changes under shardwise/" if dirty else ""))
    wanted = set(args.configs.split(",")) if args.configs else None
    load, waited = (os.getloadavg()[0], 0.0) if args.no_wait else \
        _wait_for_quiet(args.max_load, args.wait_s)
    rows, loads = [], {"start": load}
    for world in [int(w) for w in args.worlds.split(",")]:
        names = [n for n in GRID[world] if wanted is None or n in wanted]
        sw = [n for n in names if n in SHARDWISE and n not in BF16]
        loads[f"w{world}"] = os.getloadavg()[0]
        got = _interleave(world, sw, args.steps, args.warmup, args.rounds) if sw else {}
        got.update(_bf16_rows(world, [n for n in names if n in BF16], args))
        isolated = (["fp32"] if "fp32" in sw else []) + [n for n in names if n in DEEPSPEED]
        for n in isolated:
            r = _isolate(world, n, args)
            got[n] = {**r, **got.get(n, {})}  # fp32: interleaved row plus its isolated time
            print(f"{world} ranks, {n}: {r.get('iso_ms', r.get('error'))}", flush=True)
        rows += [got[n] for n in names if n in got]
    ds_ran = any(r["framework"] == "deepspeed" for r in rows)
    env = {**_env(), "git_commit": commit, "engine": engine,
           "engine_uncommitted_changes": dirty, "shardwise_from": shardwise.__file__}
    report = {"env": env, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
              "load_before": load, "waited_s": waited, "load_after": os.getloadavg()[0],
              "bf16_steps": args.bf16_steps, "bf16_warmup": args.bf16_warmup, "loads": loads,
              "batch": BATCH, "seq": SEQ, "rows": rows, "targets": targets(rows),
              "notes": notes(rows, _ds_version() if ds_ran else None)}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
