"""Weights that do not fit: a meta model's layers read from the checkpoint on disk one unit
at a time, the next unit's read overlapping the current unit's compute; optionally from a
weight-only int8 / int4 store that cuts the bytes read per token.

    from shardwise.inference.weights import quantize_checkpoint, stream_weights
    model = build_model(cfg, device="meta")
    quantize_checkpoint("runs/x/checkpoints/step_00000150", "runs/x/int4", kind="int4")
    with stream_weights(model, "runs/x/int4", prefetch=1) as stream:
        logits = model(tokens)

Modules: layout.py (byte ranges and reads), decode.py (stored bytes into the tensor:
casts, layouts, dequantisation), sources.py / dcp_source.py / store.py (where a
checkpoint's tensors lie), quantize.py (writing the store), plan.py (units, work buffers,
resident tensors), stream.py (the hooks and the background threads), bandwidth.py (the
disk's read rate).
"""

from shardwise.inference.weights.bandwidth import drop_page_cache, measure_read_bandwidth
from shardwise.inference.weights.quantize import quantize_checkpoint
from shardwise.inference.weights.sources import open_source
from shardwise.inference.weights.stream import WeightStream, stream_weights

__all__ = ["WeightStream", "stream_weights", "quantize_checkpoint", "open_source",
           "measure_read_bandwidth", "drop_page_cache"]
