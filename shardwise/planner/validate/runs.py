"""The planner against published runs (data/published_runs.toml): predict, convert, compare.

    python -m shardwise.planner.validation                  # print the table
    python -m shardwise.planner.validation --choose --write bench/results/planner_validation.md
    python -m shardwise.planner.fit_runs                    # refit the families' constants

[Note: validating on published runs] For each run the planner is given what the source
states: model, hardware, GPU count, sequence length, global batch, the layout keys it
reports and the software's behaviour (``stack``); keys the source leaves out (micro-batch
size, virtual stages) are chosen by the planner's search within the schedules that software
offered, unless the software's own configuration at the commit of the figures fixes them
(the run's ``note``). The prediction is converted to the source's own metric (step time,
tokens/s/GPU, Megatron-LM 2021's recompute-inclusive TFLOP/s, model TFLOP/s) and compared
there. Runs marked ``fit`` fitted the hardware families' constants or, one each, a software
version's (``fit_runs.STACK_FITS``); the others (``judge``) measure the error. With
``--choose`` the planner also searches freely on each run's job and checks that the
published layout is in its search space and that its choice is predicted at least as fast
within the same device memory.
"""

from __future__ import annotations

import argparse
import difflib
from shardwise.compat import tomllib
from dataclasses import dataclass
from importlib import resources

from shardwise.planner.catalogue import get_model_spec
from shardwise.planner.cost_model import Estimate
from shardwise.planner.hardware import get_hardware
from shardwise.planner.parallel_layout import Layout, parse_layout
from shardwise.planner.search import in_search_space, search
from shardwise.planner.workload import Workload

__all__ = ["PublishedRun", "RunResult", "load_runs", "find_run", "runs_of_model", "hardware_of",
           "workload_of", "convert",
           "predict", "choose", "run_all", "to_markdown", "main"]


@dataclass(frozen=True)
class PublishedRun:
    """One published measurement (see data/published_runs.toml)."""

    id: str
    source: str
    cite: str
    model: str
    hardware: str
    gpus: int
    seq_len: int
    global_batch: int
    layout: str
    schedules: tuple[str, ...]
    stack: dict
    metric: str
    value: float
    role: str
    note: str = ""
    memory_gib: float | None = None
    """The memory one GPU used, where the source publishes it (data/published_runs.toml)."""


@dataclass(frozen=True)
class RunResult:
    """A run, the planner's estimate for its layout, and the comparison."""

    run: PublishedRun
    estimate: Estimate
    predicted: float
    closed_form: float | None = None
    """The prediction with the pipeline's closed forms (what the search ranks by)."""
    chosen: Estimate | None = None
    in_space: bool | None = None

    reserved_gib: float = 0.0
    """The device's memory outside the allocator (CUDA context, NCCL), in the estimate."""
    usable_gib: float = 0.0
    """The device's memory (``Hardware.hbm_bytes``), what ``fits`` compares with."""

    @property
    def error(self) -> float:
        """(predicted - published) / published, in the source's metric."""
        return (self.predicted - self.run.value) / self.run.value

    @property
    def memory_gib(self) -> float:
        """The planner's peak memory per GPU of the run's layout."""
        return self.estimate.memory.total / 2**30

    @property
    def fits(self) -> bool:
        """The predicted peak is at most the device's memory."""
        return self.estimate.fits

    @property
    def memory_error(self) -> float | None:
        """(predicted - published) / published memory, the prediction taken as the source
        measures it (the allocator's bytes: the peak less ``reserved_gib``); None where the
        source publishes none."""
        if self.run.memory_gib is None:
            return None
        return (self.memory_gib - self.reserved_gib - self.run.memory_gib) / self.run.memory_gib


def _data() -> dict:
    text = resources.files("shardwise.planner").joinpath("data/published_runs.toml").read_text()
    return tomllib.loads(text)


def load_runs() -> list[PublishedRun]:
    """Every published run, in file order."""
    data = _data()
    out = []
    for r in data["run"]:
        out.append(PublishedRun(
            id=r["id"], source=r["source"], cite=data["source"][r["source"]]["cite"],
            model=r["model"], hardware=r["hardware"], gpus=r["gpus"], seq_len=r["seq_len"],
            global_batch=r["global_batch"], layout=r["layout"],
            schedules=tuple(r.get("schedules", ())), stack=dict(r.get("stack", {})),
            metric=r["metric"], value=float(r["value"]), role=r["role"],
            note=r.get("note", ""), memory_gib=r.get("memory_gib")))
    return out


def find_run(run_id: str) -> PublishedRun:
    """The published run ``run_id`` (``shardwise plan --workload-of``).

    Raises:
        ValueError: an unknown id, naming the closest ids (or every id when none is close).
    """
    runs = load_runs()
    for r in runs:
        if r.id == run_id:
            return r
    ids = [r.id for r in runs]
    close = difflib.get_close_matches(run_id, ids, n=3, cutoff=0.5)
    hint = (f"did you mean {', '.join(close)}?" if close
            else f"published runs: {', '.join(ids)}")
    raise ValueError(f"--workload-of: no published run {run_id!r} "
                     f"(shardwise/planner/data/published_runs.toml); {hint}")


def runs_of_model(name: str) -> list[PublishedRun]:
    """The published runs that trained model ``name`` or a variant of it (its name plus a
    suffix: ``deepseek-v3-mtp``, DeepSeek-V3 with its multi-token prediction module, for
    ``deepseek-v3``)."""
    return [r for r in load_runs() if r.model == name or r.model.startswith(name + "-")]


def hardware_of(run: PublishedRun, overrides: dict | None = None):
    """The run's device (validation-only devices come from the runs file)."""
    hw = get_hardware(run.hardware, calibration="/nonexistent",
                      extra_tables=[_data().get("hardware", {})])
    return hw.replace(**overrides.get(hw.family, {})) if overrides else hw


def workload_of(run: PublishedRun) -> Workload:
    return Workload(seq_len=run.seq_len, global_batch=run.global_batch, **run.stack)


def convert(run: PublishedRun, est: Estimate, spec) -> float:
    """The estimate in the run's metric."""
    t = est.step_time
    if run.metric == "iteration_s":
        return t
    if run.metric == "tokens_per_s_per_gpu":
        return est.tokens_per_s_per_gpu
    if run.metric == "model_tflops_causal":
        per_token = spec.n_layers * 2 * run.seq_len * spec.n_heads * (spec.qk_dim + spec.v_dim)
        flops = est.model_flops - 0.5 * 3 * per_token * run.seq_len * run.global_batch
        return flops / (t * run.gpus) / 1e12
    if run.metric == "megatron_tflops":
        b, s, layers, h, v = run.global_batch, run.seq_len, spec.n_layers, spec.dim, \
            spec.vocab_size
        flops = 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
        return flops / (t * run.gpus) / 1e12
    raise ValueError(f"run {run.id}: unknown metric {run.metric!r}")


def predict(run: PublishedRun, overrides: dict | None = None, exact: bool = True
            ) -> tuple[Estimate, float]:
    """The planner's estimate for the run's stated layout and its value in the metric.

    Args:
        run: the published run.
        overrides: per hardware family, Hardware fields to replace (used while fitting).
        exact: re-price the chosen layout with every pipeline rank and the simulated
            schedule (default); False: the closed forms the search ranks by.
    """
    spec, hw, wl = get_model_spec(run.model), hardware_of(run, overrides), workload_of(run)
    fixed = parse_layout(run.layout)
    best = None
    for sched in (run.schedules or (None,)):
        f = dict(fixed) if sched is None else {**fixed, "pp_schedule": sched}
        for k in ("comm_weights", "comm_grads", "offload"):
            f.setdefault(k, "fp" if k != "offload" else "none")
        res = search(spec, hw, wl, run.gpus, f, top=0, exact=exact)
        for est in res.ranked[:1]:
            if best is None or _better(est, best):
                best = est
    if best is None:
        raise ValueError(f"run {run.id}: its layout {run.layout!r} is outside the search space")
    return best, convert(run, best, spec)


def _better(a: Estimate, b: Estimate) -> bool:
    return (not a.fits, a.step_time) < (not b.fits, b.step_time)


def choose(run: PublishedRun, published: Estimate) -> tuple[Estimate, bool]:
    """The planner's free choice on the run's job, and whether the published layout is in
    its search space."""
    spec, hw, wl = get_model_spec(run.model), hardware_of(run), workload_of(run)
    res = search(spec, hw, wl, run.gpus, {})
    return res.ranked[0], in_search_space(published.layout, spec, hw, wl, run.gpus)


def run_all(with_choice: bool = False, ids: list[str] | None = None) -> list[RunResult]:
    """Predict every run (``ids``: only those), optionally with the free search."""
    out = []
    for run in load_runs():
        if ids is not None and run.id not in ids:
            continue
        est, value = predict(run)
        _, closed = predict(run, exact=False)
        chosen = in_space = None
        if with_choice:
            chosen, in_space = choose(run, est)
        hw = hardware_of(run)
        out.append(RunResult(run, est, value, closed, chosen, in_space,
                             hw.reserved_bytes / 2**30, hw.hbm_bytes / 2**30))
    return out


def _fmt_layout(L: Layout) -> str:
    keys = ["tp", "cp", "pp", "dp_replicate", "dp_shard", "ep", "zero", "microbatch",
            "pp_schedule", "pp_virtual", "ac", "sp"]
    d = L.as_dict()
    skip = {"cp": 1, "ep": 1, "dp_replicate": 1, "pp_virtual": 1, "pp_schedule": "none"}
    return " ".join(f"{k}={str(d[k]).lower()}" for k in keys if skip.get(k) != d[k])


def to_markdown(results: list[RunResult]) -> str:
    """The validation table (every run, misses included) and its summary."""
    lines = ["| run | source | GPUs | metric | published | predicted | error | closed form | "
             "role | planner's layout | memory GiB | device GiB | fits | published GiB | "
             "memory error |",
             "|---|---|---:|---|---:|---:|---:|---:|---|---|---:|---:|---|---:|---:|"]
    for r in results:
        closed = f"{r.closed_form:.4g}" if r.closed_form is not None else "-"
        pub = f"{r.run.memory_gib:g}" if r.run.memory_gib is not None else "-"
        merr = f"{100 * r.memory_error:+.1f}%" if r.memory_error is not None else "-"
        lines.append(f"| {r.run.id} | {r.run.source} | {r.run.gpus} | {r.run.metric} | "
                     f"{r.run.value:g} | {r.predicted:.4g} | {100 * r.error:+.1f}% | {closed} | "
                     f"{r.run.role} | {_fmt_layout(r.estimate.layout)} | "
                     f"{r.memory_gib:.1f} | {r.usable_gib:.1f} | "
                     f"{'yes' if r.fits else 'NO'} | {pub} | {merr} |")
    judged = [r for r in results if r.run.role == "judge"]
    fitted = [r for r in results if r.run.role == "fit"]
    lines.append("")
    for name, group in (("judged", judged), ("fitted", fitted)):
        if group:
            errs = [abs(r.error) for r in group]
            within = sum(e <= 0.10 for e in errs)
            lines.append(f"- {name} runs: {len(group)}, mean |error| "
                         f"{100 * sum(errs) / len(errs):.1f}%, max {100 * max(errs):.1f}%, "
                         f"{within} within +-10%")
    fit = sum(r.fits for r in results)
    lines.append(f"- fits its device: {fit} of {len(results)} runs")
    mem = [r for r in results if r.memory_error is not None]
    if mem:
        errs = [abs(r.memory_error) for r in mem]
        lines.append(f"- published memory: {len(mem)} runs, mean |error| "
                     f"{100 * sum(errs) / len(errs):.1f}%, max {100 * max(errs):.1f}%, "
                     f"{sum(e <= 0.10 for e in errs)} within +-10% (the planner's peak less the "
                     f"device's reserved memory, against the allocator's peak the source read)")
    chose = [r for r in results if r.chosen is not None]
    if chose:
        lines += ["", "| run | published layout in space | planner's choice | predicted step s "
                  "(choice / published) | memory GiB |", "|---|---|---|---:|---:|"]
        for r in chose:
            lines.append(f"| {r.run.id} | {'yes' if r.in_space else 'NO'} | "
                         f"{_fmt_layout(r.chosen.layout)} | {r.chosen.step_time:.3g} / "
                         f"{r.estimate.step_time:.3g} | {r.chosen.memory.total / 2**30:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m shardwise.planner.validation``: print (or ``--write``) the table."""
    p = argparse.ArgumentParser(prog="python -m shardwise.planner.validation")
    p.add_argument("--choose", action="store_true", help="also search freely on each job")
    p.add_argument("--write", metavar="FILE", help="write the markdown table to FILE")
    p.add_argument("--run", action="append", help="only this run id (repeatable)")
    args = p.parse_args(argv)
    text = to_markdown(run_all(args.choose, args.run))
    if args.write:
        with open(args.write, "w") as fh:
            fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
