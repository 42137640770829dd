"""Low-bit training compute: fp8 (tensorwise, rowwise, blockwise), MXFP8 and NVFP4 matmuls
in the linear layers of the blocks (docs/precision.md).

One concern per module: ``codes`` (element formats: rounding, packing, decoding),
``scaling`` (tiles and scales), ``recipes`` (which cast each operand gets), ``matmul`` (the
device's scaled kernel or its emulation), ``linear`` (the autograd function), ``experts``
(per-expert scales), ``gather`` (ZeRO-3 weights gathered in fp8 straight into the matmul),
``apply`` (which layers).
"""

from shardwise.parallel.lowbit.apply import (LowPrecisionReport, apply_low_precision,
                                             low_precision_report, lowbit_modules,
                                             nonfinite_amax_layers,
                                             share_low_precision_report)
from shardwise.parallel.lowbit.linear import (LowBitState, lowbit_linear, lowbit_state,
                                              module_linear)
from shardwise.parallel.lowbit.matmul import (real_kernel_available, scaled_matmul,
                                              set_kernel_policy)
from shardwise.parallel.lowbit.recipes import RECIPE_NAMES, RECIPES, Recipe, get_recipe
from shardwise.parallel.lowbit.scaling import (FORMATS, ScaledTensor, Scaling, dequantize,
                                               quantize)

__all__ = ["apply_low_precision", "LowPrecisionReport", "low_precision_report",
           "lowbit_modules", "nonfinite_amax_layers", "share_low_precision_report",
           "LowBitState", "lowbit_linear", "lowbit_state",
           "module_linear", "real_kernel_available", "scaled_matmul", "set_kernel_policy",
           "RECIPE_NAMES", "RECIPES", "Recipe", "get_recipe", "FORMATS", "ScaledTensor",
           "Scaling", "dequantize", "quantize"]
