"""Tests for shardwise.data: corpora, tokenizers, and the corpus-to-batches pipeline
(the splitting and the loaders are in test_data_loader.py)."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.data import (
    DEFAULT_STDLIB_MAX_BYTES,
    BPETokenizer,
    ByteTokenizer,
    TokenLoader,
    build_tokenizer,
    iter_eval_batches,
    load_corpus,
    load_tokenizer,
    split_tokens,
)
from shardwise.data import corpus as corpus_mod

FAST = settings(max_examples=40, deadline=None)


@pytest.fixture(scope="module")
def stdlib_text() -> str:
    return load_corpus("stdlib")


@pytest.fixture(scope="module")
def bpe(stdlib_text: str) -> BPETokenizer:
    tok = build_tokenizer("bpe", text=stdlib_text[:100_000], vocab_size=512)
    assert isinstance(tok, BPETokenizer)
    return tok


# ----------------------------------------------------------------------------- corpus

def test_stdlib_corpus_nontrivial_and_deterministic(stdlib_text: str) -> None:
    size = len(stdlib_text.encode("utf-8"))
    # The stdlib is larger than the default cap, so the cap is what we get (minus a cut char).
    assert DEFAULT_STDLIB_MAX_BYTES - 4 < size <= DEFAULT_STDLIB_MAX_BYTES
    assert 'The "assert" statement' in stdlib_text  # pydoc_data help topics
    assert "def " in stdlib_text and "import " in stdlib_text  # library sources
    assert load_corpus("stdlib") == stdlib_text


def test_stdlib_corpus_max_bytes_is_a_prefix(stdlib_text: str) -> None:
    small = load_corpus("stdlib", max_bytes=1000)
    assert 996 < len(small.encode("utf-8")) <= 1000
    assert stdlib_text.startswith(small)
    bigger = load_corpus("stdlib", max_bytes=DEFAULT_STDLIB_MAX_BYTES + 100_000)
    assert bigger.startswith(stdlib_text) and len(bigger) > len(stdlib_text)


def test_stdlib_files_skip_tests_and_site_packages() -> None:
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    files = corpus_mod._stdlib_files(root)
    rels = [p.relative_to(root).as_posix() for p in files]
    assert len(rels) > 100 and rels == sorted(rels)
    for rel in rels:
        parts = rel.split("/")
        assert not {"test", "tests", "site-packages", "idlelib"} & set(parts), rel
        assert not parts[-1].startswith("_sysconfigdata"), rel


def test_folder_source_sorted_recursive_text_only(tmp_path) -> None:
    (tmp_path / "b.txt").write_text("bravo\n")
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfalpha")  # BOM is stripped
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("charlie \u00e9")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("hidden")
    assert load_corpus(str(tmp_path)) == "alpha\n\nbravo\n\n\ncharlie \u00e9"
    full = load_corpus(str(tmp_path)).encode("utf-8")
    for cap in range(1, len(full) + 3):  # a capped read is the same prefix of the full text
        want = full[:cap].decode("utf-8", errors="ignore")
        assert load_corpus(str(tmp_path), max_bytes=cap) == want, cap


def test_file_source_and_max_bytes_cut_on_char_boundary(tmp_path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("h\u00e9llo w\u00f6rld", encoding="utf-8")
    assert load_corpus(str(path)) == "h\u00e9llo w\u00f6rld"
    assert load_corpus(str(path), max_bytes=2) == "h"  # 'e-acute' is 2 bytes: dropped whole
    assert load_corpus(str(path), max_bytes=3) == "h\u00e9"


def _make_empty_file(tmp_path):
    (tmp_path / "e.txt").write_text("")
    return tmp_path / "e.txt", "is empty"


def _make_binary_file(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\x89PNG\x00\x00")
    return tmp_path / "x.bin", "not UTF-8 text"


def _make_missing(tmp_path):
    return tmp_path / "nope" / "missing.txt", "does not exist"


def _make_binary_folder(tmp_path):
    d = tmp_path / "bins"
    d.mkdir()
    (d / "x.bin").write_bytes(b"\x00\xff")
    (d / "empty.txt").write_text("")
    return d, "no readable text"


def _make_empty_folder(tmp_path):
    d = tmp_path / "void"
    d.mkdir()
    return d, "no readable text"


@pytest.mark.parametrize("make", [_make_empty_file, _make_binary_file, _make_missing,
                                  _make_binary_folder, _make_empty_folder])
def test_corpus_errors_name_the_path(tmp_path, make) -> None:
    path, expected = make(tmp_path)
    with pytest.raises(ValueError, match=expected) as info:
        load_corpus(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_corpus_max_bytes_must_be_positive_int(bad) -> None:
    with pytest.raises(ValueError, match=f"max_bytes.*{bad!r}"):
        load_corpus("stdlib", max_bytes=bad)


# ----------------------------------------------------------------------------- tokenizers

@FAST
@given(st.text())
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text


def test_byte_tokenizer_decode_replaces_and_checks_range() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    assert tok.decode(torch.tensor([104, 0xFF, 105])) == "h\ufffdi"
    assert tok.decode([]) == ""
    with pytest.raises(ValueError, match="token id 256 at position 1"):
        tok.decode([1, 256])
    with pytest.raises(ValueError, match="1-D"):
        tok.decode(torch.zeros(2, 2, dtype=torch.long))


def test_byte_encode_stdlib_corpus_is_fast(stdlib_text: str) -> None:
    tok = ByteTokenizer()
    start = time.perf_counter()
    ids = tok.encode(stdlib_text)
    elapsed = time.perf_counter() - start
    assert ids.numel() == len(stdlib_text.encode("utf-8"))
    # Vectorised encoding takes ~0.1 s for 4 MB; a per-byte Python loop takes several seconds.
    assert elapsed < 2.0, f"byte-encoding {ids.numel()} bytes took {elapsed:.2f} s"


def test_build_tokenizer_errors() -> None:
    with pytest.raises(ValueError, match=r"'wordpiece'.*\['byte', 'bpe'\]"):
        build_tokenizer("wordpiece")
    with pytest.raises(ValueError, match="vocab_size=1000"):
        build_tokenizer("byte", vocab_size=1000)
    assert build_tokenizer("byte", vocab_size=256).vocab_size == 256
    with pytest.raises(ValueError, match="needs text"):
        build_tokenizer("bpe", vocab_size=300)
    with pytest.raises(ValueError, match="non-empty"):
        build_tokenizer("bpe", text="", vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size must be an int >= 256.*100"):
        build_tokenizer("bpe", text="abc", vocab_size=100)


def test_bpe_missing_package_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match=r"pip install shardwise\[bpe\]"):
        build_tokenizer("bpe", text="some text", vocab_size=300)


def test_bpe_trains_and_compresses(bpe: BPETokenizer, stdlib_text: str) -> None:
    assert 256 < bpe.vocab_size <= 512
    sample = stdlib_text[200_000:220_000]
    ids = bpe.encode(sample)
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert 0 <= int(ids.min()) and int(ids.max()) < bpe.vocab_size
    assert ids.numel() < 0.7 * len(sample.encode("utf-8"))
    assert bpe.decode(ids) == sample


@FAST
@given(st.text())
def test_bpe_round_trip_any_text(bpe: BPETokenizer, text: str) -> None:
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_chunked_encode_matches_one_call(bpe: BPETokenizer, stdlib_text: str) -> None:
    text = stdlib_text[:150_000]  # > one encode chunk, so the parallel path is exercised
    assert bpe.encode(text).tolist() == bpe._backend.encode(text).ids


def test_bpe_training_is_deterministic(bpe: BPETokenizer, stdlib_text: str) -> None:
    again = build_tokenizer("bpe", text=stdlib_text[:100_000], vocab_size=512)
    sample = stdlib_text[300_000:310_000]
    assert torch.equal(again.encode(sample), bpe.encode(sample))


def test_bpe_save_load_identical(bpe: BPETokenizer, stdlib_text: str, tmp_path) -> None:
    path = tmp_path / "tok.json"
    bpe.save(path)
    for loaded in (BPETokenizer.load(path), load_tokenizer(path)):
        assert isinstance(loaded, BPETokenizer)
        assert loaded.vocab_size == bpe.vocab_size
        sample = stdlib_text[50_000:60_000]
        assert torch.equal(loaded.encode(sample), bpe.encode(sample))
    with pytest.raises(ValueError, match="missing.json"):
        BPETokenizer.load(tmp_path / "missing.json")


def test_load_tokenizer_byte_and_errors(tmp_path) -> None:
    ByteTokenizer().save(tmp_path / "byte.json")
    assert isinstance(load_tokenizer(tmp_path / "byte.json"), ByteTokenizer)
    (tmp_path / "junk.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="junk.json"):
        load_tokenizer(tmp_path / "junk.json")
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nothing.json")


# ----------------------------------------------------------------------------- end to end

def test_stdlib_byte_pipeline(stdlib_text: str) -> None:
    tok = build_tokenizer("byte")
    train_ids, val_ids = split_tokens(tok.encode(stdlib_text), val_fraction=0.05)
    loader = TokenLoader(train_ids, seq_len=64, batch_size=4, rank=0, world_size=2)
    inputs, targets = loader.next_batch()
    assert inputs.shape == (4, 64) and int(inputs.max()) < tok.vocab_size
    assert isinstance(tok.decode(inputs[0]), str)
    inputs, _ = next(iter_eval_batches(val_ids, 64, 4, 1, 2))
    assert np.array_equal(inputs[0].numpy(), val_ids[4 * 65: 4 * 65 + 64].numpy())
