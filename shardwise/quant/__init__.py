"""``shardwise.quant``: blockwise int8 / int4 / fp8 codecs, pure tensor math.

The bottom of the package: no communication, no engine. Used by the quantised collectives
(:mod:`shardwise.distributed.comm.quantized`) and, through them, by the ZeRO engine. See
[Note: codecs], [Note: error bounds] and [Note: wire format] in :mod:`shardwise.quant.codecs`.
"""

from shardwise.quant.codecs import (GRAD_KINDS, KINDS, WEIGHT_KINDS, QuantizedTensor,
                                    check_block_size, check_kind, dequantize, error_bound,
                                    pack, packed_nbytes, quantize, unpack)

__all__ = ["KINDS", "WEIGHT_KINDS", "GRAD_KINDS", "QuantizedTensor", "quantize", "dequantize",
           "pack", "unpack", "packed_nbytes", "error_bound", "check_kind", "check_block_size"]
