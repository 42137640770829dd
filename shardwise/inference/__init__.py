"""shardwise.inference: running the models shardwise trains. User guide: docs/inference.md.

* :func:`generate` / :class:`Decoder`: prefill and decode with a preallocated KV cache,
  prompts of different lengths, greedy or seeded sampling, stop tokens.
* :func:`load_model`: any shardwise checkpoint (a run, a DCP step of any layout) or Hugging
  Face safetensors, into one process.
* :mod:`shardwise.inference.weights`: weights streamed from disk unit by unit (int8 / int4
  stores), for models larger than memory.
* :mod:`shardwise.inference.act`: a vision-language-action policy acting in its environment,
  timed per action (needs the ``vla`` extra).
"""

from shardwise.inference.cache import KVCache
from shardwise.inference.checkpoint import (LoadedModel, load_model, read_model_config,
                                            resolve_checkpoint)
from shardwise.inference.decoder import Decoder
from shardwise.inference.generate import Generation, generate
from shardwise.inference.sampling import Sampler, Sampling

__all__ = ["Decoder", "Generation", "KVCache", "LoadedModel", "Sampler", "Sampling",
           "generate", "load_model", "read_model_config", "resolve_checkpoint"]
