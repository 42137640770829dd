"""Low-bit training compute (issue 33) on the user's paths, beyond the layouts
(tests/test_lowbit_layouts.py):

* masters, optimizer state and checkpoints stay high precision: ``--precision.matmul
  fp8_rowwise``'s checkpoint resumes in a ``--precision.matmul bf16`` run and that one's back
  in an fp8 run, through the CLI; every tensor saved is fp32; an fp8 run resumed from its own
  checkpoint continues bitwise as the uninterrupted run (no low-bit state is lost);
* overflow safety: an all-zero weight, an all-zero activation and huge-but-finite inputs
  train finite through every recipe, and no cast reports a non-finite amax for them;
* a non-finite amax is named: an inf written into one layer's input in a real training step
  (``SHARDWISE_FAULT=inf:...:phase=input:module=...``) stops the run with the layer's name
  in the error on every rank, or, with ``train.nonfinite = "skip"``, in the step's record;
  the flags cost no host sync in a steady step;
* ``--precision.matmul_skip`` and the start lines: the layers a recipe cannot take and the
  patterns' layers are listed with the reason, and skipping every block gives bitwise the
  run without low-bit matmuls;
* selective recompute replays a low-bit block's ops one for one (a regression: the first
  cast's flag had no op in the forward and one in the recompute);
* Hugging Face decoders built from a config (Llama, Mixtral) convert with
  ``shardwise.apply_low_precision`` and train; their router gates, ``lm_head`` and stacked
  experts stay high precision, the experts listed.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise
from shardwise.models import TransformerBlock, build_model, get_model_config
from shardwise.parallel.lowbit import RECIPE_NAMES, lowbit_modules, nonfinite_amax_layers
from shardwise.testing.dist import run_ranks
from shardwise.testing.trainer import cli_args, logged
from shardwise.train.cli import main
from shardwise.train.config import load_config
from shardwise.train.preflight import preflight

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY = {"model.dim": "128", "model.n_layers": "2", "model.n_heads": "4",
        "model.n_kv_heads": "4", "model.ffn_dim": "256", "data.seq_len": "32",
        "train.batch_size": "2", "train.eval_batches": "1", "data.max_bytes": "200000",
        "log.progress": "false", "log.plot": "false", "train.steps": "4",
        "train.eval_interval": "0", "checkpoint.keep_last": "0", "optim.warmup_steps": "1"}
CLI = cli_args(TINY)
LLAMA = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=256, vocab_size=256,
             max_seq_len=64)


def _model(recipe: str | None = None, seed: int = 0) -> torch.nn.Module:
    model = build_model(get_model_config("debug", **LLAMA), seed=seed)
    return model if recipe is None else shardwise.apply_low_precision(model, recipe)


def _tokens(step: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(step))


def _lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                             tokens[:, 1:].flatten())


# ----------------------------------------------------------------------------- checkpoints


def _saved_dtypes(path: Path) -> set[str]:
    md = dcp.FileSystemReader(str(path)).read_metadata()
    return {str(v.properties.dtype) for v in md.state_dict_metadata.values()
            if hasattr(v, "properties")}


def test_an_fp8_checkpoint_loads_into_a_bf16_run_and_back(tmp_path, capfd):
    def run(name: str, matmul: str, steps: int, resume: Path | None = None) -> list[dict]:
        extra = ["--checkpoint.resume", str(resume)] if resume else []
        code = main(["train", *CLI, "--nproc", "2", "--precision.matmul", matmul,
                     "--train.steps", str(steps), "--checkpoint.interval", "2",
                     "--log.dir", str(tmp_path / name), *extra])
        out = capfd.readouterr().out
        assert code == 0, out
        return logged(tmp_path / name)

    fp8 = run("fp8", "fp8_rowwise", 4)
    step2 = tmp_path / "fp8" / "checkpoints" / "step_00000002"
    again = run("fp8_again", "fp8_rowwise", 4, step2)
    bf16 = run("bf16", "bf16", 4, step2)
    back = run("back", "fp8_rowwise", 6, tmp_path / "bf16" / "checkpoints" / "step_00000004")
    # an fp8 run keeps no state outside the checkpoint: its resume is the uninterrupted run
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in again] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in fp8[2:]]
    assert [r["step"] for r in bf16] == [3, 4] and [r["step"] for r in back] == [5, 6]
    assert all(math.isfinite(r["loss"]) for r in bf16 + back)
    # the same weights at step 3, only the matmuls differ: close, not equal
    assert bf16[0]["loss"] != fp8[2]["loss"]
    assert bf16[0]["loss"] == pytest.approx(fp8[2]["loss"], rel=1e-2)
    for ckpt in (step2, tmp_path / "bf16" / "checkpoints" / "step_00000004",
                 tmp_path / "back" / "checkpoints" / "step_00000006"):
        assert _saved_dtypes(ckpt) == {"torch.float32"}, ckpt


def test_a_converted_model_keeps_its_names_and_fp32_state():
    plain, model = _model(), _model("fp8_rowwise")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _lm_loss(model, _tokens()).backward()
    opt.step()
    state = model.state_dict()
    assert state.keys() == plain.state_dict().keys()
    assert {t.dtype for t in state.values()} == {torch.float32}
    assert {t.dtype for s in opt.state_dict()["state"].values() for t in s.values()} == \
        {torch.float32}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}


# ----------------------------------------------------------------------------- overflow


def _corrupt(model, how: str) -> None:
    with torch.no_grad():
        if how == "zero_weight":  # the weight's amax is 0
            model.layers[0].attention.wq.weight.zero_()
        elif how == "zero_activation":  # w2 then casts an all-zero input (and gradient)
            model.layers[1].feed_forward.w1.weight.zero_()
        elif how == "huge_weight":  # finite, far above every format's range
            model.layers[0].feed_forward.w3.weight[0, :7] = 3e30
        elif how == "huge_activation":  # a huge input to w1 and w3 (1e30 would overflow
            model.layers[1].ffn_norm.weight[:5] = 1e15  # silu(w1 x) * w3 x in fp32 itself)


@pytest.mark.parametrize("how", ["zero_weight", "zero_activation", "huge_weight",
                                 "huge_activation"])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_zero_and_huge_finite_values_train_finite(recipe, how):
    reference = _model()
    _corrupt(reference, how)
    assert math.isfinite(_lm_loss(reference, _tokens()).item())  # finite in high precision
    model = _model(recipe)
    _corrupt(model, how)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        loss = _lm_loss(model, _tokens(step))
        loss.backward()
        assert math.isfinite(loss.item()), (recipe, how, step)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters()), (recipe, how)
        assert nonfinite_amax_layers(model) == []  # saturating casts, finite scales
        opt.step()
        opt.zero_grad()
        assert all(torch.isfinite(p).all() for p in model.parameters())


def _inf_into(module) -> list:
    def hook(mod, args):
        x = args[0].clone()
        x.view(-1)[0] = math.inf
        return (x, *args[1:])
    return [module.register_forward_pre_hook(hook)]


def test_the_layer_where_a_non_finite_entered_is_named_first():
    model = _model("fp8_tensorwise")
    assert nonfinite_amax_layers(model) == []  # nothing cast yet: no flags, no sync
    hooks = _inf_into(model.layers[1].feed_forward.w2)
    _lm_loss(model, _tokens()).backward()
    names = nonfinite_amax_layers(model)
    # the forward's nan reaches only the head; the backward's reaches every layer
    assert names[0] == "layers.1.feed_forward.w2"
    assert set(names) == {n for n, _, _ in lowbit_modules(model)}
    assert names[1:3] == ["layers.1.feed_forward.w3", "layers.1.feed_forward.w1"]
    assert nonfinite_amax_layers(model) == []  # cleared
    hooks[0].remove()
    for p in model.parameters():  # a gradient turned inf in backward: backward flags only
        p.grad = None
    model.layers[0].attention.wo.register_full_backward_pre_hook(
        lambda mod, grad: (torch.full_like(grad[0], math.inf),))
    model(_tokens()[:, :-1]).float().mean().backward()
    names = nonfinite_amax_layers(model)
    assert names[0] == "layers.0.attention.wo", names


INF_FAULT = "inf:rank=1:step=2:phase=input:module=layers.1.feed_forward.w2"


def _train_logged(cfg, data):
    from shardwise.train.trainer import build_env, train

    try:
        train(cfg, data, build_env(cfg))
    except Exception as exc:  # noqa: BLE001 - returned for the test to read
        return f"{type(exc).__name__}: {exc}"
    return "finished"


def _fault_run(root: Path, policy: str, world: int = 2, **over: str) -> list[str]:
    cfg = load_config(None, {**TINY, "log.dir": str(root), "train.nonfinite": policy,
                             "precision.matmul": "fp8_rowwise", **over})
    cfg, data = preflight(cfg, world_size=world)
    return run_ranks(_train_logged, world, args=(cfg, data), env={"SHARDWISE_FAULT": INF_FAULT},
                     timeout_s=180)


def test_a_non_finite_amax_stops_the_run_naming_the_layer(tmp_path):
    outcomes = _fault_run(tmp_path, "stop")
    assert outcomes[0] == outcomes[1]
    assert outcomes[0].startswith("NonFiniteError: loss is nan on rank 1 at step 2"), outcomes
    assert ("non-finite amax in low-bit layers (where it entered first): rank 1: "
            "'layers.1.feed_forward.w2' first, then 13 more: layers.1.feed_forward.w3, "
            "layers.1.feed_forward.w1, layers.1.attention.wo, ...") in outcomes[0]
    assert "rank 0" not in outcomes[0].split("non-finite amax")[1]
    assert [r["step"] for r in logged(tmp_path)] == [1]


def test_skip_logs_the_layer_and_training_goes_on(tmp_path):
    assert _fault_run(tmp_path, "skip") == ["finished", "finished"]
    records = logged(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[1]["skipped"] is True
    assert "rank 1: 'layers.1.feed_forward.w2' first" in records[1]["nonfinite"]
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 1)


def test_the_fault_names_a_module_of_the_model(tmp_path):
    from shardwise.train.faults import FaultPlan, parse_faults

    plan = FaultPlan(parse_faults("inf:phase=input:module=layers.9.attention.wq"), 0, 4)
    with pytest.raises(ValueError, match="module 'layers.9.attention.wq' is not a module"):
        plan.arm(_model())


def _syncs(cfg, data) -> int:
    from test_host_syncs import _count_syncs

    return _count_syncs(cfg, data)


def test_low_bit_steps_add_no_host_sync(tmp_path):
    counts = {}
    for matmul in ("bf16", "fp8_tensorwise"):
        for steps in (2, 5):
            cfg = load_config(None, {**TINY, "precision.matmul": matmul,
                                     "train.steps": str(steps), "train.eval_batches": "1",
                                     "log.dir": str(tmp_path / f"{matmul}-{steps}")})
            cfg, data = preflight(cfg, world_size=2)
            counts[(matmul, steps)] = max(run_ranks(_syncs, 2, args=(cfg, data),
                                                    timeout_s=180))
    per_step = {m: (counts[(m, 5)] - counts[(m, 2)]) / 3 for m in ("bf16", "fp8_tensorwise")}
    assert per_step["bf16"] >= 1  # the counter sees the step's statistics read
    assert per_step["fp8_tensorwise"] == per_step["bf16"], (per_step, counts)


# ----------------------------------------------------------------------------- skip, report


def test_the_start_lines_list_what_stays_high_precision(tmp_path, capfd):
    # 2 key/value heads: wk and wv have 64 output features, which 128-wide blocks do not take
    code = main(["train", *CLI, "--nproc", "1", "--model.n_kv_heads", "2", "--train.steps",
                 "1", "--precision.matmul", "fp8_blockwise", "--precision.matmul_skip",
                 "layers.1.feed_forward.*", "--log.dir", str(tmp_path)])
    out = capfd.readouterr().out
    assert code == 0, out
    assert ("low precision fp8_blockwise: 7 layers converted, 7 kept in high precision\n"
            "  layers.0.attention.wk: fp8_blockwise needs features divisible by 128: "
            "out_features 64\n"
            "  layers.0.attention.wv: fp8_blockwise needs features divisible by 128: "
            "out_features 64\n") in out
    assert "  layers.1.feed_forward.w2: matches skip pattern 'layers.1.feed_forward.*'" in out


def test_skipping_every_block_is_bitwise_the_high_precision_run(tmp_path):
    runs = {}
    for name, over in (("bf16", {}),
                       ("all_skipped", {"precision.matmul": "mxfp8",
                                        "precision.matmul_skip": "layers.*"}),
                       ("one_skipped", {"precision.matmul": "mxfp8",
                                        "precision.matmul_skip": "layers.1.*"})):
        cfg = load_config(None, {**TINY, "train.steps": "2", "log.dir": str(tmp_path / name),
                                 **over})
        runs[name] = preflight(cfg, world_size=1)
    from shardwise.testing.trainer import train_runs

    run_ranks(train_runs, 1, args=(list(runs.values()),), timeout_s=180)
    loss = {name: [r["loss"] for r in logged(tmp_path / name)] for name in runs}
    assert loss["all_skipped"] == loss["bf16"]
    assert loss["one_skipped"] != loss["bf16"]


def test_skip_patterns_in_the_python_api():
    model = shardwise.apply_low_precision(_model(), "fp8_tensorwise",
                                          skip=["*.attention.*", "layers.1.feed_forward.w2"])
    report = shardwise.low_precision_report(model)
    assert report.converted == ["layers.0.feed_forward.w1", "layers.0.feed_forward.w2",
                                "layers.0.feed_forward.w3", "layers.1.feed_forward.w1",
                                "layers.1.feed_forward.w3"]
    assert report.skipped["layers.0.attention.wq"] == "matches skip pattern '*.attention.*'"
    assert [n for n, _, _ in lowbit_modules(model)] == report.converted
    with pytest.raises(ValueError, match="skip must be an iterable of name patterns, got "
                                         "'layers.*'"):
        shardwise.apply_low_precision(_model(), "mxfp8", skip="layers.*")


# ----------------------------------------------------------------------------- recompute


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_selective_recompute_of_low_bit_blocks_gives_the_same_gradients(recipe):
    plain = _model(recipe)
    checked = shardwise.checkpoint_activations(copy.deepcopy(plain), "selective",
                                               blocks=TransformerBlock)
    for model in (plain, checked):
        for step in range(2):  # the second step starts with the flags set
            _lm_loss(model, _tokens(step)).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checked.named_parameters()):
        assert torch.equal(a.grad, b.grad), (recipe, name)


# ----------------------------------------------------------------------------- Hugging Face


def _hf(kind: str):
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=256, vocab_size=256,
                  max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **common, num_local_experts=4, num_experts_per_tok=2))


def _hf_train(model, steps: int = 4) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = _tokens()
    losses = []
    for _ in range(steps):
        out = model(tokens[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_a_hugging_face_decoder_converts_and_trains(kind):
    reference = _hf_train(_hf(kind))
    model = shardwise.apply_low_precision(_hf(kind), "fp8_rowwise")
    report = shardwise.low_precision_report(model)
    mlp = (["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"] if kind == "llama" else [])
    assert report.converted == [f"model.layers.{i}.{p}" for i in range(2) for p in
                                ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                 "self_attn.o_proj", *mlp]]
    if kind == "mixtral":  # the router stays, unlisted; the stacked experts are listed
        assert list(report.skipped) == ["model.layers.0.mlp.experts",
                                        "model.layers.1.mlp.experts"]
        assert "no low-bit forward" in report.skipped["model.layers.0.mlp.experts"]
    else:
        assert report.skipped == {}
    converted = {n for n, _, _ in lowbit_modules(model)}
    assert "lm_head" not in converted and not any("gate." in n or n.endswith(".gate")
                                                  for n in converted)
    assert type(model.lm_head) is torch.nn.Linear
    losses = _hf_train(model)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5, losses
    assert losses[0] == pytest.approx(reference[0], rel=1e-2)  # low-bit, not garbage
    assert losses != reference
    assert {p.dtype for p in model.parameters()} == {torch.float32}
