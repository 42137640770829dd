"""Split a model into pipeline stages: ``split_stages(model, pp_mesh, virtual, layers_per_stage)``.

    schedule = build_schedule("1f1b", pp=2, microbatches=4)
    part = split_stages(model, mesh, schedule.virtual, placement=schedule.placement)
    part.stages        # this rank's StageModules, in stage order
    part.state_dict()  # the unsplit model's names, for this rank's pieces

A model is split along the pieces it declares (``pipeline_pieces``, [Note: declared pieces]
in shardwise/models/pieces.py): its ``"first"`` pieces (shardwise's Transformer: the token
embedding; a VLA: its vision tower and projector too), its ``"block"`` pieces (the
Transformer's ``layers``), its ``"last"`` pieces (the final norm and the output head). There
are ``pp * virtual`` stages; stage s gets a contiguous run of blocks (by default as even as
possible, the first stages taking one more when the count does not divide: 7 layers over 3
stages are 3, 2, 2), the first stage also the first pieces, the last also the last pieces
(the loss is the executor's). ``placement[s]`` (from the schedule: looped or V) names the
pipeline rank holding stage s. A Hugging Face causal decoder is split along its own modules
(``hf_decoder_pieces``); any other model passes ``pieces=``.

[Note: pipeline parameter names] What a rank holds is a :class:`PipelinePart`, an
``nn.Module`` whose children are the pieces of its stages under their names in the unsplit
model (``tok_embeddings``, ``layers`` with the original indices as keys, ``norm``,
``output``; a Hugging Face model's ``model.layers.3``), plus the shared modules (RoPE). So
``named_parameters()`` and ``state_dict()`` use the unsplit model's names on every layout,
and a checkpoint saved at one pp degree loads at any other. The stages themselves
(:class:`StageModule`) hold the same pieces and are what the executor calls; they are not
children of the part, so nothing is registered twice.

[Note: tied embeddings across stages] With ``tie_embeddings`` (a last piece declaring
``tie=``) the output head reads the embedding matrix, which lives in the first stage. The
last stage gets a mirror: a head with a Parameter of its own, outside the part (it is
neither named nor given to the optimizer), that holds the same value. The executor keeps
them one value: before each step the embedding's value (this rank's shard of it, under ZeRO)
is copied into the mirror, sent from the first stage's rank when the last stage is
elsewhere; after the last backward the mirror's gradient is added to the embedding's, so the
optimizer steps the one matrix with the sum of both uses' gradients, exactly as autograd
sums them in the unsplit model ([Note: tied embeddings] in llama.py). This holds when both
stages sit on one rank too (a V placement), where two separately sharded modules cannot
share one Parameter. Under tensor parallelism the embedding is vocab-parallel and the mirror
takes the head's style (``copy_style``): each tensor rank's mirror holds its rows of the
vocabulary, and the value and the gradient go between the first and the last pipeline rank
of one tensor coordinate.

[Note: pipeline stages of a tensor-parallel model] ``apply_tp`` runs before the split, on
the whole (meta) model; each stage then holds its pieces already cut for this tensor rank,
and the part answers ``tp_context`` as the model did. Under sequence parallelism what a
stage sends (the residual stream between two blocks) is this tensor rank's ``1/tp`` of the
sequence, ``(B, T/tp, C)``, so the messages shrink by ``tp`` too; every stage rebuilds its
RoPE tables from the micro-batch's tokens (side inputs), whose length is the whole
sequence's. The last stage returns vocab-sharded logits ``(B, T, V/tp)`` with loss
parallelism, for the vocab-parallel cross-entropy (the executor's default loss then).

[Note: pipeline stages of an MoE model] ``apply_ep`` too runs before the split, on the
whole model (the composition order): each stage's MoE layers keep this ep rank's experts,
their placements name the ``ep`` and ``edp`` axes of the stage's data ranks, and the part
answers ``ep_context`` as the model did. The part records the names of *all* the model's
MoE layers (``moe_layers``, unsplit order), held here or not, so that every pipeline rank
knows the same facts about the model (whether balance statistics are gathered, in which
order) even when its own stages hold none ([Note: balance losses in a pipeline] in moe.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from shardwise.models.moe import moe_layers
from shardwise.models.pieces import PipelinePieces
from shardwise.parallel.expert import share_ep_context
from shardwise.parallel.pipeline.action_lists import looped_placement
from shardwise.parallel.pipeline.groups import PipelineGroups, resolve_pipeline_groups
from shardwise.parallel.pipeline.pieces import check_pieces, pipeline_pieces
from shardwise.parallel.pipeline.stage import StageModule, TiedHead, attach
from shardwise.parallel.tensor import copy_style, share_tp_context, tp_context

__all__ = ["split_stages", "stage_layer_counts", "PipelinePart", "StageModule", "TiedHead"]


def stage_layer_counts(n_layers: int, num_stages: int,
                       layers_per_stage: Sequence[int] | None = None) -> tuple[int, ...]:
    """How many blocks each stage gets.

    Args:
        n_layers: blocks in the model.
        num_stages: ``pp * virtual``.
        layers_per_stage: an explicit count per stage (summing to ``n_layers``, each >= 1);
            None splits as evenly as possible, earlier stages taking the remainder.

    Returns:
        One count per stage.

    Raises:
        ValueError: fewer layers than stages, or an explicit list of the wrong length, sum
            or with a stage of no layer (naming the values).
    """
    if n_layers < num_stages:
        raise ValueError(f"the model has {n_layers} layers, fewer than the {num_stages} "
                         f"pipeline stages (pp x virtual); every stage needs a layer")
    if layers_per_stage is None:
        base, extra = divmod(n_layers, num_stages)
        return tuple(base + (1 if s < extra else 0) for s in range(num_stages))
    counts = tuple(int(c) for c in layers_per_stage)
    if len(counts) != num_stages:
        raise ValueError(f"layers_per_stage={list(counts)} has {len(counts)} entries; expected "
                         f"one per stage (pp x virtual = {num_stages})")
    if any(c < 1 for c in counts):
        raise ValueError(f"layers_per_stage={list(counts)}: every stage needs at least one "
                         f"layer")
    if sum(counts) != n_layers:
        raise ValueError(f"layers_per_stage={list(counts)} sums to {sum(counts)}; the model "
                         f"has {n_layers} layers")
    return counts


def stage_of_pieces(decl: PipelinePieces, counts: Sequence[int]) -> list[int]:
    """The stage of each declared piece: first pieces on stage 0, the blocks in contiguous
    runs of ``counts``, last pieces on the last stage."""
    block_stage = [s for s, c in enumerate(counts) for _ in range(c)]
    out, b = [], 0
    for piece in decl.pieces:
        if piece.role == "first":
            out.append(0)
        elif piece.role == "last":
            out.append(len(counts) - 1)
        else:
            out.append(block_stage[b])
            b += 1
    return out


class PipelinePart(nn.Module):
    """What one pipeline rank holds of a model ([Note: pipeline parameter names]).

    Attributes:
        stages: this rank's :class:`StageModule` objects, in stage order.
        placement: ``placement[stage]`` = the pipeline rank holding it.
        layer_counts: blocks per stage (all stages).
        groups: the :class:`PipelineGroups` it runs on.
        shared: ``(name, module)`` of the shared modules every stage keeps (RoPE tables).
        tied: whether the head mirrors the embedding ([Note: tied embeddings across stages]).
        tie_owner: the tied matrix's parameter name (``"tok_embeddings.weight"``), or None.
        config: the unsplit model's config (for checkpoints).
        moe_layers: the module names of every MoE layer of the unsplit model, in order,
            held here or not ([Note: pipeline stages of an MoE model]).
    """

    def __init__(self, model: nn.Module, decl: PipelinePieces, groups: PipelineGroups,
                 placement: Sequence[int], counts: Sequence[int]) -> None:
        super().__init__()
        num_stages = len(placement)
        self.placement, self.layer_counts, self.groups = tuple(placement), tuple(counts), groups
        self.config = getattr(model, "config", None)
        tie = next((p for p in decl.pieces if p.tie is not None), None)
        self.tied, self.tie_owner = tie is not None, (tie.tie if tie is not None else None)
        self.moe_layers = tuple(name for name, _ in moe_layers(model))
        self.shared = list(decl.shared)  # registered below; the list is plain data
        object.__setattr__(self, "mirror", None)  # outside the part: never named or saved
        mine = [s for s in range(num_stages) if placement[s] == groups.pp_rank]
        where = stage_of_pieces(decl, counts)
        held = [(p, s) for p, s in zip(decl.pieces, where) if s in mine]
        mirror = None
        if tie is not None and num_stages - 1 in mine:
            mirror = TiedHead(model.get_parameter(tie.tie))
            copy_style(tie.module, mirror)  # vocab-parallel under tensor parallelism
            object.__setattr__(self, "mirror", mirror)
        # The part's own children: the held pieces (a tied head is the mirror, outside it)
        # and the shared modules, in the stage module's order (StageModule).
        for p, _ in held:
            if p.role == "first":
                attach(self, p.name, p.module)
        for name, module in decl.shared:
            attach(self, name, module)
        for p, _ in held:
            if p.role != "first" and p.tie is None:
                attach(self, p.name, p.module)
        self._all_pieces(model, decl, where, mine)
        ctx = tp_context(model)
        stages = []
        for s in mine:
            # The tied head runs as the mirror (and keeps no reference to the embedding).
            run = [(dataclasses.replace(p, module=mirror), mirror) if p.tie is not None
                   else (p, p.module) for p, at in held if at == s]
            stages.append(StageModule(s, num_stages, run, decl.shared, decl.side))
            if ctx is not None:  # drop the stage's last region input, as the model's hook
                stages[-1].register_forward_hook(lambda *args: ctx.clear())
        self.stages: list[StageModule] = stages
        share_tp_context(model, self)
        share_ep_context(model, self)

    def _all_pieces(self, model: nn.Module, decl: PipelinePieces, where: list[int],
                    mine: list[int]) -> None:
        """Every piece of the unsplit model in its order, and whether this rank keeps it:
        initialising a meta model draws the same random numbers as the unsplit model only
        if every rank walks all of them (see shard_stages). A tied head owns no matrix of
        its own and is not a piece here."""
        pieces = [(p.name, p.module, s in mine) for p, s in zip(decl.pieces, where)
                  if p.tie is None]
        # A real model's other pieces are dropped now; a meta model's are walked at init.
        meta = any(p.is_meta for p in model.parameters())
        if meta:
            _check_init_order(model, [m for _, m, _ in pieces], [n for n, _, _ in pieces])
        self._pieces = [(n, m if here or meta else None, here) for n, m, here in pieces]

    @property
    def num_stages(self) -> int:
        """``pp * virtual``."""
        return len(self.placement)

    @property
    def pieces(self) -> list[tuple[str, nn.Module | None, bool]]:
        """``(name, module, held here)`` for every piece of the unsplit model, in order (the
        module is None for another rank's piece once it is no longer needed)."""
        return list(self._pieces)

    def release_pieces(self) -> None:
        """Forget the other ranks' pieces (after initialisation)."""
        self._pieces = [(n, m if here else None, here) for n, m, here in self._pieces]

    def stage(self, index: int) -> StageModule:
        """This rank's stage ``index``.

        Raises:
            ValueError: the stage is held by another rank.
        """
        for st in self.stages:
            if st.index == index:
                return st
        raise ValueError(f"stage {index} is on pipeline rank {self.placement[index]}, not on "
                         f"rank {self.groups.pp_rank}")

    def forward(self, *args, **kwargs):
        raise RuntimeError("a PipelinePart runs through its executor (PipelineExecutor.step / "
                           "evaluate), not by calling it")


def _check_init_order(model: nn.Module, modules: list[nn.Module], names: list[str]) -> None:
    """A meta model's pieces are initialised in declared order ([Note: pipeline init] in
    sharding.py): that is the unsplit model's only if it is ``named_modules()`` order."""
    index = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    missing = [n for n, m in zip(names, modules) if id(m) not in index]
    if missing:
        raise ValueError(f"pieces {missing} are not modules of {type(model).__name__}")
    seq = [index[id(m)] for m in modules]
    if seq != sorted(seq):
        raise ValueError(f"pieces {names} are not in {type(model).__name__}'s "
                         f"named_modules() order, so a meta model would not be initialised "
                         f"with the unsplit model's numbers; declare them in that order")


def split_stages(model: nn.Module, pp_mesh=None, virtual: int = 1,
                 layers_per_stage: Sequence[int] | None = None, *,
                 placement: Sequence[int] | None = None,
                 pieces: PipelinePieces | None = None) -> PipelinePart:
    """Keep this rank's stages of ``model`` (see the module docstring).

    Build the model on the meta device to split large models: only the pieces kept here are
    ever materialised (by :func:`~shardwise.parallel.pipeline.shard_stages`).

    Args:
        model: a model that declares its pieces (``pipeline_pieces()``: shardwise's
            ``Transformer``), a Hugging Face causal decoder, or any model with ``pieces``;
            on any device or meta.
        pp_mesh: a ParallelMesh, a DeviceMesh with a ``"pp"`` dimension, the pipeline
            ProcessGroup, or None (the world); see :func:`resolve_pipeline_groups`. A
            tensor-parallel model (``apply_tp`` first, with the same mesh's ``["tp"]``) is
            split as it is ([Note: pipeline stages of a tensor-parallel model]).
        virtual: stages per pipeline rank (default 1); there are ``pp * virtual`` stages.
        layers_per_stage: blocks per stage, e.g. ``[3, 2, 2]`` (default None: even split).
        placement: the pipeline rank of each stage, e.g. ``schedule.placement`` (default
            None: looped, stage s on rank ``s % pp``).
        pieces: the model's declaration, for a model that declares none (default None: ask
            the model, :func:`~shardwise.parallel.pipeline.pieces.pipeline_pieces`).

    Returns:
        The :class:`PipelinePart` of this rank.

    Raises:
        ValueError: a model that declares no pieces (or an inconsistent declaration), too
            few blocks, a bad ``layers_per_stage``, a placement that does not fit ``pp`` and
            ``virtual`` (naming the value), or a mesh whose ``tp`` axis the model was not
            parallelised over.
    """
    if pieces is None:
        pieces = pipeline_pieces(model)
    else:
        check_pieces(pieces, model)
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"virtual={virtual!r}: expected stages per rank, an int >= 1")
    groups = resolve_pipeline_groups(pp_mesh)
    pp = groups.pp_size
    placement = tuple(placement) if placement is not None else looped_placement(pp, virtual)
    if len(placement) != pp * virtual or any(placement.count(r) != virtual for r in range(pp)):
        raise ValueError(f"placement {list(placement)} does not put virtual={virtual} stages "
                         f"on each of the pp={pp} ranks")
    _check_tp(model, groups)
    counts = stage_layer_counts(len(pieces.blocks), pp * virtual, layers_per_stage)
    return PipelinePart(model, pieces, groups, placement, counts)


def _check_tp(model: nn.Module, groups: PipelineGroups) -> None:
    """The model's tensor parallelism is the mesh's ``tp`` axis (when the mesh has one)."""
    ctx = tp_context(model)
    mine = ctx.tp.ranks if ctx is not None else ()
    if len(groups.tp_ranks) > 1 and ctx is None:
        raise ValueError(f"the pipeline mesh has a tp axis of {len(groups.tp_ranks)} ranks but "
                         f"{type(model).__name__} is not tensor-parallel: apply_tp(model, "
                         f"mesh['tp']) before split_stages")
    if ctx is not None and groups.tp_ranks and tuple(mine) != tuple(groups.tp_ranks):
        raise ValueError(f"{type(model).__name__} is tensor-parallel over ranks {list(mine)}, "
                         f"but the pipeline mesh's tp group of this rank is "
                         f"{list(groups.tp_ranks)}: apply_tp with the same mesh's ['tp']")
