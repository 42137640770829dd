"""PyTorch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``)
on CPU ranks, for bench/cp_bench.py: the call as shipped, and a labelled shim that lets the
same ring algorithm run on ATen's CPU flash kernels.

[Note: torch context parallel on CPU] ``context_parallel(mesh, buffers=...)`` shards the
buffers in place (head-tail load balancing, the same layout as shardwise's zigzag, when
the length divides by ``2 cp``), patches ``F.scaled_dot_product_attention`` to wrap q, k, v
as DTensors sharded on the sequence dim, and turns on DTensor handlers that run the ring
(``_templated_ring_attention``, key/value rotated by all-gather or all-to-all,
``set_rotate_method``) for exactly six ATen ops: ``_scaled_dot_product_{flash,efficient,
cudnn}_attention`` and their backwards, all CUDA kernels. On the CPU,
``scaled_dot_product_attention`` picks ``_scaled_dot_product_flash_attention_for_cpu``,
which has neither a handler nor a DTensor sharding strategy, so the first attention raises
``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default
does not have a sharding strategy registered.`` (forcing the math backend fails earlier:
its causal mask is a plain tensor added to DTensor scores). :func:`probe_as_shipped`
records these errors. :func:`install_cpu_shim` adds the missing two entries: a Shard(2)
sharding strategy for the CPU op pair and a handler that calls torch's own
``_templated_ring_attention`` / ``_templated_ring_attention_backward`` with the CPU
kernels. Everything else (buffer sharding, load balancer, rotation, merge, DTensor
dispatch) is torch's code unchanged; the shim is ~50 lines of glue, and the rows it enables
are labelled "torch (CPU shim)".
"""

from __future__ import annotations

import contextlib
import traceback

import torch
import torch.nn.functional as F

__all__ = ["probe_as_shipped", "install_cpu_shim", "cp_region", "torch_cp_step", "set_rotate"]

_INSTALLED = False


def _cp_module():
    from torch.distributed.tensor.experimental._context_parallel import _attention
    return _attention


def set_rotate(method: str) -> None:
    """torch's key/value rotation: ``"allgather"`` (its default) or ``"alltoall"``."""
    from torch.distributed.tensor.experimental import _attention as public
    public.set_rotate_method(method)


@contextlib.contextmanager
def cp_region(model, mesh, x, y):
    """torch's context manager over the tokens, labels and the RoPE tables (sharded in
    place; the tables are restored on exit, the tokens and labels are not)."""
    from torch.distributed.tensor.experimental import context_parallel
    with context_parallel(mesh, buffers=[x, y, model.rope.cos, model.rope.sin],
                          buffer_seq_dims=[1, 1, 0, 0], no_restore_buffers={x, y}):
        yield


def torch_cp_step(model, mesh, x, y) -> torch.Tensor:
    """Forward + loss + backward of the whole sequences ``x``, ``y`` (cloned: the context
    shards them in place) under torch's context parallelism; the loss of this rank's part.

    The model's ``max_seq_len`` must equal the sequence length: the RoPE tables are sharded
    like the tokens and the model reads the first ``T / cp`` rows of its shard."""
    x, y = x.clone(), y.clone()
    with cp_region(model, mesh, x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
    return loss.detach()


def probe_as_shipped(model, mesh, x, y) -> dict[str, str]:
    """One forward + backward under torch's ``context_parallel`` as shipped, with the
    default SDPA backend choice and with the math backend forced; per attempt, "ok" or the
    exception's last line and the frame that raised it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out = {}
    for name, backend in (("default backend (CPU flash)", None), ("math backend", SDPBackend.MATH)):
        ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
        try:
            with ctx:
                torch_cp_step(model, mesh, x, y)
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the error is the finding
            frames = traceback.extract_tb(exc.__traceback__)
            where = frames[-1]
            out[name] = (f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]} "
                         f"(raised in {where.filename.split('site-packages/')[-1]}:"
                         f"{where.lineno}, {where.name})")
        model.zero_grad(set_to_none=True)
    return out


def install_cpu_shim() -> None:
    """Let torch's context-parallel SDPA dispatch the CPU flash kernels (see [Note: torch
    context parallel on CPU]); idempotent."""
    global _INSTALLED
    if _INSTALLED:
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._ops.utils import (expand_to_full_mesh_op_strategy,
                                                     register_op_strategy)
    from torch.distributed.tensor.placement_types import Shard
    attn = _cp_module()
    aten = torch.ops.aten
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    @register_op_strategy(fwd)
    def _fwd_strategy(op_schema):
        # outputs (out, logsumexp), inputs (q, k, v): all sharded on the sequence dim
        mesh = op_schema.get_mesh_from_args()
        return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(2)] * 5],
                                               input_index=2)

    @register_op_strategy(bwd)
    def _bwd_strategy(op_schema):
        # outputs (dq, dk, dv), inputs (dout, q, k, v, out, logsumexp)
        mesh = op_schema.get_mesh_from_args(validate=False)
        return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(2)] * 9],
                                               input_index=3)

    def _ring_fwd(mesh, query, key, value, dropout_p=0.0, is_causal=False, *,
                  attn_mask=None, scale=None):
        assert attn_mask is None, "the shim covers is_causal attention without a mask"
        return attn._templated_ring_attention(mesh.get_group(), 2, fwd, query=query, key=key,
                                              value=value, is_causal=is_causal,
                                              dropout_p=dropout_p, scale=scale)

    def _ring_bwd(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                  attn_mask=None, scale=None):
        assert attn_mask is None, "the shim covers is_causal attention without a mask"
        return attn._templated_ring_attention_backward(
            mesh.get_group(), 2, bwd, grad_out=grad_out, grad_out_name="grad_out",
            query=query, key=key, value=value, out=out, logsumexp=logsumexp,
            is_causal=is_causal, dropout_p=dropout_p, scale=scale)

    local = {fwd: _ring_fwd, bwd: _ring_bwd}

    def _handler(op_call, args, kwargs):
        # torch's _sdpa_handler, with the CPU ops in its call map
        info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        DTensor._op_dispatcher.sharding_propagator.propagate(info)
        sharding = info.output_sharding
        assert sharding is not None and not sharding.needs_redistribute
        results = local[op_call](info.compute_mesh, *info.local_args, **info.local_kwargs)
        return DTensor._op_dispatcher.wrap(results, sharding.output_spec)

    attn.custom_ops[fwd] = _handler
    attn.custom_ops[bwd] = _handler
    _INSTALLED = True
