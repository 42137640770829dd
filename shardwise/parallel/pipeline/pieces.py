"""The pieces a pipeline split cuts: asked of the model, or read by an adapter.

    decl = pipeline_pieces(model)        # model.pipeline_pieces(), or an adapter's reading
    part = split_stages(model, mesh, virtual, placement=schedule.placement)
    part = split_stages(other, mesh, pieces=my_declaration(other))   # a model that declares none

A model declares its pieces with a ``pipeline_pieces()`` method returning a
:class:`~shardwise.models.pieces.PipelinePieces` ([Note: declared pieces] in
shardwise/models/pieces.py: ordered first / block / last pieces, side inputs every stage
rebuilds, one tensor between stages; an encoder that must live on the first stage -- a VLA's
vision tower and projector -- is declared as ``"first"`` pieces ahead of the token
embedding). shardwise's :class:`~shardwise.models.Transformer` declares its own. A model that
declares none is read by an adapter: :func:`hf_decoder_pieces` reads a Hugging Face causal
decoder (``LlamaForCausalLM`` and its kin: ``model.embed_tokens``, ``model.layers``,
``model.norm``, ``lm_head``, ``model.rotary_emb``) as it is, its own modules and their own
forwards, without converting it to shardwise's model.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from shardwise.models.pieces import ROLES, Piece, PipelinePieces

__all__ = ["Piece", "PipelinePieces", "pipeline_pieces", "hf_decoder_pieces", "check_pieces"]

_TRANSFORMER = ("tok_embeddings", "layers", "norm", "output")


def pipeline_pieces(model: nn.Module) -> PipelinePieces:
    """The pieces of ``model``: its own declaration, or the Hugging Face decoder adapter's.

    Args:
        model: a model with a ``pipeline_pieces()`` method, or a Hugging Face causal decoder.

    Returns:
        The checked :class:`PipelinePieces`.

    Raises:
        ValueError: the model declares no pieces and no adapter reads it (naming what it
            lacks), or its declaration is inconsistent (see :func:`check_pieces`).
    """
    declare = getattr(model, "pipeline_pieces", None)
    if callable(declare):
        decl = declare()
    elif _is_hf_decoder(model):
        decl = hf_decoder_pieces(model)
    else:
        missing = [n for n in _TRANSFORMER if not hasattr(model, n)]
        raise ValueError(f"split_stages needs a model that declares its pieces (a "
                         f"pipeline_pieces() method, shardwise.models.pieces), a Hugging Face "
                         f"causal decoder (model.embed_tokens, model.layers, model.norm, "
                         f"lm_head) or split_stages(..., pieces=...); shardwise's Transformer "
                         f"has {', '.join(_TRANSFORMER)}: {type(model).__name__} lacks "
                         f"{missing}")
    check_pieces(decl, model)
    return decl


def check_pieces(decl: PipelinePieces, model: nn.Module | None = None) -> None:
    """Refuse an inconsistent declaration.

    Args:
        decl: the declaration.
        model: the model it describes (its tied parameter names are checked against it).

    Raises:
        ValueError: not a PipelinePieces, an unknown role, roles out of order (first*,
            block+, last*), no block, a repeated name, or a tie on a piece that is not
            ``"last"`` or naming no parameter of a ``"first"`` piece.
    """
    if not isinstance(decl, PipelinePieces):
        raise ValueError(f"pipeline_pieces() returned {type(decl).__name__}, expected a "
                         f"shardwise.models.pieces.PipelinePieces")
    roles = [p.role for p in decl.pieces]
    bad = [p.name for p in decl.pieces if p.role not in ROLES or not isinstance(p.module,
                                                                              nn.Module)]
    if bad:
        raise ValueError(f"pieces {bad}: role must be one of {ROLES} and module an nn.Module")
    order = [ROLES.index(r) for r in roles]
    if order != sorted(order) or "block" not in roles:
        raise ValueError(f"piece roles {roles}: expected first pieces, then at least one "
                         f"block, then last pieces")
    names = [p.name for p in decl.pieces] + [n for n, _ in decl.shared]
    if len(set(names)) != len(names):
        raise ValueError(f"piece names {names} repeat; each piece is one module path")
    firsts = [p.name for p in decl.pieces if p.role == "first"]
    for p in decl.pieces:
        if p.tie is None:
            continue
        owner = next((f for f in firsts if p.tie.startswith(f + ".")), None)
        if p.role != "last" or owner is None:
            raise ValueError(f"piece {p.name!r} ties to {p.tie!r}: a tie is a last piece "
                             f"reading a parameter of a first piece ({firsts})")
        if model is not None and p.tie not in dict(model.named_parameters()):
            raise ValueError(f"piece {p.name!r} ties to {p.tie!r}, which is not a parameter "
                             f"of {type(model).__name__}")


def _is_hf_decoder(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return (hasattr(model, "lm_head") and inner is not None
            and all(hasattr(inner, n) for n in ("embed_tokens", "layers", "norm",
                                                "rotary_emb")))


def hf_decoder_pieces(model: nn.Module) -> PipelinePieces:
    """A Hugging Face causal decoder's own pieces (``LlamaForCausalLM``, Qwen2, Mistral...).

    The pieces are the model's modules under their own names (``model.embed_tokens``,
    ``model.layers.{i}``, ``model.norm``, ``lm_head``; ``lm_head`` tied to
    ``model.embed_tokens.weight`` when it shares that matrix), run by their own forwards;
    the side inputs are what ``model.model.forward`` builds once for all layers: position ids
    ``0 .. T - 1``, the rotary tables (``model.rotary_emb``, kept on every rank) and the
    causal mask of the model's attention implementation (``create_causal_mask`` of the
    model's own modeling module). The micro-batch inputs are ``(B, T)`` token ids without
    padding; the last stage returns the logits ``(B, T, vocab)``.

    Args:
        model: the ``*ForCausalLM`` module.

    Returns:
        The :class:`PipelinePieces`.

    Raises:
        ValueError: the model lacks those modules (naming the class).
    """
    if not _is_hf_decoder(model):
        raise ValueError(f"hf_decoder_pieces: {type(model).__name__} is not a Hugging Face "
                         f"causal decoder (model.embed_tokens, model.layers, model.norm, "
                         f"model.rotary_emb, lm_head)")
    inner = model.model
    tied = model.lm_head.weight is inner.embed_tokens.weight
    side = _HFSide(inner.rotary_emb, inner.config, inner.embed_tokens.weight.dtype,
                   sys.modules[type(inner).__module__].create_causal_mask)
    return PipelinePieces(
        pieces=(Piece("model.embed_tokens", inner.embed_tokens, "first"),
                *(Piece(f"model.layers.{i}", layer, call=_hf_layer)
                  for i, layer in enumerate(inner.layers)),
                Piece("model.norm", inner.norm, "last"),
                Piece("lm_head", model.lm_head, "last",
                      tie="model.embed_tokens.weight" if tied else None)),
        side=side, shared=(("model.rotary_emb", inner.rotary_emb),))


class _HFSide:
    """``input_ids -> {position_ids, position_embeddings, attention_mask}`` as the decoder's
    forward builds them (holding the rotary module and config, not the model)."""

    def __init__(self, rotary: nn.Module, config: Any, dtype: torch.dtype, mask_fn) -> None:
        self.rotary, self.config, self.dtype, self.mask_fn = rotary, config, dtype, mask_fn

    def __call__(self, input_ids: torch.Tensor) -> dict[str, Any]:
        b, t = input_ids.shape
        device = self.rotary.inv_freq.device
        positions = torch.arange(t, device=device).unsqueeze(0)  # (1, T)
        # Read for its batch size, length, dtype and device only.
        shape_only = torch.empty(b, t, 0, dtype=self.dtype, device=device)
        mask = self.mask_fn(config=self.config, inputs_embeds=shape_only, attention_mask=None,
                            cache=None, position_ids=positions)
        return {"position_ids": positions, "attention_mask": mask,
                "position_embeddings": self.rotary(shape_only, position_ids=positions)}


def _hf_layer(layer: nn.Module, h: torch.Tensor, side: dict[str, Any]) -> torch.Tensor:
    return layer(h, **side)  # (B, T, C)
