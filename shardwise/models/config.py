"""LlamaConfig: the shape of a Llama-style decoder, its exact size and its training cost.

The config is a frozen dataclass: it is validated once, in ``__post_init__``, and derived
configs are made with ``dataclasses.replace`` (which validates again), so a model can never
be built from a shape that was changed after validation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["LlamaConfig"]

_POSITIVE_INTS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len",
                  "multiple_of")
_POSITIVE_FLOATS = ("norm_eps", "rope_theta", "init_std")


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and initialisation of a Llama-style decoder-only transformer.

    The defaults are a tiny model (about 3.3M parameters) that trains on a laptop CPU; the
    named configs in :mod:`shardwise.models.registry` cover ``debug`` ... ``llama3-405b``.

    Raises:
        ValueError: from ``__post_init__`` when a field is out of range or the fields do not
            fit together (see :meth:`validate`).
    """

    dim: int = 256
    """Model (residual stream) width, in features. Must be divisible by ``n_heads``."""

    n_layers: int = 4
    """Number of transformer blocks."""

    n_heads: int = 8
    """Number of query heads, ``head_dim = dim // n_heads`` features each (even, for RoPE)."""

    n_kv_heads: int = 4
    """Number of key/value heads (grouped-query attention); must divide ``n_heads``.
    Equal to ``n_heads`` for plain multi-head attention, 1 for multi-query attention."""

    vocab_size: int = 256
    """Number of token ids (rows of the embedding table)."""

    ffn_dim: int | None = None
    """Hidden width of the SwiGLU feed-forward, in features. ``None`` derives it from ``dim``
    with the Llama rule (see ``multiple_of`` and ``ffn_dim_multiplier``)."""

    multiple_of: int = 256
    """Llama rule: the derived feed-forward width is rounded up to a multiple of this."""

    ffn_dim_multiplier: float | None = None
    """Llama rule: optional factor applied to ``int(2 * 4 * dim / 3)`` before rounding
    (1.3 for Llama 3 8B/70B, 1.2 for 405B)."""

    max_seq_len: int = 256
    """Longest sequence the model accepts, in tokens; also the length of the RoPE tables."""

    norm_eps: float = 1e-5
    """Epsilon added to the mean square inside RMSNorm (dimensionless)."""

    rope_theta: float = 10000.0
    """RoPE base: pair ``i`` of a head rotates by ``position * rope_theta ** (-2i / head_dim)``
    radians per token (500000 for Llama 3)."""

    tie_embeddings: bool = False
    """If True the output head reuses the token-embedding matrix (one Parameter, counted once)."""

    init_std: float = 0.02
    """Standard deviation of the normal init of embeddings and linear weights; the output
    projections of each block (``attention.wo``, ``feed_forward.w2``) use
    ``init_std / sqrt(2 * n_layers)`` so the residual stream variance does not grow with depth."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field and their combinations.

        Raises:
            ValueError: naming the offending field, its value and what was expected.
        """
        for name in _POSITIVE_INTS:
            _check_positive_int(name, getattr(self, name))
        if self.ffn_dim is not None:
            _check_positive_int("ffn_dim", self.ffn_dim)
        for name in _POSITIVE_FLOATS:
            _check_positive_float(name, getattr(self, name))
        if self.ffn_dim_multiplier is not None:
            _check_positive_float("ffn_dim_multiplier", self.ffn_dim_multiplier)
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"LlamaConfig: tie_embeddings={self.tie_embeddings!r}, "
                             f"expected a bool")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"LlamaConfig: dim={self.dim} is not divisible by "
                             f"n_heads={self.n_heads}; expected dim to be a multiple of n_heads")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} is not divisible by "
                             f"n_kv_heads={self.n_kv_heads}; grouped-query attention needs each "
                             f"kv head to serve the same number of query heads")
        if self.head_dim % 2 != 0:
            raise ValueError(f"LlamaConfig: head_dim=dim/n_heads={self.dim}/{self.n_heads}="
                             f"{self.head_dim} is odd; RoPE rotates feature pairs, expected an "
                             f"even head_dim")

    @property
    def head_dim(self) -> int:
        """Features per attention head (``dim // n_heads``)."""
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Hidden width of the feed-forward: ``ffn_dim`` if set, else the Llama rule
        ``round_up(int(multiplier * int(8 * dim / 3)), multiple_of)``."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def num_params(self) -> int:
        """Exact number of parameters of ``Transformer(self)``.

        Returns:
            The parameter count, with the tied embedding/output matrix counted once. Equal to
            ``sum(p.numel() for p in model.parameters())``.
        """
        embedding = self.vocab_size * self.dim
        output = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return embedding + self.n_layers * self._params_per_layer() + self.dim + output

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward), PaLM / Chinchilla accounting.

        ``6 * N + 12 * n_layers * dim * seq_len`` where ``N`` counts the weights that take
        part in a matrix multiply: every linear weight of the blocks plus the output head
        (when tied, the shared matrix counts once, for its output-head use). The input
        embedding lookup and the RMSNorm gains are not matmuls and are left out. Each matmul
        weight costs 2 FLOPs per token forward and 4 backward; the attention term is
        ``QK^T`` and ``AV`` (2 * 2 * seq_len * dim forward per layer, times 3), counted over
        the full ``seq_len x seq_len`` score matrix as PaLM does, although a causal kernel
        skips about half of it. This equals what ``torch.utils.flop_counter`` counts for one
        forward and backward, divided by the number of tokens.

        Args:
            seq_len: context length in tokens; defaults to ``max_seq_len``.

        Returns:
            FLOPs per token, an int.

        Raises:
            ValueError: if ``seq_len`` is not a positive int.
        """
        seq_len = self.max_seq_len if seq_len is None else seq_len
        _check_positive_int("seq_len", seq_len)
        matmul_params = self.n_layers * (self._params_per_layer() - 2 * self.dim)
        matmul_params += self.vocab_size * self.dim
        return 6 * matmul_params + 12 * self.n_layers * self.dim * seq_len

    def _params_per_layer(self) -> int:
        kv_dim = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv_dim  # wq, wo + wk, wv
        feed_forward = 3 * self.dim * self.ffn_hidden_dim  # w1, w2, w3
        return attention + feed_forward + 2 * self.dim  # + attention_norm, ffn_norm

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of the config fields, in declaration order (for override validation)."""
        return [f.name for f in dataclasses.fields(cls)]


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; True as a width is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"LlamaConfig: {name}={value!r}, expected a positive int")


def _check_positive_float(name: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not 0 < value < math.inf:  # also rejects nan
        raise ValueError(f"LlamaConfig: {name}={value!r}, expected a positive finite number")
