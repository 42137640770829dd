"""shardwise.models: a parallelism-unaware Llama-style decoder and its named configs.

    from shardwise.models import build_model, get_model_config, list_model_configs

    cfg = get_model_config("debug", vocab_size=256)   # named config + field overrides
    cfg.num_params()                                  # exact count (tied weights once)
    cfg.flops_per_token(seq_len)                      # training FLOPs per token (6N + attention)
    model = build_model(cfg, device="cpu", seed=0)    # built and initialised
    model = build_model(cfg, device="meta")           # no storage, no RNG use
    logits = model(tokens)                            # (B, T) int64 -> (B, T, vocab)

Parameter names (torchtitan's): ``tok_embeddings.weight``,
``layers.{i}.attention_norm.weight``, ``layers.{i}.attention.{wq,wk,wv,wo}.weight``,
``layers.{i}.ffn_norm.weight``, ``layers.{i}.feed_forward.{w1,w2,w3}.weight``,
``norm.weight``, ``output.weight`` (absent from ``named_parameters()`` when embeddings are
tied). ``model.layers`` is an ``nn.ModuleList`` of :class:`TransformerBlock`, the natural
sharding unit. RoPE tables are non-persistent fp32 buffers.

Meta-device materialisation: for each module in ``model.named_modules()`` order, allocate
that module's direct tensors and call :func:`init_module_weights` on it; with the same
``torch.manual_seed`` the result is bitwise ``build_model(cfg, device="cpu", seed=...)``
(what ``shardwise.shard(..., init_weights=init_module_weights)`` does, one rank's rows at a
time).
"""

from shardwise.models.config import LlamaConfig
from shardwise.models.llama import (
    Attention,
    FeedForward,
    RMSNorm,
    RotaryEmbedding,
    TiedOutput,
    Transformer,
    TransformerBlock,
    build_model,
    init_module_weights,
)
from shardwise.models.registry import get_model_config, list_model_configs

__all__ = [
    "Attention",
    "FeedForward",
    "LlamaConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "TiedOutput",
    "Transformer",
    "TransformerBlock",
    "build_model",
    "get_model_config",
    "init_module_weights",
    "list_model_configs",
]
