"""The ``shardwise`` command: --help, and bad input refused before any rank starts.

Every case here runs ``main()`` in this process: a refused run returns exit code 2 with one
line naming the value, before a single rank is launched (so each test takes milliseconds; a
check that failed to fire would launch a 1-step run of a tiny model instead of hanging).
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from shardwise.testing.trainer import refused
from shardwise.train.config import io as config_io
from shardwise.train.cli import build_parser, main
from shardwise.train.config import Config

# Keeps any run that wrongly gets past the checks short.
TINY = ["--train.steps", "1", "--model.dim", "32", "--model.n_layers", "1", "--model.n_heads",
        "2", "--model.n_kv_heads", "1", "--data.seq_len", "16", "--train.batch_size", "2",
        "--log.progress", "false", "--log.plot", "false"]



def test_help_lists_every_field_with_meaning_and_default(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    headings = [m.group(1) for m in re.finditer(r"\[(\w+)\]:", text)]
    assert headings == ["model", "data", "train", "optim", "parallel", "precision", "comm",
                        "offload", "moe", "log", "checkpoint", "vla"]
    assert "--nproc N alias of --parallel.nproc" in text and "--config FILE" in text
    text = text[text.index("[model]:"):]  # the grouped entries, not the usage or description
    for section, key, _hint, default, doc in config_io.iter_fields(Config()):
        entry = f"--{section}.{key}"
        after = text[text.index(entry + " "):]
        assert " ".join(doc.split()[:6]) in after, entry
        shown = "unset" if default is None else config_io.to_toml_value(default)
        assert f"(default: {shown})" in after[:600], entry


def test_top_level_help_names_train(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "train" in capsys.readouterr().out


@pytest.mark.parametrize("args, expected", [
    (["--train.step", "30"], "unknown key --train.step in the command line; did you mean "
                             "--train.steps?"),
    (["--parallel.stag", "3"], "did you mean --parallel.stage?"),
    (["--log.dri=x"], "unknown key --log.dri"),
    (["--train.steps", "ten"], "train.steps: expected int, got 'ten'"),
    (["--optim.lr", "fast"], "optim.lr: expected float, got 'fast'"),
    (["--train.steps", "0"], "train.steps must be a positive int, got 0"),
    (["--train.batch_size", "-2"], "train.batch_size must be a positive int (sequences per "
                                   "rank), got -2"),
    (["--train.grad_accum", "0"], "train.grad_accum must be a positive int, got 0"),
    (["--optim.lr", "-1e-3"], "optim.lr must be a finite number >= 0, got -0.001"),
    (["--parallel.stage", "5"], "parallel.stage must be a ZeRO stage in 0..3, got 5"),
    (["--parallel.dp_shard", "3"], "parallel.dp_replicate * parallel.dp_shard = 1 * 3 = 3, "
                                   "expected the world size 2"),
    (["--nproc", "3", "--parallel.dp_replicate", "2"], "parallel.dp_replicate=2 does not "
                                                       "divide the world size 3"),
    (["--nproc", "zero"], "parallel.nproc: expected int, got 'zero'"),
    (["--data.seq_len", "512"], "data.seq_len=512 exceeds max_seq_len=256 of model 'debug'"),
    (["--model.name", "debgu"], "unknown model config 'debgu' (did you mean 'debug'?)"),
    (["--model.name", "gpt3-175b"], "'gpt3-175b' is a published shape the planner prices "
                                    "(gelu feed-forward, layernorm, learned positions) that "
                                    "shardwise.models cannot build; price it with `shardwise "
                                    "plan --model gpt3-175b`"),
    (["--model.name", "bloom-176b"], "alibi positions"),
    (["--model.n_heads", "3"], "n_heads=3"),
    (["positional"], "unexpected argument 'positional'"),
])
def test_bad_input_is_refused_with_the_value(capsys, tmp_path, args, expected):
    message = refused(capsys, *TINY, "--log.dir", str(tmp_path / "out"), *args)
    assert expected in message


def test_config_file_errors_name_the_file_and_key(capsys, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[optim]\nweightdecay = 0.1\n")
    message = refused(capsys, "--config", str(path))
    assert "optim.weightdecay" in message and "bad.toml" in message
    assert "did you mean optim.weight_decay" in message


def test_unwritable_output_dir(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    message = refused(capsys, *TINY, "--log.dir", str(blocker / "run"))
    assert "log.dir" in message and str(blocker / "run") in message
    assert "cannot be written" in message


def test_missing_corpus_path(capsys, tmp_path):
    missing = tmp_path / "nowhere.txt"
    message = refused(capsys, *TINY, "--log.dir", str(tmp_path / "o"), "--data.source",
                       str(missing))
    assert str(missing) in message


def test_empty_corpus(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    message = refused(capsys, *TINY, "--log.dir", str(tmp_path / "o"), "--data.source",
                       str(empty))
    assert str(empty) in message and "empty" in message


def test_whitespace_only_corpus(capsys, tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\n\t  \n" * 100)
    message = refused(capsys, *TINY, "--log.dir", str(tmp_path / "o"), "--data.source",
                       str(blank))
    assert str(blank) in message and "no text" in message


def test_corpus_too_small_for_one_global_batch(capsys, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("def f(x):\n    return x + 1\n" * 8)  # 232 bytes
    message = refused(capsys, *TINY, "--log.dir", str(tmp_path / "o"), "--data.source",
                       str(small))
    assert str(small) in message and "too small" in message
    assert "2 ranks x 2 sequences x 17 tokens" in message
    assert not (tmp_path / "o" / "metrics.jsonl").exists()  # no rank ever started


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None,
                    reason="tensorboard is installed")
def test_tensorboard_missing_is_a_clear_error(capsys, tmp_path):
    message = refused(capsys, *TINY, "--log.dir", str(tmp_path / "o"), "--log.tensorboard")
    assert "tensorboard" in message and "pip install" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")
def test_nccl_without_cuda_is_refused_before_launch(capsys, tmp_path):
    message = refused(capsys, *TINY, "--log.dir", str(tmp_path / "o"), "--parallel.backend",
                       "nccl")
    assert "parallel.backend = 'nccl'" in message and "CUDA" in message


@pytest.mark.parametrize("args", [["--nproc", "3", "--parallel.nproc", "2"],
                                  ["--parallel.nproc=2", "--nproc=3"],
                                  ["--checkpoint.async", "--checkpoint.async_save", "false"]])
def test_an_alias_and_its_key_that_disagree_arerefused(capsys, tmp_path, args):
    message = refused(capsys, *TINY, "--log.dir", str(tmp_path / "o"), *args)
    first, second = (a for a in args if a.startswith("--") and not a[2:].isdigit())
    assert first.split("=")[0] in message and second.split("=")[0] in message
    assert "disagree" in message


def test_an_alias_and_its_key_that_agree_are_fine():
    from shardwise.train.cli import _attach_values, _check_aliases

    args = build_parser().parse_args(_attach_values(
        ["train", "--nproc", "2", "--parallel.nproc", "2", "--checkpoint.async",
         "--checkpoint.async_save", "yes"]))
    _check_aliases(args)  # no error: the same values, spelled differently
    assert vars(args)["parallel.nproc"] == "2"


def test_engine_errors_name_the_config_key(capsys, tmp_path):
    message = refused(capsys, *TINY, "--log.dir", str(tmp_path / "o"), "--offload.device",
                      "disk", "--offload.path", str(tmp_path / "nope"))
    assert message == (f"offload.path = '{tmp_path / 'nope'}' does not exist; create the "
                       "directory first")


def _small_checkpoint(path) -> None:
    from shardwise import checkpoint

    checkpoint.save(path, torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(40)]),
                    step=3)


def test_inspect_is_a_summary_with_tensors_and_json_on_request(tmp_path, capsys):
    import json

    _small_checkpoint(tmp_path / "step_00000003")
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "tensors:   80 model, 0 optimizer (--tensors lists them)" in text
    assert "model.0.weight" not in text and len(text.splitlines()) < 15
    assert main(["checkpoint", "inspect", str(tmp_path), "--tensors"]) == 0
    assert "model.39.bias" in capsys.readouterr().out
    assert main(["checkpoint", "inspect", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step"] == 3 and data["path"].endswith("step_00000003")
    assert data["tensors"][0] == {"name": "model.0.weight", "shape": [4, 4],
                                  "dtype": "float32", "bytes": 64, "chunks": 1}


@pytest.mark.parametrize("args, code", [
    (["train", "--help"], 0),  # argparse itself ignores a closed stdout
    (["checkpoint", "inspect", "CKPT", "--tensors"], 141),  # 128 + SIGPIPE, as a shell says
])
def test_a_closed_stdout_ends_the_command_quietly(tmp_path, args, code):
    """``shardwise ... | head -1`` whose reader is gone before the output is written."""
    import os
    import subprocess
    import sys

    _small_checkpoint(tmp_path / "step_00000003")
    args = [str(tmp_path) if a == "CKPT" else a for a in args]
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the command writes anything
    proc = subprocess.run([sys.executable, "-m", "shardwise.train.cli", *args], stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert proc.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored"
    assert proc.returncode == code


def test_every_planner_only_shape_is_refused_by_name():
    """The catalogue's shapes the trainer cannot build are refused with their own name and
    the command that prices them; the registry's names are not."""
    from shardwise.models import list_model_configs
    from shardwise.planner import planner_only_models
    from shardwise.train.preflight import _planner_only

    only = planner_only_models()
    assert {"gpt3-175b", "mt-nlg-530b", "gpt-1t", "bloom-176b"} <= set(only)
    for name in only:
        why = _planner_only(name)
        assert why and repr(name) in why and f"shardwise plan --model {name}" in why
    assert all(_planner_only(name) is None for name in list_model_configs())
