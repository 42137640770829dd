"""Checkpoints reshard across expert-parallel degrees, exactly (issue 13).

* The reshard matrix: model (with moved DeepSeek-V3 biases) and AdamW state saved at ep 4
  x ZeRO stage 3 on 4 ranks load bitwise at ep 2 stage 1 (4 ranks) and at ep 1 stage 3
  (2 ranks); trained at ep 2 and saved again, they load bitwise at ep 4 stage 2.
* ``state_dict()`` holds the unsplit names and shapes; an expert weight is a DTensor over
  the sub-mesh its placement names (``ep``, then ``edp`` when it has more than one rank).
* ``full_state_dict`` at ep 4 equals the unsplit model's state dict.
* Hugging Face safetensors in the Mixtral layout exported from an ep 4 and an ep 2
  checkpoint are byte-identical to the export from an ep 1 one, and import into an ep 2
  model exactly (each rank reading only its experts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardwise
from shardwise.checkpoint.export import export_safetensors
from shardwise.models import (MoESettings, TransformerBlock, build_model, configure_moe,
                              finish_moe_step, get_model_config, moe_aux_loss)
from shardwise.parallel import apply_global_balance
from shardwise.testing import run_ranks
from shardwise.testing.reshard import (assert_same_files, assert_same_states, import_whole,
                                       load_train_save, save_fresh, save_trained)

SMALL = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
             moe_ffn_dim=48)
EXPERT = "layers.1.feed_forward.experts.w1"


def _build(seed: int, ep: int, stage: int, balance: str = "bias"):
    torch.set_num_threads(1)
    model = build_model(get_model_config("debug-moe", **SMALL), seed=seed)
    configure_moe(model, MoESettings(balance=balance, bias_update_rate=0.01))
    mesh = shardwise.ParallelDims(world_size=dist.get_world_size(), ep=ep).build_mesh()
    if ep > 1:
        shardwise.apply_ep(model, mesh)
    shardwise.shard(model, stage=stage, wrap={TransformerBlock}, mesh=mesh)
    apply_global_balance(model, mesh.group("dp"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, mesh


def _train(model, opt, mesh, steps: int) -> None:
    gen = torch.Generator().manual_seed(7 + mesh.local_rank("dp"))
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 9), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        (loss + moe_aux_loss(model)).backward()
        opt.step()
        opt.zero_grad()
        finish_moe_step(model)


def _build_aux(seed: int, ep: int, stage: int):
    """Zero biases: Mixtral routing (what the HF export holds) has none."""
    return _build(seed, ep, stage, balance="aux")


def _layout(model):
    """The state dict's shapes and an expert weight's DTensor layout."""
    sd = model.state_dict()
    w = sd[EXPERT]
    return ({k: tuple(v.shape) for k, v in sd.items()},
            (isinstance(w, DTensor), w.device_mesh.mesh_dim_names,
             tuple((type(p).__name__, getattr(p, "dim", None)) for p in w.placements)))


def test_reshard_matrix_across_expert_parallel_degrees(tmp_path):
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    want, (shapes, layout) = run_ranks(save_trained, 4,
                                       args=(_build, _train, first, 4, 3, 2, _layout))[0]
    unsplit = build_model(get_model_config("debug-moe", **SMALL), seed=0).state_dict()
    assert shapes == {k: tuple(v.shape) for k, v in unsplit.items()}
    assert layout == (True, ("ep",), (("Shard", 0),))  # edp has one rank at ep 4 on 4
    assert any(v.any() for k, v in want[0].items() if k.endswith("expert_bias"))
    out = run_ranks(load_train_save, 4, args=(_build, _train, first, 2, 1, second))
    for got, resharded, _ in out:
        assert_same_states(got, want, "ep2 stage1")
        assert resharded
    for got, resharded, _ in run_ranks(load_train_save, 2,
                                       args=(_build, _train, first, 1, 3, None)):
        assert_same_states(got, want, "ep1 stage3 on 2 ranks")
        assert resharded
    trained = out[0][2]
    for got, resharded, _ in run_ranks(load_train_save, 4,
                                       args=(_build, _train, second, 4, 2, None)):
        assert_same_states(got, trained, "ep4 stage2")
        assert resharded


def _full_and_layout(ep: int):
    model, _, _ = _build(0, ep, 3)
    w = model.state_dict()[EXPERT]
    return shardwise.full_state_dict(model), w.device_mesh.mesh_dim_names


def test_full_state_dict_and_mixtral_export_equal_the_unsplit_model(tmp_path):
    unsplit = build_model(get_model_config("debug-moe", **SMALL), seed=0).state_dict()
    for full, names in run_ranks(_full_and_layout, 4, args=(2,)):
        assert names == ("ep", "edp")  # ep 2 x edp 2: experts split, then ZeRO rows
        assert full.keys() == unsplit.keys()
        assert all(torch.equal(full[k], unsplit[k]) for k in unsplit)
    exports = {}
    for ep, world in ((1, 2), (2, 2), (4, 4)):
        ckpt = tmp_path / f"ep{ep}"
        run_ranks(save_fresh, world, args=(_build_aux, str(ckpt), ep, 1))
        exports[ep] = tmp_path / f"hf{ep}"
        export_safetensors(ckpt, exports[ep])
    assert "config.json" in assert_same_files(exports)
    for full in run_ranks(import_whole, 4, args=(_build_aux, str(exports[4]), 2)):
        assert all(torch.equal(full[k], unsplit[k]) for k in unsplit), "import at ep 2"
