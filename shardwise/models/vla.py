"""A vision-language-action model (OpenVLA's recipe): ViT -> MLP projector -> Llama decoder
whose top ``num_action_tokens`` token ids are actions. Unaware of parallelism.

    from shardwise.models import build_model, get_model_config
    cfg = get_model_config("debug-vla")                  # a VLAConfig
    model = build_model(cfg, device="cpu", seed=0)
    logits = model(tokens, images)   # (B, T) int64, (N, 3, H, W) float -> (B, T, vocab)

A sample is ``[BOS] [IMAGE] * P per frame, mission words, [ACT]``; the label at ``[ACT]`` is
the action's token id (``vocab_size - num_action_tokens + a``, see vla_actions.py). The
interface with the data side (shardwise/data/vla/) is the ``VLABatch``: ``tokens`` (B, T),
``labels`` (B, T) and every frame of the batch, ``images`` (N, 3, H, W), sample-major, in the
order of their IMAGE runs.

[Note: the vision tower always runs]
``forward`` runs the vision tower and the projector on ``images`` whatever ``N`` is, 0
included: under ZeRO-3 the tower's units gather their parameters in its forward and reduce
its gradients in its backward, under tensor parallelism its layers all-reduce, and every
rank must issue the same collectives in the same order whether or not its micro-batch holds
a frame (docs/design.md, "A step is a contract between ranks"). With ``N = 0`` the
projected ``(0, dim)`` rows are scattered into no position, autograd still reaches every
vision parameter (with zero gradients), so the ranks' reductions match.

Pieces, in data-flow and registration order (what a pipeline split cuts along): ``vision``
(patch embedding, position embeddings, ``vision.blocks.{i}``, ``vision.norm``),
``projector``, then the decoder of llama.py: ``tok_embeddings``, ``layers.{i}``, ``norm``,
``output``. The decoder's pieces sit at the top level with Transformer's names, so its
tensor-parallel plan, MoE helpers and checkpoint names carry over unchanged.
``pipeline_pieces()`` declares them for the pipeline split: the tower, the projector and
the token embedding (with the patch features merged in) on the first stage, the decoder
blocks divided between stages, the final norm and head on the last.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.config import LlamaConfig
from shardwise.models.layers import linear as _linear
from shardwise.models.llama import (TiedOutput, add_decoder, check_tokens, decode,
                                    init_module_weights)
from shardwise.models.pieces import Piece, PipelinePieces
from shardwise.models.vision import VisionEncoder

__all__ = ["VLAConfig", "VisionLanguageAction", "Projector"]


@dataclass(frozen=True)
class VLAConfig:
    """Shape of a :class:`VisionLanguageAction`: its vision tower, projector and decoder.

    Raises:
        ValueError: from ``__post_init__``, naming the field and value.
    """

    decoder: LlamaConfig
    """The Llama decoder (dense or MoE); ``vocab_size`` covers text and action tokens."""

    image_size: int = 56
    """Frame height and width, in pixels."""

    patch_size: int = 8
    """Patch side, in pixels (``image_size`` a multiple of it)."""

    channels: int = 3
    """Input channels per frame (RGB)."""

    vision_dim: int = 128
    """Vision tower width, in features."""

    vision_layers: int = 2
    """Vision tower blocks."""

    vision_heads: int = 4
    """Attention heads per vision block."""

    vision_mlp_ratio: float = 4.0
    """Vision MLP hidden width / ``vision_dim``."""

    num_action_tokens: int = 16
    """Action token ids: the top ``num_action_tokens`` ids of the decoder's vocabulary."""

    image_token_id: int = 2
    """The id of an IMAGE position (one per patch)."""

    act_token_id: int = 3
    """The id of the ACT position (whose next-token prediction is the action)."""

    pad_id: int = 0
    """The padding id."""

    def __post_init__(self) -> None:
        if not isinstance(self.decoder, LlamaConfig):
            raise ValueError(f"VLAConfig: decoder={self.decoder!r}, expected a LlamaConfig")
        for name in ("image_size", "patch_size", "channels", "vision_dim", "vision_layers",
                     "vision_heads", "num_action_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"VLAConfig: {name}={value!r}, expected a positive int")
        if self.image_size % self.patch_size:
            raise ValueError(f"VLAConfig: image_size={self.image_size} is not a multiple of "
                             f"patch_size={self.patch_size}")
        if self.vision_dim % self.vision_heads:
            raise ValueError(f"VLAConfig: vision_dim={self.vision_dim} is not divisible by "
                             f"vision_heads={self.vision_heads}")
        if not self.vision_mlp_ratio > 0:
            raise ValueError(f"VLAConfig: vision_mlp_ratio={self.vision_mlp_ratio!r}, "
                             f"expected a positive number")
        specials = (self.pad_id, self.image_token_id, self.act_token_id)
        first_action = self.decoder.vocab_size - self.num_action_tokens
        if first_action <= max(specials) or len(set(specials)) < 3 or min(specials) < 0:
            raise ValueError(f"VLAConfig: pad/image/act ids {specials} must be distinct, "
                             f">= 0 and below the first action id {first_action} (vocab_size="
                             f"{self.decoder.vocab_size}, num_action_tokens="
                             f"{self.num_action_tokens})")

    @property
    def num_patches(self) -> int:
        """IMAGE positions per frame: ``(image_size // patch_size) ** 2``."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def max_seq_len(self) -> int:
        """The decoder's longest sequence, in tokens."""
        return self.decoder.max_seq_len

    @property
    def vocab_size(self) -> int:
        """The decoder's vocabulary, text and action tokens."""
        return self.decoder.vocab_size

    @property
    def first_action_id(self) -> int:
        """Token id of action 0: ``vocab_size - num_action_tokens``."""
        return self.decoder.vocab_size - self.num_action_tokens

    def vision_params(self) -> int:
        """Parameters of the vision tower (patch and position embeddings, blocks, norm)."""
        d, hidden = self.vision_dim, int(self.vision_dim * self.vision_mlp_ratio)
        block = 4 * d * d + 2 * d * hidden + 2 * d
        embed = self.channels * self.patch_size ** 2 * d + self.num_patches * d
        return embed + self.vision_layers * block + d

    def projector_params(self) -> int:
        """Parameters of the projector (vision_dim -> dim -> dim, bias-free)."""
        return self.vision_dim * self.decoder.dim + self.decoder.dim ** 2

    def num_params(self) -> int:
        """Every parameter: vision tower, projector and decoder (tied weights once)."""
        return self.vision_params() + self.projector_params() + self.decoder.num_params()

    def make_module(self) -> VisionLanguageAction:
        """Construct the model on the current default device (``build_model`` calls it on
        meta, then allocates and initialises it)."""
        return VisionLanguageAction(self)

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of the config fields, in declaration order (for override validation)."""
        return [f.name for f in dataclasses.fields(cls)]


class Projector(nn.Module):
    """LLaVA's two-layer MLP from the vision width to the decoder's: ``fc2(gelu(fc1(x)))``.

    ``tp_plan``: its tensor-parallel plan (``fc1`` column-, ``fc2`` row-parallel)."""

    tp_plan = {"fc1": "colwise", "fc2": "rowwise"}

    def __init__(self, vision_dim: int, dim: int, init_std: float) -> None:
        super().__init__()
        self.fc1 = _linear(vision_dim, dim, init_std)
        self.fc2 = _linear(dim, dim, init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (..., vision_dim) -> (..., dim)


class VisionLanguageAction(nn.Module):
    """ViT encoder + projector + Llama decoder; patch features replace the IMAGE tokens'
    embeddings (see the module doc for its pieces and [Note: the vision tower always runs]).

    Construction allocates on the current default device and, off meta, initialises from
    the global RNG; :func:`~shardwise.models.build_model` is the reproducible path.

    Args:
        config: a :class:`VLAConfig`.

    Raises:
        ValueError: ``config`` is not a VLAConfig.
    """

    def __init__(self, config: VLAConfig) -> None:
        super().__init__()
        if not isinstance(config, VLAConfig):
            raise ValueError(f"VisionLanguageAction: config={config!r}, expected a VLAConfig")
        self.config = config
        dec = config.decoder
        self.vision = VisionEncoder(config.image_size, config.patch_size, config.vision_dim,
                                    config.vision_layers, config.vision_heads,
                                    config.vision_mlp_ratio, config.channels, dec.init_std)
        self.projector = Projector(config.vision_dim, dec.dim, dec.init_std)
        add_decoder(self, dec)
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights()

    def forward(self, tokens: torch.Tensor, images: torch.Tensor,
                part: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits of a batch of samples with their frames.

        Args:
            tokens: ``(B, T)`` int64 ids, IMAGE ids where patch features go, ``T <=
                max_seq_len``; causal attention at positions ``0 .. T - 1``, so right padding
                never changes earlier positions.
            images: ``(N, channels, image_size, image_size)`` float frames of the whole batch
                in the order of their IMAGE runs (sample-major); ``N`` may be 0.
            part: ``(T',)`` int64 positions of the sequence to decode, or None (all of
                them). The whole sequence is embedded (tower and merge on every frame), then
                only these positions go through the decoder, whose RoPE must place them:
                a context-parallel rank's part in ``apply_cp``'s layout (the trainer's
                ``shardwise.train.vla``), which gives RoPE those global positions.

        Returns:
            ``(B, T, vocab_size)`` logits (``(B, T', vocab_size)`` with ``part``).

        Raises:
            ValueError: bad tokens or images, or ``N * num_patches`` differing from the
                number of IMAGE ids (naming both).
        """
        # Before any collective: a count mismatch is the caller's, and fails on its rank.
        check_inputs(self.config, tokens, images)
        patches = self.projector(self.vision(images))  # (N, P, C), N may be 0
        h = merge_patches(self.config.image_token_id, self.tok_embeddings, tokens, patches)
        if part is not None:
            h = h[:, part]  # (B, T', C): the tokens this call decodes
        return decode(self, h, h.shape[1])  # (B, T | T', V)

    def pipeline_pieces(self) -> PipelinePieces:
        """This model's pieces, as the pipeline split reads them ([Note: declared pieces] in
        pieces.py), in ``named_modules()`` order: on the first stage the vision tower
        (``vision``: patch embedding, position embeddings, blocks, norm, as :meth:`forward`
        runs it), the ``projector`` and ``tok_embeddings`` (the token embedding and the
        scatter of the patch features into the IMAGE positions); the decoder blocks
        ``layers.{i}`` (``block(h, cos, sin)``, the RoPE tables as side inputs, as the
        Transformer's); ``norm`` and ``output`` on the last stage (a tied head names the
        embedding matrix).

        The micro-batch inputs are ``(tokens, images)``; between the first pieces the
        running value is ``(tokens, features)``, and what leaves the first stage is the
        ``(B, T, dim)`` embeddings. Running the pieces in order is :meth:`forward`, a
        micro-batch of no frame included ([Note: the vision tower always runs]).

        Returns:
            The :class:`~shardwise.models.pieces.PipelinePieces`.
        """
        tie = "tok_embeddings.weight" if isinstance(self.output, TiedOutput) else None
        # partials of module-level functions, not bound methods: a stage keeps its own
        # pieces and the config, never the whole model
        return PipelinePieces(
            pieces=(Piece("vision", self.vision, "first",
                          call=functools.partial(_encode, self.config)),
                    Piece("projector", self.projector, "first", call=_project),
                    Piece("tok_embeddings", self.tok_embeddings, "first",
                          call=functools.partial(_embed, self.config.image_token_id)),
                    *(Piece(f"layers.{i}", block, call=_run_block)
                      for i, block in enumerate(self.layers)),
                    Piece("norm", self.norm, "last"),
                    Piece("output", self.output, "last", tie=tie)),
            side=functools.partial(_rope_tables, self.rope), shared=(("rope", self.rope),))

    def init_weights(self) -> None:
        """Initialise every parameter and buffer from the global torch RNG:
        ``init_module_weights(m)`` for each ``m`` in ``self.modules()`` order."""
        for module in self.modules():
            init_module_weights(module)


def check_inputs(config: VLAConfig, tokens: torch.Tensor, images: torch.Tensor) -> None:
    """Refuse tokens and frames that do not fit together (before any collective).

    Raises:
        ValueError: bad tokens or images, or ``N * num_patches`` differing from the number
            of IMAGE ids (naming both).
    """
    check_tokens(tokens, config.max_seq_len, "VisionLanguageAction")
    slots = int((tokens == config.image_token_id).sum())
    rows = images.shape[0] * config.num_patches if images.dim() == 4 else -1
    if slots != rows:
        raise ValueError(f"VisionLanguageAction: tokens hold {slots} IMAGE ids (id "
                         f"{config.image_token_id}) but images {tuple(images.shape)} "
                         f"give {rows} patch rows ({config.num_patches} per frame)")


def merge_patches(image_id: int, embedding: nn.Module, tokens: torch.Tensor,
                  patches: torch.Tensor) -> torch.Tensor:
    """The token embeddings ``(B, T, dim)`` of ``tokens``, with the projected patch features
    ``patches`` ``(N, P, dim)`` in the IMAGE positions."""
    h = embedding(tokens)  # (B, T, C)
    is_image = (tokens == image_id).unsqueeze(-1)  # (B, T, 1)
    # masked_scatter fills the IMAGE positions in row-major (sample, position) order,
    # which is the frames' sample-major order.
    return h.masked_scatter(is_image, patches.to(h.dtype).flatten(0, 1))


# The pieces' calls ([Note: declared pieces]): x is (tokens, images), then (tokens, features).
def _encode(config: VLAConfig, vision: nn.Module, x: tuple, side: Any) -> tuple:
    tokens, images = x
    check_inputs(config, tokens, images)  # before the tower's collectives, on this rank
    return tokens, vision(images)  # (N, P, vision_dim)


def _project(projector: nn.Module, x: tuple, side: Any) -> tuple:
    return x[0], projector(x[1])  # (N, P, dim)


def _embed(image_id: int, embedding: nn.Module, x: tuple, side: Any) -> torch.Tensor:
    return merge_patches(image_id, embedding, *x)  # (B, T, dim): one tensor leaves stage 0


def _rope_tables(rope: nn.Module, inputs: tuple) -> tuple[torch.Tensor, ...]:
    return rope(inputs[0].shape[1])  # (T, hd/2) each, from the micro-batch's tokens


def _run_block(block: nn.Module, h: torch.Tensor, side: tuple) -> torch.Tensor:
    return block(h, *side)  # (B, T, C); side = (cos, sin)
