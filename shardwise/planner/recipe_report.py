"""What a plan says about its low-bit recipe: how the device runs it, which linears it
converts, and its priced parts in one layout (what ``shardwise plan`` prints and its
``--json`` records carry as ``matmul_recipe``).

    s = recipe_summary(cm, layout)     # cm: a CostModel whose workload has a recipe
    print("\\n".join(describe_recipe(s, cm.hw.name)))

The parts are per step on the layout's busiest pipeline rank ([Note: pricing a low-bit
recipe] in recipe_cost.py): the converted multiplies' seconds at the recipe's rate and in
the compute dtype (forward and backward passes, replays aside), the casts' (with the
emulation's dequantisations), one gather round of the rank's units in bytes with and without
fp8 codes ([Note: pricing fp8 weight gathers] in dp_cost.py), the activations the recipe's
saved codes add a micro-batch, and the step with and without the recipe.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from shardwise.planner.cost_model import CostModel
from shardwise.planner.dp_cost import fp8_split, gather_bytes
from shardwise.planner.recipe_cost import recipe_path, recipe_seconds

__all__ = ["recipe_summary", "describe_recipe"]


def _layer_parts(cm, L, layers, offered: bool) -> dict[str, object]:
    """Seconds and bytes of the rank's layers per step (``L.pp_microbatches`` of them)."""
    m = L.pp_microbatches
    out = {"multiplies_s": 0.0, "multiplies_hp_s": 0.0, "casts_s": 0.0,
           "saved_delta_bytes": 0.0, "converted": [], "skipped": {}}
    for moe, count in Counter(cm.spec.is_moe_layer(i) for i in layers).items():
        w, _ = cm.stages.work(moe, L.tp, L.cp, L.sp, L.ep, L.microbatch, L.cp_impl, offered)
        rs = recipe_seconds(cm.hw, cm.wl, w)
        out["multiplies_s"] += m * count * sum(rs.mm)
        out["multiplies_hp_s"] += m * count * sum(rs.hp)
        out["casts_s"] += m * count * (rs.cast_fwd + rs.cast_bwd)
        if L.ac == "none":
            out["saved_delta_bytes"] += count * w.lowbit.saved_delta
        names = [x.name for x in w.lowbit.converted]
        out["converted"] += [n for n in names if n not in out["converted"]]
        out["skipped"].update(dict(w.lowbit.skipped))
    return out


def _gathers(cm, L, layers, first: bool, last: bool) -> dict[str, float]:
    """Bytes one rank sends in one gather of all its units, as priced and in the compute
    dtype, at stage 3 (empty otherwise)."""
    if L.zero != 3:
        return {}
    plain = dataclasses.replace(L, comm_weights="fp")
    root, dense, experts = cm.units(L, layers, first, last)
    world, ew = L.dp_shard * L.cp, max(1, L.dp_shard * L.cp // L.ep)
    split = fp8_split(cm, L, layers)
    units = [(root, 1, world)] + [(u, c, world) for u, c in dense.items()] + [
        (u, c, ew) for u, c in experts.items()]
    sent = sum(c * gather_bytes(cm, L, u, n, split) for u, c, n in units if u)
    hp = sum(c * gather_bytes(cm, plain, u, n, {}) for u, c, n in units if u)
    scales = sum(c * len(split[u][0]) for u, c, _ in units if u in split)
    return {"gather_round_bytes": sent, "gather_round_hp_bytes": hp,
            "scale_all_reduce_bytes": 4.0 * scales}


def recipe_summary(cm, L) -> dict[str, object]:
    """The workload's recipe in layout ``L`` (see the module docstring).

    Raises:
        ValueError: the workload has no recipe (``matmul_recipe="none"``).
    """
    wl = cm.wl
    if wl.matmul_recipe == "none":
        raise ValueError("recipe_summary: the workload has matmul_recipe='none'")
    path = recipe_path(cm.hw, wl.matmul_recipe)
    r, rt, layers = max(cm.sample_ranks(L), key=lambda x: x[1].busy)
    _, first, last = cm.rank_plan(L, r)
    parts = _layer_parts(cm, L, layers, cm.stages.offered(L))
    without = CostModel(cm.spec, cm.hw, dataclasses.replace(wl, matmul_recipe="none"))
    return {"recipe": path.name, "native": path.native, "dtype": path.dtype,
            "how": path.words, "compute_dtype": wl.compute_dtype, **parts,
            **_gathers(cm, L, layers, first, last),
            "step_s": cm.estimate(L).step_time, "step_without_s": without.estimate(L).step_time}


def describe_recipe(s: dict[str, object], hw_name: str) -> list[str]:
    """A summary as the lines ``shardwise plan`` prints under its table."""
    dt = s["compute_dtype"]
    skipped = "; ".join(f"{k}: {v}" for k, v in s["skipped"].items()) or "none"
    lines = [f"matmul recipe {s['recipe']} on {hw_name}: {s['how']}",
             f"  converts {', '.join(s['converted'])} in every block (skipped: {skipped}); "
             f"embedding, head, norms and routers stay {dt}",
             f"  layout #1, per step on its busiest rank: converted multiplies "
             f"{s['multiplies_s']:.3g} s ({s['multiplies_hp_s']:.3g} s in {dt}), casts and "
             f"amax passes {s['casts_s']:.3g} s" + (" with the dequantisations" if not s["native"]
                                                    else "")]
    if "gather_round_bytes" in s:
        fp8 = s["scale_all_reduce_bytes"]
        lines.append(f"  ZeRO-3 gathers {s['gather_round_bytes'] / 1e9:.3g} GB a round "
                     f"({s['gather_round_hp_bytes'] / 1e9:.3g} GB in {dt})"
                     + (f", the converted weights as fp8 codes, their scales agreed in one "
                        f"{fp8:.0f}-byte all-reduce a step" if fp8 else ""))
    if s["saved_delta_bytes"]:
        lines.append(f"  saved codes change the activations by "
                     f"{s['saved_delta_bytes'] / 2**30:+.3g} GiB a micro-batch in flight")
    lines.append(f"  step {s['step_s']:.4g} s ({s['step_without_s']:.4g} s with {dt} "
                 f"multiplies: {s['step_without_s'] / s['step_s']:.3g}x)")
    return lines
