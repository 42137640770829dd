"""``apply_tp``: tensor (and sequence) parallelism applied to a model in place, before
``shardwise.shard``.

    mesh = ParallelDims(world_size=4, tp=2).build_mesh()          # tp 2 x dp_shard 2
    model = shardwise.apply_tp(model, mesh["tp"])                 # Megatron TP + SP
    model = shardwise.shard(model, stage=3, wrap={TransformerBlock}, mesh=mesh)
    logits = model(tokens)                                        # (B, T, V / tp)
    loss = shardwise.parallel.vocab_parallel_cross_entropy(logits, targets, mesh["tp"])
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.distributed.parallel_dims import ParallelMesh
from shardwise.distributed.placement import Axis, placement_of
from shardwise.parallel.tensor.layers import TPContext, apply_style, replicate_param
from shardwise.parallel.tensor.plan import default_plan, resolve_plan
from shardwise.shard.registry import attach_tracker, engine_states

__all__ = ["apply_tp", "tp_context", "share_tp_context"]

_CTX_ATTR = "_shardwise_tp_context"


def _tp_axis(tp_mesh) -> Axis:
    if isinstance(tp_mesh, ParallelMesh):
        tp_mesh = tp_mesh["tp"]
    if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be a 1-D DeviceMesh (e.g. ParallelMesh['tp']), got "
                         f"{tp_mesh!r}")
    return Axis("tp", tuple(int(r) for r in tp_mesh.mesh.tolist()), tp_mesh.get_group())


def _heads(model: nn.Module) -> tuple[int | None, int | None]:
    """(query heads, KV heads) from a shardwise or Hugging Face config (None if unknown)."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "decoder", cfg)  # a vision-language-action model: its decoder's
    q = getattr(cfg, "n_heads", None) or getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "n_kv_heads", None) or getattr(cfg, "num_key_value_heads", None) or q
    return q, kv


def _head_dim(model: nn.Module, name: str) -> int | None:
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    hd = getattr(parent, "head_dim", None)
    return hd if isinstance(hd, int) and not isinstance(hd, bool) else None


def _local_kv_groups(model: nn.Module, tp: int) -> None:
    """Hugging Face attention repeats KV heads ``num_key_value_groups`` times; with fewer
    KV heads than tensor ranks each rank holds one KV head for ``q / tp`` query heads."""
    q, kv = _heads(model)
    if q is None:
        return
    groups = (q // tp) // max(kv // tp, 1)
    for m in model.modules():
        if isinstance(getattr(m, "num_key_value_groups", None), int):
            m.num_key_value_groups = groups


def _check_ties(model: nn.Module) -> None:
    """A split parameter registered in a module without a style (a tie the plan broke)."""
    for name, m in model.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            pl = placement_of(p) if p is not None else None
            if pl is not None and any(not a.is_data for _, a in pl.splits) \
                    and not hasattr(m, "_shardwise_tp"):
                raise ValueError(f"parameter {name}.{attr} is split by the plan ("
                                 f"{pl.describe()}) but {name or '<root>'} "
                                 f"({type(m).__name__}) has no style: a tied weight needs a "
                                 f"style in every module that registers it")


def apply_tp(model: nn.Module, tp_mesh, plan: dict[str, str] | None = None,
             sequence_parallel: bool = True, loss_parallel: bool = True) -> nn.Module:
    """Parallelise ``model`` over the tensor ranks of ``tp_mesh``, in place.

    Apply it before :func:`shardwise.shard` (which then shards each rank's pieces over the
    data axes). Every parameter gets a :class:`~shardwise.distributed.placement.Placement`;
    names are unchanged and ``state_dict()`` (once sharded) holds the unsplit tensors as
    DTensors.

    Args:
        model: a shardwise ``Transformer`` or ``VisionLanguageAction`` (its vision tower,
            projector and decoder; ``sequence_parallel=False``), a Hugging Face decoder
            whose config has ``base_model_tp_plan``, or any model with ``plan``; on the meta
            device or real.
        tp_mesh: the 1-D tensor-parallel DeviceMesh (``mesh["tp"]`` of a ParallelMesh; the
            ParallelMesh itself is accepted too).
        plan: ``{"module.glob": style}`` (see :mod:`shardwise.parallel.tensor.plan`);
            default None: the model's built-in plan.
        sequence_parallel: split the activations between tensor-parallel regions along the
            sequence (default True; needs a ``vocab`` embedding in the plan, a style for
            every parameter, and sequence lengths divisible by the degree).
        loss_parallel: the LM head (``colwise_output``) returns vocab-sharded logits ``(B,
            T, V / tp)`` for :func:`vocab_parallel_cross_entropy` (default True); False:
            whole logits, gathered.

    Returns:
        ``model``.

    Raises:
        ValueError: a model already sharded or parallelised, a bad ``tp_mesh`` or plan,
            heads / vocab / widths not divisible by the degree, a Hugging Face plan with
            sequence or loss parallelism (their forward computes positions from the
            embedding's length and their plan gathers the logits), sequence parallelism
            with parameters no style covers.
    """
    axis = _tp_axis(tp_mesh)
    if engine_states(model):
        raise ValueError(f"{type(model).__name__} is already sharded: apply_tp goes before "
                         f"shardwise.shard")
    if hasattr(model, _CTX_ATTR):
        raise ValueError(f"{type(model).__name__} is already tensor-parallel; apply_tp once")
    source = "user"
    if plan is None:
        plan, source = default_plan(model, axis.size)
    if source == "hf" and (sequence_parallel or loss_parallel):
        raise ValueError(f"the Hugging Face plan of {type(model).__name__} supports neither "
                         f"sequence_parallel (its forward derives positions from the "
                         f"embedding's sequence length) nor loss_parallel (its plan gathers "
                         f"the logits); pass sequence_parallel=False, loss_parallel=False")
    if source == "vla" and sequence_parallel:
        raise ValueError(f"the built-in plan of {type(model).__name__} supports no "
                         f"sequence_parallel yet (the image features are written into the "
                         f"whole sequence after the embedding); pass sequence_parallel=False")
    entries = resolve_plan(model, plan)
    styles = {s for _, _, s in entries}
    if sequence_parallel and "vocab" not in styles:
        raise ValueError("sequence_parallel=True needs a vocab-parallel embedding (style "
                         "'vocab') in the plan: it is where the sequence is first split; pass "
                         "sequence_parallel=False")
    if loss_parallel and "colwise_output" not in styles:
        raise ValueError("loss_parallel=True needs an LM head with style 'colwise_output' in "
                         "the plan; pass loss_parallel=False")
    ctx = TPContext(axis, bool(sequence_parallel), bool(loss_parallel))
    q_heads, _ = _heads(model)
    for name, module, style in entries:
        apply_style(name, module, style, ctx, _head_dim(model, name), q_heads)
    _local_kv_groups(model, axis.size)
    loose = [n for n, p in model.named_parameters() if placement_of(p) is None]
    if sequence_parallel and loose:
        raise ValueError(f"with sequence_parallel=True every parameter needs a style (its "
                         f"gradient may be a partial sum over the tensor ranks); none covers "
                         f"{loose[:4]}{' ...' if len(loose) > 4 else ''}")
    for _, p in model.named_parameters():
        if placement_of(p) is None:
            replicate_param(p, ctx, summed=False)
    _check_ties(model)
    model.register_forward_hook(lambda *args: ctx.clear())  # drop the last region's input
    setattr(model, _CTX_ATTR, ctx)
    attach_tracker(model, ctx.tracker)  # memory_report's tp_comm_bytes
    return model


def tp_context(model: nn.Module) -> TPContext | None:
    """The tensor-parallel context of a model passed to :func:`apply_tp` (None otherwise)."""
    return getattr(model, _CTX_ATTR, None)


def share_tp_context(model: nn.Module, part: nn.Module) -> None:
    """Let ``part`` (a piece of ``model`` that is run on its own, e.g. a pipeline rank's
    stages) answer :func:`tp_context` and report the tensor-parallel buffers as ``model``
    does. A no-op when ``model`` is not tensor-parallel."""
    ctx = tp_context(model)
    if ctx is None:
        return
    setattr(part, _CTX_ATTR, ctx)
    attach_tracker(part, ctx.tracker)
