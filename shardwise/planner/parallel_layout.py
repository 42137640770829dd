"""A parallel layout as data: the record the planner searches, prices and prints.

    parse_layout("tp=8,pp=16,dp_shard=128,pp_schedule=1f1b,microbatch=1,ac=full")
    # -> {"tp": 8, "pp": 16, ...}: the keys a user fixed; the search chooses the rest

Keys (the short names of the config and of ``--layout``):

=================  ========================================================================
dp_replicate       replicas; gradients all-reduced across them (hybrid sharding)
dp_shard           ranks a replica's parameters / gradients / optimizer state are sharded over
cp                 context parallelism: ranks splitting each sequence
tp                 tensor parallelism (with ``sp``: sequence parallelism in its regions)
pp                 pipeline stages
ep                 expert parallelism, carved out of ``dp_shard x cp`` (divides it)
zero               ZeRO stage 0-3 over ``dp_shard x cp``
microbatch         sequences per micro-batch on one data-parallel rank
pp_microbatches    micro-batches per step on one data-parallel rank (gradient accumulation
                   when ``pp == 1``): global batch = dp_replicate x dp_shard x microbatch x this
pp_schedule        none (pp 1), gpipe, 1f1b, interleaved_1f1b, zb1, zbv, dualpipev
pp_virtual         stages per pipeline rank (2 for interleaved_1f1b / zbv / dualpipev, else 1)
ac                 activation checkpointing: none, selective (attention core), full
sp                 sequence parallelism with tensor parallelism (true / false)
offload            none or cpu (optimizer state and fp32 masters in host memory)
comm_weights       fp, int8 or fp8 parameter all-gathers
comm_grads         fp, int8 or int4 gradient reduce-scatters
cp_impl            how context parallelism attends (cp > 1): ring (shardwise's default),
                   ulysses, hybrid (shardwise.parallel.context builds all three) or
                   allgather (Llama 3's all-gather of keys and values, priced for the
                   published runs that used it and for multi-head latent attention, which
                   apply_cp does not cover); at cp 1 it changes nothing
=================  ========================================================================

``cp_impl`` is the last field, so layout strings and JSON records written before it parse
to the same layouts (ring, the trainer's default).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from shardwise.parallel.context import ulysses_degree
from shardwise.parallel.pipeline.schedules import SCHEDULE_NAMES, schedule_spec

__all__ = ["Layout", "LAYOUT_KEYS", "SCHEDULES", "CP_IMPLS", "parse_layout", "check_layout",
           "cp_degrees", "cp_impl_error"]

SCHEDULES = ("none",) + tuple(n for n in SCHEDULE_NAMES if n != "looped_bfs")
"""``none`` (pp 1) and the generators of ``shardwise.parallel`` (looped BFS, which holds
every micro-batch like GPipe and is never faster than interleaved 1F1B, is left out)."""
CP_IMPLS = ("ring", "ulysses", "hybrid", "allgather")
"""Context-parallel attention: the three ``shardwise.parallel.context`` builds
(``CP_IMPLS`` there) and Llama 3's all-gather of keys and values."""
_V_FIXED = {"zbv": 2, "dualpipev": 2}
_CHOICES = {"pp_schedule": SCHEDULES, "ac": ("none", "selective", "full"),
            "offload": ("none", "cpu"), "comm_weights": ("fp", "int8", "fp8"),
            "comm_grads": ("fp", "int8", "int4"), "cp_impl": CP_IMPLS}
_INTS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "zero", "microbatch",
         "pp_microbatches", "pp_virtual")


@dataclass(frozen=True)
class Layout:
    """A resolved layout (every key set); see the module docstring for the keys."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 1
    microbatch: int = 1
    pp_microbatches: int = 1
    pp_schedule: str = "none"
    pp_virtual: int = 1
    ac: str = "none"
    sp: bool = False
    offload: str = "none"
    comm_weights: str = "fp"
    comm_grads: str = "fp"
    cp_impl: str = "ring"

    @property
    def dp(self) -> int:
        """Data-parallel ranks (replicas x shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def key(self) -> str:
        """A compact one-line form, parseable by :func:`parse_layout`."""
        return ",".join(f"{k}={_fmt(v)}" for k, v in self.as_dict().items())

    def replace(self, **changes) -> "Layout":
        return dataclasses.replace(self, **changes)


LAYOUT_KEYS = tuple(f.name for f in dataclasses.fields(Layout))


def _fmt(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _parse_value(key: str, text: str) -> object:
    if key in _INTS:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"--layout: {key}={text!r}, expected an integer") from None
        if value < (0 if key == "zero" else 1):
            raise ValueError(f"--layout: {key}={value}, expected an integer >= "
                             f"{0 if key == 'zero' else 1}")
        return value
    if key == "sp":
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"--layout: sp={text!r}, expected true or false")
        return text.lower() in ("true", "1")
    if text not in _CHOICES[key]:
        close = difflib.get_close_matches(text, _CHOICES[key], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"--layout: {key}={text!r}{hint}; expected one of "
                         f"{', '.join(_CHOICES[key])}")
    return text


def parse_layout(text: str) -> dict[str, object]:
    """The keys fixed by a ``--layout`` string (``key=value`` pairs, comma-separated).

    Raises:
        ValueError: an unknown key (with the closest one), a repeated key, a bad value.
    """
    out: dict[str, object] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"--layout: {item!r} is not key=value (e.g. tp=8,pp=16)")
        key, value = (s.strip() for s in item.split("=", 1))
        if key == "zero_stage":
            key = "zero"
        if key not in LAYOUT_KEYS:
            close = difflib.get_close_matches(key, LAYOUT_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"--layout: unknown key {key!r}{hint}; keys: "
                             f"{', '.join(LAYOUT_KEYS)}")
        if key in out:
            raise ValueError(f"--layout: {key} given twice")
        out[key] = _parse_value(key, value)
    return out


def check_layout(layout: Layout, spec, gpus: int, seq_len: int, global_batch: int) -> None:
    """Refuse a layout that cannot run this job, naming the value and what was expected.

    Raises:
        ValueError: the mesh does not multiply to ``gpus``, ``ep`` does not divide
            ``dp_shard x cp`` or the experts, the batch does not split, a schedule's
            virtual stages or micro-batches do not fit, the context-parallel
            implementation does not fit the key/value heads (:func:`cp_degrees`), or a key
            contradicts another.
    """
    L = layout
    if L.gpus != gpus:
        raise ValueError(f"dp_replicate x dp_shard x cp x tp x pp = {L.dp_replicate} x "
                         f"{L.dp_shard} x {L.cp} x {L.tp} x {L.pp} = {L.gpus}, expected the "
                         f"GPU count {gpus}")
    if (L.dp_shard * L.cp) % L.ep:
        raise ValueError(f"ep={L.ep} must divide dp_shard x cp = {L.dp_shard * L.cp}")
    if L.ep > 1 and (not spec.is_moe or spec.n_experts % L.ep):
        raise ValueError(f"ep={L.ep} needs a mixture of experts whose expert count it "
                         f"divides; {spec.name} has {spec.n_experts} experts")
    if spec.n_heads % L.tp:
        raise ValueError(f"tp={L.tp} must divide the {spec.n_heads} attention heads of "
                         f"{spec.name}")
    if seq_len % (2 * L.cp) and L.cp > 1:
        raise ValueError(f"cp={L.cp}: the sequence length {seq_len} must be a multiple of "
                         f"2 x cp (load-balanced causal chunks)")
    if L.cp > 1:
        cp_degrees(L.cp_impl, L.cp, L.tp, spec)
    if L.dp * L.microbatch * L.pp_microbatches != global_batch:
        raise ValueError(f"dp_replicate x dp_shard x microbatch x pp_microbatches = {L.dp} x "
                         f"{L.microbatch} x {L.pp_microbatches} = "
                         f"{L.dp * L.microbatch * L.pp_microbatches}, expected the global "
                         f"batch {global_batch} sequences")
    _check_pipeline(L, spec)
    if L.zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={L.zero}, expected 0, 1, 2 or 3")
    if L.zero == 0 and (L.comm_weights != "fp" or L.comm_grads != "fp"):
        raise ValueError(f"comm_weights={L.comm_weights}, comm_grads={L.comm_grads} need "
                         f"zero >= 1: stage 0 all-reduces whole gradients")
    if L.sp and L.tp == 1:
        raise ValueError("sp=true needs tp > 1 (sequence parallelism lives in tp regions)")


def cp_degrees(impl: str, cp: int, tp: int, spec) -> tuple[int, int]:
    """(ring ranks, all-to-all degree) of context-parallel attention ``impl`` over ``cp``
    ranks for ``spec``'s attention split ``tp`` ways: ``(cp, 1)`` for ring, ``(1, cp)``
    for ulysses, ``(cp / u, u)`` for hybrid (``u`` as ``apply_cp`` chooses it,
    ``shardwise.parallel.context.ulysses_degree``), ``(1, 1)`` for allgather (neither).

    Raises:
        ValueError: an all-to-all degree the key/value heads per tensor rank do not allow
            (each rank takes whole heads), or ring / ulysses / hybrid on multi-head latent
            attention (``apply_cp`` does not cover it); each names the numbers.
    """
    if cp == 1 or impl == "allgather":
        return 1, 1
    if impl not in CP_IMPLS:
        raise ValueError(f"cp_impl={impl!r}, expected one of {', '.join(CP_IMPLS)}")
    if spec.is_mla:
        raise ValueError(f"cp_impl={impl!r}: shardwise.parallel.context covers grouped-query "
                         f"attention, not the multi-head latent attention of {spec.name}; "
                         f"use cp_impl=allgather (its latent keys all-gathered)")
    u = ulysses_degree(impl, cp, max(1, spec.kv_heads // tp))
    return cp // u, u


def cp_impl_error(impl: str, cp: int, tp: int, spec) -> str | None:
    """Why ``impl`` cannot run at ``cp`` x ``tp`` on ``spec`` (None: it can); see
    :func:`cp_degrees`."""
    try:
        cp_degrees(impl, cp, tp, spec)
    except ValueError as exc:
        return str(exc)
    return None


def _check_pipeline(L: Layout, spec) -> None:
    if L.pp == 1:
        if L.pp_schedule != "none" or L.pp_virtual != 1:
            raise ValueError(f"pp_schedule={L.pp_schedule}, pp_virtual={L.pp_virtual} need "
                             f"pp > 1 (pp=1 runs schedule 'none' with one stage)")
        return
    if L.pp_schedule == "none":
        raise ValueError(f"pp={L.pp} needs a pipeline schedule, got pp_schedule=none")
    want = _V_FIXED.get(L.pp_schedule)
    if want is not None and L.pp_virtual != want:
        raise ValueError(f"pp_schedule={L.pp_schedule} runs pp_virtual={want} stages per "
                         f"rank, got pp_virtual={L.pp_virtual}")
    if L.pp_schedule == "interleaved_1f1b" and L.pp_virtual < 2:
        raise ValueError(f"pp_schedule=interleaved_1f1b needs pp_virtual >= 2, got "
                         f"{L.pp_virtual}")
    if L.pp_schedule in ("gpipe", "1f1b", "zb1") and L.pp_virtual != 1:
        raise ValueError(f"pp_schedule={L.pp_schedule} runs one stage per rank, got "
                         f"pp_virtual={L.pp_virtual}")
    if L.pp * L.pp_virtual > spec.n_layers:
        raise ValueError(f"pp x pp_virtual = {L.pp * L.pp_virtual} stages, more than the "
                         f"{spec.n_layers} layers of {spec.name}")
    need = schedule_spec(L.pp_schedule).min_microbatches(L.pp)
    if L.pp_microbatches < need:
        raise ValueError(f"pp_schedule={L.pp_schedule} with pp={L.pp} needs pp_microbatches "
                         f">= {need}, got {L.pp_microbatches}")
