"""Host tensors handed to accelerator-only (NCCL) groups, caught on the CPU.

The first H100 run stopped at start: the doctor's exchange built its tensors on the host and
handed them to the default NCCL group. :func:`shardwise.testing.device_audit` replays a job
as if on GPUs ([Note: device audit]); here the real trainer (doctor, engine, metrics, step
guard) runs 2 steps at 2 ranks under it, in a few layouts, and the audit itself is shown to
refuse what NCCL refuses and to accept what NCCL accepts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from shardwise.distributed import comm
from shardwise.distributed import env as dist_env
from shardwise.testing.device_audit import ACCELERATOR, device_audit
from shardwise.testing.dist import run_ranks
from shardwise.train.config import load_config
from shardwise.train.doctor import check_ranks
from shardwise.train.preflight import preflight
from shardwise.train.trainer import build_env, train

TINY = {"model.dim": "32", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
        "data.seq_len": "32", "train.batch_size": "4", "train.eval_batches": "1",
        "data.max_bytes": "200000", "log.progress": "false", "log.plot": "false",
        "train.steps": "2"}
LAYOUTS = {
    "stage3": {"parallel.stage": "3"},
    "stage2_bf16_clip_eval": {"parallel.stage": "2", "precision.param_dtype": "bf16",
                              "train.eval_interval": "2"},
    "stage1_checkpoint": {"parallel.stage": "1", "checkpoint.interval": "2",
                          "checkpoint.async_save": "true"},
    "fp16_loss_scale": {"parallel.stage": "2", "precision.param_dtype": "fp16"},
    "pp2": {"parallel.pp": "2", "parallel.pp_microbatches": "2"},
    "moe_ep2": {"model.name": "debug-moe", "model.num_experts": "4", "model.moe_ffn_dim": "32",
                "parallel.ep": "2"},
    "lowbit_watchdog": {"parallel.stage": "3", "precision.matmul": "fp8_rowwise",
                        "parallel.watchdog": "debug"},
}


def _unit_cases() -> dict[str, str]:
    """What the audit refuses and accepts, one collective each."""
    out = {}
    with device_audit() as audit:
        for name, make in (("host", lambda: torch.zeros(2)),
                           ("host_copy", lambda: torch.zeros(2, device=ACCELERATOR).cpu()),
                           ("group_device", lambda: torch.zeros(2, device=comm.group_device())),
                           ("derived", lambda: torch.ones(2).to(ACCELERATOR) * 2),
                           ("tensor_on_device", lambda: torch.tensor([1.0, 2.0],
                                                                     device=ACCELERATOR))):
            try:
                comm.all_reduce(make(), label=f"audit.{name}")
                out[name] = "ok"
            except RuntimeError as exc:
                out[name] = str(exc)
        gloo = dist.new_group(backend="gloo")
        comm.all_reduce(torch.zeros(2), gloo, label="audit.host_on_gloo")
        out["host_on_gloo"] = f"ok {audit.checked}"
    return out


def _train_audited(runs: dict) -> dict:
    """The unit cases, then each layout's trainer (doctor first, as the launcher does)."""
    results = {"units": _unit_cases()}
    real_init = dist_env.init

    def init(*args, **kwargs):
        return dataclasses.replace(real_init(*args, **kwargs), device=ACCELERATOR)

    dist_env.init = init
    try:
        for name, (cfg, data) in runs.items():
            try:
                with device_audit() as audit:
                    env = build_env(cfg)
                    check_ranks(cfg, env)
                    train(cfg, data, env)
                    results[name] = audit.checked
            except Exception as exc:
                raise RuntimeError(f"layout {name}: {exc}") from exc
    finally:
        dist_env.init = real_init
    return results


@pytest.fixture(scope="module")
def audited(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("audit")
    runs = {}
    for name, over in LAYOUTS.items():
        cfg = load_config(None, {**TINY, "train.eval_interval": "0", "log.dir": str(root / name),
                                 "checkpoint.dir": str(root / name / "ckpt"), **over})
        runs[name] = preflight(cfg, world_size=2)
    return run_ranks(_train_audited, world_size=2, args=(runs,), timeout_s=240)[0]


def test_the_audit_refuses_host_tensors_on_accelerator_groups(audited):
    units = audited["units"]
    for name in ("host", "host_copy"):
        message = units[name]
        assert "a tensor on the host (" in message and "accelerator only" in message, message
    for name in ("group_device", "derived", "tensor_on_device"):
        assert units[name] == "ok", (name, units[name])
    assert units["host_on_gloo"] == "ok 6"  # an explicit Gloo group takes host tensors


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_trainer_hands_accelerator_groups_device_tensors(audited, layout):
    assert audited[layout] > 10  # it ran, and the collectives were checked
