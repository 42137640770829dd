"""shardwise.data: corpora, tokenizers and rank-aware, resumable token loaders.

Typical use (the trainer does exactly this)::

    from shardwise.data import load_corpus, build_tokenizer, split_tokens, TokenLoader

    text = load_corpus("stdlib")                     # offline corpus from Python's own sources
    tok = build_tokenizer("byte")                    # or "bpe", text=text, vocab_size=4096
    train_ids, val_ids = split_tokens(tok.encode(text), val_fraction=0.05)
    loader = TokenLoader(train_ids, seq_len=256, batch_size=8, rank=r, world_size=n, seed=0)
    inputs, targets = loader.next_batch()            # (8, 256) int64 each
"""

from shardwise.data.corpus import DEFAULT_STDLIB_MAX_BYTES, STDLIB_SOURCE, load_corpus
from shardwise.data.loader import TokenLoader, iter_eval_batches, split_tokens
from shardwise.data.tokenizer import (
    DEFAULT_BPE_VOCAB_SIZE,
    TOKENIZER_KINDS,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
)

__all__ = [
    "load_corpus", "DEFAULT_STDLIB_MAX_BYTES", "STDLIB_SOURCE",
    "Tokenizer", "ByteTokenizer", "BPETokenizer", "build_tokenizer", "load_tokenizer",
    "TOKENIZER_KINDS", "DEFAULT_BPE_VOCAB_SIZE",
    "split_tokens", "TokenLoader", "iter_eval_batches",
]
