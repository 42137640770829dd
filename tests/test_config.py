"""Configuration: defaults, TOML, dotted overrides, and every bad-input message."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from shardwise.train.config import io as config_io
from shardwise.train.config import (
    Config, all_keys, check_output_dir, load_config, resolve_world, to_toml)

ROOT = Path(__file__).resolve().parents[1]


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_debug_toml_is_the_default():
    assert load_config(ROOT / "configs" / "debug.toml") == Config()


def test_debug_toml_spells_out_every_key_with_its_help():
    """configs/debug.toml is "the defaults written out": every key of every section, each
    with the docstring --help prints (issue 30.7: the pp and ep keys were missing). Regenerate
    with ``to_toml(Config())`` under the file's opening comment."""
    from shardwise.train.config import to_toml

    text = (ROOT / "configs" / "debug.toml").read_text()
    assert text.endswith(to_toml(Config())), "configs/debug.toml is out of date"
    for section, key, *_ in config_io.iter_fields(Config()):
        assert f"\n{key} = " in text or f"\n# {key} = (unset)" in text, f"{section}.{key}"


def test_every_field_has_a_docstring():
    missing = [f"{s}.{k}" for s, k, _h, _v, doc in config_io.iter_fields(Config()) if not doc]
    assert not missing
    assert set(config_io.field_docs(Config)) == {f.name for f in dataclasses.fields(Config)}


def test_precedence_defaults_toml_cli(tmp_path):
    path = _toml(tmp_path, '[train]\nsteps = 7\nbatch_size = 3\n[log]\ndir = "from-toml"\n')
    cfg = load_config(path, {"train.steps": "30"})
    assert cfg.train.steps == 30          # command line beats TOML
    assert cfg.train.batch_size == 3      # TOML beats defaults
    assert cfg.log.dir == "from-toml"
    assert cfg.train.grad_accum == Config().train.grad_accum  # untouched default


@pytest.mark.parametrize("key, text, expected", [
    ("log.progress", "false", False), ("log.progress", "True", True),
    ("train.steps", "12", 12), ("optim.lr", "1e-3", 1e-3), ("optim.lr", "2", 2.0),
    ("optim.betas", "0.8,0.99", (0.8, 0.99)), ("optim.betas", "[0.8, 0.99]", (0.8, 0.99)),
    ("optim.no_decay", "norm,bias,tok_", ("norm", "bias", "tok_")),
    ("model.dim", "64", 64), ("model.dim", "none", None), ("data.source", "my/text", "my/text"),
])
def test_cli_strings_are_parsed(key, text, expected):
    cfg = load_config(None, {key: text})
    section, field = key.split(".")
    assert getattr(getattr(cfg, section), field) == expected


def test_round_trip_through_saved_toml(tmp_path):
    cfg = load_config(None, {"train.steps": "5", "model.dim": "64", "optim.betas": "0.5,0.6",
                             "data.source": 'a "quoted" path', "log.plot": "false"})
    path = _toml(tmp_path, to_toml(cfg))
    assert load_config(path) == cfg
    assert path.read_text().isascii()


@pytest.mark.parametrize("where", ["cli", "toml"])
@pytest.mark.parametrize("key, suggestion", [
    ("train.step", "train.steps"), ("trian.steps", "train.steps"), ("optim.weightdecay",
     "optim.weight_decay"), ("parallel.stages", "parallel.stage")])
def test_unknown_key_suggests_closest(tmp_path, where, key, suggestion):
    section, field = key.split(".")
    if where == "toml" and section == "trian":
        suggestion = "train"  # a TOML table name is judged on its own: [trian] -> [train]
    with pytest.raises(ValueError) as info:
        if where == "cli":
            load_config(None, {key: "1"})
        else:
            load_config(_toml(tmp_path, f"[{section}]\n{field} = 1\n"))
    message = str(info.value)
    assert (key if where == "cli" else section) in message
    assert f"did you mean {'--' if where == 'cli' else ''}{suggestion}" in message


def test_unknown_toml_section_and_stray_key(tmp_path):
    with pytest.raises(ValueError, match=r"unknown section \[trian\].*did you mean train"):
        load_config(_toml(tmp_path, "[trian]\nsteps = 3\n"))
    with pytest.raises(ValueError, match=r"steps = 3.*outside any \[section\].*train\.steps"):
        load_config(_toml(tmp_path, "steps = 3\n"))


@pytest.mark.parametrize("key, value, expected", [
    ("train.steps", "ten", "expected int"), ("optim.lr", "fast", "expected float"),
    ("log.progress", "maybe", "expected bool"), ("optim.betas", "0.9", "expected list of 2"),
    ("model.dim", "1.5", "expected int or none"),
])
def test_wrong_type_on_cli_names_key_value_and_type(key, value, expected):
    with pytest.raises(ValueError) as info:
        load_config(None, {key: value})
    message = str(info.value)
    assert key in message and repr(value) in message and expected in message


@pytest.mark.parametrize("line, key, shown, expected", [
    ('steps = "30"', "train.steps", "'30'", "expected int"),
    ("steps = 2.5", "train.steps", "2.5", "expected int"),
    ("steps = true", "train.steps", "True", "expected int"),
    ("batch_size = [8]", "train.batch_size", "[8]", "expected int"),
])
def test_wrong_type_in_toml(tmp_path, line, key, shown, expected):
    with pytest.raises(ValueError) as info:
        load_config(_toml(tmp_path, f"[train]\n{line}\n"))
    assert key in str(info.value) and shown in str(info.value) and expected in str(info.value)


def test_malformed_and_missing_toml(tmp_path):
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(_toml(tmp_path, "[train\nsteps = 3\n"))
    with pytest.raises(ValueError, match="cannot be read"):
        load_config(tmp_path / "absent.toml")


@pytest.mark.parametrize("key, value", [
    ("train.steps", "0"), ("train.steps", "-3"), ("train.batch_size", "0"),
    ("train.grad_accum", "0"), ("optim.lr", "-0.1"), ("parallel.stage", "4"),
    ("parallel.stage", "-1"), ("data.seq_len", "0"), ("data.val_fraction", "1.0"),
    ("data.tokenizer", "wordpiece"), ("parallel.backend", "mpi"), ("parallel.nproc", "0"),
    ("optim.min_lr_ratio", "1.5"), ("optim.betas", "0.9,1.0"), ("parallel.dp_shard", "0"),
    ("precision.param_dtype", "fp8"), ("precision.loss_scale", "0"),
    ("comm.weights", "int4"), ("comm.grads", "fp8"), ("offload.device", "nvme"),
    ("offload.buffer_mb", "0"),
    ("train.nonfinite", "ignore"), ("parallel.watchdog", "maybe"), ("parallel.timeout_s", "0"),
])
def test_impossible_values_name_the_value(key, value):
    with pytest.raises(ValueError) as info:
        load_config(None, {key: value})
    message = str(info.value)
    assert message.startswith(key) and "must be" in message
    assert str(load_config_value(key, value)) in message


def load_config_value(key: str, text: str):
    """What the command-line string parses to (the value the message must show)."""
    section, field = key.split(".")
    hint = {f"{s}.{k}": h for s, k, h, _v, _d in config_io.iter_fields(Config())}[key]
    value = config_io.parse_value(key, text, hint, from_cli=True)
    return repr(value) if isinstance(value, str) else value


@pytest.mark.parametrize("replicate, shard, world, ok", [
    (1, -1, 2, 2), (2, -1, 4, 2), (2, 2, 4, 2), (1, 3, 2, None), (3, -1, 4, None),
])
def test_degrees_must_multiply_to_world_size(replicate, shard, world, ok):
    cfg = load_config(None, {"parallel.dp_replicate": str(replicate),
                             "parallel.dp_shard": str(shard)})
    if ok is None:
        with pytest.raises(ValueError) as info:
            resolve_world(cfg, world)
        assert "parallel.dp_replicate" in str(info.value) and str(world) in str(info.value)
    else:
        assert resolve_world(cfg, world).parallel.dp_shard == ok


def test_output_dir_is_probed(tmp_path):
    assert check_output_dir(tmp_path / "a" / "b").is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"log.dir .*file/sub.* cannot be written"):
        check_output_dir(blocker / "sub")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into read-only folders")
def test_read_only_output_dir(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="cannot be written"):
        check_output_dir(locked)


def test_all_keys_cover_every_section():
    sections = {k.split(".")[0] for k in all_keys()}
    assert sections == {"model", "data", "train", "optim", "parallel", "precision", "comm",
                        "offload", "moe", "log", "checkpoint", "vla"}


@pytest.mark.parametrize("overrides, message", [
    ({"parallel.stage": "0", "comm.grads": "int4"},
     "comm.weights='fp', comm.grads='int4', comm.hierarchy=0 need parallel.stage 1, 2 or 3, "
     "got 0"),
    ({"parallel.stage": "2", "comm.hierarchy": "2"},
     "comm.hierarchy=2 needs parallel.stage 3 with parallel.reshard_after_forward true"),
    ({"comm.hierarchy": "2", "comm.weights": "fp8", "precision.matmul": "fp8_tensorwise"},
     "comm.hierarchy=2 with comm.weights='fp8' and precision.matmul='fp8_tensorwise': the "
     "secondary partition keeps compute-dtype rows, not the fp8 codes"),
    ({"offload.device": "disk"}, "offload.device='disk' needs offload.path"),
    ({"parallel.stage": "0", "offload.device": "cpu"},
     "offload.device='cpu' needs parallel.stage 1, 2 or 3 (sharded masters), got 0"),
])
def test_keys_that_constrain_each_other_are_named(overrides, message):
    with pytest.raises(ValueError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_hierarchy_must_divide_the_shard_degree():
    cfg = load_config(None, {"comm.hierarchy": "2"})
    with pytest.raises(ValueError, match="comm.hierarchy=2 must divide parallel.dp_shard=3"):
        resolve_world(cfg, 3)
