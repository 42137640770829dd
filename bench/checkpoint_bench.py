"""Checkpoint save / load time and memory: shardwise.checkpoint vs DCP used directly with FSDP2.

    python bench/checkpoint_bench.py                     # debug model, 2 and 4 ranks, 5 repeats
    python bench/checkpoint_bench.py --quick             # 1 repeat, no load wait
    python bench/checkpoint_bench.py --wait-load 15      # wait up to 15 min for load < 1.5

Rows (same debug Llama, 3.3M parameters, AdamW after one step, Gloo CPU ranks, 1 thread each):

* shardwise: ``shardwise.shard(model, stage=3, wrap={TransformerBlock})``, then
  ``shardwise.checkpoint.save`` / ``load``: DCP plus per-segment sha256 of every file, the
  manifest, the atomic rename; load verifies every checksum first (split over the ranks).
* shardwise async: ``Checkpointer(async_save=True).save``: "save" is the time training is
  blocked (snapshot copy), "total" until the background write is committed.
* FSDP2 + DCP: ``fully_shard`` per block and root, ``get_state_dict(model, opt)`` +
  ``dcp.save``; load: ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` (the recipe of
  PyTorch's DCP tutorial). No checksums, no atomic commit.

Times are rank 0's wall time between barriers, median of the repeats. Peak RSS is the
per-rank VmHWM during the operation (the kernel's high-water mark reset just before it via
``/proc/self/clear_refs``), max over ranks; "+RSS" is that peak minus the RSS just before.
Results: bench/results/checkpoint_bench.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardwise.testing import run_ranks  # noqa: E402

ROWS = ("shardwise", "shardwise_async", "fsdp2_dcp")
NAMES = {"shardwise": "shardwise.checkpoint", "shardwise_async": "shardwise async",
         "fsdp2_dcp": "FSDP2 + DCP"}


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _measure(fn) -> tuple[float, int, int]:
    """(seconds between barriers, peak RSS during fn, RSS before) on this rank."""
    dist.barrier()
    before = _kib("VmRSS")
    _reset_hwm()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0, _kib("VmHWM"), before


def _build(kind: str):
    import torch.nn.functional as F

    import shardwise
    from shardwise.models import TransformerBlock, build_model, get_model_config

    model = build_model(get_model_config("debug"), seed=0)
    if kind == "fsdp2_dcp":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    else:
        model = shardwise.shard(model, stage=3, wrap={TransformerBlock})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _ops(kind: str, model, opt, path: str):
    """(save, load) callables for one row."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from shardwise import checkpoint

    if kind == "fsdp2_dcp":
        def save():
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

        def load():
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        return save, load
    if kind == "shardwise_async":
        ckpt = checkpoint.Checkpointer(path, keep_last=1, async_save=True)
        counter = [0]

        def save():
            counter[0] += 1
            ckpt.save(counter[0], model, opt)
        return save, ckpt
    return (lambda: checkpoint.save(path, model, opt, step=1),
            lambda: checkpoint.load(path, model, opt))


def _rank_job(kind: str, path: str, repeats: int) -> dict:
    torch.set_num_threads(1)
    model, opt = _build(kind)
    save, load = _ops(kind, model, opt, path)
    out: dict = {"save": [], "load": [], "total": []}
    for _ in range(repeats):
        out["save"].append(_measure(save))
        if kind == "shardwise_async":
            out["total"].append(_measure(load.close)[0] + out["save"][-1][0])
        else:
            out["load"].append(_measure(load))
    if dist.get_rank() == 0:
        out["bytes"] = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    if kind == "shardwise_async":
        out["snapshot_bytes"] = load.peak_snapshot_bytes
    return out


def _summary(per_rank: list[dict]) -> dict:
    row = {"bytes": per_rank[0]["bytes"]}
    for op in ("save", "load"):
        runs = per_rank[0][op]
        if not runs:
            continue
        row[f"{op}_s"] = statistics.median(r[0] for r in runs)
        row[f"{op}_s_all"] = [round(r[0], 4) for r in runs]
        row[f"{op}_peak_rss_mib"] = max(r[1] for p in per_rank for r in p[op]) / 2**20
        row[f"{op}_extra_rss_mib"] = max(r[1] - r[2] for p in per_rank for r in p[op]) / 2**20
    if per_rank[0]["total"]:
        row["async_total_s"] = statistics.median(per_rank[0]["total"])
        row["snapshot_mib"] = max(p["snapshot_bytes"] for p in per_rank) / 2**20
    return row


def _wait_for_load(limit: float, minutes: float) -> float:
    deadline = time.time() + minutes * 60
    while os.getloadavg()[0] >= limit and time.time() < deadline:
        time.sleep(15)
    return os.getloadavg()[0]


def _markdown(results: dict, meta: dict) -> str:
    lines = ["# Checkpoint benchmark: shardwise.checkpoint vs DCP with FSDP2", "",
             f"{meta['model']}, AdamW state after one step, Gloo CPU ranks with one thread "
             f"each; median of {meta['repeats']} repeats; {meta['date']}, {meta['machine']}, "
             f"torch {meta['torch']}, load average before the run {meta['load_before']:.2f}.",
             "Produced by `python bench/checkpoint_bench.py` (see its docstring for the "
             "recipe of each row).", "",
             "| ranks | row | save s | load s | save peak RSS MiB (+over before) | load peak "
             "RSS MiB (+over before) | on disk MiB |", "|---|---|---|---|---|---|---|"]
    for world, rows in results.items():
        for kind, r in rows.items():
            save = f"{r['save_s']:.3f}"
            load = f"{r['load_s']:.3f}" if "load_s" in r else "-"
            if "async_total_s" in r:
                save += f" blocking ({r['async_total_s']:.3f} to commit)"
                load = "as shardwise"
            lrss = (f"{r['load_peak_rss_mib']:.0f} (+{r['load_extra_rss_mib']:.1f})"
                    if "load_peak_rss_mib" in r else "-")
            lines.append(f"| {world} | {NAMES[kind]} | {save} | {load} | "
                         f"{r['save_peak_rss_mib']:.0f} (+{r['save_extra_rss_mib']:.1f}) | "
                         f"{lrss} | {r['bytes'] / 2**20:.1f} |")
    lines += ["", "Snapshot memory of the async save (per rank, copied shards + optimizer "
              "state): " + ", ".join(f"{w} ranks {rows['shardwise_async']['snapshot_mib']:.1f}"
                                     f" MiB" for w, rows in results.items()
                                     if "shardwise_async" in rows) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the results (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", default="2,4")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="1 repeat, no load wait, no files")
    p.add_argument("--wait-load", type=float, default=15.0, help="minutes to wait for load")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    load_before = os.getloadavg()[0] if args.quick else _wait_for_load(1.5, args.wait_load)
    results: dict = {}
    for world in (int(w) for w in args.world.split(",")):
        results[world] = {}
        for kind in ROWS:
            folder = tempfile.mkdtemp(prefix="ckpt-bench-")
            path = os.path.join(folder, "ckpt")
            try:
                per_rank = run_ranks(_rank_job, world, args=(kind, path, repeats),
                                     timeout_s=600, threads=1)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            results[world][kind] = _summary(per_rank)
            print(world, kind, {k: v for k, v in results[world][kind].items()
                                if not k.endswith("_all")}, flush=True)
    meta = {"model": "debug Llama (3.3M parameters: dim 256, 4 layers, vocab 256)",
            "repeats": repeats, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "load_before": load_before,
            "load_after": os.getloadavg()[0]}
    if not args.quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "checkpoint_bench.json").write_text(json.dumps(
            {"meta": meta, "results": results}, indent=2) + "\n")
        (out / "checkpoint_bench.md").write_text(_markdown(results, meta))
    print(_markdown(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
