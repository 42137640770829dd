"""The VLA training step at ZeRO stage 3 beside PyTorch FSDP2 wrapping the same towers
(issue 34's speed target: shardwise no slower than FSDP2 in every round).

    python bench/vla_bench.py                 # 6 rounds x (2 + 20) steps (~15 min at load 12)
    python bench/vla_bench.py --steps 40      # narrower per-round intervals ("not settled")
    python bench/vla_bench.py --tiny --out /tmp/vla   # 1 round, 2 steps: the test's smoke run
    python bench/vla_bench.py --from-json bench/results/vla_bench.json   # re-render the table

Model: ``get_model_config("debug-vla")`` (ViT 2 x 128 wide, projector, Llama decoder 4 x 256,
vocab 128), ``build_model(cfg, seed=0)`` on every rank, fp32, ``torch.optim.AdamW(lr=3e-4,
betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)``; 2 Gloo ranks, one intra-op thread each.

Data: real BabyAI GoToLocal expert demonstrations (``ensure_dataset``, generated once into
``--data``), one frame per sample, padded to a fixed length; ``warmup + steps`` batches per
rank are read once by ``VLALoader`` (rank r of 2 takes its slice of every global batch) in
the driver and replayed identically to every peer and every round. Loss: cross-entropy at
the ACT positions (labels -100 elsewhere), the trainer's ``vla_loss``.

Peers (all on one 1-D ``DeviceMesh`` of the 2 ranks):

- ``sw3``: ``shardwise.shard(model, stage=3, wrap={ModelBlock}, mesh=mesh)``, defaults
  (prefetch 1, reshard after forward): a unit per ``VisionBlock`` and ``TransformerBlock``.
- ``fsdp2``: ``fully_shard(block, mesh=mesh)`` for every ``ModelBlock`` of both towers, then
  ``fully_shard(model, mesh=mesh)`` (torchtitan's way), defaults (reshard after forward,
  implicit prefetch).
- context rows: ``sw2`` (``shard(stage=2, wrap={ModelBlock})``) and ``ddp``
  (``DistributedDataParallel(model)``, 25 MiB buckets).

[Note: vla bench noise control]
The machine is shared (2 cores, other jobs running), so the design keeps every ratio inside
one time window: one job (two fresh ranks) per round holds every peer, built from the same
seed, and steps them one after another in an order rotated every step (step i of ``sw3`` and
step i of ``fsdp2`` run back to back, on the same batch). Per round: each peer's median step
time (the slowest rank's, after an untimed barrier), the per-step paired ratios ``sw3 /
fsdp2``, their median and a distribution-free 95% interval of that median (order
statistics of the binomial), and the CPU time (``time.process_time``: the rank process's
user + system time, Gloo threads included) beside it, which hardly moves with load. A round
meets the target when its interval lies at or below 1.00, misses it when the interval lies
above 1.00, and is unsettled when the interval straddles 1.00. ``gc`` is collected before
every peer's step and disabled inside it, so a collection lands on no peer's clock.
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
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.launch import JobFailure, run_job  # noqa: E402
from bench.vla_report import to_markdown  # noqa: E402

OUT = Path(ROOT) / "bench" / "results"
LEVEL = "BabyAI-GoToLocal-v0"
PEERS = ("sw3", "fsdp2", "sw2", "ddp")
OPT = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
WORLD = 2
DESCRIBE = {
    "sw3": "shardwise.shard(model, stage=3, wrap={ModelBlock}, mesh=mesh); defaults "
           "(prefetch=1, reshard_after_forward=True)",
    "fsdp2": "fully_shard(block, mesh=mesh) for every ModelBlock (VisionBlock, "
             "TransformerBlock), then fully_shard(model, mesh=mesh); defaults",
    "sw2": "shardwise.shard(model, stage=2, wrap={ModelBlock}, mesh=mesh); defaults",
    "ddp": "DistributedDataParallel(model); defaults (bucket_cap_mb=25)",
}


# ----------------------------------------------------------------------------- data


def load_batches(data_dir: str, episodes: int, batch: int, n_steps: int,
                 pad_to: int) -> list[list[tuple]]:
    """``n_steps`` real batches per rank, as ``[rank][step] = (tokens, labels, images)``.

    Generates the demonstrations into ``data_dir`` once (later runs reuse them).

    Raises:
        ValueError: a sample is longer than ``pad_to``; ``data_dir`` holds another dataset.
    """
    from shardwise.data.vla import VLALoader, ensure_dataset
    path = ensure_dataset(data_dir, LEVEL, episodes=episodes)
    out = []
    for rank in range(WORLD):
        loader = VLALoader(path, batch, rank, WORLD, seed=0, frames=1, pad_to=pad_to)
        out.append([(b.tokens, b.labels, b.images)
                    for b in (loader.next_batch() for _ in range(n_steps))])
    return out


# ----------------------------------------------------------------------------- rank side


def _wrap(name: str, model, mesh):
    """``model`` wrapped as peer ``name`` (see the module doc)."""
    import shardwise
    from shardwise.models.layers import ModelBlock
    if name in ("sw3", "sw2"):
        return shardwise.shard(model, stage=int(name[2]), wrap={ModelBlock}, mesh=mesh)
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for module in model.modules():
            if isinstance(module, ModelBlock):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model)
    raise ValueError(f"unknown peer {name!r}; expected one of {', '.join(PEERS)}")


class _Peer:
    """One peer's wrapped model, optimizer and step on this rank."""

    def __init__(self, name: str, mesh) -> None:
        import torch

        from shardwise.models import build_model, get_model_config
        self.model = _wrap(name, build_model(get_model_config("debug-vla"), seed=0), mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), **OPT)

    def step(self, tokens, labels, images):
        import torch.nn.functional as F
        logits = self.model(tokens, images)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())  # -100 ignored
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def speed_job(names: list[str], batches: list[list[tuple]], warmup: int, offset: int) -> dict:
    """Every peer of ``names`` on this job's ranks, stepped in an order rotated every step
    (see [Note: vla bench noise control]). Returns this rank's per-peer wall and CPU times
    of the timed steps and its losses of every step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    peers = {n: _Peer(n, mesh) for n in names}
    rec = {n: {"wall": [], "cpu": [], "loss": []} for n in names}
    mine = batches[rank]
    for i, batch in enumerate(mine):
        k = (i + offset) % len(names)
        for n in names[k:] + names[:k]:
            gc.collect()
            dist.barrier()
            gc.disable()
            start, cpu = time.perf_counter(), time.process_time()
            loss = peers[n].step(*batch)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            gc.enable()
            rec[n]["loss"].append(float(loss))
            if i >= warmup:
                rec[n]["wall"].append(wall)
                rec[n]["cpu"].append(cpu)
    return {"rank": rank, "peers": rec}


# ----------------------------------------------------------------------------- driver


def aggregate(res: list[dict], names: list[str]) -> dict:
    """One round's record from the ranks' results: per peer and timed step the slowest
    rank's wall and CPU time; every rank's losses (all steps, warm-up included)."""
    out = {}
    for n in names:
        per = [r["peers"][n] for r in sorted(res, key=lambda r: r["rank"])]
        out[n] = {"wall": [max(v) for v in zip(*[p["wall"] for p in per])],
                  "cpu": [max(v) for v in zip(*[p["cpu"] for p in per])],
                  "loss": [p["loss"] for p in per]}
    return out


def _round(r: int, batches, args) -> dict:
    """Round ``r``: one job of every peer; its record with the load average before it."""
    k = r % len(args.peers)
    names = args.peers[k:] + args.peers[:k]  # who builds and steps first rotates too
    load = os.getloadavg()
    start = time.perf_counter()
    res = run_job(speed_job, WORLD, args=(names, batches, args.warmup, r),
                  with_deepspeed=False, timeout_s=args.job_timeout)
    return {"round": r + 1, "load": list(load), "job_s": time.perf_counter() - start,
            "order": names, "peers": aggregate(res, args.peers)}


def run(args, log=print) -> dict:
    """Run every round, rewriting the results after each; returns the whole record."""
    t0 = time.time()
    batches = load_batches(args.data, args.episodes, args.batch, args.warmup + args.steps,
                           args.pad_to)
    data = {"meta": _meta(args, batches, time.time() - t0), "rounds": []}
    started = time.time()
    for r in range(args.rounds):
        if args.max_minutes and (time.time() - started) / 60 > args.max_minutes:
            log(f"stopping before round {r + 1}: past --max-minutes {args.max_minutes}")
            break
        rec = _round(r, batches, args)
        data["rounds"].append(rec)
        data["meta"]["minutes"] = (time.time() - started) / 60
        _write(data, args.out)
        log(f"round {r + 1}: " + ", ".join(
            f"{n} {1e3 * statistics.median(v['wall']):.1f} ms "
            f"(cpu {1e3 * statistics.median(v['cpu']):.1f})" for n, v in rec["peers"].items())
            + f"; load {rec['load'][0]:.1f}, job {rec['job_s']:.0f} s")
    data["meta"]["load_at_end"] = list(os.getloadavg())
    _write(data, args.out)
    return data


def _write(data: dict, out: str) -> None:
    Path(out + ".json").write_text(json.dumps(data, indent=1))
    Path(out + ".md").write_text(to_markdown(data))


def _meta(args, batches, data_s: float) -> dict:
    import torch

    import shardwise
    from shardwise.models import get_model_config
    git = ["git", "-C", ROOT]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "shardwise"], capture_output=True,
                           text=True).stdout.strip()
    tokens, _, images = batches[0][0]
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
            "commit": commit + ("+dirty" if dirty else ""),
            "shardwise_from": os.path.dirname(shardwise.__file__),
            "cores": os.cpu_count(), "machine": platform.platform(), "world": WORLD,
            "params": get_model_config("debug-vla").num_params(), "level": LEVEL,
            "episodes": args.episodes, "batch": args.batch, "seq": int(tokens.shape[1]),
            "frames_per_batch": int(images.shape[0]), "steps": args.steps,
            "warmup": args.warmup, "rounds": args.rounds, "peers": args.peers,
            "describe": {n: DESCRIBE[n] for n in args.peers},
            "optimizer": {**OPT, "betas": list(OPT["betas"])}, "data_s": data_s,
            "load_at_start": list(os.getloadavg())}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   help="1 round, 1 warm-up + 2 timed steps, 12 episodes (seconds)")
    p.add_argument("--rounds", type=int, default=None, help="default 6; tiny 1")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20; tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2; tiny 1)")
    p.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    p.add_argument("--pad-to", type=int, default=64, help="fixed tokens per sample")
    p.add_argument("--episodes", type=int, default=None, help="default 120; tiny 12")
    p.add_argument("--peers", default=",".join(PEERS), help="sw3 and fsdp2 always run")
    p.add_argument("--data", default=None,
                   help="demonstrations folder (default <tmp>/shardwise-vla-bench-<episodes>)")
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="start no round past this many minutes (0: no limit)")
    p.add_argument("--job-timeout", type=float, default=600.0)
    p.add_argument("--out", default=str(OUT / "vla_bench"), help="output stem")
    p.add_argument("--from-json", default="", help="re-render the table of an earlier run")
    args = p.parse_args(argv)
    t = args.tiny
    args.rounds = args.rounds or (1 if t else 6)
    args.steps = args.steps or (2 if t else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if t else 2)
    args.episodes = args.episodes or (12 if t else 120)
    args.data = args.data or os.path.join(tempfile.gettempdir(),
                                          f"shardwise-vla-bench-{args.episodes}")
    peers = [n for n in args.peers.split(",") if n]
    bad = [n for n in peers if n not in PEERS]
    if bad:
        p.error(f"--peers: unknown {bad}; expected names from {list(PEERS)}")
    args.peers = ["sw3", "fsdp2"] + [n for n in PEERS[2:] if n in peers]
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
