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
from shardwise.models.mla import LatentAttention
from shardwise.models.moe import (MoE, MoESettings, MoEStepStats, configure_moe,
                                  finish_moe_step, moe_aux_loss, moe_layers, set_stats_reducer)
from shardwise.models.registry import get_model_config, list_model_configs

__all__ = [
    "Attention",
    "FeedForward",
    "LatentAttention",
    "LlamaConfig",
    "MoE",
    "MoESettings",
    "MoEStepStats",
    "RMSNorm",
    "RotaryEmbedding",
    "TiedOutput",
    "Transformer",
    "TransformerBlock",
    "build_model",
    "configure_moe",
    "finish_moe_step",
    "get_model_config",
    "init_module_weights",
    "list_model_configs",
    "moe_aux_loss",
    "moe_layers",
    "set_stats_reducer",
]
