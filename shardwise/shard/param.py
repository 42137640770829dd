"""One parameter of a sharding unit, with every view the engine keeps of it.

:class:`ShardedParam` plays the role FSDP2's ``FSDPParam`` plays: the unit owns flat
buffers (its shard, its gathered parameters, its gradient shard; [Note: unit layout] in
layout.py) and each parameter is a set of views into them, kept together in one object
instead of parallel lists kept in step by index:

* ``param``: the user's ``nn.Parameter``; between steps it holds this rank's rows (a view of
  the unit's shard buffer), so ``named_parameters()`` keeps names and ``ndim`` and any
  optimizer steps the shard in place;
* ``shard``: the same rows as a plain view (loads and copies write through it);
* ``full_block``: the parameter's ``(n, padded)`` block of the gathered buffer;
* ``full``: the gathered parameter, an ``nn.Parameter`` created once that the modules hold
  while the unit computes ([Note: freeing gathered parameters] in unit.py);
* ``placeholder``: what the modules hold during the model's forward while the unit is not
  gathered ([Note: ungathered placeholders] in ungathered.py);
* ``grad_view``: this rank's gradient rows in the unit's gradient buffer, once it exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.shard.layout import ParamLayout
from shardwise.shard.ungathered import UngatheredParameter

__all__ = ["ParamEntry", "ShardedParam"]


@dataclass
class ParamEntry:
    """A unique parameter and every place it is registered (tied parameters have several):
    what unit discovery finds, before any buffer exists."""

    param: nn.Parameter
    fqns: list[str]
    registrations: list[tuple[nn.Module, str]] = field(default_factory=list)

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad


class ShardedParam:
    """One parameter of a unit laid out over its shard group (see the module docstring).

    Args:
        entry: the parameter and where it is registered.
        layout: its place in the unit's flat buffers.
        rank: this rank's index in the shard group.
        world: ranks in the shard group.
        shard_buf: the unit's flat shard buffer (this rank's rows of every parameter).
        full_buf: the unit's flat gathered buffer (every rank's padded rows).
        unit_label: the unit's name, for the placeholder's messages.
    """

    def __init__(self, entry: ParamEntry, layout: ParamLayout, rank: int, world: int,
                 shard_buf: torch.Tensor, full_buf: torch.Tensor, unit_label: str) -> None:
        self.entry, self.layout, self.rank = entry, layout, rank
        self.trainable = entry.trainable
        p, n = layout, world
        self.shard = self.rows_of(shard_buf)
        block = full_buf[n * p.offset:n * (p.offset + p.padded_numel)]
        self.full_block = block.view(n, p.padded_numel)
        self.full = nn.Parameter(block[:p.numel].view(p.shape), requires_grad=self.trainable)
        self.placeholder = UngatheredParameter(self.full, unit_label, entry.fqns[0])
        self.grad_view: torch.Tensor | None = None

    # ------------------------------------------------------------ the user's parameter
    @property
    def param(self) -> nn.Parameter:
        """The user's parameter (this rank's rows between steps)."""
        return self.entry.param

    @property
    def fqns(self) -> list[str]:
        """Its names in the sharded module (several when tied)."""
        return self.entry.fqns

    def load_full(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of ``full`` (the whole parameter) into the shard."""
        p = self.layout
        start = p.row_offset(self.rank)
        rows = full.reshape(p.rows, p.row_numel)[start:start + p.local_rows(self.rank)]
        with torch.no_grad():
            self.shard.view(-1).copy_(rows.reshape(-1))

    def adopt_shard(self) -> None:
        """Point the user's parameter at its shard (once, after loading). A parameter on the
        meta device cannot take real data: it is replaced by a new one, everywhere it is
        registered, keeping its attributes (placement records, ``_no_weight_decay``...)."""
        e = self.entry
        if e.param.is_meta and not self.shard.is_meta:
            new = nn.Parameter(self.shard, requires_grad=e.param.requires_grad)
            new.__dict__.update(e.param.__dict__)
            e.param = new
        else:
            e.param.data = self.shard
            e.param.grad = None

    # ------------------------------------------------------------ what the modules hold
    def register(self, tensor: torch.Tensor) -> None:
        """Make every module that registers this parameter hold ``tensor``."""
        for mod, attr in self.entry.registrations:
            mod._parameters[attr] = tensor

    def swap_in(self) -> None:
        """The gathered parameter (for compute)."""
        self.register(self.full)

    def swap_out(self, placeholder: bool = False) -> None:
        """The sharded parameter (between steps), or the placeholder (during the model's
        forward, while the unit is not gathered)."""
        self.register(self.placeholder if placeholder else self.entry.param)

    # ------------------------------------------------------------ gradients
    def full_grad(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The gathered parameter's gradient for packing, zeros (not allocated) when none
        arrived (an unused parameter); a 0-d gradient as one element."""
        g = self.full.grad
        if g is None:
            g = torch.zeros((), dtype=dtype, device=device).expand(self.layout.shape)
        return g.reshape(1) if g.dim() == 0 else g

    def rows_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the parameter inside ``flat`` (a buffer laid out as the
        unit's shard), shaped as the shard."""
        p = self.layout
        return flat[p.offset:p.offset + p.local_rows(self.rank) * p.row_numel].view(
            p.local_shape(self.rank))

