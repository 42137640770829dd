"""Named model configs, from CPU-sized ``debug`` models to published Llama 3 and MoE shapes.

=============  ==========  ==========  ==============================================
name           params      active      use
=============  ==========  ==========  ==============================================
debug          3.28M                   tests and the default config; ~100 steps in minutes
                                       on 2 CPU cores
debug-moe      10.37M      3.29M       MoE twin of debug: 8 experts of width 384, top-2
                                       (the active FFN width of debug), every block
small          33.6M                   benchmarks (vocab 8192: a BPE tokenizer, or override
                                       vocab_size)
llama3-8b      8.03B                   Llama 3 8B shape (vocab 128256, GQA 32/8, ffn 14336)
mixtral-8x7b   46.70B      12.88B      Mixtral 8x7B: 8 experts of 14336, top-2 softmax
llama3-70b     70.55B                  Llama 3 70B shape (GQA 64/8, ffn 28672)
llama3-405b    405.85B                 Llama 3 405B shape (GQA 128/8, ffn 53248)
deepseek-v3    671.03B     37.55B      DeepSeek-V3: MLA, 3 dense + 58 MoE blocks of 256
                                       experts of 2048 + 1 shared, top-8 sigmoid, x2.5
debug-vla      3.74M                   vision-language-action (VLAConfig): ViT tower 0.42M,
                                       projector 0.10M, debug-like decoder with 16 action
                                       tokens; a training step in under a second on 2 cores
debug-vla-moe  10.82M      3.74M       its MoE twin (8 experts, top-2 in the decoder)
vla-7b         7.39B                   OpenVLA-sized: Llama 2 7B decoder (256 action
                                       tokens) + a ViT-H/14-sized tower at 224 x 224
                                       (OpenVLA fuses SigLIP + DINOv2: 7.54B)
=============  ==========  ==========  ==============================================

The Llama 3 feed-forward widths come from the Llama rule (``multiple_of`` and
``ffn_dim_multiplier``), not from a hard-coded ``ffn_dim``; the parameter counts above are
checked by the tests, the MoE shapes against their published totals (Mixtral 8x7B: 46.7B,
12.9B active; DeepSeek-V3: 671B, 37B active, without its 14B multi-token-prediction module,
which is not modelled). ``deepseek-v3`` builds and runs its MLA attention (mla.py) without
the YaRN extension (``max_seq_len`` 4096, the pre-training context) and routes with plain
top-8 over all 256 experts: DeepSeek's node-limited routing (top-4 of 8 expert groups) is
not implemented.
"""

from __future__ import annotations

import dataclasses
import difflib
from types import MappingProxyType

from shardwise.models.config import LlamaConfig
from shardwise.models.vla import VLAConfig

__all__ = ["get_model_config", "list_model_configs"]

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=8192)

# Read-only view: the registry is fixed data, not a global that callers mutate.
_CONFIGS = MappingProxyType({
    "debug": LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256,
                         multiple_of=256, max_seq_len=256),
    "debug-moe": LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=256,
                             multiple_of=256, max_seq_len=256, num_experts=8, top_k=2,
                             moe_ffn_dim=384),
    "small": LlamaConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=8192,
                         multiple_of=256, max_seq_len=512),
    "llama3-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             multiple_of=1024, ffn_dim_multiplier=1.3, **_LLAMA3),
    "mixtral-8x7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                vocab_size=32000, ffn_dim=14336, max_seq_len=32768,
                                rope_theta=1e6, num_experts=8, top_k=2, moe_ffn_dim=14336),
    "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                              multiple_of=4096, ffn_dim_multiplier=1.3, **_LLAMA3),
    "llama3-405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                               multiple_of=4096, ffn_dim_multiplier=1.2, **_LLAMA3),
    "deepseek-v3": LlamaConfig(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128,
                               vocab_size=129280, ffn_dim=18432, max_seq_len=4096,
                               norm_eps=1e-6, num_experts=256, top_k=8, num_shared_experts=1,
                               moe_ffn_dim=2048, moe_first_dense=3, router_score="sigmoid",
                               router_scale=2.5, attention="mla", q_lora_rank=1536,
                               kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                               v_head_dim=128),
})

_DEBUG_VISION = dict(image_size=56, patch_size=8, vision_dim=128, vision_layers=2,
                     vision_heads=4, num_action_tokens=16)

# Vision-language-action models (vla.py): apart from _CONFIGS, whose names are the decoders
# the trainer and the planner take.
_VLA_CONFIGS = MappingProxyType({
    "debug-vla": VLAConfig(decoder=dataclasses.replace(_CONFIGS["debug"], vocab_size=128),
                           **_DEBUG_VISION),
    "debug-vla-moe": VLAConfig(decoder=dataclasses.replace(_CONFIGS["debug-moe"],
                                                           vocab_size=128), **_DEBUG_VISION),
    "vla-7b": VLAConfig(decoder=LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                                            vocab_size=32000, ffn_dim=11008, max_seq_len=4096),
                        image_size=224, patch_size=14, vision_dim=1280, vision_layers=32,
                        vision_heads=16, num_action_tokens=256),
})


def list_model_configs(multimodal: bool = False) -> list[str]:
    """Names accepted by :func:`get_model_config`, smallest model first.

    Args:
        multimodal: also list the vision-language-action configs (``debug-vla``,
            ``debug-vla-moe``, ``vla-7b``: :class:`~shardwise.models.vla.VLAConfig`), after
            the decoders (default False: the decoder-only :class:`LlamaConfig` names).

    Returns:
        A new list of names.
    """
    return list(_CONFIGS) + (list(_VLA_CONFIGS) if multimodal else [])


def get_model_config(name: str, **overrides: object) -> LlamaConfig | VLAConfig:
    """A named config, optionally with some fields replaced.

    Args:
        name: one of :func:`list_model_configs` (``multimodal=True`` included).
        **overrides: fields of the config to replace, e.g. ``vocab_size=256`` (for a
            ``VLAConfig``: its own fields, ``decoder`` a whole ``LlamaConfig``).

    Returns:
        A new, validated :class:`LlamaConfig` (or :class:`VLAConfig` for the ``*vla*`` names).

    Raises:
        ValueError: for an unknown name (listing the valid names and the closest match),
            an unknown override field (naming it), or an override that fails validation.
    """
    configs = {**_CONFIGS, **_VLA_CONFIGS}
    if name not in configs:
        raise ValueError(f"unknown model config {name!r}{_did_you_mean(name, configs)}; "
                         f"valid names: {', '.join(configs)}")
    base = configs[name]
    fields = type(base).field_names()
    unknown = [key for key in overrides if key not in fields]
    if unknown:
        key = unknown[0]
        raise ValueError(f"unknown {type(base).__name__} field {key!r} in overrides for "
                         f"{name!r}{_did_you_mean(key, fields)}; valid fields: "
                         f"{', '.join(fields)}")
    return dataclasses.replace(base, **overrides)


def _did_you_mean(word: str, choices) -> str:  # noqa: ANN001 - any iterable of str
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""
