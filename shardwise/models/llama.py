"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention), unaware of parallelism.

Its variants come from the same config: mixture-of-experts feed-forwards (moe.py) and
multi-head latent attention (mla.py).

Build and run::

    from shardwise.models import build_model, get_model_config
    cfg = get_model_config("debug")
    model = build_model(cfg, device="cpu", seed=0)       # constructed + initialised
    logits = model(tokens)                               # (B, T) int64 -> (B, T, vocab)

Big models are built on the meta device (no storage, no RNG) and materialised module by
module by the sharding engine; see [Note: init order] for why that gives the same weights
as an eager build.

[Note: init order]
``init_module_weights(m)`` touches only ``m``'s direct parameters and buffers and draws from
the global torch RNG. ``Transformer.init_weights`` calls it for each module in
``self.modules()`` order, which is ``named_modules()`` order. A caller that builds on meta,
seeds the RNG, then for each module in ``named_modules()`` order allocates that module's
direct tensors (``module.to_empty(device=..., recurse=False)``) and calls
``init_module_weights(module)`` therefore draws the same random numbers into the same
tensors: the result is bitwise equal to ``build_model(cfg, device, seed)``.

[Note: tied embeddings]
With ``tie_embeddings=True`` the output head is a ``TiedOutput`` that owns no Parameter: its
``weight`` property returns ``tok_embeddings.weight``, so ``output.weight is
tok_embeddings.weight`` holds by construction. The shared matrix is registered once (under
``tok_embeddings``), is initialised once, appears once in ``parameters()`` and
``state_dict()``, and gets the sum of both uses' gradients from autograd. Registering the
same Parameter on two modules (the usual ``output.weight = tok_embeddings.weight``) would
break the tie silently whenever a per-module step (``to_empty(recurse=False)``, or an engine
swapping in a sharded Parameter) replaces it on one module but not the other.

RMSNorm, RoPE and the SwiGLU feed-forward live in layers.py (re-exported here).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.config import LlamaConfig
from shardwise.models.layers import (FeedForward, ModelBlock, RMSNorm, RotaryEmbedding,
                                     apply_rotary, document_ids, document_mask, repeat_kv,
                                     rope_tables)
from shardwise.models.layers import linear as _linear
from shardwise.models.experts import GroupedExperts
from shardwise.models.mla import LatentAttention
from shardwise.models.moe import MoE
from shardwise.models.pieces import Piece, PipelinePieces
from shardwise.models.router import Router

__all__ = [
    "Attention",
    "FeedForward",
    "RMSNorm",
    "RotaryEmbedding",
    "TiedOutput",
    "Transformer",
    "add_decoder",
    "check_tokens",
    "decode",
    "TransformerBlock",
    "apply_rotary",
    "build_model",
    "init_module_weights",
    "repeat_kv",
    "rope_tables",
]


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE.

    ``context_parallel`` (set by ``apply_cp``) replaces the one-process attention with the
    context-parallel one: same inputs, this rank's rows of the same output. ``kv_cache`` (set
    by shardwise.inference while it generates) attends over the cached keys and values of
    the earlier tokens too ([Note: the cache as an attention hook] in inference/cache.py).
    """

    context_parallel = None
    kv_cache = None

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hd, std = config.head_dim, config.init_std
        self.head_dim = hd
        self.wq = _linear(config.dim, config.n_heads * hd, std)
        self.wk = _linear(config.dim, config.n_kv_heads * hd, std)
        self.wv = _linear(config.dim, config.n_kv_heads * hd, std)
        self.wo = _linear(config.n_heads * hd, config.dim, std / math.sqrt(2 * config.n_layers))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        # documents: (B, T) document ids of packed sequences (of the whole sequence under
        # context parallelism), or None for one causal sequence per row.
        # Head counts come from the projections' widths (-1), not the config, and the batch
        # and sequence sizes from their outputs, not from x: a tensor-parallel column split
        # of wq/wk/wv (fewer local heads; under sequence parallelism x holds a piece of the
        # sequence that the projections gather) needs no change here.
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, t = q.shape[:2]
        q = q.view(b, t, -1, self.head_dim)  # (B, T, H, hd)
        k = k.view(b, t, -1, self.head_dim)  # (B, T, KV, hd)
        v = v.view(b, t, -1, self.head_dim)  # (B, T, KV, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|KV, T, hd)
        if self.kv_cache is not None:
            y = self.kv_cache.attend(q, k, v)  # (B, H, T, hd)
        elif self.context_parallel is not None:
            y = self.context_parallel(q, k, v, documents)  # (B, H, T, hd)
        else:
            n_rep = q.shape[1] // k.shape[1]
            # Explicit repeat rather than sdpa(enable_gqa=True): every backend accepts it.
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, H, T, hd)
            if documents is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents))
        y = y.transpose(1, 2).reshape(b, t, -1)  # (B, T, H * hd)
        return self.wo(y)  # (B, T, C)


class TransformerBlock(ModelBlock):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``.

    The natural unit for sharding, activation checkpointing and pipeline stages. The
    feed-forward is a :class:`~shardwise.models.moe.MoE` when ``config.is_moe_layer(layer_id)``,
    the attention a :class:`~shardwise.models.mla.LatentAttention` when ``config.attention ==
    "mla"``.

    Args:
        config: the model shape.
        layer_id: the block's index (0-based), which decides dense or MoE (default 0).
    """

    def __init__(self, config: LlamaConfig, layer_id: int = 0) -> None:
        super().__init__()
        # Registration order = data-flow order, so parameters() lists them as they are used.
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = LatentAttention(config) if config.attention == "mla" else Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = MoE(config) if config.is_moe_layer(layer_id) else FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        if documents is None:
            h = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, C)
        else:  # packed documents (multi-head latent attention takes none)
            h = x + self.attention(self.attention_norm(x), cos, sin, documents)
        return h + self.feed_forward(self.ffn_norm(h))  # (B, T, C)


class TiedOutput(nn.Module):
    """Output head that reads the token-embedding matrix (see [Note: tied embeddings])."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        # object.__setattr__ keeps the embedding out of _modules: it is not a child of
        # the head, and must not be visited, materialised or saved twice.
        object.__setattr__(self, "_embedding", embedding)

    @property
    def weight(self) -> nn.Parameter:
        return self._embedding.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)  # (B, T, C) -> (B, T, V)

    def extra_repr(self) -> str:
        return "weight=tok_embeddings.weight"


class Transformer(nn.Module):
    """Llama-style decoder-only language model.

    Construction allocates on the current default device. Off meta it ends with
    :meth:`init_weights`, drawing from the global RNG after torch's own default inits have
    drawn from it too; :func:`build_model` is the reproducible path (same seed, same
    weights, whether built eagerly or materialised from meta).

    Args:
        config: the model shape (a validated :class:`LlamaConfig`).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise ValueError(f"Transformer: config={config!r}, expected a LlamaConfig")
        self.config = config
        add_decoder(self, config)
        if not self.tok_embeddings.weight.is_meta:  # _weight left it uninitialised
            self.init_weights()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits.

        Args:
            tokens: ``(B, T)`` int64 (or int32) token ids, ``1 <= T <= max_seq_len``.
            positions: ``(B, T)`` position ids for packed documents (RoPE at these
                positions; a document starts where they do not continue, and attends only
                to itself), or None: one sequence per row at positions ``0 .. T - 1``.
            documents: ``(B, T)`` document ids instead of deriving them from
                ``positions`` (under context parallelism: the whole sequence's, which
                ``apply_cp`` fills in).

        Returns:
            ``(B, T, vocab_size)`` logits in the model's dtype.

        Raises:
            ValueError: if ``tokens`` is not a 2-D integer tensor or ``T`` is out of range.
        """
        check_tokens(tokens, self.config.max_seq_len, "Transformer")
        h = self.tok_embeddings(tokens)  # (B, T, C)
        return decode(self, h, tokens.shape[1], positions, documents)  # (B, T, V)

    def pipeline_pieces(self) -> PipelinePieces:
        """This model's pieces, as the pipeline split reads them ([Note: declared pieces]
        in pieces.py): the token embedding first, the blocks (``block(h, cos, sin)``, the
        RoPE tables of the sequence as side inputs), then the final norm and the head (a
        tied head names the embedding matrix). Running them in order is :meth:`forward`
        on one sequence per row.

        Returns:
            The :class:`~shardwise.models.pieces.PipelinePieces`.
        """
        tie = "tok_embeddings.weight" if isinstance(self.output, TiedOutput) else None
        return PipelinePieces(
            pieces=(Piece("tok_embeddings", self.tok_embeddings, "first"),
                    *(Piece(f"layers.{i}", block, call=_run_block)
                      for i, block in enumerate(self.layers)),
                    Piece("norm", self.norm, "last"),
                    Piece("output", self.output, "last", tie=tie)),
            # partial, not a bound method: a stage keeps the RoPE module, not the model
            side=functools.partial(_rope_tables, self.rope), shared=(("rope", self.rope),))

    def init_weights(self) -> None:
        """Initialise every parameter and buffer from the global torch RNG.

        Equivalent to ``init_module_weights(m)`` for each ``m`` in ``self.modules()``
        order (see [Note: init order]).
        """
        for module in self.modules():
            init_module_weights(module)


def add_decoder(module: nn.Module, config: LlamaConfig) -> None:
    """Register the decoder's pieces on ``module``, in data-flow order: ``tok_embeddings``,
    ``rope``, ``layers`` (``n_layers`` :class:`TransformerBlock`), ``norm``, ``output``.

    Shared by :class:`Transformer` and the vision-language-action model (vla.py), which
    puts its vision tower before them; :func:`decode` runs them. Allocates on the current
    default device and initialises nothing (the caller does).

    Args:
        module: the model to register the pieces on.
        config: the decoder's shape.
    """
    # _weight skips nn.Embedding's own normal_ init: wasted work on CPU, and on meta it
    # goes through torch._refs, whose first use imports torch._dynamo (seconds).
    module.tok_embeddings = nn.Embedding(config.vocab_size, config.dim,
                                         _weight=torch.empty(config.vocab_size, config.dim))
    module.tok_embeddings.init_std = config.init_std
    module.rope = RotaryEmbedding(config.rope_dim, config.max_seq_len, config.rope_theta)
    module.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
    module.norm = RMSNorm(config.dim, config.norm_eps)
    if config.tie_embeddings:
        module.output = TiedOutput(module.tok_embeddings)
    else:
        module.output = _linear(config.dim, config.vocab_size, config.init_std)


def decode(module: nn.Module, h: torch.Tensor, seq_len: int,
           positions: torch.Tensor | None = None,
           documents: torch.Tensor | None = None) -> torch.Tensor:
    """Run the pieces :func:`add_decoder` registered on ``module`` from the embeddings on.

    Args:
        module: a module holding ``rope``, ``layers``, ``norm`` and ``output``.
        h: ``(B, T, C)`` input embeddings (under sequence parallelism this rank's piece).
        seq_len: the whole sequence length ``T`` (the RoPE tables' length).
        positions: as :meth:`Transformer.forward`'s.
        documents: as :meth:`Transformer.forward`'s.

    Returns:
        ``(B, T, vocab_size)`` logits.
    """
    cos, sin = module.rope(seq_len, positions)  # (T | B x T, hd/2) each
    if positions is not None and documents is None:
        documents = document_ids(positions)
    for layer in module.layers:
        # (B, T, C); the one-sequence call stays the plain (h, cos, sin)
        h = layer(h, cos, sin) if documents is None else layer(h, cos, sin, documents)
    return module.output(module.norm(h))  # (B, T, V)


def check_tokens(tokens: torch.Tensor, max_seq_len: int, who: str) -> None:
    """Check a ``(B, T)`` integer token tensor with ``1 <= T <= max_seq_len``.

    Raises:
        ValueError: naming ``who``, the shape and dtype, and what was expected.
    """
    if not isinstance(tokens, torch.Tensor):
        raise ValueError(f"{who}: tokens is a {type(tokens).__name__}, expected a "
                         f"torch.Tensor of shape (batch, seq_len) and dtype int64")
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{who}: tokens has shape {tuple(tokens.shape)} and dtype "
                         f"{tokens.dtype}, expected a 2-D (batch, seq_len) tensor of "
                         f"dtype torch.int64 or torch.int32")
    seq_len = tokens.shape[1]
    if not 1 <= seq_len <= max_seq_len:
        raise ValueError(f"{who}: sequence length {seq_len} (tokens shape "
                         f"{tuple(tokens.shape)}) is outside [1, max_seq_len="
                         f"{max_seq_len}]")


def _rope_tables(rope: RotaryEmbedding, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return rope(tokens.shape[1])  # (T, hd/2) each, at the sequence's positions


def _run_block(block: nn.Module, h: torch.Tensor, side: tuple) -> torch.Tensor:
    return block(h, *side)  # (B, T, C); side = (cos, sin)


def init_module_weights(module: nn.Module) -> None:
    """Initialise ONE module's direct parameters and buffers (``recurse=False``).

    Embeddings and linear weights get ``normal(0, init_std)`` (the block output
    projections ``attention.wo`` and ``feed_forward.w2`` use ``init_std / sqrt(2 *
    n_layers)``), RMSNorm gains get ones, RoPE tables are recomputed; MoE experts draw
    ``w1, w2, w3`` (``w2`` with the output std) and a router's balancing bias is zeroed.
    Modules without direct tensors (containers, blocks, a tied head) are left alone. Random
    draws come from the global torch RNG of the tensors' device, in registration order.

    Args:
        module: a module of a :class:`Transformer` whose direct tensors are materialised.

    Raises:
        ValueError: if ``module`` has direct parameters but is not a shardwise model module.
    """
    if isinstance(module, (RMSNorm, RotaryEmbedding, Router, GroupedExperts)):
        module.reset_parameters()
        return
    params = [p for p in module._parameters.values() if p is not None]
    if not params:
        return
    std = getattr(module, "init_std", None)
    if std is None:
        names = list(module._parameters)
        raise ValueError(f"init_module_weights: {type(module).__name__} has parameters "
                         f"{names} but no init_std; expected a module built by Transformer")
    with torch.no_grad():
        for p in params:
            p.normal_(mean=0.0, std=std)


def build_model(config: LlamaConfig, device: torch.device | str = "cpu",
                seed: int = 0) -> nn.Module:
    """Construct a :class:`Transformer` (or the model of another config, such as a
    ``VLAConfig``'s ``VisionLanguageAction``) and initialise it.

    The model is constructed on meta (no torch default init is wasted), allocated on
    ``device``, then ``torch.manual_seed(seed)`` and :meth:`Transformer.init_weights`.

    Args:
        config: the model shape.
        device: target device (default ``"cpu"``). ``"meta"`` returns the model without
            storage and without touching the RNG (``seed`` is ignored).
        seed: seed for ``torch.manual_seed`` before init (default 0).

    Returns:
        The model, in fp32, in training mode.

    Raises:
        ValueError: if ``config`` is neither a LlamaConfig nor has ``make_module``, or
            ``seed`` is not an int.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"build_model: seed={seed!r}, expected an int")
    # Another model's config (vla.py's VLAConfig) says how to construct its module.
    make = Transformer if isinstance(config, LlamaConfig) else getattr(config, "make_module", None)
    if make is None:
        raise ValueError(f"build_model: config={config!r}, expected a LlamaConfig or a config "
                         f"with make_module() (e.g. a VLAConfig)")
    device = torch.device(device)
    with torch.device("meta"):
        model = make(config) if make is Transformer else make()
    if device.type == "meta":
        return model
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights()
    return model
