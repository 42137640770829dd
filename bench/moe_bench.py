"""Mixture of experts on 4 CPU ranks: shardwise expert parallelism against a dense model of
the same active parameters and against DeepSpeed-MoE, plus a load-balance study.

    python bench/moe_bench.py                   # ~5 minutes on a loaded 2-core machine
    python bench/moe_bench.py --rounds 1 --balance-steps 50 --only sw-ep4,dense
    python bench/moe_bench.py --from-json bench/results/moe_bench.json   # re-render

Timing rows (Gloo, one intra-op thread per rank, ZeRO stage 1 everywhere, AdamW, the same
byte-level text batches): ``dense`` is the ``debug`` Llama (feed-forward width 768), the
active parameters of ``debug-moe`` (8 experts of width 384, top-2); ``sw-ep1`` is
``debug-moe`` with every expert on every rank; ``sw-ep2`` / ``sw-ep4`` split the experts
over 2 / 4 ranks with :func:`shardwise.apply_ep`; ``ds-ep4`` replaces each block's
feed-forward with ``deepspeed.moe.layer.MoE`` (same experts, ``ep_size=4``, top-2,
``drop_tokens=False``: dropless, every expert padded to the largest expert's load). Per row:
step time (slowest rank, median over steps, per-round medians), peak RSS during the timed
steps (largest rank), and the all-to-all bytes each rank sent per step. For shardwise the
bytes counted by ``comm_stats`` under the ``ep_*`` labels are asserted equal to
:func:`shardwise.parallel.dispatch_bytes` from the token counts every rank routed
([Note: dispatch bytes]) plus the counts exchange; for DeepSpeed they are read from
``torch.distributed.all_to_all_single``'s inputs.

Balance study: a smaller MoE (dim 128, 2 blocks, 8 experts of 192, top-2) at ep 4 for
``--balance-steps`` steps with ``balance`` = aux, bias and none: the coefficient of
variation of the per-expert counts of the global batch (every step, every layer) and the LM
loss. Target (issue 13): bias reaches a CV no worse than aux without raising the LM loss.

DeepSpeed JIT-builds a small shared-memory op on CPU under ``~/.cache/torch_extensions``; a
stale ``lock`` file left there by a killed build makes every later init wait forever: point
``TORCH_EXTENSIONS_DIR`` at a fresh folder (the bench's ``--ds-timeout`` bounds the wait).
Writes bench/results/moe_bench.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.launch import JobFailure, run_job  # noqa: E402

OUT = Path(ROOT) / "bench" / "results"
BATCH, SEQ, LR = 4, 128, 3e-4
# name -> (framework, model, ep)
JOBS = {"dense": ("shardwise", "debug", 1), "sw-ep1": ("shardwise", "debug-moe", 1),
        "sw-ep2": ("shardwise", "debug-moe", 2), "sw-ep4": ("shardwise", "debug-moe", 4),
        "ds-ep4": ("deepspeed", "debug-moe", 4)}
SMALL = {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "moe_ffn_dim": 192}
EP_SUFFIXES = ("ep_dispatch", "ep_combine", "ep_dispatch_grad", "ep_combine_grad")


def _batches(n: int, batch: int, seq: int, rank: int, seed: int = 0):
    """``(n, batch, seq + 1)`` byte-token windows of the stdlib corpus for this data rank
    (the same windows for every row and balance mode)."""
    import torch

    from shardwise.data.corpus import load_corpus
    text = load_corpus("stdlib", max_bytes=2 * 2**20).encode("utf-8")
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    starts = torch.randint(0, ids.numel() - seq - 1, (n, batch), generator=gen)
    return ids[starts.unsqueeze(-1) + torch.arange(seq + 1)]


def _shardwise_model(name: str, ep: int, balance: str, overrides: dict, rate: float):
    """(model, ParallelMesh): built on meta, experts split over ep, ZeRO-1, balanced over
    the data ranks."""
    import torch
    import torch.distributed as dist

    import shardwise
    from shardwise.models import (MoESettings, TransformerBlock, build_model, configure_moe,
                                  get_model_config, init_module_weights)
    from shardwise.parallel import apply_global_balance
    mesh = shardwise.ParallelDims(world_size=dist.get_world_size(), ep=ep).build_mesh()
    model = build_model(get_model_config(name, **overrides), device="meta")
    if ep > 1:
        shardwise.apply_ep(model, mesh)
    torch.manual_seed(0)
    shardwise.shard(model, stage=1, wrap={TransformerBlock}, mesh=mesh,
                    init_weights=init_module_weights)
    configure_moe(model, MoESettings(balance=balance, bias_update_rate=rate))
    apply_global_balance(model, mesh.group("dp"))
    return model, mesh


def _count_routing(model) -> list:
    """Record each experts module's ``counts`` argument (rows per global expert) per call."""
    from shardwise.models import moe_layers
    seen: list = []
    for _, layer in moe_layers(model):
        layer.experts.register_forward_pre_hook(
            lambda _m, args: seen.append([int(c) for c in args[1].tolist()]))
    return seen


def sw_job(name: str, ep: int, steps: int, warmup: int) -> dict:
    """One shardwise timing row on this rank."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import shardwise
    from bench.measure import reset_hwm, rss_hwm
    from shardwise.models import finish_moe_step, moe_aux_loss
    from shardwise.parallel import ep_context
    model, mesh = _shardwise_model(name, ep, "aux", {}, 1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    data = _batches(warmup + steps, BATCH, SEQ, dist.get_rank())
    routed, times = _count_routing(model), []
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            reset_hwm()
            shardwise.reset_comm_stats()
            routed.clear()
        start = time.perf_counter()
        lm = F.cross_entropy(model(data[i, :, :-1]).flatten(0, 1), data[i, :, 1:].flatten())
        aux = moe_aux_loss(model)
        (lm if aux is None else lm + aux).backward()
        opt.step()
        opt.zero_grad()
        finish_moe_step(model)
        times.append(time.perf_counter() - start)
    stats = shardwise.comm_stats()
    ctx = ep_context(model)
    return {"step_s": times[warmup:], "rss_peak": rss_hwm(), "loss": float(lm),
            "routed": routed, "ep_ranks": list(ctx.ep.ranks) if ctx else [dist.get_rank()],
            "a2a_sent": sum(stats.label(s).bytes_sent for s in EP_SUFFIXES),
            "a2a_received": sum(stats.label(s).bytes_received for s in EP_SUFFIXES),
            "counts_sent": stats.label("ep_counts").bytes_sent,
            "comm_sent": stats.bytes_sent}


def _ds_model(ep: int):
    """shardwise's ``debug`` Transformer whose feed-forwards are DeepSpeed MoE layers of the
    ``debug-moe`` experts."""
    from deepspeed.moe.layer import MoE as DSMoE
    from torch import nn

    from shardwise.models import build_model, get_model_config
    from shardwise.models.layers import FeedForward
    moe_cfg = get_model_config("debug-moe")

    class DSFeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = DSMoE(moe_cfg.dim, FeedForward(moe_cfg, hidden_dim=moe_cfg.moe_ffn_dim),
                             num_experts=moe_cfg.num_experts, ep_size=ep, k=moe_cfg.top_k,
                             drop_tokens=False, use_rts=False, min_capacity=0,
                             top2_2nd_expert_sampling=False)
            self.aux = None

        def forward(self, x):  # noqa: ANN001, ANN201
            y, self.aux, _ = self.moe(x)
            return y

    model = build_model(get_model_config("debug"), seed=0)
    for block in model.layers:
        block.feed_forward = DSFeedForward()
    return model


def ds_job(ep: int, steps: int, warmup: int) -> dict:
    """The DeepSpeed-MoE timing row on this rank (ZeRO-1, the same data and optimizer)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from bench.measure import reset_hwm, rss_hwm
    deepspeed.init_distributed(dist_backend="gloo")
    model = _ds_model(ep)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "all"})
    opt = torch.optim.AdamW(groups, lr=LR, foreach=True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": 1},
        "steps_per_print": 10 ** 9, "gradient_clipping": 0.0})
    a2a = {"sent": 0}
    original = dist.all_to_all_single

    def counted(*args, **kw):  # DeepSpeed's MoE splits evenly: 1/n of the input stays
        inp = kw["input"] if "input" in kw else args[1]
        assert kw.get("input_split_sizes") is None, "uneven splits are not counted here"
        n = dist.get_world_size(kw.get("group"))
        a2a["sent"] += inp.numel() * inp.element_size() * (n - 1) // n
        return original(*args, **kw)
    dist.all_to_all_single = counted
    data, times = _batches(warmup + steps, BATCH, SEQ, dist.get_rank()), []
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            reset_hwm()
            a2a["sent"] = 0
        start = time.perf_counter()
        lm = F.cross_entropy(engine(data[i, :, :-1]).flatten(0, 1), data[i, :, 1:].flatten())
        aux = sum(b.feed_forward.aux for b in model.layers)
        engine.backward(lm + 0.01 * aux)
        engine.step()
        times.append(time.perf_counter() - start)
    dist.all_to_all_single = original
    return {"step_s": times[warmup:], "rss_peak": rss_hwm(), "loss": float(lm),
            "a2a_sent": a2a["sent"]}


def balance_job(balance: str, steps: int, rate: float) -> dict:
    """``steps`` steps of the small MoE at ep 4 with one balance mode: per-step CV of each
    layer's global counts and the LM loss (mean over the data ranks)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardwise.distributed import comm
    from shardwise.models import finish_moe_step, moe_aux_loss
    model, mesh = _shardwise_model("debug-moe", dist.get_world_size(), balance, SMALL, rate)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    data = _batches(steps, BATCH, 64, mesh.local_rank("dp"), seed=1)
    cv, lm_losses, maxload = [], [], []
    for i in range(steps):
        lm = F.cross_entropy(model(data[i, :, :-1]).flatten(0, 1), data[i, :, 1:].flatten())
        aux = moe_aux_loss(model)
        (lm if aux is None else lm + aux).backward()
        opt.step()
        opt.zero_grad()
        stats = finish_moe_step(model)
        cv.append([s.tokens_cv for s in stats])
        maxload.append([s.tokens_max / s.counts.mean().item() for s in stats])
        total = lm.detach().double()
        comm.all_reduce(total, mesh.group("dp"), label="bench.loss")
        lm_losses.append(total.item() / mesh.size("dp"))
    return {"cv": cv, "maxload": maxload, "lm_loss": lm_losses}


def check_bytes(ranks: list[dict], dim: int, num_experts: int) -> dict:
    """Assert every rank's counted all-to-all bytes equal [Note: dispatch bytes]'s formula
    from the routed counts of its ep group; returns the formula's per-rank figures."""
    import torch

    from shardwise.parallel import dispatch_bytes
    out = {"sent": [], "received": []}
    for me, r in enumerate(ranks):
        group = r["ep_ranks"]
        ep, idx = len(group), group.index(me)
        calls = len(r["routed"])
        assert all(len(ranks[g]["routed"]) == calls for g in group)
        sent = received = 0
        for c in range(calls):  # one call per MoE layer and forward, the same order
            counts = torch.tensor([ranks[g]["routed"][c] for g in group])
            s, q = dispatch_bytes(counts, dim * 4)[idx]
            sent, received = sent + s, received + q
        counts_bytes = calls * (ep - 1) * (num_experts // ep) * 8
        assert (r["a2a_sent"], r["a2a_received"]) == (sent, received), \
            f"rank {me}: counted {(r['a2a_sent'], r['a2a_received'])}, formula " \
            f"{(sent, received)}"
        assert r["counts_sent"] == counts_bytes, (me, r["counts_sent"], counts_bytes)
        out["sent"].append(sent)
        out["received"].append(received)
    return out


def _timing_row(name: str, args) -> dict:  # noqa: ANN001
    fw, model, ep = JOBS[name]
    if fw == "deepspeed":
        res = run_job(ds_job, 4, args=(ep, args.steps, args.warmup), timeout_s=args.ds_timeout)
    else:
        res = run_job(sw_job, 4, args=(model, ep, args.steps, args.warmup), timeout_s=900)
    steps = [max(s) for s in zip(*[r["step_s"] for r in res])]  # the slowest rank
    row = {"step_s": statistics.median(steps), "rss_peak": max(r["rss_peak"] for r in res),
           "a2a_sent_per_step": statistics.mean(r["a2a_sent"] for r in res) / args.steps,
           "loss": res[0]["loss"]}
    if fw == "shardwise":
        row["comm_sent_per_step"] = statistics.mean(r["comm_sent"] for r in res) / args.steps
        if ep > 1:
            check_bytes(res, 256, 8)
            row["bytes_checked"] = True
            calls = len(res[0]["routed"])
            row["ep_counts_sent_per_step"] = res[0]["counts_sent"] / args.steps
            row["tokens_per_expert"] = [sum(r["routed"][c][e] for r in res
                                            for c in range(calls)) for e in range(8)]
    return row


def _balance_runs(rates: str) -> list[tuple[str, str, float]]:
    """(label, balance mode, bias rate) of each balance-study run."""
    runs = [("aux", "aux", 0.0)]
    runs += [(f"bias, rate {r}", "bias", float(r)) for r in rates.split(",") if r]
    return runs + [("none", "none", 0.0)]


def _sizes() -> dict:
    from shardwise.models import get_model_config
    return {n: {"params": get_model_config(n).num_params(),
                "active": get_model_config(n).num_active_params()}
            for n in ("debug", "debug-moe")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--balance-steps", type=int, default=200)
    p.add_argument("--bias-rates", default="0.001,0.01",
                   help="comma-separated bias_update_rate values, one bias row each "
                        "(DeepSeek-V3's 0.001, and a rate sized for a 200-step run)")
    p.add_argument("--ds-timeout", type=float, default=600.0)
    p.add_argument("--only", default="", help="comma-separated rows and balance modes")
    p.add_argument("--out", default=str(OUT / "moe_bench"))
    p.add_argument("--from-json", default="", help="re-render the table of an earlier run")
    args = p.parse_args(argv)
    from bench.moe_report import to_markdown
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        Path(args.out + ".md").write_text(to_markdown(saved))
        return 0
    only = set(args.only.split(",")) - {""}
    rows: dict = {n: {"rounds": []} for n in JOBS if not only or n in only}
    for rnd in range(args.rounds):  # rows interleaved, so load changes hit all alike
        for name in rows:
            try:
                rows[name]["rounds"].append(_timing_row(name, args))
            except JobFailure as exc:
                rows[name]["error"] = str(exc)[-1500:]
            print(f"round {rnd} {name}: {rows[name]}"[:300], flush=True)
    balance = {}
    for label, mode, rate in _balance_runs(args.bias_rates):
        if not only or mode in only:
            res = run_job(balance_job, 4, args=(mode, args.balance_steps, rate),
                          timeout_s=1800)
            balance[label] = {**res[0], "mode": mode, "rate": rate}
            print(f"balance {label}: last lm {res[0]['lm_loss'][-1]:.4f}", flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
            "balance_steps": args.balance_steps,
            "batch": BATCH, "seq": SEQ, "small": SMALL, "sizes": _sizes(),
            "load": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    saved = {"meta": meta, "rows": rows, "balance": balance}
    Path(args.out + ".json").write_text(json.dumps(saved, indent=1))
    Path(args.out + ".md").write_text(to_markdown(saved))
    print(to_markdown(saved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
