"""A preallocated key/value cache for decoding, attached to a model's attention modules.

[Note: the cache as an attention hook]
Every attention module of the built-in decoders (``Attention``, ``LatentAttention``) has a
``kv_cache`` attribute, None in training. :meth:`KVCache.attach` sets it to a
:class:`LayerCache` per block; the attention then hands its rotated ``q, k, v`` to
``kv_cache.attend`` instead of attending over its own input. The model's modules, weights
and forward stay the training ones: tensor parallelism (fewer local heads), weights
streamed from disk and low-bit weights compose with the cache without knowing of it.

[Note: left padding]
A batch of prompts of different lengths is left-padded to the longest, so every row writes
its next token into the same cache slot: slot ``s`` of row ``b`` holds the token at position
``s - start[b]``, where ``start[b]`` is the row's padding. A query attends to the slots in
``[start[b], its own slot]``. A padding query attends to itself only (its output is never
read, and a row of the mask with no True would give NaN).

[Note: the decode step's mask]
A decode step's query sits in the newest slot, at or after every row's start, so its mask is
only the padding one: ``slot >= start[b]``. That ``(B, 1, 1, max_len)`` mask is built once
per cache and sliced per step; a batch without padding (every start 0) passes no mask at
all, and a prefill of it attends with ``is_causal`` (SDPA's fused path, no mask tensor).
Grouped query heads read their key head through SDPA's ``enable_gqa`` rather than
``repeat_kv`` copies of the whole cache every step (bitwise the same result on CPU, and 3-6x
faster at batch 8). Positions are sliced from a ``(B, max_len)`` table built once.

[Note: a static-shape step]
With ``static=True`` (``Decoder(model, compile=True)``) a decode step has the same shapes at
every position, so ``torch.compile`` traces it once: the new keys and values go into their
slot by ``index_copy_`` at a ``(1,)`` slot tensor (not a Python int, which the compiler would
bake in), and the query attends over all ``max_len`` slots with the mask
``start[b] <= slot' <= slot``; the empty slots are masked out. This is gpt-fast's decode
step. The tokens equal the eager path's; logits agree to float rounding (the softmax sums
over more, masked, terms).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn


__all__ = ["KVCache", "LayerCache", "attention_modules"]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that take a ``kv_cache`` (one per block, in block order).

    Raises:
        ValueError: ``model`` has none (not a built-in decoder).
    """
    found = [m for m in model.modules() if hasattr(type(m), "kv_cache")]
    if not found:
        raise ValueError(f"{type(model).__name__} has no attention module with a kv_cache hook; "
                         f"expected a shardwise Transformer (or a model imported into one with "
                         f"shardwise.checkpoint.export.import_safetensors)")
    return found


class LayerCache:
    """One block's keys and values: ``(B, heads, max_len, dim)`` each, allocated at the first
    :meth:`attend` from the shapes the attention produces (its local heads under tensor
    parallelism, the latent attention's key and value widths)."""

    def __init__(self, owner: "KVCache") -> None:
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def _allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        b, max_len = self.owner.batch, self.owner.max_len
        if k.shape[0] != b:
            raise ValueError(f"the cache holds {b} rows, the attention got a batch of {k.shape[0]}")
        self.k = k.new_zeros(b, k.shape[1], max_len, k.shape[3])
        self.v = v.new_zeros(b, v.shape[1], max_len, v.shape[3])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        """Write this step's keys and values into their slots, attend over the filled ones.

        Args:
            q: ``(B, H, T, d)`` rotated queries of this step's ``T`` tokens.
            k: ``(B, KV, T, d)`` rotated keys (``KV`` divides ``H``: grouped queries).
            v: ``(B, KV, T, dv)`` values.
            scale: the softmax scale (None: ``d ** -0.5``).

        Returns:
            ``(B, H, T, dv)``, what causal attention over the whole sequence gives at these
            positions.
        """
        if self.k is None:
            self._allocate(k, v)
        if self.owner.slot is not None:  # [Note: a static-shape step]
            self.k.index_copy_(2, self.owner.slot, k)
            self.v.index_copy_(2, self.owner.slot, v)
            keys, values = self.k, self.v  # (B, KV, max_len, d): every slot, masked
        else:
            at, t = self.owner.filled, q.shape[2]
            self.k[:, :, at:at + t] = k
            self.v[:, :, at:at + t] = v
            keys, values = self.k[:, :, :at + t], self.v[:, :, :at + t]  # (B, KV, S, d)
        # grouped queries read their key head inside SDPA (torch >= 2.5; the package needs
        # 2.6): no repeat_kv copy of the cache ([Note: the decode step's mask])
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.owner.mask,
                                              is_causal=self.owner.causal, scale=scale,
                                              enable_gqa=q.shape[1] != keys.shape[1])


class KVCache:
    """Keys and values of every block for a batch of ``batch`` rows of up to ``max_len``
    tokens, and the bookkeeping of one forward (its positions and mask).

    Args:
        model: the decoder whose attention modules will read and write the cache.
        batch: rows.
        max_len: the most tokens a row holds (prompt, padding included, plus new tokens).
        start: ``(B,)`` int64, the padding of each row ([Note: left padding]).
        static: decode steps attend over every slot with fixed shapes ([Note: a static-shape
            step]), for ``torch.compile``.

    Raises:
        ValueError: a bad ``batch`` / ``max_len`` / ``start``.
    """

    def __init__(self, model: nn.Module, batch: int, max_len: int, start: torch.Tensor,
                 static: bool = False) -> None:
        if batch < 1 or max_len < 1:
            raise ValueError(f"KVCache: batch={batch}, max_len={max_len}, expected both >= 1")
        if tuple(start.shape) != (batch,):
            raise ValueError(f"KVCache: start has shape {tuple(start.shape)}, expected ({batch},)")
        self.modules = attention_modules(model)
        self.batch, self.max_len = batch, max_len
        self.start = start
        self.layers = [LayerCache(self) for _ in self.modules]
        self.filled = 0  # slots written by earlier forwards
        self.mask: torch.Tensor | None = None
        self.causal = False  # attend with is_causal instead of a mask (an unpadded prefill)
        self.positions: torch.Tensor | None = None
        self.static = static
        self.slot: torch.Tensor | None = None  # (1,) int64: this step's slot, static steps
        self.padded = bool((start > 0).any())  # one host read per cache, not per step
        slots = torch.arange(max_len, device=start.device)  # (max_len,)
        # [Note: the decode step's mask]: both built once, sliced per forward
        self._visible = (slots >= start.view(-1, 1)).view(batch, 1, 1, max_len)
        self._positions = (slots.view(1, -1) - start.view(-1, 1)).clamp_min(0)  # (B, max_len)
        self._slots = slots

    def begin(self, t: int) -> torch.Tensor:
        """Set the mask of a forward of ``t`` new tokens per row; return their ``(B, t)``
        positions (for the RoPE tables).

        Raises:
            ValueError: the ``t`` tokens do not fit in ``max_len``.
        """
        if self.filled + t > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} tokens per row; {self.filled} are "
                             f"filled and this forward adds {t}")
        at = self.filled
        self.positions = self._positions[:, at:at + t]  # (B, t)
        if t == 1 and self.static and at > 0:  # [Note: a static-shape step]
            # fresh tensors, not views at a moving offset: the compiled step sees one layout
            self.positions = self.positions.clone()
            self.slot = self._slots[at:at + 1].clone()
            self.mask, self.causal = self._visible & (self._slots <= at), False
        elif t == 1:  # decode: [Note: the decode step's mask]
            self.mask = self._visible[..., :at + 1] if self.padded else None
            self.causal = False
        elif at == 0 and not self.padded:
            self.mask, self.causal = None, True
        else:
            self.mask, self.causal = self._mask(at, t), False
        return self.positions

    def _mask(self, at: int, t: int) -> torch.Tensor:
        """``(B, 1, t, at + t)``: the padding mask and causal, a padding query sees itself."""
        dev = self.start.device
        slots = torch.arange(at, at + t, device=dev)  # (t,)
        keys = torch.arange(at + t, device=dev)  # (S,)
        start = self.start.view(-1, 1, 1)  # (B, 1, 1)
        visible = (keys >= start) & (keys <= slots.view(-1, 1))  # (B, t, S)
        return (visible | (keys == slots.view(-1, 1))).unsqueeze(1)  # (B, 1, t, S)

    def end(self, t: int) -> None:
        """The forward of :meth:`begin` ran: its ``t`` slots are filled."""
        self.filled += t
        self.mask, self.causal, self.slot = None, False, None

    def nbytes(self) -> int:
        """Bytes the allocated keys and values take."""
        return sum(c.k.nbytes + c.v.nbytes for c in self.layers if c.k is not None)

    @contextmanager
    def attached(self) -> Iterator["KVCache"]:
        """Point every attention module at its layer's cache for the ``with`` body; the
        modules are left as they were (no cache) on exit, also on an exception."""
        busy = [type(m).__name__ for m in self.modules if m.kv_cache is not None]
        if busy:
            raise ValueError(f"the model's attention already has a cache attached ({busy[0]}); "
                             f"one generation at a time per model")
        for module, layer in zip(self.modules, self.layers):
            module.kv_cache = layer
        try:
            yield self
        finally:
            for module in self.modules:
                module.kv_cache = None
