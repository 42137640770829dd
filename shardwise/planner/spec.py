"""ModelSpec: the shape of a decoder-only transformer as the planner sees it.

One record covers what the planner must price: Llama-style decoders (RMSNorm, SwiGLU, RoPE,
grouped-query attention), GPT-style decoders (LayerNorm, GELU, biases, learned positions,
dropout), mixture-of-experts feed-forwards (routed + shared experts, the first layers dense)
and multi-head latent attention (MLA). The trainer can build only the Llama-style dense
shapes (``buildable``); the planner prices them all.

[Note: parameter shapes] :meth:`ModelSpec.unit_shapes` lists every parameter's shape per
sharding unit exactly as ``shardwise.models.Transformer`` registers them (one unit per
``TransformerBlock`` plus the root unit holding the embedding, final norm and output head),
so the engine's own layout arithmetic (``shardwise.shard.layout.build_layout``) gives the
planner the bytes ``shardwise.memory_report`` counts. Tensor parallelism divides the
column-parallel weights' rows (wq, wk, wv, w1, w3, embedding and output vocabulary) and the
row-parallel weights' columns (wo, w2); norms and routers are replicated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["ModelSpec"]

_MLPS = ("swiglu", "gelu")
_NORMS = ("rmsnorm", "layernorm")
_POSITIONS = ("rope", "learned", "alibi")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder's shape (see the module docstring).

    Attributes are widths in features and counts; defaults describe a dense Llama block.
    """

    name: str
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    ffn_dim: int
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means ``n_heads``."""
    head_dim: int = 0
    """Features per head; 0 means ``dim // n_heads``."""
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    position: str = "rope"
    bias: bool = False
    dropout: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 8192
    # Mixture of experts (n_experts == 0: dense).
    n_experts: int = 0
    top_k: int = 0
    n_shared_experts: int = 0
    moe_ffn_dim: int = 0
    n_dense_layers: int = 0
    """Leading layers with a dense ``ffn_dim`` feed-forward (DeepSeek's first 3)."""
    moe_every: int = 1
    """Layer ``i >= n_dense_layers`` is MoE when ``(i + 1) % moe_every == 0`` (as
    ``LlamaConfig.is_moe_layer``)."""
    # Multi-head latent attention (kv_lora_rank == 0: standard attention).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0
    """Multi-token-prediction modules (DeepSeek-V3: 1), each priced as one more layer."""
    buildable: bool = True
    """Whether ``shardwise.models`` can build it (``shardwise train`` refuses the others)."""
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelSpec {self.name!r}: {f}={v!r}, expected an int >= 1")
        for f, choices in (("mlp", _MLPS), ("norm", _NORMS), ("position", _POSITIONS)):
            if getattr(self, f) not in choices:
                raise ValueError(f"ModelSpec {self.name!r}: {f}={getattr(self, f)!r}, expected "
                                 f"one of {', '.join(choices)}")
        if self.kv_heads and self.n_heads % self.kv_heads:
            raise ValueError(f"ModelSpec {self.name!r}: n_heads={self.n_heads} is not a "
                             f"multiple of n_kv_heads={self.kv_heads}")
        if self.n_experts and not (0 < self.top_k <= self.n_experts and self.moe_ffn_dim > 0):
            raise ValueError(f"ModelSpec {self.name!r}: a MoE needs 0 < top_k <= n_experts and "
                             f"moe_ffn_dim > 0, got top_k={self.top_k}, n_experts="
                             f"{self.n_experts}, moe_ffn_dim={self.moe_ffn_dim}")
        if self.n_dense_layers > self.n_layers:
            raise ValueError(f"ModelSpec {self.name!r}: n_dense_layers={self.n_dense_layers} "
                             f"exceeds n_layers={self.n_layers}")

    # ---------------------------------------------------------------- derived widths
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hd(self) -> int:
        """Features per attention head."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_dim(self) -> int:
        """Query/key features per head (MLA: nope + rope parts)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.hd

    @property
    def v_dim(self) -> int:
        """Value features per head."""
        return self.v_head_dim if self.is_mla else self.hd

    @property
    def attn_width(self) -> int:
        """Width of the attention output before ``wo`` (heads x value features)."""
        return self.n_heads * self.v_dim

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) has an expert feed-forward."""
        return (self.is_moe and index >= self.n_dense_layers
                and (index + 1) % self.moe_every == 0)

    @property
    def n_moe_layers(self) -> int:
        return sum(1 for i in range(self.n_layers) if self.is_moe_layer(i))

    # ---------------------------------------------------------------- parameter shapes
    def _norm(self, tp: int) -> list[tuple[int, ...]]:
        return [(self.dim,), (self.dim,)] if self.norm == "layernorm" else [(self.dim,)]

    def _linear(self, out_f: int, in_f: int) -> list[tuple[int, ...]]:
        return [(out_f, in_f)] + ([(out_f,)] if self.bias else [])

    def attention_shapes(self, tp: int = 1) -> list[tuple[int, ...]]:
        """Attention weights of one block on one tensor-parallel rank ([Note: parameter
        shapes]); grouped kv heads fewer than ``tp`` are replicated, not split."""
        d, h = self.dim, self.n_heads // tp
        if self.is_mla:
            shapes = []
            if self.q_lora_rank:
                shapes += self._linear(self.q_lora_rank, d) + [(self.q_lora_rank,)]
                shapes += self._linear(h * self.qk_dim, self.q_lora_rank)
            else:
                shapes += self._linear(h * self.qk_dim, d)
            shapes += self._linear(self.kv_lora_rank + self.qk_rope_head_dim, d)
            shapes += [(self.kv_lora_rank,)]
            shapes += self._linear(h * (self.qk_nope_head_dim + self.v_head_dim),
                                   self.kv_lora_rank)
            return shapes + [(d, h * self.v_dim)] + ([(d,)] if self.bias else [])
        kv = max(1, self.kv_heads // tp) * self.hd
        return (self._linear(h * self.hd, d) + self._linear(kv, d) + self._linear(kv, d)
                + [(d, h * self.hd)] + ([(d,)] if self.bias else []))

    def ffn_shapes(self, index: int, tp: int = 1, ep: int = 1, experts: bool = True
                   ) -> list[tuple[int, ...]]:
        """Feed-forward weights of block ``index`` on one (tp, ep) rank (``experts=False``:
        without the routed experts, which shard over the expert-data-parallel group)."""
        if not self.is_moe_layer(index):
            return self._dense_ffn(self.ffn_dim, tp)
        shapes = [(self.n_experts, self.dim)]  # router, replicated
        if experts:
            shapes += self.expert_shapes(index, tp, ep)
        if self.n_shared_experts:
            shapes += self._dense_ffn(self.n_shared_experts * self.moe_ffn_dim, tp)
        return shapes

    def expert_shapes(self, index: int, tp: int = 1, ep: int = 1) -> list[tuple[int, ...]]:
        """The routed experts of block ``index`` held by one (tp, ep) rank: grouped
        ``(experts, in, out)`` tensors, as ``shardwise.models``' GroupedExperts holds them
        (w1 and w3 ``(E, dim, f)``, w2 ``(E, f, dim)``), so the engine shards them by
        expert along dim 0."""
        if not self.is_moe_layer(index):
            return []
        e, f, d = self.n_experts // ep, self.moe_ffn_dim // tp, self.dim
        if self.mlp == "swiglu":
            return [(e, d, f), (e, f, d), (e, d, f)]
        return [(e, d, f), (e, f, d)]

    def _dense_ffn(self, hidden: int, tp: int) -> list[tuple[int, ...]]:
        f, d = hidden // tp, self.dim
        w2 = [(d, f)] + ([(d,)] if self.bias else [])
        if self.mlp == "swiglu":
            return self._linear(f, d) + w2 + self._linear(f, d)
        return self._linear(f, d) + w2

    def block_shapes(self, index: int, tp: int = 1, ep: int = 1, experts: bool = True
                     ) -> list[tuple[int, ...]]:
        """Every parameter of block ``index``: norm, attention, norm, feed-forward."""
        return (self._norm(tp) + self.attention_shapes(tp) + self._norm(tp)
                + self.ffn_shapes(index, tp, ep, experts))

    def root_shapes(self, tp: int = 1, first: bool = True, last: bool = True
                    ) -> list[tuple[int, ...]]:
        """Parameters outside the blocks on a pipeline stage holding the embedding
        (``first``) and / or the final norm and head (``last``)."""
        shapes: list[tuple[int, ...]] = []
        v = -(-self.vocab_size // tp)
        if first:
            shapes.append((v, self.dim))
            if self.position == "learned":
                shapes.append((self.max_seq_len, self.dim))
        if last:
            shapes += self._norm(tp)
            if not (self.tie_embeddings and first):
                shapes.append((v, self.dim))
        return shapes

    def unit_shapes(self, tp: int = 1, ep: int = 1) -> list[list[tuple[int, ...]]]:
        """Root unit first, then one unit per block (the trainer's wrap policy)."""
        return [self.root_shapes(tp)] + [self.block_shapes(i, tp, ep)
                                         for i in range(self.n_layers)]

    # ---------------------------------------------------------------- counts
    def num_params(self) -> int:
        """Every parameter of the main model, tied embedding counted once (the published
        counts: DeepSeek-V3's 671B leaves out its multi-token-prediction module)."""
        return sum(math.prod(s) for u in self.unit_shapes() for s in u)

    def mtp_params(self) -> int:
        """Parameters of the multi-token-prediction modules (one block each, plus the
        projection and norms joining it to the main model; embedding and head shared)."""
        block = sum(math.prod(s) for s in self.block_shapes(self.n_layers - 1))
        return self.mtp_layers * (block + 2 * self.dim * self.dim + 2 * self.dim)

    def active_params(self) -> int:
        """Parameters a token passes through (routed experts: ``top_k`` of them)."""
        if not self.is_moe:
            return self.num_params()
        per_expert = (3 if self.mlp == "swiglu" else 2) * self.dim * self.moe_ffn_dim
        return self.num_params() - self.n_moe_layers * (self.n_experts - self.top_k) * per_expert

    def with_name(self, name: str) -> "ModelSpec":
        return dataclasses.replace(self, name=name)
