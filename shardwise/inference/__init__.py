"""Inference: KV cache, prefill / decode, weights streamed from disk (weights/)."""
