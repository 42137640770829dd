"""LlamaConfig: the shape of a Llama-style decoder, its exact size and its training cost.

The config is a frozen dataclass: it is validated once, in ``__post_init__``, and derived
configs are made with ``dataclasses.replace`` (which validates again), so a model can never
be built from a shape that was changed after validation.

The same config describes the dense Llama, its mixture-of-experts variant (``num_experts >
0``: routed SwiGLU experts in every ``moe_every``-th block, see moe.py) and DeepSeek's
multi-head latent attention (``attention = "mla"``, see mla.py).

Every parameter and FLOP count here (the functions at the end) is checked against the built
model (``sum(p.numel())``) and against ``torch.utils.flop_counter`` by the tests, for dense,
MoE and MLA shapes. Per block::

    attention   GQA: wq, wk, wv, wo            MLA: (wq | wq_a, q_norm, wq_b), wkv_a, kv_norm,
                                                    wkv_b, wo               (see mla.py)
    feed-forward  dense: w1, w2, w3 (ffn_hidden_dim)
                  MoE:   router gate (E x dim) + E routed experts + one shared SwiGLU of
                         num_shared_experts * moe_ffn_dim                   (see moe.py)
    norms       attention_norm, ffn_norm (dim each)
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

    num_experts: int = 0
    """Routed experts per MoE feed-forward (0: a dense model, one SwiGLU per block)."""

    top_k: int = 2
    """Routed experts each token visits (``1 <= top_k <= num_experts``); MoE only."""

    num_shared_experts: int = 0
    """Always-on experts per MoE layer (DeepSeek style), run on every token beside the routed
    ones; stored as one SwiGLU of width ``num_shared_experts * moe_ffn_dim``."""

    moe_ffn_dim: int | None = None
    """Hidden width of each expert, routed or shared, in features (None: ``ffn_hidden_dim``)."""

    moe_every: int = 1
    """Block ``i`` (0-based) has an MoE feed-forward when ``i >= moe_first_dense`` and
    ``(i + 1) % moe_every == 0`` (Qwen / Llama 4 interleaving); the others stay dense."""

    moe_first_dense: int = 0
    """Leading blocks that stay dense whatever ``moe_every`` says (DeepSeek-V3: 3)."""

    router_score: str = "softmax"
    """Router scores: "softmax" over all experts (Mixtral) or per-expert "sigmoid"
    (DeepSeek-V3). Experts are chosen by score (plus the balancing bias), top ``top_k``."""

    router_norm_topk: bool = True
    """Divide each token's top-k scores by their sum (Mixtral, DeepSeek-V3). With softmax and
    ``top_k = 1`` the weight is then always 1 and only balancing losses train the router."""

    router_scale: float = 1.0
    """Factor applied to the routed experts' weights (DeepSeek-V3: 2.5)."""

    attention: str = "gqa"
    """"gqa": grouped-query attention (llama.py); "mla": DeepSeek's multi-head latent
    attention (mla.py), shaped by the five fields below."""

    q_lora_rank: int | None = None
    """MLA: rank of the query down-projection (None: queries projected directly)."""

    kv_lora_rank: int | None = None
    """MLA: rank of the joint key/value compression (required for "mla")."""

    qk_nope_head_dim: int | None = None
    """MLA: per-head query/key features without RoPE (required for "mla")."""

    qk_rope_head_dim: int | None = None
    """MLA: per-head query/key features with RoPE, the key part shared by all heads (even;
    required for "mla")."""

    v_head_dim: int | None = None
    """MLA: per-head value features (required for "mla")."""

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
        if self.attention == "gqa" and self.head_dim % 2 != 0:
            raise ValueError(f"LlamaConfig: head_dim=dim/n_heads={self.dim}/{self.n_heads}="
                             f"{self.head_dim} is odd; RoPE rotates feature pairs, expected an "
                             f"even head_dim")
        self._validate_moe()
        self._validate_attention()

    def _validate_moe(self) -> None:
        for name in ("num_experts", "num_shared_experts", "moe_first_dense"):
            _check_int(name, getattr(self, name), minimum=0)
        _check_positive_int("top_k", self.top_k)
        _check_positive_int("moe_every", self.moe_every)
        if self.moe_ffn_dim is not None:
            _check_positive_int("moe_ffn_dim", self.moe_ffn_dim)
        _check_positive_float("router_scale", self.router_scale)
        if self.router_score not in ("softmax", "sigmoid"):
            raise ValueError(f"LlamaConfig: router_score={self.router_score!r}, expected "
                             f"'softmax' or 'sigmoid'")
        if not isinstance(self.router_norm_topk, bool):
            raise ValueError(f"LlamaConfig: router_norm_topk={self.router_norm_topk!r}, "
                             f"expected a bool")
        if self.num_experts and self.top_k > self.num_experts:
            raise ValueError(f"LlamaConfig: top_k={self.top_k} exceeds num_experts="
                             f"{self.num_experts}; expected 1 <= top_k <= num_experts")
        if self.num_experts == 0 and self.num_shared_experts:
            raise ValueError(f"LlamaConfig: num_shared_experts={self.num_shared_experts} "
                             f"needs routed experts (num_experts > 0), got num_experts=0")

    def _validate_attention(self) -> None:
        mla = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim")
        if self.attention == "gqa":
            given = [n for n in mla if getattr(self, n) is not None]
            if given:
                raise ValueError(f"LlamaConfig: {given[0]}={getattr(self, given[0])!r} is an "
                                 f"MLA field but attention='gqa'; expected attention='mla' or "
                                 f"{given[0]}=None")
            return
        if self.attention != "mla":
            raise ValueError(f"LlamaConfig: attention={self.attention!r}, expected 'gqa' or "
                             f"'mla'")
        if self.q_lora_rank is not None:
            _check_positive_int("q_lora_rank", self.q_lora_rank)
        for name in mla[1:]:
            _check_positive_int(name, getattr(self, name))
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"LlamaConfig: qk_rope_head_dim={self.qk_rope_head_dim} is odd; "
                             f"RoPE rotates feature pairs, expected an even number")

    @property
    def is_moe(self) -> bool:
        """Whether some block has a mixture-of-experts feed-forward."""
        return bool(self.moe_layer_ids)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` (0-based) has an MoE feed-forward (see ``moe_every``)."""
        return (self.num_experts > 0 and layer_id >= self.moe_first_dense
                and (layer_id + 1) % self.moe_every == 0)

    @property
    def moe_layer_ids(self) -> list[int]:
        """The blocks with an MoE feed-forward, in order."""
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    @property
    def expert_hidden_dim(self) -> int:
        """Hidden width of one expert: ``moe_ffn_dim`` if set, else ``ffn_hidden_dim``."""
        return self.ffn_hidden_dim if self.moe_ffn_dim is None else self.moe_ffn_dim

    @property
    def rope_dim(self) -> int:
        """Features per head that RoPE rotates: ``head_dim`` (GQA) or ``qk_rope_head_dim``."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

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
            ``sum(p.numel() for p in model.parameters())`` (buffers such as the routers'
            balancing bias are not parameters).
        """
        return _num_params(self)

    def num_active_params(self) -> int:
        """Parameters one token uses: :meth:`num_params` less the routed experts it does not
        visit (``num_experts - top_k`` per MoE layer). Equal to :meth:`num_params` when dense.
        """
        return _num_active_params(self)

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward), PaLM / Chinchilla accounting.

        ``6 * N + 6 * n_layers * seq_len * (qk + v)`` where ``N`` counts the weights a token
        multiplies by: every linear weight of the blocks it visits (for an MoE layer: the
        router, its ``top_k`` routed experts and the shared ones) plus the output head
        (when tied, the shared matrix counts once, for its output-head use), and ``qk`` /
        ``v`` are the widths of all heads' queries and values (``dim`` each for GQA, so the
        term is the familiar ``12 * n_layers * dim * seq_len``). The input embedding lookup
        and the RMSNorm gains are not matmuls and are left out. Each matmul weight costs 2
        FLOPs per token forward and 4 backward; the attention term is ``QK^T`` and ``AV``,
        counted over the full ``seq_len x seq_len`` score matrix as PaLM does, although a
        causal kernel skips about half of it. This equals what ``torch.utils.flop_counter``
        counts for one forward and backward, divided by the number of tokens (for MoE, in
        dropless routing, where every token visits exactly ``top_k`` experts).

        Args:
            seq_len: context length in tokens; defaults to ``max_seq_len``.

        Returns:
            FLOPs per token, an int.

        Raises:
            ValueError: if ``seq_len`` is not a positive int.
        """
        seq_len = self.max_seq_len if seq_len is None else seq_len
        _check_positive_int("seq_len", seq_len)
        return _flops_per_token(self, seq_len)

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of the config fields, in declaration order (for override validation)."""
        return [f.name for f in dataclasses.fields(cls)]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"LlamaConfig: {name}={value!r}, expected an int >= {minimum}")


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; True as a width is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"LlamaConfig: {name}={value!r}, expected a positive int")


def _check_positive_float(name: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not 0 < value < math.inf:  # also rejects nan
        raise ValueError(f"LlamaConfig: {name}={value!r}, expected a positive finite number")


# ------------------------------------------------------------ parameter and FLOP counts


def _attention_params(cfg: LlamaConfig) -> tuple[int, int]:
    """``(matmul weights, norm gains)`` of one attention module."""
    if cfg.attention == "mla":
        heads, qk = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            query, norms = cfg.dim * heads * qk, 0
        else:
            query, norms = cfg.q_lora_rank * (cfg.dim + heads * qk), cfg.q_lora_rank
        kv = (cfg.dim * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
              + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        out = heads * cfg.v_head_dim * cfg.dim
        return query + kv + out, norms + cfg.kv_lora_rank
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    return 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv_dim, 0  # wq, wo + wk, wv


def _expert_params(cfg: LlamaConfig) -> int:
    """Weights of one routed expert (a SwiGLU of ``expert_hidden_dim``)."""
    return 3 * cfg.dim * cfg.expert_hidden_dim


def _feed_forward_params(cfg: LlamaConfig, layer_id: int, active: bool = False) -> int:
    """Matmul weights of block ``layer_id``'s feed-forward (all of them, or, with ``active``,
    those one token multiplies by: router, ``top_k`` routed experts, shared experts)."""
    if not cfg.is_moe_layer(layer_id):
        return 3 * cfg.dim * cfg.ffn_hidden_dim
    routed = cfg.top_k if active else cfg.num_experts
    shared = cfg.num_shared_experts * _expert_params(cfg)
    return cfg.num_experts * cfg.dim + routed * _expert_params(cfg) + shared


def _matmul_params(cfg: LlamaConfig, active: bool) -> int:
    """Every matmul weight of the blocks (active or all) plus the output head."""
    attn, _ = _attention_params(cfg)
    blocks = sum(attn + _feed_forward_params(cfg, i, active) for i in range(cfg.n_layers))
    return blocks + cfg.vocab_size * cfg.dim


def _other_params(cfg: LlamaConfig) -> int:
    """Parameters outside matmuls: norm gains, and the input embedding unless tied."""
    _, attn_norms = _attention_params(cfg)
    norms = cfg.n_layers * (2 * cfg.dim + attn_norms) + cfg.dim
    return norms + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)


def _num_params(cfg: LlamaConfig) -> int:
    """See :meth:`LlamaConfig.num_params`."""
    return _matmul_params(cfg, active=False) + _other_params(cfg)


def _num_active_params(cfg: LlamaConfig) -> int:
    """See :meth:`LlamaConfig.num_active_params`."""
    return _matmul_params(cfg, active=True) + _other_params(cfg)


def _flops_per_token(cfg: LlamaConfig, seq_len: int) -> int:
    """See :meth:`LlamaConfig.flops_per_token` (``seq_len`` already checked)."""
    if cfg.attention == "mla":
        qk = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        v = cfg.n_heads * cfg.v_head_dim
    else:
        qk = v = cfg.n_heads * cfg.head_dim
    return 6 * _matmul_params(cfg, active=True) + 6 * cfg.n_layers * seq_len * (qk + v)
