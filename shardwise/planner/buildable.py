"""Which priced layouts this version of ``shardwise train`` can build.

[Note: buildable layouts] The planner prices parallelisms before the trainer builds them
(and shapes the trainer cannot build), so ``shardwise plan`` may rank first a layout that
``shardwise train`` refuses. Every record says whether it can be run here and, if not, why;
``shardwise plan --buildable`` searches only the layouts that can. The rules are the
trainer's own refusals of a layout, restated on the planner's floor (the planner sits below
the trainer and cannot call its checks); tests/test_planner_cli.py checks each rule against
what ``shardwise.train`` refuses. Context parallelism is built (``--parallel.cp``, its
default ``cp_impl`` ring taking any number of key/value heads) except for multi-head latent
attention.
"""

from __future__ import annotations

from shardwise.planner.parallel_layout import Layout

__all__ = ["not_buildable", "BUILDABLE_FIXED"]

_SPLIT_BACKWARD = ("zb1", "zbv", "dualpipev")
"""Schedules running input and weight gradients as two backward passes (the trainer's
``shardwise.train.pipeline.SPLIT_BACKWARD``)."""

BUILDABLE_FIXED: dict[str, object] = {}
"""Layout keys ``--buildable`` fixes before the search (the rest is filtered after it)."""


def not_buildable(L: Layout, spec) -> str | None:
    """Why ``shardwise train`` of this version cannot run ``L`` for ``spec`` (None: it can).

    Args:
        L: a resolved layout.
        spec: the model's :class:`~shardwise.planner.spec.ModelSpec`.

    Returns:
        A short reason, or None.
    """
    if not getattr(spec, "buildable", True):
        return f"model {spec.name!r} is a shape only the planner prices"
    if L.cp > 1 and spec.is_mla:
        return "context parallelism (cp > 1) does not cover multi-head latent attention yet"
    if L.cp > 1 and L.cp_impl == "allgather":
        return ("cp_impl=allgather (Llama 3's all-gather) is priced, not built: the trainer "
                "builds ring, ulysses and hybrid")
    if L.pp > 1 and L.offload != "none":
        return "pipeline stages do not run with optimizer offload yet"
    if L.ep > 1 and L.tp > 1 and not L.sp:
        return "expert parallelism under tensor parallelism needs sequence parallelism"
    if L.ac == "selective" and L.pp > 1 and L.pp_schedule in _SPLIT_BACKWARD:
        return (f"selective checkpointing under {L.pp_schedule} (split backward: torch's "
                "selective checkpoint allows one backward through a block)")
    if spec.n_experts and L.ac != "none":
        return "activation checkpointing of MoE layers is refused (data-dependent routing)"
    return None
