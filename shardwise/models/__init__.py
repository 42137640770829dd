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
sharding unit. RoPE tables are non-persistent fp32 buffers. ``cfg.num_active_params()`` counts
the parameters one token uses (for a mixture of experts: ``top_k`` of the routed experts).

Mixture-of-experts blocks (``cfg.is_moe_layer(i)``, docs/moe.md): ``layers.{i}.feed_forward``
is a :class:`MoE` with ``router.gate.weight`` (E, dim), the persistent fp32 buffer
``router.expert_bias`` (E,), ``experts.{w1,w3}`` (E, dim, ffn), ``experts.w2`` (E, ffn, dim)
and optionally ``shared_experts.{w1,w2,w3}.weight``. ``MoE.experts(x_sorted, counts)`` is
the seam expert parallelism wraps. Per step: :func:`moe_aux_loss` after each forward (add it
to the loss), :func:`finish_moe_step` after the optimizer step; ``MoE.stats_reducer`` (set by
:func:`set_stats_reducer` or ``shardwise.parallel.apply_global_balance``) sums the balance
statistics over the data-parallel ranks. Multi-head latent attention blocks
(``cfg.attention == "mla"``): ``layers.{i}.attention`` is a :class:`LatentAttention`.

Vision-language-action models (``get_model_config("debug-vla")``, a :class:`VLAConfig`;
``list_model_configs(multimodal=True)`` lists them): :class:`VisionLanguageAction` is a ViT
``vision`` tower (:class:`VisionEncoder` of :class:`VisionBlock`), an MLP ``projector`` and
the decoder above under the same names; ``model(tokens, images)``. :class:`ActionTokenizer`
maps actions to the top token ids. Every repeated block (``TransformerBlock``,
``VisionBlock``) is a :class:`ModelBlock`: ``shard(..., wrap={ModelBlock})`` makes each a unit.

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
from shardwise.models.layers import ModelBlock
from shardwise.models.mla import LatentAttention
from shardwise.models.moe import (MoE, MoESettings, MoEStepStats, configure_moe,
                                  finish_moe_step, moe_aux_loss, moe_layers,
                                  set_capacity_groups, set_stats_reducer)
from shardwise.models.pieces import Piece, PipelinePieces
from shardwise.models.registry import get_model_config, list_model_configs
from shardwise.models.vision import VisionBlock, VisionEncoder
from shardwise.models.vla import VisionLanguageAction, VLAConfig
from shardwise.models.vla_actions import ActionTokenizer

__all__ = [
    "ActionTokenizer",
    "Attention",
    "FeedForward",
    "LatentAttention",
    "LlamaConfig",
    "MoE",
    "MoESettings",
    "ModelBlock",
    "MoEStepStats",
    "Piece",
    "PipelinePieces",
    "RMSNorm",
    "RotaryEmbedding",
    "TiedOutput",
    "Transformer",
    "TransformerBlock",
    "VLAConfig",
    "VisionBlock",
    "VisionEncoder",
    "VisionLanguageAction",
    "build_model",
    "configure_moe",
    "finish_moe_step",
    "get_model_config",
    "init_module_weights",
    "list_model_configs",
    "moe_aux_loss",
    "moe_layers",
    "set_capacity_groups",
    "set_stats_reducer",
]
