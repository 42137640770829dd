"""The planner's accuracy on published runs holds its floor (judged runs within +-10%, mean
|error|, every run's layout fitting its device, every published memory figure within
+-10%), its misses are the ones docs/planner.md explains, the committed table
(bench/results/planner_validation.md) is what the planner predicts today, the committed
constants are what fitting the fit runs gives, and docs/planner.md quotes the table."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from shardwise.planner.hardware import get_hardware
from shardwise.planner.validate.fit_runs import STACK_FITS, fit_families, fit_stack
from shardwise.planner.validate.runs import hardware_of, load_runs, predict, run_all

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "bench" / "results" / "planner_validation.md"
DOCS = ROOT / "docs" / "planner.md"
MISSES = {"mtnlg-530b-2240", "mtnlg-530b-2800", "mtnlg-530b-3360"}
"""The judged runs outside +-10%, explained in docs/planner.md ("Misses, and why")."""
JUDGED_WITHIN_FLOOR = 23
"""Judged runs predicted within +-10%: at least this many (23 of 26 when it was set)."""
JUDGED_MEAN_CEILING = 0.0671
"""The judged runs' mean |error|: at most this (6.61% when it was set, plus 0.1 point)."""
DOES_NOT_FIT: set[str] = set()
"""Published runs whose layout the planner prices above their device's memory: none (every
layout that really trained fits; docs/planner.md, "Memory that matches what ran")."""
MEMORY_MISSES = {"torchtitan-h100-405b-3d-1f1b"}
"""Runs whose published memory the planner misses by more than +-10%, explained in the same
section: torchtitan's 1F1B run of Llama 3.1 405B, priced with the stages torchtitan split
(15 / 16 / 15 layers, ``pp_split = "ends"``) 9.8 GiB below its published 82.5 GiB, where the
interleaved run of the same stages is within 1%: what 1F1B kept beyond the planner's
stages is not in the source (the planner's even split, 16 layers on rank 0, hid it at
-9.1%). The audit there ("What the 1F1B row's 9.8 GiB is not") found torch's Schedule1F1B
keeping nothing the interleaved schedule does not, the interleaved row overpriced instead
(its earlier chunk's gradients counted at a peak they postdate), and torchtitan's Table 6
reading the same bytes at 75.3 GiB."""
_SUMMARY = re.compile(r"^- (?P<name>judged|fitted) runs: (?P<n>\d+), mean \|error\| "
                      r"(?P<mean>[\d.]+)%, max (?P<max>[\d.]+)%, (?P<within>\d+) within \+-10%$",
                      re.M)
_DOC_ROW = re.compile(r"^\| (?P<id>[\w.-]+) \| \d+ \| \w+ \| (?P<pub>[\d.]+) \| "
                      r"(?P<pred>[\d.e+]+) \| (?P<err>[+-][\d.]+)% \| (?P<role>fit|judge) \| "
                      r"(?P<mem>[\d.]+) \| (?P<fits>yes|NO) \| (?P<pubmem>[\d.]+|-) \| "
                      r"(?P<memerr>[+-][\d.]+%|-) \|$", re.M)
_ROW = re.compile(r"^\| (?P<id>[\w.-]+) \| \w+ \| \d+ \| \w+ \| (?P<pub>[\d.]+) \| "
                  r"(?P<pred>[\d.e+]+) \| (?P<err>[+-][\d.]+)% \| (?P<closed>[\d.e+]+) \| "
                  r"(?P<role>fit|judge) \| [^|]+ \| [\d.]+ \| [\d.]+ \| (?P<fits>yes|NO) \|")


def _committed() -> dict[str, dict]:
    rows = {}
    for line in TABLE.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            rows[m["id"]] = m.groupdict()
    return rows


@pytest.fixture(scope="module")
def results():
    """Every published run predicted now (the simulated schedule and the closed forms)."""
    return {r.run.id: r for r in run_all()}


def test_every_published_run_is_in_the_committed_table():
    rows = _committed()
    runs = load_runs()
    assert set(rows) == {r.id for r in runs}
    for r in runs:
        assert rows[r.id]["role"] == r.role and float(rows[r.id]["pub"]) == r.value
    assert {r.source for r in runs} >= {"narayanan2021", "korthikanti2022", "smith2022",
                                        "bloom", "llama3", "torchtitan_h100", "deepseekv3"}


def test_accuracy_holds_its_floor(results):
    """However the table is regenerated, the planner may not get less accurate: at least
    ``JUDGED_WITHIN_FLOOR`` judged runs within +-10%, their mean |error| at most
    ``JUDGED_MEAN_CEILING``, no judged miss the docs do not explain, every fit run within
    +-10%."""
    judged = {i: abs(r.error) for i, r in results.items() if r.run.role == "judge"}
    assert sum(e <= 0.10 for e in judged.values()) >= JUDGED_WITHIN_FLOOR, judged
    assert sum(judged.values()) / len(judged) <= JUDGED_MEAN_CEILING, judged
    assert {i for i, e in judged.items() if e > 0.10} <= MISSES
    assert all(abs(r.error) <= 0.10 for r in results.values() if r.run.role == "fit")


def test_memory_holds_its_floor(results):
    """Every published run's layout fits its device but the ones the docs explain, and
    every published memory figure is predicted within +-10% but the ones the docs explain:
    a change that makes a run stop fitting, or a memory figure drift out, fails here (and
    one that fixes a listed miss asks for the list to shrink)."""
    assert {i for i, r in results.items() if not r.fits} == DOES_NOT_FIT
    sourced = {i: r.memory_error for i, r in results.items() if r.memory_error is not None}
    assert len(sourced) >= 6, sourced  # torchtitan's Tables 1, 3, 4 and 5
    assert {i for i, e in sourced.items() if abs(e) > 0.10} == MEMORY_MISSES, sourced


def test_the_committed_table_is_todays_predictions(results):
    """Every row of the committed table (the simulated prediction, its error, the closed
    form) is what the planner predicts now: the docs quote it."""
    for rid, row in _committed().items():
        r = results[rid]
        assert r.predicted == pytest.approx(float(row["pred"]), rel=1e-3), rid
        assert 100 * r.error == pytest.approx(float(row["err"]), abs=0.06), rid
        assert r.closed_form == pytest.approx(float(row["closed"]), rel=1e-3), rid
        assert row["fits"] == ("yes" if r.fits else "NO"), rid


def test_committed_constants_are_the_fit():
    fitted = fit_families(iterations=60)
    for family, (params, _) in fitted.items():
        run = next(r for r in load_runs() if r.role == "fit" and hardware_of(r).family == family)
        hw = hardware_of(run)
        assert hw.matmul_max == pytest.approx(params["matmul_max"], abs=6e-4), family
    assert get_hardware("h200").matmul_max == get_hardware("h100").matmul_max
    runs = {r.id: r for r in load_runs()}
    for name, (value, _) in fit_stack(fitted, iterations=40).items():
        fit_id, carriers = STACK_FITS[name]
        assert runs[fit_id].role == "fit"
        for rid in (fit_id, *carriers):  # one software version, one value
            assert runs[rid].stack[name] == pytest.approx(value, abs=6e-3), rid
            if rid != fit_id:
                assert runs[rid].role == "judge", rid


def test_summary_misses_and_docs_quote_the_table():
    """The summary lines are the rows', the table's judged misses are the ones the docs
    explain, and docs/planner.md's copy of the table is the committed one."""
    rows, text = _committed(), TABLE.read_text()
    summary = {m["name"]: m for m in _SUMMARY.finditer(text)}
    for name, role in (("judged", "judge"), ("fitted", "fit")):
        errs = [abs(float(r["err"])) for r in rows.values() if r["role"] == role]
        got = summary[name]
        assert int(got["n"]) == len(errs)
        assert float(got["mean"]) == pytest.approx(sum(errs) / len(errs), abs=0.06)
        assert float(got["max"]) == pytest.approx(max(errs), abs=0.06)
        assert int(got["within"]) == sum(e <= 10.0 for e in errs)
    misses = {i for i, r in rows.items() if r["role"] == "judge" and abs(float(r["err"])) > 10}
    assert misses == MISSES
    assert all(abs(float(r["err"])) <= 10 for r in rows.values() if r["role"] == "fit")
    docs = DOCS.read_text()
    quoted = {m["id"]: m.groupdict() for m in _DOC_ROW.finditer(docs)}
    assert set(quoted) == set(rows)
    for rid, q in quoted.items():
        assert {k: q[k] for k in ("pub", "pred", "err", "role", "fits")} == \
            {k: rows[rid][k] for k in ("pub", "pred", "err", "role", "fits")}, rid
    for m in _SUMMARY.finditer(text):
        assert m.group(0) in docs


def test_bloom_micro_batch_choice_is_the_one_its_engineers_made():
    """BigScience's README (tr11-176B-ml, "Replica setup"): at the full batch "MBS=2 performs
    the fastest in this setup", while MBS=1 "was faster for smaller GBS (better pipe fill)".
    The planner agrees only because each micro-batch's backward pays for accumulating its
    gradients in fp32 ([Note: gradient accumulation]): without that pass it would pick MBS=1
    at every batch size."""
    run = next(r for r in load_runs() if r.id == "bloom-176b-384")

    def step(gbs: int, mb: int, accum: float) -> float:
        r = dataclasses.replace(run, global_batch=gbs,
                                layout=run.layout.replace("microbatch=2", f"microbatch={mb}"),
                                stack={**run.stack, "grad_accum_bytes": accum})
        return predict(r, exact=False)[1]

    acc = run.stack["grad_accum_bytes"]
    assert step(2048, 2, acc) < min(step(2048, 1, acc), step(2048, 4, acc))
    assert step(192, 1, acc) < step(192, 2, acc)
    assert step(2048, 1, 0) < step(2048, 2, 0)
