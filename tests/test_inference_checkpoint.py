"""Loading a trained model for inference (shardwise/inference/checkpoint.py): runs trained
on 2 ranks under ZeRO-3, tp 2 and pp 2 load into one process and reproduce the trainer's own
validation loss (computed by the trained ranks at the last step); the safetensors export
loads to bitwise the same logits; the path errors name the path and what was expected.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from shardwise.checkpoint.export import export_safetensors, import_safetensors
from shardwise.data import iter_eval_batches
from shardwise.inference.checkpoint import (LoadedModel, load_model, read_model_config,
                                            resolve_checkpoint)
from shardwise.models import LlamaConfig, build_model
from shardwise.testing.dist import run_ranks
from shardwise.testing.trainer import logged, train_runs
from shardwise.train.config import load_config
from shardwise.train.preflight import build_model_config, preflight

TINY = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
        "data.seq_len": "32", "train.batch_size": "2", "train.eval_batches": "2",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false",
        "train.steps": "2", "train.eval_interval": "0", "checkpoint.keep_last": "0",
        "checkpoint.interval": "2", "optim.warmup_steps": "1"}
LAYOUTS = {"zero3": {"parallel.stage": "3"}, "tp2": {"parallel.tp": "2"},
           "pp2": {"parallel.pp": "2", "parallel.pp_microbatches": "2"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs trained in one launch of 2 ranks: ``{name: (run dir, cfg, data)}``."""
    root = tmp_path_factory.mktemp("runs")
    prepared = {}
    for name, over in LAYOUTS.items():
        cfg = load_config(None, {**TINY, "log.dir": str(root / name), **over})
        prepared[name] = (root / name, *preflight(cfg, world_size=2))
    run_ranks(train_runs, 2, args=([(c, d) for _, c, d in prepared.values()],), timeout_s=240)
    return prepared


def _val_loss(model, cfg, data, ranks: int) -> float:
    """The trainer's validation loss (shardwise/train/step.py, evaluate) in one process: the
    mean over the data ranks of each rank's mean loss over its eval batches."""
    per_rank = []
    for rank in range(ranks):
        losses = [F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).item()
                  for x, y in iter_eval_batches(data.val_ids, seq_len=cfg.data.seq_len,
                                                batch_size=cfg.train.batch_size, rank=rank,
                                                world_size=ranks,
                                                max_batches=cfg.train.eval_batches)]
        per_rank.append(sum(losses) / len(losses))
    return sum(per_rank) / len(per_rank)


@pytest.mark.parametrize("name, data_ranks", [("zero3", 2), ("tp2", 1), ("pp2", 1)])
def test_a_run_loads_to_the_trained_model(runs, name, data_ranks):
    run, cfg, data = runs[name]
    loaded = load_model(run)  # the run directory: its newest checkpoint
    assert isinstance(loaded, LoadedModel)
    assert loaded.path == run / "checkpoints" / "step_00000002"
    assert (loaded.format, loaded.step, loaded.config) == (
        "dcp", 2, build_model_config(cfg, data.vocab_size))
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    with torch.inference_mode():
        mine = _val_loss(loaded.model, cfg, data, data_ranks)
    trained = logged(run, "val_loss")[-1]
    assert trained["step"] == 2
    assert mine == pytest.approx(trained["val_loss"], rel=1e-6)
    assert "step 2 (dcp)" in loaded.describe()


def test_both_layouts_and_the_safetensors_export_give_the_same_logits(runs, tmp_path):
    run, cfg, data = runs["zero3"]
    step = resolve_checkpoint(run)
    export_safetensors(step, tmp_path / "hf")
    tokens = data.val_ids[:64].view(2, 32)
    dcp_model = load_model(step).model
    hf = load_model(tmp_path / "hf")
    assert (hf.format, hf.step, hf.run_dir) == ("safetensors", 2, None)
    reference = build_model(build_model_config(cfg, data.vocab_size), seed=5)
    import_safetensors(tmp_path / "hf", reference)
    with torch.inference_mode():
        want = reference(tokens)
        assert torch.equal(dcp_model(tokens), want)
        assert torch.equal(hf.model(tokens), want)
    single = tmp_path / "hf" / "model-00001-of-00001.safetensors"
    assert resolve_checkpoint(single) == single
    assert read_model_config(single).dim == 32


def test_dtype_and_a_checkpoint_folder_given_directly(runs):
    run, _, _ = runs["tp2"]
    step = run / "checkpoints" / "step_00000002"
    loaded = load_model(step, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    rope = [b for n, b in loaded.model.named_buffers() if n.endswith(("cos", "sin"))]
    assert rope and all(b.dtype == torch.float32 for b in rope)
    assert isinstance(read_model_config(run), LlamaConfig)
    assert loaded.run_dir is None  # the test runs write no config.toml (the CLI does)


def test_errors_name_the_path_and_what_was_expected(runs, tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint .*nowhere does not exist; expected a run"):
        load_model(tmp_path / "nowhere")
    bare = tmp_path / "run"  # a run trained with checkpoint.interval 0
    bare.mkdir()
    (bare / "config.toml").write_text("[train]\nsteps = 2\n")
    with pytest.raises(ValueError, match=r"no checkpoints under .*checkpoint.interval N"):
        resolve_checkpoint(bare)
    moved = tmp_path / "moved"  # a run whose checkpoint.dir was elsewhere
    moved.mkdir()
    elsewhere = runs["tp2"][0] / "checkpoints"
    (moved / "config.toml").write_text(f'[checkpoint]\ndir = "{elsewhere}"\n')
    assert resolve_checkpoint(moved) == elsewhere / "step_00000002"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"neither a run, a checkpoint nor safetensors"):
        load_model(other)
    with pytest.raises(ValueError, match=r"not a \.safetensors file"):
        resolve_checkpoint(other / "notes.txt")


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(runs, tmp_path):
    import shutil

    run, _, _ = runs["zero3"]
    copy = tmp_path / "run"
    shutil.copytree(run / "checkpoints", copy / "checkpoints")
    shutil.copytree(copy / "checkpoints" / "step_00000002", copy / "checkpoints" / "step_00000003")
    data_file = sorted((copy / "checkpoints" / "step_00000003").glob("*.distcp"))[0]
    data_file.write_bytes(data_file.read_bytes()[:-8])  # truncated
    with pytest.warns(UserWarning, match=r"step_00000003 is damaged"):
        assert resolve_checkpoint(copy).name == "step_00000002"
    (copy / "checkpoints" / "step_00000002" / "__0_0.distcp").write_bytes(b"")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"every checkpoint under .* is damaged \(2 "
                                             r"checked; the newest, step_00000003: "):
            load_model(copy)
    manifest = json.loads((copy / "checkpoints" / "step_00000002" / "manifest.json").read_text())
    manifest["model"]["config"]["wings"] = 2
    (copy / "checkpoints" / "step_00000002" / "manifest.json").write_text(json.dumps(manifest))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"does not fit a shardwise LlamaConfig"):
            read_model_config(copy / "checkpoints" / "step_00000002")
