"""Models whose units run in awkward orders, generated from a seed, for prefetch/parity tests.

:class:`TopologyModel` is a two-tower contrastive model (two inputs, two branches, a 0-d
temperature) whose forward is a *program* drawn from a seed: a sequence of block calls on
either branch, each possibly only on even or odd steps, with "mix" operations that feed one
branch into the other (so their backward passes interleave). The generator makes sure every
topology has, somewhere, the cases that break prefetching engines:

* branches made of units with identical shapes (only the unit's identity tells them apart);
* units registered in one order and run in another;
* a unit skipped on some steps (which ones depends on the step, identically on every rank);
* a unit called twice in one forward;
* nested units (a wrapped ``Pair`` module holding two wrapped blocks and a parameter of its
  own);
* the branch order of the whole forward changing from step to step;
* a frozen unit.

Set ``model.step`` before each forward (the training loops here do). Every rank must run the
same program, so the model is a function of ``(seed, step)`` only, never of the data.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "Pair", "TopologyModel", "Op", "generate_program", "two_tower_program",
           "contrastive_loss", "DIM"]

DIM = 8  # hidden width of every block (identical shapes across the branches)


class Block(nn.Module):
    """One unit: linear -> layer norm -> tanh, with a residual connection."""

    def __init__(self, dim: int = DIM, bias: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=bias)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.lin(x)))


class Pair(nn.Module):
    """A unit holding two units: ``second(first(x) * gate)`` (nested wrapping)."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.first, self.second = Block(dim), Block(dim)
        self.gate = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x) * self.gate)


@dataclass(frozen=True)
class Op:
    """One step of a forward program.

    kind: "call" (``h[branch] = blocks[name](h[branch])``) or "mix"
        (``h[branch] = h[branch] + 0.5 * h[1 - branch]``).
    when: "always", "even" or "odd" (the step's parity).
    """

    kind: str
    branch: int
    name: str = ""
    when: str = "always"

    def runs(self, step: int) -> bool:
        return self.when == "always" or (self.when == "even") == (step % 2 == 0)


def generate_program(seed: int) -> tuple[list[str], list[str], list[Op]]:
    """Draw a topology: (block names in registration order, pair names, forward program)."""
    rng = random.Random(seed)
    blocks = [f"b{i}" for i in range(rng.randint(4, 6))]
    pairs = ["p0"]
    program = [Op("call", rng.randrange(2), rng.choice(blocks + pairs))
               for _ in range(rng.randint(6, 9))]
    for b in blocks + pairs:  # every unit runs at least once on even steps
        if all(op.name != b for op in program):
            program.insert(rng.randrange(len(program) + 1), Op("call", rng.randrange(2), b))
    # the awkward cases, each at least once
    twice = rng.choice(blocks)
    program.insert(rng.randrange(len(program) + 1), Op("call", rng.randrange(2), twice))
    skip = rng.randrange(len(program))
    program[skip] = Op("call", program[skip].branch, program[skip].name,
                       rng.choice(["even", "odd"]))
    for _ in range(rng.randint(1, 3)):
        program.insert(rng.randrange(1, len(program)), Op("mix", rng.randrange(2)))
    registration = blocks[:]
    rng.shuffle(registration)  # registered in another order than they run
    return registration, pairs, program


def two_tower_program(layers: int = 3) -> tuple[list[str], list[str], list[Op]]:
    """A plain two-tower model: a vision-like and a text-like tower of identical layers."""
    names = [f"v{i}" for i in range(layers)] + [f"t{i}" for i in range(layers)]
    program = ([Op("call", 0, f"v{i}") for i in range(layers)]
               + [Op("call", 1, f"t{i}") for i in range(layers)])
    return names, [], program


def contrastive_loss(za: torch.Tensor, zb: torch.Tensor, logit_scale: torch.Tensor
                     ) -> torch.Tensor:
    """CLIP's symmetric cross-entropy over the batch's pairs (not decomposable over ranks)."""
    logits = F.normalize(za, dim=-1) @ F.normalize(zb, dim=-1).T * logit_scale.exp()  # (B, B)
    labels = torch.arange(za.shape[0], device=za.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class TopologyModel(nn.Module):
    """A two-tower contrastive model running a generated program (see the module docstring).

    Args:
        seed: draws the program (:func:`generate_program`); None builds a plain two tower.
        init_seed: seed of the weights (default: ``seed`` or 0).
        swap_on_odd: run the program's branch-1 calls first on odd steps (another order of
            the same units every other step). Default True.
        frozen: freeze the parameters of the last registered block. Default True.
    """

    def __init__(self, seed: int | None, init_seed: int | None = None, swap_on_odd: bool = True,
                 frozen: bool = True) -> None:
        super().__init__()
        names, pairs, self.program = (generate_program(seed) if seed is not None
                                      else two_tower_program())
        torch.manual_seed(init_seed if init_seed is not None else (seed or 0))
        self.embed_a = nn.Linear(6, DIM)
        self.embed_b = nn.Linear(5, DIM)
        self.blocks = nn.ModuleDict({n: Block() for n in names})
        self.pairs = nn.ModuleDict({n: Pair() for n in pairs})
        self.proj_a = nn.Linear(DIM, 4, bias=False)
        self.proj_b = nn.Linear(DIM, 4, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(0.5))
        if frozen and names:
            self.blocks[names[-1]].requires_grad_(False)
        self.swap_on_odd = swap_on_odd
        self.step = 0

    def _unit(self, name: str) -> nn.Module:
        return self.blocks[name] if name in self.blocks else self.pairs[name]

    def _order(self) -> list[Op]:
        ops = [op for op in self.program if op.runs(self.step)]
        if self.swap_on_odd and self.step % 2 == 1:  # branch 1's calls first, mixes kept last
            calls = [op for op in ops if op.kind == "call"]
            ops = ([op for op in calls if op.branch == 1] + [op for op in calls if op.branch == 0]
                   + [op for op in ops if op.kind == "mix"])
        return ops

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = [self.embed_a(a), self.embed_b(b)]                       # 2 x (B, DIM)
        for op in self._order():
            if op.kind == "call":
                h[op.branch] = self._unit(op.name)(h[op.branch])
            else:
                h[op.branch] = h[op.branch] + 0.5 * h[1 - op.branch]
        return contrastive_loss(self.proj_a(h[0]), self.proj_b(h[1]), self.logit_scale)
