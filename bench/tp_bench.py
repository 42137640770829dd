"""Tensor (+ sequence) parallelism: shardwise against PyTorch's own composition (DTensor
``parallelize_module`` with torchtitan's Llama plan, then ``fully_shard`` over the data
axis), on 2 and 4 CPU ranks (Gloo, one intra-op thread per rank), on the same model.

    python bench/tp_bench.py                 # ~5 minutes on 2 cores
    python bench/tp_bench.py --steps 3 --only sw-tp2-sp,torch-tp2-sp

Per layout: median step time (AdamW, ZeRO-3 over the data axis, loss parallel), peak RSS
during the timed steps, bytes each rank sent per step on the loopback interface ([Note:
bytes on the wire] in bench/measure.py; shardwise's own ``comm_stats`` beside it), and the
activation bytes saved for backward on one rank (measured with saved-tensor hooks; each
storage once, parameters and their views excluded) with and without sequence parallelism,
beside Korthikanti et al. 2022's per-layer formula scaled to the measured tp 1 value:
``sbh(34 + 5as/h)`` at tp 1, ``sbh(10 + 24/t + 5as/(ht))`` with TP, ``sbh(34/t +
5as/(ht))`` with TP + SP. Writes bench/results/tp_bench.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.launch import run_job  # noqa: E402

OUT = Path(ROOT) / "bench" / "results"
BATCH, SEQ = 4, 128
# name -> (world, framework, tp, sequence parallel)
JOBS = {
    "sw-tp1": (2, "shardwise", 1, False),
    "sw-tp2": (2, "shardwise", 2, False),
    "sw-tp2-sp": (2, "shardwise", 2, True),
    "torch-tp2": (2, "torch", 2, False),
    "torch-tp2-sp": (2, "torch", 2, True),
    "sw-tp2xdp2-sp": (4, "shardwise", 2, True),
    "torch-tp2xdp2-sp": (4, "torch", 2, True),
}


def _torch_plan(model, tp_mesh, sp: bool) -> None:
    """torchtitan's Llama plan (DTensor TP + SP, loss parallel) on shardwise's Transformer."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    seq = Shard(1) if sp else Replicate()
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                     use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    for block in model.layers:
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=seq),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if sp:
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),))})
        parallelize_module(block, tp_mesh, plan)


def _build(framework: str, tp: int, sp: bool):
    """(model, loss(logits, targets), backward context, data rank)."""
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import shardwise
    from shardwise.models import (TransformerBlock, build_model, get_model_config,
                                  init_module_weights)
    cfg, world = get_model_config("debug"), dist.get_world_size()
    if framework == "shardwise":
        mesh = shardwise.ParallelDims(world_size=world, tp=tp).build_mesh()
        model = build_model(cfg, device="meta")
        if tp > 1:
            shardwise.apply_tp(model, mesh["tp"], sequence_parallel=sp)
        torch.manual_seed(0)
        shardwise.shard(model, stage=3, wrap={TransformerBlock}, mesh=mesh,
                        init_weights=init_module_weights)
        if tp > 1:
            def loss(z, y):
                return shardwise.vocab_parallel_cross_entropy(z, y, mesh["tp"])
        else:
            def loss(z, y):
                return F.cross_entropy(z.flatten(0, 1), y.flatten())
        return model, loss, contextlib.nullcontext, mesh.local_rank("dp")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    model = build_model(cfg, seed=0)
    _torch_plan(model, mesh["tp"], sp)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    def loss(z, y):
        return F.cross_entropy(z.flatten(0, 1), y.flatten())
    return model, loss, loss_parallel, mesh["dp"].get_local_rank()


def _saved_bytes(model, loss_fn, ctx, x, y) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward, without
    parameters (and views of them)."""
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    types: set[str] = set()

    def pack(t):
        base = t._base if t._base is not None else t
        if not isinstance(base, nn.Parameter) and not isinstance(t, nn.Parameter):
            local = t.to_local() if isinstance(t, DTensor) else t
            local = getattr(local, "elem", local)  # funcol's AsyncCollectiveTensor wraps it
            if local.is_floating_point() and local.device.type != "meta":
                try:
                    st = local.untyped_storage()
                    seen[st.data_ptr()] = st.nbytes()
                except RuntimeError:  # a wrapper subclass without storage of its own
                    seen[id(local)] = local.numel() * local.element_size()
                    types.add(type(local).__name__)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx():
        loss = loss_fn(model(x), y)
    with ctx():
        loss.backward()
    if types:
        print(f"saved tensors without storage: {sorted(types)}", flush=True)
    return sum(seen.values())


def tp_job(framework: str, tp: int, sp: bool, steps: int, warmup: int) -> dict:
    """One layout on this job's ranks: the measurements of this rank."""
    import torch
    import torch.distributed as dist

    import shardwise
    from bench.measure import loopback_bytes, reset_hwm, rss_hwm
    model, loss_fn, ctx, dp_rank = _build(framework, tp, sp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(dp_rank)
    data = torch.randint(0, 256, (warmup + steps + 1, BATCH, SEQ + 1), generator=gen)
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            reset_hwm()
            sent0 = loopback_bytes()[1]
            shardwise.reset_comm_stats()
        start = time.perf_counter()
        x, y = data[i, :, :-1], data[i, :, 1:]
        with ctx():
            loss = loss_fn(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    dist.barrier()
    sent = (loopback_bytes()[1] - sent0) / dist.get_world_size() / steps
    counted = shardwise.comm_stats().bytes_sent / steps
    act = _saved_bytes(model, loss_fn, ctx, data[-1, :, :-1], data[-1, :, 1:])
    return {"step_s": statistics.median(times[warmup:]), "rss_peak": rss_hwm(),
            "wire_bytes": sent, "counted_bytes": counted, "activation_bytes": act,
            "loss": float(loss)}


def korthikanti(tp: int, sp: bool) -> float:
    """Per-layer activation bytes relative to tp 1 (Korthikanti et al. 2022, eqs. 1-3) for
    the debug model at this batch: s = SEQ, h = 256, a = 8 heads."""
    s, h, a = SEQ, 256, 8
    full = 34 + 5 * a * s / h
    if tp == 1:
        return 1.0
    if sp:
        return (34 / tp + 5 * a * s / (h * tp)) / full
    return (10 + 24 / tp + 5 * a * s / (h * tp)) / full


def _markdown(rows: dict, meta: dict) -> str:
    base = rows.get("sw-tp1", {}).get("activation_bytes")
    lines = [f"# Tensor parallelism: shardwise vs PyTorch DTensor TP + FSDP2 ({meta['date']})",
             "", f"debug Llama (3.3M parameters, 4 layers, dim 256, 8 heads / 4 KV), batch "
             f"{BATCH} x {SEQ} tokens per data rank, AdamW, ZeRO-3 over the data axis, loss "
             f"parallel; {meta['cpus']} CPUs, Gloo, 1 thread per rank; median of "
             f"{meta['steps']} steps after {meta['warmup']}; loopback namespace {meta['netns']}. "
             f"Activations: bytes saved for "
             f"backward on rank 0 (parameters excluded); 'Korthikanti' is the paper's ratio "
             f"to tp 1 times the measured tp 1 value.", "",
             "| layout | ranks | step (ms) | vs torch | peak RSS (MiB) | wire MiB/step/rank "
             "| counted MiB | activations (MiB) | / tp 1 | Korthikanti (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        world, fw, tp, sp = JOBS[name]
        twin = rows.get(name.replace("sw-", "torch-")) if fw == "shardwise" else None
        ratio = f"{r['step_s'] / twin['step_s']:.2f}x" if twin else ""
        act = r["activation_bytes"] / 2**20
        rel = f"{r['activation_bytes'] / base:.3f}" if base else ""
        pred = f"{base * korthikanti(tp, sp) / 2**20:.2f}" if base else ""
        counted = f"{r['counted_bytes'] / 2**20:.2f}" if fw == "shardwise" else ""
        lines.append(f"| {name} | {world} | {r['step_s'] * 1e3:.1f} | {ratio} | "
                     f"{r['rss_peak'] / 2**20:.0f} | {r['wire_bytes'] / 2**20:.2f} | "
                     f"{counted} | {act:.2f} | {rel} | {pred} |")
    lines += ["", "Targets (issue 11): step time <= 0.9x PyTorch's composition; activations with "
              "SP within 10% of 1/tp of tp 1's.", ""]
    for name, r in rows.items():
        twin = rows.get(name.replace("sw-", "torch-"))
        if name.startswith("sw-") and twin:
            ratio = r["step_s"] / twin["step_s"]
            lines.append(f"* {name}: step time {ratio:.2f}x PyTorch's: "
                         f"{'met' if ratio <= 0.9 else 'NOT met'}")
        world, fw, tp, sp = JOBS[name]
        if fw == "shardwise" and sp and base:
            rel = r["activation_bytes"] / (base / tp)
            lines.append(f"* {name}: activations {rel:.3f} x (tp 1 / tp): "
                         f"{'met' if abs(rel - 1) <= 0.1 else 'NOT met'}")
    if meta.get("load"):
        lines += ["", f"Load average during the run: {meta['load']} (a shared 2-core machine: "
                  f"step times are noisy; the ratios compare jobs run minutes apart)."]
    return "\n".join(lines) + "\n"


def _private_netns(argv: list[str]) -> str:
    """Re-run under ``unshare -n`` (loopback counters see only this benchmark; as
    bench/zero_bench.py does); returns "private" or "shared"."""
    if os.environ.get("TP_BENCH_NETNS"):
        subprocess.run(["ip", "link", "set", "lo", "up"], check=False)
        return "private"
    if shutil.which("unshare") and shutil.which("ip") and subprocess.run(
            ["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True
            ).returncode == 0:
        os.environ["TP_BENCH_NETNS"] = "1"
        os.execvp("unshare", ["unshare", "-n", "--", sys.executable, os.path.abspath(__file__),
                              *argv])
    return "shared"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated job names")
    p.add_argument("--out", default=str(OUT / "tp_bench"))
    p.add_argument("--from-json", default="", help="re-render the table of an earlier run")
    args = p.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        Path(args.out + ".md").write_text(_markdown(saved["rows"], saved["meta"]))
        return 0
    netns = _private_netns(sys.argv[1:] if argv is None else list(argv))
    names = [n for n in JOBS if not args.only or n in args.only.split(",")]
    rows = {}
    for name in names:
        world, fw, tp, sp = JOBS[name]
        res = run_job(tp_job, world, args=(fw, tp, sp, args.steps, args.warmup),
                      with_deepspeed=False, timeout_s=900)
        rows[name] = {**res[0], "wire_bytes": statistics.mean(r["wire_bytes"] for r in res),
                      "rss_peak": max(r["rss_peak"] for r in res)}
        print(f"{name}: {rows[name]['step_s'] * 1e3:.1f} ms, loss {rows[name]['loss']:.4f}, "
              f"activations {rows[name]['activation_bytes'] / 2**20:.2f} MiB", flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "steps": args.steps,
            "warmup": args.warmup, "netns": netns,
            "load": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    Path(args.out + ".md").write_text(_markdown(rows, meta))
    print(_markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
