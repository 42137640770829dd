"""A module whose parameters are read outside its own forward, wrapped as a unit, is named
(issue 16: "[Note: ungathered placeholders]") instead of failing with a raw shape error."""

from __future__ import annotations

import torch
from torch import nn

import shardwise
from shardwise.testing import run_ranks


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0].square().mean()


def _wrapped_out_proj() -> list[str]:
    out = []
    out_proj = nn.modules.linear.NonDynamicallyQuantizableLinear
    model = shardwise.shard(Attention(), stage=3, wrap={out_proj})
    try:
        model(torch.randn(2, 5, 16))
        out.append("no error")
    except ValueError as exc:
        out.append(str(exc))
    # after the failed forward the modules hold the shards again, as between steps
    out.append(type(model.mha.out_proj.weight).__name__)
    good = shardwise.shard(Attention(), stage=3, wrap={nn.MultiheadAttention})
    good(torch.randn(2, 5, 16)).backward()
    out.append("parent wrapped: ok")
    return out


def test_a_parameter_read_outside_its_units_forward_is_named():
    for out in run_ranks(_wrapped_out_proj, world_size=2, timeout_s=60):
        assert out[0].startswith("parameter 'mha.out_proj.weight' of unit 'mha.out_proj' was "
                                 "used"), out[0]
        assert "Wrap the module that reads it, or an ancestor of both" in out[0]
        assert out[1] == "Parameter" and out[2] == "parent wrapped: ok"
