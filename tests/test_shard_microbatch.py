"""Per-micro-batch engine controls (issue 12: what pipeline schedules drive the engine with).

Four micro-batches per step on 2 ranks, stages 0-3, in the orders pipeline schedules use,
against the plain accumulation loop (``no_sync`` for all but the last micro-batch):

* 1F1B (forward 2 before backward 1) and GPipe (all forwards, then all backwards) orders,
  with ``set_gradient_sync`` off until the last backward: bitwise the same weights;
* a zero-bubble split: each backward is an input-gradient pass (``inputs=`` the stage input,
  ``retain_graph=True``) and, later, a weight-gradient pass (``inputs=graph_parameters``);
  the reduction happens once, after the last weight pass; same weights (1e-6) and the same
  input gradients;
* stage 3 with ``set_reshard_after_forward/backward(False)``: one all-gather per unit for
  the whole step instead of one per micro-batch and pass, then ``reshard``; same weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise.testing import run_ranks
from shardwise.testing.parity import max_rel_err

MICRO, STEPS, DIM = 4, 2, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.lin(x)))


class Stack(nn.Module):
    """A pipeline stage: its input is an activation that needs a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def _batches(rank: int):
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(STEPS, MICRO, 4, 5, DIM, generator=g)
    return xs[:, :, 2 * rank:2 * rank + 2]


def _train(order: str, stage: int) -> tuple[dict, list, int]:
    model = shardwise.shard(Stack(), stage=stage, wrap={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, input_grads = _batches(dist.get_rank()), []
    shardwise.reset_comm_stats()
    for step in range(STEPS):
        inputs = [xs[step, m].clone().requires_grad_() for m in range(MICRO)]
        if order == "plain":
            for m, x in enumerate(inputs):
                ctx = shardwise.no_sync(model) if m < MICRO - 1 else torch.enable_grad()
                with ctx:
                    (model(x) / MICRO).backward()
        elif order in ("1f1b", "gpipe"):
            losses = {}
            shardwise.set_gradient_sync(model, False)
            fwd = [0, 1, "b0", 2, "b1", 3, "b2", "b3"] if order == "1f1b" else \
                [0, 1, 2, 3, "b0", "b1", "b2", "b3"]
            for a in fwd:
                if isinstance(a, int):
                    losses[a] = model(inputs[a]) / MICRO
                    continue
                m = int(a[1])
                if m == MICRO - 1:
                    shardwise.set_gradient_sync(model, True)
                losses.pop(m).backward()
        elif order == "zero_bubble":
            shardwise.set_gradient_sync(model, False)
            shardwise.set_reshard_after_backward(model, False)  # W needs the parameters
            losses = [model(x) / MICRO for x in inputs]
            for x, loss in zip(inputs, losses):
                torch.autograd.backward(loss, inputs=[x], retain_graph=True)   # I
            for m, loss in enumerate(losses):                                  # W, later
                if m == MICRO - 1:
                    shardwise.set_gradient_sync(model, True)
                    shardwise.set_reshard_after_backward(model, True)
                torch.autograd.backward(loss, inputs=shardwise.graph_parameters(model))
        elif order == "keep_gathered":
            shardwise.set_reshard_after_forward(model, False)
            shardwise.set_reshard_after_backward(model, False)
            for m, x in enumerate(inputs):
                shardwise.set_gradient_sync(model, m == MICRO - 1)
                (model(x) / MICRO).backward()
            shardwise.reshard(model)
        input_grads.append([x.grad.clone() for x in inputs])
        opt.step()
        opt.zero_grad()
    gathers = shardwise.comm_stats()["all_gather"].calls
    return shardwise.full_state_dict(model), input_grads, gathers


def _grid() -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        for order in ("plain", "1f1b", "gpipe", "zero_bubble"):
            out[(stage, order)] = _train(order, stage)
    out[(3, "keep_gathered")] = _train("keep_gathered", 3)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_grid, world_size=2, timeout_s=300)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_pipeline_orders_train_like_plain_accumulation(results, stage):
    for rank_results in results:
        plain, plain_grads, _ = rank_results[(stage, "plain")]
        for order in ("1f1b", "gpipe"):
            state, grads, _ = rank_results[(stage, order)]
            assert all(torch.equal(state[k], plain[k]) for k in plain), (stage, order)
            assert all(torch.equal(a, b) for s, t in zip(grads, plain_grads)
                       for a, b in zip(s, t))
        state, grads, _ = rank_results[(stage, "zero_bubble")]
        err, key = max_rel_err(state, plain)
        assert err < 1e-6, (stage, err, key)
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for s, t in zip(grads, plain_grads)
                   for a, b in zip(s, t))


def test_keeping_units_gathered_gathers_once_per_step(results):
    for rank_results in results:
        plain, _, plain_gathers = rank_results[(3, "plain")]
        state, _, gathers = rank_results[(3, "keep_gathered")]
        assert all(torch.equal(state[k], plain[k]) for k in plain)
        units = 4  # three blocks and the root (head)
        assert gathers == STEPS * units, gathers
        assert plain_gathers == STEPS * MICRO * 2 * 3 + STEPS * MICRO, plain_gathers


def test_controls_refuse_an_unsharded_model_and_a_non_bool():
    with pytest.raises(ValueError, match="needs a module passed to shardwise.shard"):
        shardwise.set_gradient_sync(nn.Linear(2, 2), False)
    with pytest.raises(ValueError, match="sync must be True or False, got 0"):
        shardwise.set_gradient_sync(shardwise.shard(Stack(), stage=0), 0)
