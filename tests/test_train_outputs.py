"""What a run writes and prints: which folder (never over an earlier run), the config lines
at start, progress off a terminal, one continuous metrics history after a resume, and what
the validation split is."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.train.cli import main
from shardwise.train.config import load_config
from shardwise.train.metrics import MetricsLogger
from shardwise.train.preflight import config_lines
from shardwise.train.rundir import choose_log_dir, clear_run, run_outputs
from shardwise.train.trainer import validation_note

TINY = ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2",
        "--model.n_kv_heads", "1", "--data.seq_len", "16", "--train.batch_size", "2",
        "--data.max_bytes", "100000", "--log.plot", "false", "--train.steps", "1"]


def _a_run_in(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text("")
    (folder / "metrics.jsonl").write_text("")
    return folder


# ----------------------------------------------------------------------------- log.dir


def test_the_default_folder_moves_to_a_numbered_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, {})
    assert choose_log_dir(cfg) is cfg  # nothing there yet
    _a_run_in(tmp_path / "runs" / "debug")
    assert choose_log_dir(cfg).log.dir == "runs/debug-2"
    _a_run_in(tmp_path / "runs" / "debug-2")
    (tmp_path / "runs" / "debug-3").mkdir()  # an empty folder holds no run
    assert choose_log_dir(cfg).log.dir == "runs/debug-3"
    # resuming continues the run in the default folder
    resume = load_config(None, {"checkpoint.resume": "auto"})
    assert choose_log_dir(resume).log.dir == "runs/debug"


def test_a_named_folder_with_a_run_is_refused_naming_the_ways_on(tmp_path):
    folder = _a_run_in(tmp_path / "mine")
    (folder / "checkpoints" / "step_00000002").mkdir(parents=True)
    cfg = load_config(None, {"log.dir": str(folder)})
    with pytest.raises(ValueError) as info:
        choose_log_dir(cfg)
    assert str(info.value) == (
        f"log.dir '{folder}' already holds a run (config.toml, metrics.jsonl, checkpoints/); "
        "expected a folder without one: pass --log.overwrite true to replace that run, "
        "--checkpoint.resume auto to continue it, or another --log.dir")
    for ok in ({"log.overwrite": "true"}, {"checkpoint.resume": "auto"}):
        assert choose_log_dir(load_config(None, {"log.dir": str(folder), **ok})).log.dir \
            == str(folder)


def test_overwrite_removes_only_the_earlier_runs_outputs(tmp_path):
    folder = _a_run_in(tmp_path / "mine")
    (folder / "checkpoints" / "step_00000002").mkdir(parents=True)
    (folder / "tb").mkdir()
    (folder / "metrics.until-step-3.jsonl").write_text("")
    (folder / "notes.txt").write_text("mine, keep")
    cfg = load_config(None, {"log.dir": str(folder), "log.overwrite": "true"})
    assert clear_run(cfg) == ["config.toml", "metrics.jsonl", "tb/", "checkpoints/",
                              "metrics.until-step-3.jsonl"]
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    assert run_outputs(folder) == []
    with pytest.raises(ValueError, match="log.overwrite=true removes the run that "
                                         "checkpoint.resume='auto' would continue"):
        load_config(None, {"log.overwrite": "true", "checkpoint.resume": "auto"})


def test_refused_before_launch_by_the_command(tmp_path, capsys):
    folder = _a_run_in(tmp_path / "mine")
    assert main(["train", *TINY, "--log.dir", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardwise: error: log.dir '{folder}' already holds a run")
    assert (folder / "config.toml").read_text() == ""  # untouched


def test_the_quick_start_runs_twice_into_two_folders(tmp_path):
    """``shardwise train`` twice in one folder: the second run says where it writes."""
    script = Path(sys.executable).parent / "shardwise"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "shardwise.train.cli"]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC",
                                "SLURM_"))}
    outs = []
    for _ in range(2):
        proc = subprocess.run([*cmd, "train", *TINY, "--nproc", "1"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(proc.stdout)
    assert "holds an earlier run" not in outs[0]
    assert ("log.dir 'runs/debug' holds an earlier run, so this run writes to 'runs/debug-2'"
            in outs[1])
    for folder in ("debug", "debug-2"):
        summary = json.loads((tmp_path / "runs" / folder / "summary.json").read_text())
        assert summary["log_dir"] == f"runs/{folder}"
        assert summary["steady_tokens_per_s"] > 0
    assert ("compute fp32, reduce fp32, masters fp32; activation checkpointing none; compile "
            "off; communication full precision; optimizer offload none") in outs[0]


def test_the_start_line_names_checkpointing_compile_communication_and_offload():
    """Issue 30.7: the layout line said nothing of these."""
    from shardwise.train.trainer import describe_features

    cfg = load_config(None, {"train.activation_checkpoint": "selective", "train.compile": "true",
                             "comm.weights": "int8", "comm.grads": "int4",
                             "offload.device": "cpu"})
    assert describe_features(cfg) == (
        "activation checkpointing selective; compile on (inductor); communication weights "
        "int8, gradients int4 (blocks of 256); optimizer offload cpu")


def test_the_summary_gives_the_steady_state_beside_the_whole():
    """Issue 30.7: tokens/s over the whole run includes the first step's compile."""
    from shardwise.train.metrics import format_summary

    summary = {"final_train_loss": 2.0, "final_val_loss": None, "steps": 3, "tokens": 300,
               "tokens_per_s": 50.0, "steady_tokens_per_s": 100.0, "world_size": 2,
               "peak_rss_mib": [1.0, 1.0], "elapsed_s": 6.0, "train_time_s": 6.0,
               "log_dir": "x", "outputs": []}
    assert ("3 steps, 300 tokens, 50 tokens/s on 2 ranks (steady state 100 tokens/s: the "
            "median step after the first, which compiles and warms up)") in \
        format_summary(summary)


# ----------------------------------------------------------------------------- printing


def test_start_up_prints_the_non_default_keys_and_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a quick-start run's runs/debug in the checkout moves it on
    cfg = load_config(None, {"train.steps": "30", "optim.betas": "0.9,0.99"})
    cfg = choose_log_dir(cfg)
    from shardwise.train.config import resolve_world

    lines = config_lines(resolve_world(cfg, 2))
    assert lines == ["config: every key in runs/debug/config.toml; not the default:",
                     "  train.steps = 30", "  optim.betas = [0.9, 0.99]"]
    assert config_lines(resolve_world(load_config(None, {}), 4)) == [
        "config: the defaults; every key in runs/debug/config.toml"]


def _records(n: int, start: int = 1) -> list[dict]:
    return [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "tokens_per_s": 1000.0,
             "rss_mib": [300.0, 301.0]} for s in range(start, start + n)]


def test_progress_off_a_terminal_is_plain_periodic_lines(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=25, enabled=True, refresh_every=10)
    logger.echo("model ...")
    for record in _records(25):
        logger.log_step(record)
    logger.close()
    err = capsys.readouterr().err
    assert "\r" not in err and "%|" not in err
    assert [line.split(":")[0] for line in err.splitlines()] == [
        "step 1/25", "step 10/25", "step 20/25", "step 25/25"]
    assert "step 10/25: loss 4.0000 | lr 0.001 | 1,000 tok/s | mem r0 300M r1 301M" in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_bar_appears_with_the_first_step(tmp_path, monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    logger = MetricsLogger(tmp_path, total_steps=3, enabled=True)
    logger.echo("model ...")
    logger.echo("ZeRO stage 3 ...")
    assert term.getvalue() == ""  # no empty "0%" bars while the run starts
    for record in _records(3):
        logger.log_step(record)
    logger.close()
    drawn = term.getvalue()
    assert drawn.count("\n") == 1 and drawn.rstrip().endswith("mem r0 300M r1 301M]")  # one bar


# ----------------------------------------------------------------------------- history


def test_a_resumed_run_keeps_one_continuous_history(tmp_path):
    path = tmp_path / "metrics.jsonl"
    earlier = _records(6) + [{"step": 3, "val_loss": 4.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in earlier))
    logger = MetricsLogger(tmp_path, total_steps=8, enabled=True, progress=False,
                           resume_step=4)
    assert [r["step"] for r in logger.history] == [1, 2, 3, 4, 3]  # 5 and 6 run again
    for record in _records(4, start=5):
        logger.log_step(record)
    logger.close()
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert written == logger.all_records
    assert [r["step"] for r in written if "loss" in r] == list(range(1, 9))
    assert not list(tmp_path.glob("metrics.until-step-*"))
    fresh = MetricsLogger(tmp_path, total_steps=8, enabled=True, progress=False)
    fresh.close()
    assert path.read_text() == "" and fresh.history == []  # a fresh run starts a new file


# ----------------------------------------------------------------------------- validation


def test_the_validation_split_is_named_where_its_loss_is_shown(tmp_path, capsys):
    label, line = validation_note(load_config(None, {}))
    assert label == "the last 5% of the corpus, held out"
    assert line.startswith("validation: the last 5% of the corpus (data.val_fraction)")
    assert "other modules than the training text" in line
    _, own = validation_note(load_config(None, {"data.source": "my.txt",
                                                "data.val_fraction": "0.1"}))
    assert own == "validation: the last 10% of the corpus (data.val_fraction), never trained on"
    logger = MetricsLogger(tmp_path, total_steps=2, enabled=True, progress=False,
                           val_label=label)
    logger.log_eval({"step": 2, "val_loss": 4.25})
    logger.close()
    assert capsys.readouterr().out == "step 2: val_loss 4.2500 (the last 5% of the corpus, " \
                                      "held out)\n"
