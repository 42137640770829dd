"""Context parallelism: attention over a sequence split across ranks, exact at any length.

Long sequences are where activation memory grows fastest; splitting the sequence over the
``cp`` ranks divides every token-wise activation by ``cp``, and only attention needs the
whole sequence. Three implementations (docs/parallelism.md, "Context parallelism")::

    from shardwise.parallel.context import apply_cp, cp_context
    apply_cp(model, mesh["cp"], impl="ring", load_balance="zigzag")
    cp = cp_context(model)
    logits = model(cp.shard(tokens))                 # this rank's part of each sequence
    loss = F.cross_entropy(logits.flatten(0, 1), cp.shard(labels).flatten())

- ``ring`` ([Note: ring attention] in runtime.py): key/value blocks travel around the ranks.
- ``ulysses`` ([Note: Ulysses attention]): all-to-all from sequence to head shards and back.
- ``hybrid``: all-to-all inside groups of consecutive ranks, ring across them.

The layout ([Note: causal load balance] in layout.py) decides which tokens a rank holds;
the block arithmetic ([Note: blockwise attention] in kernels.py) makes every implementation
exact under any layout and with packed documents; the operators ([Note: context-parallel
operators] in ops.py) keep ``torch.compile`` free of graph breaks.
"""

from shardwise.parallel.context.apply import apply_cp, cp_context, share_cp_context, ulysses_degree
from shardwise.parallel.context.cost import attention_entries, bytes_per_layer
from shardwise.parallel.context.layout import (LOAD_BALANCES, check_sequence_length, chunk_count,
                                               document_ids, rank_chunks, rank_positions,
                                               rank_ranges, shard_sequence, unmasked_entries,
                                               unshard_sequence)
from shardwise.parallel.context.runtime import CP_IMPLS, ContextParallel

__all__ = ["apply_cp", "cp_context", "share_cp_context", "ulysses_degree", "ContextParallel",
           "CP_IMPLS", "LOAD_BALANCES", "check_sequence_length", "chunk_count", "document_ids",
           "rank_chunks", "rank_positions", "rank_ranges", "shard_sequence", "unshard_sequence",
           "unmasked_entries", "bytes_per_layer", "attention_entries"]
