"""Model names the planner knows: the trainer's registry plus published shapes (data/models.toml).

    get_model_spec("llama3-405b")          # from shardwise.models.registry (buildable)
    get_model_spec("gpt-1t")               # from the planner's catalogue (planner-only)
    load_model_config("my_model.toml")     # any other shape

Registry names are converted from their ``LlamaConfig`` so the two never disagree. Shapes the
trainer cannot build are marked ``buildable = false``; :func:`planner_only_models` lists them
so that ``shardwise train`` can refuse them by name.
"""

from __future__ import annotations

import dataclasses
import difflib
from shardwise.compat import tomllib
from importlib import resources
from pathlib import Path

from shardwise.models import LlamaConfig, get_model_config, list_model_configs
from shardwise.planner.spec import ModelSpec

__all__ = ["list_models", "get_model_spec", "from_llama_config", "load_model_config",
           "planner_only_models"]

_FIELDS = {f.name for f in dataclasses.fields(ModelSpec)}


def from_llama_config(cfg: LlamaConfig, name: str = "custom") -> ModelSpec:
    """The :class:`ModelSpec` of ``Transformer(cfg)`` (same parameters, same shapes),
    mixture-of-experts and multi-head-latent-attention fields included when the config
    has them."""
    moe, mla = {}, {}
    if getattr(cfg, "num_experts", 0):
        moe = dict(n_experts=cfg.num_experts, top_k=cfg.top_k,
                   n_shared_experts=cfg.num_shared_experts, moe_ffn_dim=cfg.expert_hidden_dim,
                   n_dense_layers=cfg.moe_first_dense, moe_every=cfg.moe_every)
    if getattr(cfg, "attention", "gqa") == "mla":
        mla = dict(q_lora_rank=cfg.q_lora_rank or 0, kv_lora_rank=cfg.kv_lora_rank,
                   qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                   v_head_dim=cfg.v_head_dim)
    return ModelSpec(name=name, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                     n_kv_heads=cfg.n_kv_heads, vocab_size=cfg.vocab_size,
                     ffn_dim=cfg.ffn_hidden_dim, tie_embeddings=cfg.tie_embeddings,
                     max_seq_len=cfg.max_seq_len, buildable=True,
                     source="shardwise.models.registry", **moe, **mla)


def _catalogue() -> dict[str, dict]:
    text = resources.files("shardwise.planner").joinpath("data/models.toml").read_text()
    return tomllib.loads(text)


def _resolve(name: str, table: dict, tables: dict[str, dict], where: str) -> ModelSpec:
    fields = dict(table)
    base = fields.pop("base", None)
    if base is not None:
        if base in tables:
            inherited = dict(tables[base])
        elif base in list_model_configs():
            inherited = _spec_fields(from_llama_config(get_model_config(base), base))
            inherited.pop("source")
        else:
            raise ValueError(f"{where}: base={base!r} is not a model name; valid: "
                             f"{', '.join(list_models())}")
        inherited.pop("name", None)  # the new entry has its own name
        fields = {**inherited, **fields}
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(_FIELDS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{where}: unknown model field {unknown[0]!r}{hint}; valid fields: "
                         f"{', '.join(sorted(_FIELDS - {'name'}))}")
    fields["name"] = fields.get("name", name)
    try:
        return ModelSpec(**fields)
    except TypeError as exc:  # a required field is missing
        raise ValueError(f"{where}: {exc}") from None


def _spec_fields(spec: ModelSpec) -> dict:
    return {f: getattr(spec, f) for f in _FIELDS}


def list_models() -> list[str]:
    """Every name :func:`get_model_spec` accepts: registry names first (a registry name
    shadows a catalogue entry of the same name: what the trainer builds is what is planned)."""
    registry = list_model_configs()
    return registry + [n for n in _catalogue() if not n.startswith("_") and n not in registry]


def get_model_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of a registry or catalogue name.

    Raises:
        ValueError: for an unknown name (with the closest valid one).
    """
    if name in list_model_configs():
        return from_llama_config(get_model_config(name), name)
    tables = _catalogue()
    if name.startswith("_") or name not in tables:
        close = difflib.get_close_matches(name, list_models(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown model {name!r}{hint}; valid names: {', '.join(list_models())}"
                         f", or --model-config FILE.toml")
    return _resolve(name, tables[name], tables, f"model {name!r} in data/models.toml")


def load_model_config(path: str | Path) -> ModelSpec:
    """A :class:`ModelSpec` from a TOML file of ModelSpec fields (``base = "llama3-8b"``
    starts from a known model and overrides some fields).

    Raises:
        ValueError: a missing file, bad TOML, unknown fields or values out of range.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--model-config {str(path)!r}: no such file")
    try:
        table = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--model-config {str(path)!r}: not valid TOML ({exc})") from None
    return _resolve(p.stem, table, {k: v for k, v in _catalogue().items()}, str(path))


def planner_only_models() -> list[str]:
    """Catalogue names the trainer cannot build (GELU/LayerNorm GPTs, MLA, MoE)."""
    return [n for n in list_models() if not get_model_spec(n).buildable]
