"""The frameworks under test, each wrapped the way its documentation shows, behind one
small interface: ``fwd_bwd``, ``opt_step`` and ``held_bytes``.

Every framework gets the same model (``build_model(cfg, seed=0)``, built eagerly in fp32
on every rank), the same batches and the same AdamW hyper-parameters (one parameter group,
weight decay on every parameter, no gradient clipping). Settings not named here are each
framework's defaults (DDP's 25 MiB buckets, FSDP2's reshard-after-forward, DeepSpeed's
bucket sizes and ZeRO-3 persistence threshold); :func:`describe` records them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bench.measure import TensorBytes, reachable_tensors

__all__ = ["FRAMEWORKS", "LABELS", "Runner", "build_runner", "describe"]

FRAMEWORKS = ("ddp", "fsdp2", "ds1", "ds2", "ds3", "sw0", "sw1", "sw2", "sw3")
LABELS = {"ddp": "PyTorch DDP", "fsdp2": "PyTorch FSDP2", "ds1": "DeepSpeed ZeRO-1",
          "ds2": "DeepSpeed ZeRO-2", "ds3": "DeepSpeed ZeRO-3",
          "sw0": "shardwise stage 0", "sw1": "shardwise stage 1",
          "sw2": "shardwise stage 2", "sw3": "shardwise stage 3"}


def adamw_kwargs(opt: dict) -> dict:
    kw = {"lr": opt["lr"], "betas": tuple(opt["betas"]), "eps": opt["eps"],
          "weight_decay": opt["weight_decay"]}
    if opt.get("foreach") is not None:
        kw["foreach"] = opt["foreach"]
    return kw


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # logits (B, T, V)


class Runner:
    """One framework around one model: the timed step is ``fwd_bwd`` then ``opt_step``."""

    name = ""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def fwd_bwd(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(self.model(inputs), targets)
        loss.backward()
        return loss

    def opt_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def held_bytes(self) -> tuple[dict[str, int], dict[str, int]]:
        """(bytes per category, bytes per source) of the tensors this rank holds now."""
        tb = TensorBytes()
        for p in self.model.parameters():
            tb.add("params", p, "parameters")
        for p in self.model.parameters():
            tb.add("grads", p.grad, "parameters.grad")
        tb.add_optimizer_state(self.optimizer)
        return tb.by_category, tb.by_source

    def engine_report(self) -> dict | None:
        """The framework's own accounting, where it has one (shardwise)."""
        return None


class DDPRunner(Runner):
    name = "ddp"

    def __init__(self, model, opt):
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model)  # CPU: no device_ids; 25 MiB buckets, grads separate from buckets
        super().__init__(ddp, torch.optim.AdamW(ddp.parameters(), **adamw_kwargs(opt)))


class FSDP2Runner(Runner):
    name = "fsdp2"

    def __init__(self, model, opt):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        super().__init__(model, torch.optim.AdamW(model.parameters(), **adamw_kwargs(opt)))


class ShardwiseRunner(Runner):
    def __init__(self, model, opt, stage: int):
        import shardwise
        from shardwise.models import TransformerBlock
        self.name = f"sw{stage}"
        shardwise.shard(model, stage=stage, wrap={TransformerBlock})
        super().__init__(model, torch.optim.AdamW(model.parameters(), **adamw_kwargs(opt)))

    def engine_report(self) -> dict:
        import shardwise
        return shardwise.memory_report(self.model, self.optimizer).as_dict()


def ds_config(stage: int, micro_batch: int, opt: dict) -> dict:
    params = {"torch_adam": True, **adamw_kwargs(opt)}
    params["betas"] = list(params["betas"])
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": params},
            "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
            "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


def _ds_category(attr: str) -> str:
    a = attr.lower()
    if any(s in a for s in ("ipg", "bucket", "temp", "offload", "swap")):
        return "other"
    if "fp32" in a:
        return "optimizer"  # fp32 master partitions: optimizer-held copies of the params
    if "grad" in a:
        return "grads"
    if any(s in a for s in ("bit16", "fp16", "lp_", "param", "persistent", "partitioned")):
        return "params"
    return "other"


class DeepSpeedRunner(Runner):
    def __init__(self, model, opt, stage: int, micro_batch: int):
        import deepspeed
        self.name = f"ds{stage}"
        deepspeed.init_distributed(dist_backend="gloo")
        self.config = ds_config(stage, micro_batch, opt)
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=self.config)
        super().__init__(engine, optimizer)

    def fwd_bwd(self, inputs, targets):
        loss = loss_fn(self.model(inputs), targets)
        self.model.backward(loss)
        return loss

    def opt_step(self):
        self.model.step()  # optimizer step and zero_grad

    def held_bytes(self):
        tb = TensorBytes()
        params = list(self.model.module.parameters())
        for p in params:
            tb.add("params", getattr(p, "ds_tensor", None), "parameters.ds_tensor")
            tb.add("params", p.data, "parameters")
        for p in params:
            tb.add("grads", p.grad, "parameters.grad")
        zero = self.optimizer  # the ZeRO optimizer; .optimizer is the torch AdamW inside
        tb.add_optimizer_state(zero.optimizer)
        attrs = sorted(vars(zero).items(), key=lambda kv: (_ds_category(kv[0]) == "other",
                                                           kv[0]))
        for attr, value in attrs:
            if attr == "optimizer":
                continue
            ts = reachable_tensors(value)
            tb.add_all(_ds_category(attr), ts, f"zero.{attr}")
            for t in ts:  # fp32 master partitions carry the reduced grads at step time
                tb.add("grads", t.grad, f"zero.{attr}.grad")
        return tb.by_category, tb.by_source


def build_runner(name: str, model: nn.Module, opt: dict, micro_batch: int) -> Runner:
    """Wrap ``model`` with framework ``name`` (one of :data:`FRAMEWORKS`)."""
    if name == "ddp":
        return DDPRunner(model, opt)
    if name == "fsdp2":
        return FSDP2Runner(model, opt)
    if name.startswith("sw"):
        return ShardwiseRunner(model, opt, int(name[2:]))
    if name.startswith("ds"):
        return DeepSpeedRunner(model, opt, int(name[2:]), micro_batch)
    raise ValueError(f"unknown framework {name!r}; expected one of {', '.join(FRAMEWORKS)}")


def describe(opt: dict) -> dict[str, str]:
    """How each framework is set up, for the report."""
    return {
        "ddp": "DistributedDataParallel(model), defaults (bucket_cap_mb=25, "
               "broadcast_buffers=True, gradient_as_bucket_view=False)",
        "fsdp2": "fully_shard(block, mesh) for each TransformerBlock, then fully_shard(model); "
                 "defaults (reshard_after_forward=True, fp32)",
        "ds": f"deepspeed.initialize with {ds_config(0, 0, opt)} (stage and micro batch set "
              f"per row); ZeRO defaults otherwise (stage 3 keeps parameters under "
              f"stage3_param_persistence_threshold=1e5 elements whole on every rank)",
        "sw": "shardwise.shard(model, stage=s, wrap={TransformerBlock}); defaults "
              "(prefetch=1, reshard_after_forward=True, bucket_mb=25)",
        "optimizer": f"torch.optim.AdamW({adamw_kwargs(opt)}) on each framework's parameters",
    }
