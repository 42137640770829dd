"""Signal-to-quantisation noise of every low-bit recipe against float64, held to the measured
values (bench/lowbit_numerics.py, the committed table's computation at 256 tokens per
``small`` layer; the table itself is at 4 x 512, where every value lies in the same bands).

Each band is the range measured over the seven layer shapes, widened by ``MARGIN_DB``. The
floor catches a cast that lost precision (e5m2 in the forward costs about 6 dB, one
mantissa bit); the ceiling catches a cast that changed the other way (dropping the
power-of-two rounding of the rowwise scales gains 1.1-1.8 dB in the forward), since either
means the recipe no longer computes what it says.
"""

from __future__ import annotations

import math

import pytest

from bench.lowbit_numerics import LAYERS, QUANTITIES, numerics
from shardwise.parallel.lowbit import RECIPE_NAMES

TOKENS = 256
MARGIN_DB = 0.5
# recipe -> quantity -> (lowest, highest) dB measured over the layers (256 tokens)
MEASURED = {
    "fp8_tensorwise": {"output": (28.48, 28.63), "grad_input": (24.17, 24.81),
                       "grad_weight": (24.18, 25.47)},
    "fp8_rowwise": {"output": (28.48, 28.62), "grad_input": (28.46, 28.67),
                    "grad_weight": (28.50, 29.14)},
    "fp8_rowwise_gw_hp": {"output": (28.48, 28.62), "grad_input": (28.46, 28.67),
                          "grad_weight": (129.76, math.inf)},  # fp32: no ceiling
    "fp8_blockwise": {"output": (30.09, 30.97), "grad_input": (28.38, 28.79),
                      "grad_weight": (29.28, 31.08)},
    "mxfp8": {"output": (25.66, 26.55), "grad_input": (27.12, 27.88),
              "grad_weight": (26.28, 26.91)},
    "nvfp4": {"output": (17.62, 19.02), "grad_input": (17.22, 17.51),
              "grad_weight": (16.76, 18.54)},
}
FP8 = [r for r in RECIPE_NAMES if r != "nvfp4"]


@pytest.fixture(scope="module")
def sqnr():
    return numerics(recipes=RECIPE_NAMES, tokens=TOKENS)


def test_every_recipe_is_measured():
    assert set(MEASURED) == set(RECIPE_NAMES)


@pytest.mark.parametrize("quantity", QUANTITIES)
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_sqnr_within_the_measured_band(sqnr, recipe, quantity):
    lo, hi = MEASURED[recipe][quantity]
    for layer in LAYERS:
        db = sqnr[recipe][layer][quantity]
        assert lo - MARGIN_DB <= db <= hi + MARGIN_DB, (layer, db)


def test_high_precision_weight_gradient_beats_rowwise(sqnr):
    for layer in LAYERS:
        hp = sqnr["fp8_rowwise_gw_hp"][layer]
        row = sqnr["fp8_rowwise"][layer]
        assert hp["grad_weight"] > row["grad_weight"] + 60, layer
        assert hp["output"] == row["output"]  # the same forward casts


def test_nvfp4_is_below_every_fp8_recipe(sqnr):
    for layer in LAYERS:
        for q in QUANTITIES:
            nv = sqnr["nvfp4"][layer][q]
            assert all(nv + 5 < sqnr[r][layer][q] for r in FP8), (layer, q)
