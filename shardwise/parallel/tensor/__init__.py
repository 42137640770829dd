"""Tensor and sequence parallelism (Megatron-style), composed with the ZeRO engine.

:func:`apply_tp` parallelises a model in place from a plan (built in for the shardwise
Llama and Hugging Face decoders with ``base_model_tp_plan``);
:func:`vocab_parallel_cross_entropy` computes the loss from vocab-sharded logits.
"""

from shardwise.parallel.tensor.api import apply_tp, share_tp_context, tp_context
from shardwise.parallel.tensor.layers import STYLES, copy_style
from shardwise.parallel.tensor.loss import vocab_parallel_cross_entropy
from shardwise.parallel.tensor.plan import HF_STYLES, LLAMA_PLAN, default_plan, resolve_plan

__all__ = ["apply_tp", "tp_context", "share_tp_context", "copy_style",
           "vocab_parallel_cross_entropy", "STYLES", "LLAMA_PLAN", "HF_STYLES", "default_plan",
           "resolve_plan"]
