"""Offload benchmark: step time and peak RAM of the debug model at stage 3 on 2 Gloo ranks
(fp32, AdamW), without offload, with CPU offload, with disk offload, and DeepSpeed's
ZeRO-Offload beside them.

    python -m bench.offload_bench                     # writes bench/results/offload_bench.{md,json}
    python -m bench.offload_bench --steps 5 --no-wait # quick look
    python -m bench.offload_bench --render            # rewrite the .md from the .json alone

Without an accelerator ``Offload(device="cpu")`` is a pass-through, so the CPU-offload
figure is the forced host-copy path (see bench/offload_report.py).

Step time is measured twice. Interleaved (the comparison the targets use): in each of
``--rounds`` jobs every rank builds all shardwise configurations side by side and steps
them in rotating order, so another job's burst on this shared 2-core machine slows every
configuration alike; per step the slowest rank counts; the median is over all rounds.
Isolated: one job per configuration (DeepSpeed included: it cannot share a process), which
also gives peak RSS (the resident high-water mark during the timed steps; clear_refs resets
it after warm-up) and, for shardwise's offload, the wrapper's accounting of optimizer state
held in RAM, checked against the buffer. Ranks are ``shardwise.testing.run_ranks``
processes with one intra-op thread each; the timed step is forward + backward + optimizer
step + zero_grad after an untimed barrier. Final weights are hashed to show that offload
changes no bit. Before measuring, the benchmark waits (up to ``--wait-s``) for the 1-minute
load average to fall below ``--max-load``; the load is recorded either way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time

import torch

from bench.offload_report import BUFFER_MB, LABELS, MACHINE_NOTES, markdown, targets

__all__ = ["CONFIGS", "run_config", "main"]

MODEL = {}  # the "debug" config as registered: dim 256, 4 layers, vocab 256 (3.28M params)
BATCH, SEQ = 4, 128  # sequences x tokens per rank per step
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CONFIGS = LABELS  # configuration name -> the label its row carries


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _batches(n: int, rank: int, world: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (n, world * BATCH, SEQ + 1), generator=g)
    return [t[rank * BATCH:(rank + 1) * BATCH] for t in tokens]


def _ds_config(offload: bool, cpu_adam: bool) -> dict:
    zero = {"stage": 3}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]),
                                                     "torch_adam": not cpu_adam}},
           "zero_optimization": zero, "steps_per_print": 10 ** 9,
           "gradient_clipping": 0.0}  # shardwise's rows do not clip either
    if offload and not cpu_adam:
        cfg["zero_force_ds_cpu_optimizer"] = False  # torch AdamW on the offloaded state
    return cfg


def _build(name: str, path: str, cpu_adam: bool):
    """(model, optimizer, backward function, offloaded optimizer or None) for ``name``."""
    import shardwise
    from shardwise.models import TransformerBlock, build_model, get_model_config
    from shardwise.shard.offload import Offload, offload_optimizer
    model = build_model(get_model_config("debug", **MODEL), seed=0)
    if name.startswith("ds"):
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        engine, opt, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(),
            config=_ds_config(name == "ds3-offload", cpu_adam))
        return engine, opt, engine.backward, engine.step, None
    shardwise.shard(model, stage=3, wrap={TransformerBlock})
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    policy = {"cpu": Offload(), "cpu-copy": Offload(),
              "disk": Offload(device="disk", path=path, buffer_mb=BUFFER_MB),
              "disk-sync": Offload(device="disk", path=path, buffer_mb=BUFFER_MB,
                                   prefetch=False)}.get(name)
    wrapped = None
    if policy is not None:
        opt = wrapped = offload_optimizer(opt, policy, _force_host_masters=name == "cpu-copy")

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, lambda loss: loss.backward(), step, wrapped


def _weights_hash(model) -> str:
    m = model.module if hasattr(model, "module") else model
    h = hashlib.sha256()
    for _, p in sorted(m.named_parameters()):
        t = p.detach()
        if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3: hash this rank's partition
            t = p.ds_tensor.detach()
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _timed_step(model, backward, step, x) -> tuple[float, torch.Tensor]:
    import torch.nn.functional as F
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    backward(loss)
    step()
    return time.perf_counter() - t0, loss


def run_interleaved(names: list[str], steps: int, warmup: int, path: str) -> dict:
    """One rank: every shardwise configuration in ``names`` built here and stepped in
    rotating order; returns step times and final-weight hashes per configuration."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {n: _build(n, path, False) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for i, x in enumerate(_batches(warmup + steps, rank, world)):
        for name in names[i % len(names):] + names[:i % len(names)]:
            model, _, backward, step, _ = runs[name]
            dist.barrier()
            dt, _ = _timed_step(model, backward, step, x)
            if i >= warmup:
                times[name].append(dt)
    hashes = {n: _weights_hash(r[0]) for n, r in runs.items()}
    for _, _, _, _, wrapped in runs.values():
        if wrapped is not None:
            wrapped.close()
    return {"times": times, "hashes": hashes}


def run_config(name: str, steps: int, warmup: int, path: str, cpu_adam: bool) -> dict:
    """One rank's measurements of configuration ``name`` (called on every rank)."""
    import torch.distributed as dist

    import shardwise.shard.offload  # noqa: F401 - imports before the RSS baseline
    if name.startswith("ds"):
        import deepspeed  # noqa: F401
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_entry = _status_kib("VmRSS") * 1024
    model, opt, backward, step, wrapped = _build(name, path, cpu_adam)
    batches = _batches(warmup + steps, rank, world)
    times, before = [], None
    for i, x in enumerate(batches):
        if i == warmup:
            if wrapped is not None:
                wrapped.reset_peak()
                before = wrapped.stats()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM restarts from the current RSS
        dist.barrier()
        dt, loss = _timed_step(model, backward, step, x)
        times.append(dt)
    out = {"times": times[warmup:], "rss_peak": _status_kib("VmHWM") * 1024, "rss_entry": rss_entry,
           "loss": loss.detach().item(), "hash": _weights_hash(model)}
    if wrapped is None and not name.startswith("ds"):  # shardwise without offload: all in RAM
        out["state_bytes"] = sum(v.numel() * v.element_size() for st in opt.state.values()
                                 for v in st.values() if isinstance(v, torch.Tensor))
    elif wrapped is not None:
        s = wrapped.stats()
        out["offload"] = {k: getattr(s, k) for k in s.__dataclass_fields__ if k != "run_dir"}
        for k in ("read_bytes", "write_bytes", "read_s", "write_s", "wait_s"):
            out["offload"][k + "_per_step"] = (getattr(s, k) - getattr(before, k)) / steps
        out["files_during"] = s.run_dir is not None and os.path.exists(s.run_dir)
        wrapped.close()
        out["files_after_close"] = s.run_dir is not None and os.path.exists(s.run_dir)
    return out


def _summarise(name: str, ranks: list[dict]) -> dict:
    per_step = [max(ts) for ts in zip(*(r["times"] for r in ranks))]  # slowest rank per step
    row = {"config": name, "label": CONFIGS[name], "step_ms": 1e3 * statistics.median(per_step),
           "step_ms_min": 1e3 * min(per_step), "peak_rss_mib": max(r["rss_peak"] for r in ranks)
           / 2 ** 20, "train_rss_mib": max(r["rss_peak"] - r["rss_entry"] for r in ranks) / 2 ** 20,
           "loss": ranks[0]["loss"], "hashes": [r["hash"] for r in ranks]}
    if "state_bytes" in ranks[0]:
        row["state_bytes"] = [r["state_bytes"] for r in ranks]
    if "offload" in ranks[0]:
        row["offload"] = [r["offload"] for r in ranks]
        row["files_during"] = all(r["files_during"] for r in ranks)
        row["files_after_close"] = any(r["files_after_close"] for r in ranks)
    return row


def _wait_for_quiet(max_load: float, wait_s: float) -> tuple[float, float]:
    """Wait until the 1-minute load average is below ``max_load``; (load, seconds waited)."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= max_load and time.monotonic() - t0 < wait_s:
        time.sleep(15)
    return os.getloadavg()[0], time.monotonic() - t0


def _nvme_note() -> str:
    """Why DeepSpeed's NVMe offload (ZeRO-Infinity) is or is not beside disk offload."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        if not AsyncIOBuilder().is_compatible(verbose=False):
            return ("DeepSpeed's NVMe offload (ZeRO-Infinity, offload_optimizer device=nvme) "
                    "was not run: its async_io op needs libaio (libaio-dev), which this "
                    "machine lacks, so it cannot build.")
        return "DeepSpeed's NVMe offload could build here but is not part of this table."
    except Exception as e:  # noqa: BLE001
        return f"DeepSpeed's NVMe offload was not run ({type(e).__name__})."


def _cpu_adam_builds() -> tuple[bool, str]:
    """Whether DeepSpeed's compiled CPU Adam (DeepSpeedCPUAdam) loads here."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
        CPUAdamBuilder().load(verbose=False)
        return True, "DeepSpeedCPUAdam (cpu_adam op, JIT-built)"
    except Exception as e:  # noqa: BLE001 - reported in the table
        return False, f"cpu_adam op unavailable ({type(e).__name__}); torch AdamW instead"


def _interleave(names: list[str], args, path: str) -> dict[str, dict]:
    """Interleaved step times of the shardwise configurations, pooled over rounds."""
    from shardwise.testing import run_ranks
    pooled: dict[str, list[float]] = {n: [] for n in names}
    hashes: dict[str, list] = {}
    for _ in range(args.rounds):
        ranks = run_ranks(run_interleaved, 2, args=(names, args.steps, args.warmup, path),
                          timeout_s=1800)
        for n in names:  # per step the slowest rank
            pooled[n] += [max(ts) for ts in zip(*(r["times"][n] for r in ranks))]
            hashes[n] = [r["hashes"][n] for r in ranks]
    return {n: {"inter_ms": 1e3 * statistics.median(pooled[n]),
                "inter_ms_min": 1e3 * min(pooled[n]), "inter_hashes": hashes[n]}
            for n in names}


def _notes(names: list[str], ds_note: str) -> list[str]:
    """What the table's reader needs to know about this machine and the rows."""
    notes = list(MACHINE_NOTES)
    if any(n.startswith("ds") for n in names):
        notes.append(f"DeepSpeed {_ds_version()}, CPU accelerator; ZeRO-Offload optimizer: "
                     f"{ds_note}. Its weights hash over its own partitions, so the bitwise "
                     f"column does not apply.")
        notes.append(_nvme_note())
    return notes


def main(argv: list[str] | None = None) -> dict:
    from shardwise.testing import run_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved jobs")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default="bench/results/offload_bench")
    ap.add_argument("--disk-dir", default=None, help="where disk offload writes (default: tmp)")
    ap.add_argument("--max-load", type=float, default=1.5)
    ap.add_argument("--wait-s", type=float, default=900.0)
    ap.add_argument("--no-wait", action="store_true")
    ap.add_argument("--render", action="store_true",
                    help="only rewrite OUT.md from OUT.json (no measurement)")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.out + ".json") as f:
            report = json.load(f)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(report))
        return report
    names = [n for n in args.configs.split(",") if n]
    cpu_adam, ds_note = _cpu_adam_builds() if any(n.startswith("ds") for n in names) \
        else (False, "")
    load, waited = (os.getloadavg()[0], 0.0) if args.no_wait else \
        _wait_for_quiet(args.max_load, args.wait_s)
    rows = {}
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as path:
        inter = _interleave([n for n in names if not n.startswith("ds")], args, path)
        for name in names:
            ranks = run_ranks(run_config, 2, timeout_s=1200, env={"DS_ACCELERATOR": "cpu"},
                              args=(name, args.steps, args.warmup, path, cpu_adam))
            rows[name] = {**_summarise(name, ranks), **inter.get(name, {})}
            print(f"{name}: {rows[name].get('inter_ms', float('nan')):.1f} ms interleaved, "
                  f"{rows[name]['step_ms']:.1f} ms isolated", flush=True)
    report = {"env": _env(), "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
              "load_before": load, "waited_s": waited, "load_after": os.getloadavg()[0],
              "batch": BATCH, "seq": SEQ, "buffer_mb": BUFFER_MB, "rows": list(rows.values()),
              "targets": targets(rows), "notes": _notes(names, ds_note)}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    return report


def _ds_version() -> str:
    import deepspeed
    return deepspeed.__version__


def _env() -> dict:
    return {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
            "torch": torch.__version__, "cpus": os.cpu_count(), "python": platform.python_version()}


if __name__ == "__main__":
    main()
