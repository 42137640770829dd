"""``shardwise plan``: predict and rank parallel layouts for a model on a cluster.

    shardwise plan --model llama3-405b --hardware h100 --gpus 16384 --seq-len 8192 \\
        --global-batch 2048                                # top layouts as a table
    shardwise plan ... --json                              # the same records, JSON only
    shardwise plan ... --layout "tp=8,pp=16,dp_shard=128,pp_schedule=1f1b,microbatch=1,ac=full"
    shardwise plan ... --plot plan.png                     # memory + pipeline timeline
    shardwise plan ... --workload-of deepseek-v3-2048      # a published run's stack
    shardwise plan --hardware local --calibrate            # measure this machine first
    shardwise plan --model-config my_model.toml ...        # any other shape

Exit codes: 0 success, 2 bad input (one line naming the value).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

__all__ = ["add_parser", "run"]

_DESCRIPTION = """\
Predict step time, tokens/s per GPU, MFU, HFU, memory per GPU and the bottleneck of every
parallel layout (data / ZeRO / context / tensor / pipeline / expert degrees, micro-batches,
schedule, checkpointing, offload, quantised communication) and print the best. --layout
fixes keys (the search chooses the rest). --global-batch is in sequences. The model and
its accuracy against published runs: docs/planner.md."""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``plan`` subcommand on ``sub``; returns its parser."""
    p = sub.add_parser("plan", help="predict and rank parallel layouts (docs/planner.md)",
                       description=_DESCRIPTION, allow_abbrev=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a registry or catalogue model name (e.g. llama3-405b)")
    p.add_argument("--model-config", metavar="FILE", help="a TOML of ModelSpec fields")
    p.add_argument("--hardware", help="device name (h100, a100-80gb, ..., local)")
    p.add_argument("--hardware-config", metavar="FILE", help="a TOML extending the catalogue")
    p.add_argument("--calibration", metavar="FILE",
                   help="calibration file of --hardware local (default "
                        "~/.cache/shardwise/calibration.toml or $SHARDWISE_CALIBRATION)")
    p.add_argument("--gpus", type=int, help="GPUs (ranks) of the job")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    p.add_argument("--layout", metavar="K=V,...", help="layout keys to fix (see docs)")
    p.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    p.add_argument("--json", action="store_true", help="print only a JSON array of records")
    p.add_argument("--buildable", action="store_true",
                   help="only layouts this version's `shardwise train` can build (every "
                        "record says whether it can, and why not)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the best layout's memory and "
                   "pipeline timeline")
    p.add_argument("--calibrate", action="store_true",
                   help="with --hardware local: run micro-benchmarks, store the calibration")
    p.add_argument("--calibrate-budget", type=float, default=30.0, metavar="SECONDS",
                   help="time the micro-benchmarks may take (default 30)")
    g = p.add_argument_group("workload (defaults: shardwise's own stack)")
    g.add_argument("--workload-of", metavar="RUN_ID",
                   help="price the software stack of a published run (its `stack` in "
                        "shardwise/planner/data/published_runs.toml, e.g. deepseek-v3-2048); "
                        "the options below and --workload override it")
    g.add_argument("--compute-dtype", help="bf16 (default), fp16, fp8 or fp32")
    g.add_argument("--matmul-recipe", metavar="RECIPE",
                   help="low-bit matmuls in the blocks' linears, as the trainer's "
                        "--precision.matmul: none (default), fp8_tensorwise, fp8_rowwise, "
                        "fp8_rowwise_gw_hp, fp8_blockwise, mxfp8 or nvfp4")
    g.add_argument("--optimizer", help="adamw (default), adam or sgd")
    g.add_argument("--attention", help="flash (default) or unfused")
    g.add_argument("--fused-kernels", action="store_true", default=None,
                   help="bandwidth-bound ops as fused kernels (default: eager PyTorch)")
    g.add_argument("--workload", metavar="K=V,...", default="",
                   help="other Workload fields, e.g. overlap_ep=true,overlap_dp=false "
                        "(see shardwise/planner/workload.py)")
    return p


_FLAGS = ("compute_dtype", "matmul_recipe", "optimizer", "attention", "fused_kernels")
"""Workload fields with options of their own."""


def _workload(args, run_id: str | None):
    """The Workload of the job: shardwise's defaults, under the published run ``run_id``'s
    stack (if any), under the options given, under ``--workload``."""
    from shardwise.planner.validate.runs import find_run
    from shardwise.planner.workload import Workload, parse_workload
    stack = dict(find_run(run_id).stack) if run_id else {}
    flags = {k: getattr(args, k) for k in _FLAGS if getattr(args, k) is not None}
    return Workload(**{**stack, **flags, **parse_workload(args.workload),
                       "seq_len": args.seq_len, "global_batch": args.global_batch})


def _stack_hint(args, spec, hw, fixed: dict, best) -> str | None:
    """One line for a layout that does not fit with shardwise's own stack on a model a
    published run trained: the memory that run's stack (``--workload-of``) gives it."""
    from shardwise.planner.search import search
    from shardwise.planner.validate.runs import runs_of_model
    if args.workload_of or best.fits or not fixed:
        return None
    runs = sorted(runs_of_model(spec.name),
                  key=lambda r: (r.hardware != hw.name, r.gpus != args.gpus))
    if not runs:
        return None
    run = runs[0]
    ranked = search(spec, hw, _workload(args, run.id), args.gpus, fixed).ranked
    if not ranked:
        return None
    e = ranked[0]
    as_ = "" if run.model == spec.name else f" (as {run.model})"
    return (f"hint: {spec.name} is the model of the published run {run.id}{as_}; priced with "
            f"that run's software stack (--workload-of {run.id}) this layout takes "
            f"{e.memory.total / 2**30:.1f} GiB per GPU of {hw.hbm_bytes / 2**30:.1f} "
            f"({'fits' if e.fits else 'does not fit either'})")


def _need(args, *names: str) -> None:
    for n in names:
        if getattr(args, n) is None:
            raise ValueError(f"--{n.replace('_', '-')} is required (see shardwise plan -h)")


def _spec(args):
    from shardwise.planner.catalogue import get_model_spec, load_model_config
    if args.model and args.model_config:
        raise ValueError("give --model or --model-config, not both")
    if args.model_config:
        return load_model_config(args.model_config)
    _need(args, "model")
    return get_model_spec(args.model)


def _do_calibrate(args) -> None:
    from shardwise.planner.calibrate import measure_local, write_calibration
    from shardwise.planner.hardware import default_calibration_path
    if args.hardware != "local":
        raise ValueError(f"--calibrate measures this machine: use --hardware local, got "
                         f"--hardware {args.hardware}")
    path = args.calibration or default_calibration_path()
    meas = measure_local(args.calibrate_budget)
    out = write_calibration(meas, path)
    print(f"shardwise plan: calibration written to {out}", file=sys.stderr)


def _table(result, spec, hw, wl, gpus: int, top: int) -> str:
    from shardwise.planner.buildable import not_buildable
    head = (f"shardwise plan: {spec.name} on {gpus} x {hw.name} ({hw.description}), "
            f"seq {wl.seq_len}, global batch {wl.global_batch} sequences\n"
            f"{result.evaluated:,} layouts priced, {result.pruned:,} pruned, "
            f"{result.seconds:.1f} s\n")
    rows = [f"{'#':>2} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6} {'HFU':>6} {'GiB':>6} "
            f"{'fits':>4} {'build':>5}  {'bottleneck':<13} layout"]
    reasons: dict[str, list[int]] = {}
    for i, e in enumerate(result.ranked[:top], 1):
        why = not_buildable(e.layout, spec)
        if why:
            reasons.setdefault(why, []).append(i)
        rows.append(f"{i:>2} {e.step_time:>8.3g} {e.tokens_per_s_per_gpu:>10.4g} "
                    f"{e.mfu:>6.1%} {e.hfu:>6.1%} {e.memory.total / 2**30:>6.1f} "
                    f"{'yes' if e.fits else 'NO':>4} {'no' if why else 'yes':>5}  "
                    f"{e.bottleneck:<13} {_short(e.layout)}")
    for why, rows_of in reasons.items():  # [Note: buildable layouts]
        rows.append(f"build no (#{', #'.join(map(str, rows_of))}): {why}; shardwise train of "
                    f"this version refuses it (--buildable: only layouts it builds)")
    return head + "\n".join(rows)


def _short(L) -> str:
    from shardwise.planner.parallel_layout import Layout
    default = Layout()
    keep = ("tp", "pp", "dp_shard", "zero", "microbatch", "ac") + (
        ("cp_impl",) if L.cp > 1 else ())
    return ",".join(f"{k}={str(v).lower()}" for k, v in L.as_dict().items()
                    if k in keep or (v != getattr(default, k) and k != "cp_impl"))


def _record(e, spec, cm) -> dict:
    """An estimate's JSON record, with whether ``shardwise train`` can build its layout and,
    under a low-bit recipe, its priced parts (``recipe_report.recipe_summary``)."""
    from shardwise.planner.buildable import not_buildable
    from shardwise.planner.recipe_report import recipe_summary
    why = not_buildable(e.layout, spec)
    out = {**e.record(), "buildable": why is None, "not_buildable_reason": why}
    if cm.wl.matmul_recipe != "none":
        out["matmul_recipe"] = recipe_summary(cm, e.layout)
    return out


def _plan(args) -> int:
    from shardwise.planner.buildable import BUILDABLE_FIXED, not_buildable
    from shardwise.planner.cost_model import CostModel
    from shardwise.planner.hardware import get_hardware
    from shardwise.planner.parallel_layout import parse_layout
    from shardwise.planner.search import explain_empty, search
    _need(args, "hardware", "gpus", "seq_len", "global_batch")
    spec = _spec(args)
    hw = get_hardware(args.hardware, args.hardware_config, args.calibration)
    wl = _workload(args, args.workload_of)
    fixed = parse_layout(args.layout) if args.layout else {}
    if args.top < 1:
        raise ValueError(f"--top={args.top}, expected an integer >= 1")
    if args.buildable:  # [Note: buildable layouts]
        clash = {k: v for k, v in BUILDABLE_FIXED.items() if fixed.get(k, v) != v}
        if clash:
            raise ValueError(f"--buildable with --layout {args.layout!r}: this version builds "
                             f"only {BUILDABLE_FIXED} for {sorted(clash)}")
        fixed = {**fixed, **BUILDABLE_FIXED}
    result = search(spec, hw, wl, args.gpus, fixed)
    if args.buildable:
        result = dataclasses.replace(result, ranked=[
            e for e in result.ranked if not_buildable(e.layout, spec) is None])
    if not result.ranked:
        raise ValueError(explain_empty(spec, hw, wl, args.gpus, fixed))
    cm = CostModel(spec, hw, wl)
    hint = _stack_hint(args, spec, hw, fixed, result.ranked[0])
    if args.json:
        json.dump([_record(e, spec, cm) for e in result.ranked[:args.top]], sys.stdout,
                  indent=1)
        sys.stdout.write("\n")
    else:
        print(_table(result, spec, hw, wl, args.gpus, args.top))
        if wl.matmul_recipe != "none":
            from shardwise.planner.recipe_report import describe_recipe, recipe_summary
            print("\n".join(describe_recipe(recipe_summary(cm, result.ranked[0].layout),
                                             hw.name)))
    if hint:
        print(hint, file=sys.stderr if args.json else sys.stdout)
    if args.plot:
        from shardwise.planner.plot import plot_estimate
        out = plot_estimate(result.ranked[0], cm, args.plot)
        print(f"shardwise plan: plot written to {out}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    """Execute ``shardwise plan`` for parsed ``args``; returns the exit code.

    Bad input prints one line naming the value to stderr and returns 2.
    """
    try:
        if args.calibrate:
            _do_calibrate(args)
            if args.gpus is None and args.model is None and args.model_config is None:
                return 0
        return _plan(args)
    except ValueError as exc:
        print(f"shardwise: error: {exc}", file=sys.stderr, flush=True)
        return 2


def main(argv: list[str] | None = None) -> int:
    """``python -m shardwise.planner.cli ...`` (the same as ``shardwise plan ...``)."""
    parser = argparse.ArgumentParser(prog="shardwise")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    return run(parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    raise SystemExit(main())
