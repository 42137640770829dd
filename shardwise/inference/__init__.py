"""shardwise.inference: running the models shardwise trains. User guide: docs/inference.md.

* :func:`generate` / :class:`Decoder`: prefill and decode with a preallocated KV cache,
  prompts of different lengths, greedy or seeded sampling, stop tokens.
"""

from shardwise.inference.cache import KVCache
from shardwise.inference.decoder import Decoder
from shardwise.inference.generate import Generation, generate
from shardwise.inference.sampling import Sampler, Sampling

__all__ = ["Decoder", "Generation", "KVCache", "Sampler", "Sampling", "generate"]
