"""Everything this CPU machine cannot check, in one run on a GPU machine (issue 10).

    bash bench/gpu_check.sh                  # on a machine with one or more CUDA GPUs
    python bench/gpu_check.py --device cpu   # the same code paths on the CPU (a dry run)

Checks, in order, each a row of the summary table:

1. parity on CUDA at world size 1 (and under torchrun with NCCL on every GPU when there is
   more than one): stages 0-3, SGD with momentum, 5 steps of a small Llama against the same
   model trained without shardwise on the same device; max relative weight difference;
2. the trainer for 50 steps in bf16 with ``train.sync_debug = "error"`` (any host sync in
   forward, backward, norm, clipping or the optimizer step raises), final loss;
3. memory per phase (forward, loss, backward, optimizer step) of a ~1B-parameter Llama
   (the ``small`` shape scaled up, bf16 compute, one GPU, stage 3) over 3 steps at batch 1
   and 4 x 2048 tokens, then its throughput, tokens/s, MFU against the device's dense bf16
   peak from the planner's hardware catalogue, and peak memory per phase, eager and with
   ``shardwise.compile_blocks`` (a FAIL when what a step leaves allocated keeps growing);
4. compiled (inductor) training parity at stages 0-3 when ``bench/compile_check.py`` exists;
5. a zero-bubble stage's split backward (``I`` then ``W``) against one backward, bitwise in
   bf16, with no host synchronisation in ``W``;
6. routed experts by ``grouped_mm`` (bf16, the CUDA path no CPU test runs) against the
   per-expert loop, forward and backward, with no host synchronisation;
7. context-parallel attention (a ring of one rank, packed documents too) against SDPA in
   bf16, forward and backward, with no host synchronisation;
8. low-bit compute (bench/gpu_lowbit.py): per recipe, the device kernel against the
   emulation, and tokens/s of the ~1B Llama against bf16 matmuls, torchtitan's figures
   beside them;
9. decode (bench/gpu_decode.py): tokens/s of ``shardwise.inference.generate`` on a
   Llama-2-7B-shaped model, batch 1, bf16, 200 new tokens, eager, gpt-fast's published A100
   figure (104.9 tokens/s, compiled) in the same row; then compiled (``compile=True``).

What one GPU cannot check is printed at the end: cross-rank overlap of the side streams,
the NCCL watchdog abort (needs a peer that hangs), hierarchical partitions across nodes.
Everything finishes in well under 8 minutes on an H100-class GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import shardwise  # noqa: E402
from shardwise.models import TransformerBlock, build_model, get_model_config  # noqa: E402

TINY = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64,
            multiple_of=32)
BILLION = dict(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, vocab_size=32000,
               max_seq_len=2048, multiple_of=256)


def _init(device: str) -> None:
    if not torch.distributed.is_initialized():
        shardwise.distributed.init(backend="nccl" if device == "cuda" else "gloo",
                                   watchdog="off")


def _train(model, device, steps: int, rank: int, ranks: int) -> None:
    """SGD + momentum on global batches of ``4 * ranks`` sequences; this rank takes its 4
    (``ranks`` = 1: the whole batch, the one-process reference)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    world = torch.distributed.get_world_size()
    for _ in range(steps):
        tok = torch.randint(0, TINY["vocab_size"], (4 * world, 33), generator=g).to(device)
        tok = tok[4 * rank:4 * (rank + ranks)]
        logits = model(tok[:, :-1]).float()
        F.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()


def parity(device: str) -> list[tuple[str, str, str]]:
    """Stages 0-3 against plain one-process training on the same device and global batch."""
    _init(device)
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else "cpu"
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ref = build_model(get_model_config("debug", **TINY), seed=0).to(dev)
    _train(ref, dev, 5, 0, world)
    rows = []
    for stage in (0, 1, 2, 3):
        model = build_model(get_model_config("debug", **TINY), seed=0).to(dev)
        shardwise.shard(model, stage=stage, wrap={TransformerBlock})
        _train(model, dev, 5, rank, 1)
        full = shardwise.full_state_dict(model)
        err = max(((full[k].to(dev) - v).abs().max() / v.abs().max().clamp(min=1e-6)).item()
                  for k, v in ref.state_dict().items())
        rows.append((f"parity stage {stage} ({world} rank{'s' if world > 1 else ''})",
                     f"{err:.1e}", "ok" if err < 1e-5 else "FAIL"))
    return rows


def trainer(device: str, steps: int) -> tuple[str, str, str]:
    out = tempfile.mkdtemp(prefix="gpu-check-")
    cmd = [sys.executable, "-m", "shardwise.train.cli", "train", "--nproc", "1",
           "--train.steps", str(steps), "--log.dir", out, "--log.progress", "false",
           "--log.plot", "false", "--train.eval_interval", "0",
           "--precision.param_dtype", "bf16", "--train.sync_debug",
           "error" if device == "cuda" else "off",
           "--parallel.backend", "nccl" if device == "cuda" else "gloo"]
    # A fresh job: not this process's rendezvous (its MASTER_PORT is taken by this process).
    launch = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
              "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in launch}
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        return (f"trainer {steps} steps bf16, sync_debug error", "failed",
                (run.stderr or run.stdout).strip().splitlines()[-1][:120])
    summary = json.loads(Path(out, "summary.json").read_text())
    loss = summary["final_train_loss"]
    return (f"trainer {steps} steps bf16, sync_debug error", f"loss {loss}", "ok")


def _peak_flops(device: str) -> float | None:
    if device != "cuda":
        return None
    from shardwise.planner import get_hardware, list_hardware
    name = torch.cuda.get_device_name().lower()
    for hw in list_hardware():
        key = hw.replace("-sxm", "").split("-")[0]
        if key in name:
            return get_hardware(hw).peak("bf16")
    return None


PHASES = ("fwd", "loss", "bwd", "opt")


class PhaseMemory:
    """Per step, the peak of ``torch.cuda.memory_allocated`` in each phase (forward, the
    logits' cast and loss, backward, optimizer step) and what is allocated after the step,
    in GiB: allocator statistics, read on the host without synchronising. A no-op on the
    CPU (``rows`` stays empty). A step that holds more than the one before it after the
    step shows as a growing ``after`` column."""

    def __init__(self, device: str) -> None:
        self.on = device == "cuda"
        self.rows: list[tuple[float, ...]] = []
        self._row: list[float] = []

    def begin(self) -> None:
        if self.on:
            self._row = []
            torch.cuda.reset_peak_memory_stats()

    def mark(self) -> None:
        """The phase in progress has ended."""
        if self.on:
            self._row.append(torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
            if len(self._row) == len(PHASES):
                self.rows.append((*self._row, torch.cuda.memory_allocated() / 2**30))

    def summary(self, keep: int = 3) -> str:
        """The first ``keep`` steps and the last, ``peak fwd/loss/bwd/opt > after``."""
        if not self.rows:
            return ""
        picked = list(enumerate(self.rows, 1))
        picked = picked[:keep] + (picked[-1:] if len(picked) > keep else [])
        return "GiB " + "/".join(PHASES) + " > after: " + "; ".join(
            f"s{i} " + "/".join(f"{v:.1f}" for v in r[:-1]) + f" > {r[-1]:.1f}"
            for i, r in picked)

    def steady(self) -> bool:
        """What is allocated after each step stops growing after the second step (the
        first creates the optimizer's state): within 64 MiB."""
        after = [r[-1] for r in self.rows[1:]]
        return all(b - a < 1 / 16 for a, b in zip(after, after[1:]))


def timed_steps(model, opt, tokens: torch.Tensor, device: str, warmup: int = 3,
                memory: PhaseMemory | None = None) -> float:
    """Seconds per training step over ``tokens`` (``(steps + warmup, batch, seq + 1)``),
    after ``warmup`` untimed steps (and compiles); ``memory`` records each phase's peak."""
    memory = memory or PhaseMemory("cpu")
    for i in range(tokens.shape[0]):
        if i == warmup:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        memory.begin()
        out = model(tokens[i, :, :-1])
        memory.mark()
        logits = out.float()
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[i, :, 1:].flatten())
        memory.mark()
        del out, logits
        loss.backward()
        memory.mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        memory.mark()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / (tokens.shape[0] - warmup)


def _billion_stage3(device: str, compiled: bool = False):
    """bench/gpu_check's ~1B Llama (TINY on the CPU) at stage 3 with bf16 compute, and its
    AdamW; None when ``compiled`` is asked and compile_blocks is not built."""
    _init(device)
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else "cpu"
    cfg = get_model_config("debug", **(BILLION if device == "cuda" else TINY))
    model = build_model(cfg, device="meta")
    if compiled:
        if not hasattr(shardwise, "compile_blocks"):
            return None
        shardwise.compile_blocks(model)
    shardwise.shard(model, stage=3, wrap={TransformerBlock}, device=dev,
                    mixed_precision=shardwise.MixedPrecision(param_dtype=torch.bfloat16))
    return cfg, dev, model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def phase_memory(device: str) -> list[tuple[str, str, str]]:
    """Per-phase peaks of the ~1B stage-3 step at batch 1 and 4 (x 2048 tokens), 3 steps
    each: what the first H100 run's out-of-memory left open (bench/results/
    gpu_check_h100.md). FAIL when what is allocated after a step grows after step 2."""
    rows = []
    for batch in (1, 4):
        cfg, dev, model, opt = _billion_stage3(device)
        seq = 2048 if device == "cuda" else 32
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (3, batch, seq + 1), generator=g).to(dev)
        memory = PhaseMemory(device)
        timed_steps(model, opt, tokens, device, warmup=0, memory=memory)
        rows.append((f"memory per phase, stage 3, {batch} x {seq}",
                     memory.summary() or "no CUDA statistics",
                     "ok" if memory.steady() else "FAIL"))
        del model, opt
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def throughput(device: str, compiled: bool, steps: int) -> tuple[str, str, str]:
    built = _billion_stage3(device, compiled)
    if built is None:
        return ("throughput, compiled", "skipped", "shardwise.compile_blocks not built")
    cfg, dev, model, opt = built
    batch, seq = (4, 2048) if device == "cuda" else (2, 32)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (steps + 3, batch, seq + 1), generator=g).to(dev)
    memory = PhaseMemory(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = timed_steps(model, opt, tokens, device, memory=memory)
    tps = batch * seq / seconds
    peak = _peak_flops(device)
    mfu = f", MFU {cfg.flops_per_token(seq) * tps / peak:.1%}" if peak else ""
    mem = (f", peak {max(max(r[:-1]) for r in memory.rows):.1f} GiB ({memory.summary()})"
           if memory.rows else "")
    mode = "compiled" if compiled else "eager"
    label = f"throughput {cfg.num_params() / 1e9:.2f}B params, {mode}"
    return (label, f"{tps:,.0f} tokens/s{mfu}{mem}", "ok" if memory.steady() else "FAIL")


def compile_parity(device: str) -> tuple[str, str, str]:
    script = ROOT / "bench" / "compile_check.py"
    if not script.exists():
        return ("inductor parity, stages 0-3", "skipped", "bench/compile_check.py not built")
    # a job of its own: this process's rendezvous variables (and its port) stay here
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE")}
    run = subprocess.run([sys.executable, str(script), "--backend", "inductor", "--device",
                          device, "--ac", "full,selective"], cwd=ROOT, capture_output=True,
                         text=True, env=env)
    last = (run.stdout or run.stderr).strip().splitlines()[-1:] or ["no output"]
    return ("inductor parity, stages 0-3", last[0][:60], "ok" if run.returncode == 0 else "FAIL")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _no_host_sync(device: str):
    """Raise on any host synchronisation inside (CUDA only; a no-op on the CPU)."""
    from shardwise.train.step import sync_debug

    return sync_debug("error", torch.device(device))


def split_backward(device: str, dtype: torch.dtype | None = None) -> tuple[str, str, str]:
    """A zero-bubble stage's input and weight passes (``I`` then ``W``) on the device give
    the unsplit backward's gradients bit for bit (bf16 Llama blocks on CUDA), and the ``W``
    pass makes no host synchronisation ([Note: split backward])."""
    from shardwise.parallel.pipeline.split_backward import input_pass, weight_pass

    label = "zero-bubble I + W = one backward"
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    model = build_model(get_model_config("debug", **TINY), seed=0).to(device, dtype)
    params = list(model.layers.parameters())
    cos, sin = (t.to(device) for t in model.rope(16))
    g = torch.Generator().manual_seed(1)
    x0, gy = (torch.randn(2, 16, TINY["dim"], generator=g).to(device, dtype) for _ in range(2))

    def stage(x):
        for block in model.layers:
            x = block(x, cos, sin)
        return x

    def grads():
        out = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return out

    x = x0.clone().requires_grad_()
    torch.autograd.backward(stage(x), gy)
    ref_x, ref = x.grad.clone(), grads()
    x = x0.clone().requires_grad_()
    deferred = input_pass([stage(x)], [gy], x)
    try:
        with _no_host_sync(device):
            weight_pass(deferred, [params])
    except RuntimeError as exc:
        return (label, f"host sync in W: {str(exc)[:40]}", "FAIL")
    got = grads()
    same = torch.equal(x.grad, ref_x) and all(torch.equal(a, b) for a, b in zip(got, ref))
    worst = max(_rel(a, b) for a, b in zip(got, ref))
    return (label, f"{dtype}: bitwise {same}, max rel {worst:.1e}",
            "ok" if same else "FAIL")


def expert_compute(device: str, dtype: torch.dtype | None = None) -> tuple[str, str, str]:
    """Routed experts by ``grouped_mm`` against the per-expert loop on the device, forward
    and backward, with an empty expert and a skewed one (bf16 on CUDA: the path torch
    documents for compute capability 8.0+, which no CPU test runs), and no host
    synchronisation in the grouped path ([Note: grouped expert compute])."""
    from shardwise.models.experts import expert_ffn, grouped_mm_supported

    label = "MoE experts: grouped_mm = loop"
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([0, 70, 3, 1, 200, 0, 20, 6])
    e, c, h = counts.numel(), 256, 384
    x0 = torch.randn(int(counts.sum()), c, generator=g).to(device, dtype)
    gy = torch.randn(x0.shape, generator=g).to(device, dtype)
    w0 = [0.05 * torch.randn(*shape, generator=g) for shape in ((e, c, h), (e, h, c), (e, c, h))]
    if not grouped_mm_supported(x0, w0[0].to(device, dtype)):
        return (label, f"grouped_mm not supported for {dtype} here", "skipped")

    def run(compute: str) -> list[torch.Tensor]:
        x = x0.clone().requires_grad_()
        w = [t.to(device, dtype).requires_grad_() for t in w0]
        n = counts.to(device)
        with _no_host_sync(device) if compute == "grouped_mm" else contextlib.nullcontext():
            y = expert_ffn(x, n, *w, compute=compute)
            y.backward(gy)
        return [y.detach(), x.grad, *(t.grad for t in w)]

    try:
        grouped = run("grouped_mm")
    except RuntimeError as exc:
        return (label, f"{str(exc)[:48]}", "FAIL")
    loop = run("loop")
    worst = max(_rel(a, b) for a, b in zip(grouped, loop))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: another accumulation order
    return (label, f"{dtype}: max rel {worst:.1e} (limit {tol:.0e})",
            "ok" if worst <= tol else "FAIL")


def context_parallel(device: str) -> tuple[str, str, str]:
    """Context-parallel attention's device path (one rank: the ring of one, every block
    pair through the device's kernels, here the plain-tensor path) against one SDPA, with
    packed documents, forward and backward, with no host synchronisation ([Note: blockwise
    attention])."""
    from shardwise.models.layers import document_ids, document_mask, repeat_kv
    from shardwise.parallel.context.apply import _Attend

    label = "context-parallel attention = SDPA"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    _init(device)
    mesh = shardwise.ParallelDims(world_size=torch.distributed.get_world_size(), cp=1,
                                  dp_shard=-1).build_mesh(device)
    model = build_model(get_model_config("debug", **TINY), device="meta")
    shardwise.apply_cp(model, mesh["cp"], impl="ring")
    attend = _Attend(shardwise.cp_context(model))
    g = torch.Generator().manual_seed(0)
    q0, gy = (torch.randn(2, 4, 64, 16, generator=g).to(device, dtype) for _ in range(2))
    k0, v0 = (torch.randn(2, 2, 64, 16, generator=g).to(device, dtype) for _ in range(2))
    pos = torch.cat([torch.arange(40), torch.arange(24)]).expand(2, 64).to(device)
    worst = 0.0
    for docs in (None, document_ids(pos)):
        def run(fn):
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            y = fn(q, k, v)
            y.backward(gy)
            return [y.detach(), q.grad, k.grad, v.grad]

        try:
            with _no_host_sync(device):
                got = run(lambda q, k, v, d=docs: attend(q, k, v, d))
        except RuntimeError as exc:
            return (label, f"{str(exc)[:48]}", "FAIL")
        ref = run(lambda q, k, v, d=docs: F.scaled_dot_product_attention(
            q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=d is None,
            attn_mask=None if d is None else document_mask(d)))
        worst = max(worst, *(_rel(a, b) for a, b in zip(got, ref)))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    return (label, f"{dtype}: max rel {worst:.1e} (limit {tol:.0e})",
            "ok" if worst <= tol else "FAIL")


def multi_gpu(device: str) -> list[tuple[str, str, str]]:
    n = torch.cuda.device_count() if device == "cuda" else 0
    if n < 2:
        return [("parity under torchrun (NCCL)", "skipped", "one GPU")]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                          str(min(n, 4)), str(Path(__file__)), "--only-parity"], cwd=ROOT,
                         capture_output=True, text=True)
    verdict = "ok" if run.returncode == 0 else "FAIL"
    return [(f"parity under torchrun ({min(n, 4)} GPUs, NCCL)", "ran", verdict)]


CANNOT = ("Not checked on one GPU: overlap of the all-gather / reduce-scatter side streams "
          "across ranks (needs NCCL peers), the NCCL watchdog's abort of a hung collective "
          "(needs a peer that hangs), the hierarchical partition across nodes.")


def lowbit_rows(device: str, steps: int) -> list[tuple[str, str, str]]:
    """The low-bit rows (bench/gpu_lowbit.py)."""
    from bench.gpu_lowbit import kernel_rows, throughput_rows
    return [*kernel_rows(device), *throughput_rows(device, BILLION, steps)]


def decode_rows(device: str, compile: bool) -> list[tuple[str, str, str]]:
    """A decode row (bench/gpu_decode.py), eager or compiled."""
    from bench.gpu_decode import decode_rows as rows
    return rows(device, compile=compile)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only-parity", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=20, help="timed throughput steps")
    args = parser.parse_args()
    if args.device == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if args.only_parity:
        rows = parity(args.device)
        return 0 if all(r[2] == "ok" for r in rows) else 1
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0" if args.device == "cpu" else "2000")
    checks = [("parity", lambda: parity(args.device)),
              ("parity under torchrun", lambda: multi_gpu(args.device)),
              ("trainer", lambda: [trainer(args.device, 50 if args.device == "cuda" else 3)]),
              ("memory per phase", lambda: phase_memory(args.device)),
              ("throughput, eager", lambda: [throughput(args.device, False, args.steps)]),
              ("throughput, compiled", lambda: [throughput(args.device, True, args.steps)]),
              ("inductor parity", lambda: [compile_parity(args.device)]),
              ("zero-bubble I + W", lambda: [split_backward(args.device)]),
              ("MoE experts", lambda: [expert_compute(args.device)]),
              ("context-parallel attention", lambda: [context_parallel(args.device)]),
              ("low-bit", lambda: lowbit_rows(args.device, args.steps)),
              ("decode, eager", lambda: decode_rows(args.device, False)),
              ("decode, compiled", lambda: decode_rows(args.device, True))]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run)"
    print(f"shardwise GPU check on {name}, torch {torch.__version__}", flush=True)
    rows = []
    for label, check in checks:  # each row printed as it lands: a run cut short keeps what it did
        start = time.perf_counter()
        try:
            got = check()
        except Exception as exc:  # one broken check (an OOM, say) must not hide the others
            got = [(label, f"{type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:100]}", "FAIL")]
        for row in got:
            rows.append(row)
            print(f"  {row[0]}: {row[1]} [{row[2]}]", flush=True)
        gc.collect()  # the models of one check are gone before the next builds its own
        if args.device == "cuda":
            torch.cuda.empty_cache()
        print(f"    ({time.perf_counter() - start:.1f} s)", flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\nshardwise GPU check on {name}, torch {torch.__version__}")
    for check, value, verdict in rows:
        print(f"{check.ljust(width)}  {value:<48}  {verdict}")
    print(CANNOT)
    return 0 if all(r[2] in ("ok", "one GPU") or r[1] == "skipped" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
