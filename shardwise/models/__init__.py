"""shardwise.models: a parallelism-unaware Llama-style decoder and its named configs.

See docs/INTERFACES.md (shardwise.models) for the contract with the sharding engine.
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
