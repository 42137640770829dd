"""``apply_cp``: give a model's attention layers context parallelism, in place."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.distributed.parallel_dims import ParallelMesh
from shardwise.models.layers import RotaryEmbedding
from shardwise.models.llama import Attention
from shardwise.models.mla import LatentAttention
from shardwise.parallel.context.hf import check_hf_model, install_hf, is_hf_model
from shardwise.parallel.context.layout import LOAD_BALANCES
from shardwise.parallel.context.ops import cp_attention, register
from shardwise.parallel.context.runtime import CP_IMPLS, ContextParallel
from shardwise.shard.registry import engine_states

__all__ = ["apply_cp", "cp_context", "share_cp_context", "ulysses_degree"]

_CTX_ATTR = "_shardwise_cp_context"


class _Attend:
    """What an attention layer calls instead of its one-process attention."""

    __slots__ = ("runtime",)

    def __init__(self, runtime: ContextParallel) -> None:
        self.runtime = runtime

    def __call__(self, q, k, v, documents=None):
        return cp_attention(self.runtime, q, k, v, documents)


def _cp_ranks(cp_mesh) -> tuple[tuple[int, ...], object]:
    if isinstance(cp_mesh, ParallelMesh):
        return tuple(cp_mesh.ranks("cp")), cp_mesh.group("cp")
    if isinstance(cp_mesh, DeviceMesh) and cp_mesh.ndim == 1:
        return tuple(int(r) for r in cp_mesh.mesh.tolist()), cp_mesh.get_group()
    raise ValueError(f"cp_mesh must be a 1-D DeviceMesh (e.g. ParallelMesh['cp']), got "
                     f"{cp_mesh!r}")


def _kv_heads(model: nn.Module, tp: int) -> int | None:
    cfg = getattr(model, "config", None)
    kv = getattr(cfg, "n_kv_heads", None) or getattr(cfg, "num_key_value_heads", None)
    if kv is None:
        kv = getattr(cfg, "n_heads", None) or getattr(cfg, "num_attention_heads", None)
    return None if kv is None else max(kv // tp, 1)


def ulysses_degree(impl: str, cp: int, kv_heads: int) -> int:
    """The all-to-all degree of ``impl`` at ``cp``: 1 for ring, ``cp`` for ulysses, and for
    hybrid the largest proper divisor of ``cp`` that divides ``kv_heads`` (at least 2).

    Raises:
        ValueError: ulysses with ``cp`` not dividing the key/value heads, hybrid with no
            such divisor; each names the numbers.
    """
    if impl == "ring":
        return 1
    if impl == "ulysses":
        if kv_heads % cp:
            raise ValueError(f"cp_impl='ulysses' at cp={cp} needs the key/value heads "
                             f"({kv_heads} per tensor rank) to divide by {cp}: each rank "
                             f"takes whole heads; use cp_impl='ring' or 'hybrid'")
        return cp
    degrees = [d for d in range(2, cp) if cp % d == 0 and kv_heads % d == 0]
    if not degrees:
        raise ValueError(f"cp_impl='hybrid' at cp={cp} needs a degree d with 1 < d < {cp} "
                         f"dividing both cp and the key/value heads ({kv_heads} per tensor "
                         f"rank); none does: use cp_impl='ring' or 'ulysses'")
    return max(degrees)


def _subgroup(ranks: tuple[int, ...], cp_ranks: tuple[int, ...], cp_group) -> object:
    if ranks == cp_ranks:
        return cp_group
    if len(ranks) == 1:
        return None
    # Only the members create it: other cp groups build theirs at the same time.
    return dist.new_group(list(ranks), use_local_synchronization=True)


def apply_cp(model: nn.Module, cp_mesh, impl: str = "ring", load_balance: str = "zigzag",
             *, ulysses: int | None = None) -> nn.Module:
    """Context-parallelise ``model``'s attention over ``cp_mesh``, in place.

    Every rank of the cp group then runs the model on its part of each sequence
    (:meth:`ContextParallel.shard`, in the ``load_balance`` layout): token-wise layers need
    nothing, RoPE uses each token's global position, and attention sees the whole sequence
    through ``impl`` (docs/parallelism.md, "Context parallelism"). Parameters stay
    replicated over cp: shard or replicate the model over ``dp_shard_cp`` (cp ranks average
    gradients like data ranks). Apply after ``apply_tp`` / ``apply_ep`` and before
    activation checkpointing, compile and ``shard``.

    Packed documents: call the model with ``positions=`` (this rank's part of the
    per-token position ids; a document starts where they do not continue) and each
    document attends only to itself, with RoPE at those positions.

    Args:
        model: a shardwise ``Transformer`` (grouped-query attention), on meta or real, or
            a Hugging Face decoder (a transformers ``PreTrainedModel``: Llama, Qwen2,
            Mistral, ...; see :mod:`shardwise.parallel.context.hf`, which also covers its
            packed documents, HF's ``position_ids``).
        cp_mesh: the 1-D context-parallel DeviceMesh (``mesh["cp"]`` of a ParallelMesh;
            the ParallelMesh itself is accepted).
        impl: ``"ring"`` (key/value blocks around the ranks), ``"ulysses"`` (all-to-all
            from sequence to head shards; the degree must divide the key/value heads) or
            ``"hybrid"`` (all-to-all inside groups of consecutive ranks, ring across them).
        load_balance: ``"zigzag"`` (rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``:
            equal work under the causal mask) or ``"none"`` (contiguous pieces).
        ulysses: hybrid's all-to-all degree (default: :func:`ulysses_degree`).

    Returns:
        ``model``.

    Raises:
        ValueError: a model already sharded or context-parallel, a bad mesh, impl,
            load_balance or degree, a model that is neither of the above (naming its
            type), or attention that context parallelism does not cover (multi-head
            latent attention; for Hugging Face models see :func:`check_hf_model`).
    """
    ranks, group = _cp_ranks(cp_mesh)
    if impl not in CP_IMPLS:
        raise ValueError(f"apply_cp: impl={impl!r}, expected one of {CP_IMPLS}")
    if load_balance not in LOAD_BALANCES:
        raise ValueError(f"apply_cp: load_balance={load_balance!r}, expected one of "
                         f"{LOAD_BALANCES}")
    if engine_states(model):
        raise ValueError(f"{type(model).__name__} is already sharded: apply_cp goes before "
                         f"shardwise.shard")
    if hasattr(model, _CTX_ATTR):
        raise ValueError(f"{type(model).__name__} is already context-parallel; apply_cp once")
    latent = [n for n, m in model.named_modules() if isinstance(m, LatentAttention)]
    if latent:
        raise ValueError(f"apply_cp: multi-head latent attention ({latent[0]}) is not "
                         f"covered by context parallelism; use attention='gqa'")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    hf = not layers and is_hf_model(model)
    if hf:
        check_hf_model(model)
    elif not layers:
        raise ValueError(f"apply_cp: {type(model).__name__} is neither a shardwise "
                         f"Transformer (it has no shardwise Attention module) nor a Hugging "
                         f"Face PreTrainedModel; context parallelism has nothing to "
                         f"parallelise")
    from shardwise.parallel.tensor import tp_context
    tp = tp_context(model)
    kv = _kv_heads(model, tp.tp.size if tp is not None else 1)
    cp = len(ranks)
    if ulysses is None:
        ulysses = ulysses_degree(impl, cp, kv if kv is not None else cp)
    elif impl != "hybrid" or cp % ulysses or not 1 < ulysses < cp:
        raise ValueError(f"apply_cp: ulysses={ulysses} applies to impl='hybrid' only and "
                         f"must be a proper divisor of cp={cp} above 1")
    me = ranks.index(dist.get_rank()) if dist.is_initialized() else 0
    inner = me // ulysses
    a2a_ranks = tuple(ranks[inner * ulysses:(inner + 1) * ulysses])
    ring_ranks = tuple(ranks[o * ulysses + me % ulysses] for o in range(cp // ulysses))
    runtime = register(ContextParallel(
        impl, load_balance, ranks, group,
        ring_ranks, _subgroup(ring_ranks, ranks, group),
        a2a_ranks, _subgroup(a2a_ranks, ranks, group)))
    if hf:
        install_hf(model, runtime)
        setattr(model, _CTX_ATTR, runtime)
        return model
    attend = _Attend(runtime)
    for layer in layers:
        layer.context_parallel = attend
    for rope in model.modules():
        if isinstance(rope, RotaryEmbedding):
            rope.context_parallel = runtime
    model.register_forward_pre_hook(_documents_hook(runtime), with_kwargs=True)
    setattr(model, _CTX_ATTR, runtime)
    return model


def _documents_hook(runtime: ContextParallel):
    """Packed documents: the whole sequence's document ids from every rank's positions
    (one all-gather per forward, not per layer), handed to the layers as ``documents``."""

    def hook(module, args, kwargs):
        positions = kwargs.get("positions")
        if positions is None or kwargs.get("documents") is not None:
            return None
        return args, {**kwargs, "documents": runtime.documents(positions)}

    return hook


def cp_context(model: nn.Module) -> ContextParallel | None:
    """What :func:`apply_cp` gave ``model`` (None when it is not context-parallel)."""
    return getattr(model, _CTX_ATTR, None)


def share_cp_context(model: nn.Module, part: nn.Module) -> None:
    """Let ``part`` (a piece of ``model`` run on its own, e.g. a pipeline rank's stages)
    answer :func:`cp_context` as ``model`` does; a no-op when it is not context-parallel."""
    ctx = cp_context(model)
    if ctx is not None:
        setattr(part, _CTX_ATTR, ctx)
