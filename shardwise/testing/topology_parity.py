"""Train the topology subjects sharded, with DDP and in one process: the prefetch-parity grid.

Shared by ``tests/test_shard_topologies.py`` and ``bench/prefetch_parity.py``. A *subject*
is a model by name: ``fuzz-<seed>`` (:class:`~shardwise.testing.topologies.TopologyModel`
of that seed), ``two-tower``, or ``hf-clip`` (a Hugging Face CLIP built from a config;
needs ``transformers``). A *layout* is ``"ddp"`` or ``(stage, reshard_after_forward,
prefetch)``. Every run is SGD with momentum for :data:`STEPS` steps on a global batch of
:data:`GLOBAL_BATCH` pairs split evenly over the ranks; the reference is one process whose
loss is the mean of the ranks' losses, as data parallelism defines it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise
from shardwise.testing.topologies import Block, Pair, TopologyModel

__all__ = ["STEPS", "GLOBAL_BATCH", "LAYOUTS", "build", "batch", "reference", "train",
           "grid", "has_transformers", "weight_err"]

STEPS, GLOBAL_BATCH = 4, 12          # 12 pairs divide among 2 and 3 ranks
LAYOUTS = [(1, True), (2, True), (3, True), (3, False)]   # (stage, reshard_after_forward)


def weight_err(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
               floor: float = 1e-2) -> tuple[float, str]:
    """The largest per-tensor ``max |w - w_ref| / max(max |w_ref|, floor)`` and its key.

    The floor keeps tensors that stay near zero (a key projection's bias, whose gradient is
    zero in exact arithmetic) from turning rounding noise into huge relative errors; 1e-2 is
    below the scale of any trained weight here.
    """
    worst = (0.0, "")
    for k, r in ref.items():
        scale = max(r.abs().max().item() if r.numel() else 0.0, floor)
        diff = (state[k].double() - r.double()).abs().max().item() if r.numel() else 0.0
        worst = max(worst, (diff / scale, k))
    return worst


def has_transformers() -> bool:
    """Whether Hugging Face ``transformers`` is importable (for the ``hf-clip`` subject)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _clip():
    from transformers import CLIPConfig, CLIPModel
    from transformers.models.clip.modeling_clip import CLIPEncoderLayer
    layer = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4)
    cfg = CLIPConfig(text_config=dict(vocab_size=50, max_position_embeddings=16, bos_token_id=0,
                                      eos_token_id=1, pad_token_id=1, **layer),
                     vision_config=dict(image_size=16, patch_size=8, **layer), projection_dim=16)
    torch.manual_seed(0)
    return CLIPModel(cfg), {CLIPEncoderLayer}


def build(subject: str):
    """(model, wrap classes) of a subject, identical on every call."""
    if subject == "hf-clip":
        return _clip()
    seed = None if subject == "two-tower" else int(subject.split("-")[1])
    return TopologyModel(seed), {Block, Pair}


def batch(subject: str, step: int) -> tuple[torch.Tensor, ...]:
    """The global batch of ``step`` (dim 0 = pairs)."""
    g = torch.Generator().manual_seed(1000 + step)
    if subject == "hf-clip":
        return (torch.randint(2, 50, (GLOBAL_BATCH, 8), generator=g),
                torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=g))
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)


def loss_of(subject: str, model, step: int, tensors) -> torch.Tensor:
    inner = getattr(model, "module", model)
    if subject == "hf-clip":
        return model(input_ids=tensors[0], pixel_values=tensors[1], return_loss=True).loss
    inner.step = step
    return model(*tensors)


def _zero_missing(params) -> None:
    for p in params:  # the engine's semantics: an unused parameter gets a zero gradient
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def _slices(subject, step, rank, world):
    per = GLOBAL_BATCH // world
    return [t[rank * per:(rank + 1) * per] for t in batch(subject, step)]


def reference(subject: str, world: int) -> dict[str, torch.Tensor]:
    """One process, the same global batch: the mean of the ``world`` shards' losses."""
    model, _ = build(subject)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        loss = sum(loss_of(subject, model, step, _slices(subject, step, r, world))
                   for r in range(world)) / world
        loss.backward()
        _zero_missing(model.parameters())
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(subject: str, layout) -> dict[str, torch.Tensor]:
    """Train ``subject`` in ``layout`` on the current ranks; the full weights (rank 0)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, wrap = build(subject)
    if layout == "ddp":
        run = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    else:
        stage, raf, prefetch = layout
        run = shardwise.shard(model, stage=stage, wrap=wrap, prefetch=prefetch,
                              reshard_after_forward=raf)
    opt = torch.optim.SGD(run.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        loss_of(subject, run, step, _slices(subject, step, rank, world)).backward()
        if layout == "ddp":
            _zero_missing(model.parameters())
        opt.step()
        opt.zero_grad()
    if layout == "ddp":
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return shardwise.full_state_dict(model, rank0_only=True)


def grid(subjects: list[str]) -> dict:
    """Every layout of every subject on the current ranks; rank 0 returns the weights."""
    out = {}
    for subject in subjects:
        out[(subject, "ddp")] = train(subject, "ddp")
        for stage, raf in LAYOUTS:
            for prefetch in (0, 1, 2):
                out[(subject, (stage, raf, prefetch))] = train(subject, (stage, raf, prefetch))
    return out if dist.get_rank() == 0 else {}
