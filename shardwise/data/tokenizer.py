"""Tokenizers: raw UTF-8 bytes, or a byte-level BPE trained in-process on the corpus.

Both map text to a 1-D int64 tensor of ids in ``[0, vocab_size)`` and back::

    tok = build_tokenizer("byte")                                 # vocab_size 256, no training
    tok = build_tokenizer("bpe", text=text, vocab_size=4096)      # pip install shardwise[bpe]
    ids = tok.encode(text)                                        # (N,) int64
    assert tok.decode(ids) == text
    tok.save("run/tokenizer.json"); tok = load_tokenizer("run/tokenizer.json")

Byte-level BPE is lossless on any string (every byte has a token), so unlike a word-piece
vocabulary nothing maps to "unknown".
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence, Union

import numpy as np
import torch

if TYPE_CHECKING:  # the real import is lazy: tokenizers is an optional dependency
    import tokenizers

__all__ = [
    "Tokenizer", "ByteTokenizer", "BPETokenizer", "build_tokenizer", "load_tokenizer",
    "TOKENIZER_KINDS", "DEFAULT_BPE_VOCAB_SIZE",
]

#: Valid ``kind`` values for :func:`build_tokenizer`.
TOKENIZER_KINDS = ("byte", "bpe")

#: BPE vocabulary size when none is given: small enough to train on a few MB in seconds.
DEFAULT_BPE_VOCAB_SIZE = 4096

_BYTE_VOCAB_SIZE = 256
# Marker written by ByteTokenizer.save so load_tokenizer can tell the two file kinds apart.
_BYTE_FILE_KEY = "shardwise_byte_tokenizer"
# Characters per piece when BPE-encoding long text in parallel (encode_batch).
_BPE_CHUNK_CHARS = 1 << 16
# A lone newline between two non-space characters is a boundary of the GPT-2 pre-tokenizer
# regex whatever surrounds it, so cutting there gives exactly the ids of encoding the whole text.
# (A cut inside a longer whitespace run would not: "\n\n[" pre-tokenizes as "\n", "\n", "[",
# but a piece ending in "\n\n" keeps them together.)
_BPE_SAFE_CUT = re.compile(r"(?<=\S)\n(?=\S)")

IdsLike = Union[torch.Tensor, np.ndarray, Sequence[int]]


class Tokenizer(Protocol):
    """What the rest of shardwise needs from a tokenizer."""

    kind: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> torch.Tensor: ...

    def decode(self, ids: IdsLike) -> str: ...

    def save(self, path: str | Path) -> None: ...


def _ids_to_numpy(ids: IdsLike) -> np.ndarray:
    """``ids`` as a 1-D int64 numpy array; ValueError if it is not 1-D."""
    if isinstance(ids, torch.Tensor):
        arr = ids.detach().cpu().numpy()
    else:
        arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_id_range(arr: np.ndarray, vocab_size: int) -> None:
    """Raise ValueError naming the first id outside ``[0, vocab_size)``."""
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        pos = int(np.argmax(bad))
        raise ValueError(
            f"token id {int(arr[pos])} at position {pos} is outside [0, {vocab_size})")


class ByteTokenizer:
    """UTF-8 bytes as tokens: id = byte value, ``vocab_size`` 256, no training needed."""

    kind = "byte"

    @property
    def vocab_size(self) -> int:
        return _BYTE_VOCAB_SIZE

    def encode(self, text: str) -> torch.Tensor:
        """Encode ``text`` to its UTF-8 bytes.

        Args:
            text: any string.

        Returns:
            1-D int64 tensor, one id per UTF-8 byte.
        """
        # numpy view of the bytes then one widening copy: ~10 ms per 4 MB, no Python loop.
        # (torch.frombuffer would warn on the read-only bytes object and rejects empty input.)
        arr = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return torch.from_numpy(arr.astype(np.int64))

    def decode(self, ids: IdsLike) -> str:
        """Decode byte ids to text; invalid UTF-8 becomes U+FFFD (``errors="replace"``).

        Args:
            ids: 1-D tensor, array or sequence of ints in ``[0, 256)``.

        Returns:
            The decoded string.

        Raises:
            ValueError: ``ids`` is not 1-D integers, or an id is outside ``[0, 256)``.
        """
        arr = _ids_to_numpy(ids)
        _check_id_range(arr, _BYTE_VOCAB_SIZE)
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def save(self, path: str | Path) -> None:
        """Write a small JSON marker so :func:`load_tokenizer` can rebuild this tokenizer."""
        Path(path).write_text(json.dumps({_BYTE_FILE_KEY: 1}) + "\n", encoding="utf-8")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


def _import_tokenizers() -> Any:
    """Import the optional ``tokenizers`` package or explain how to install it."""
    try:
        import tokenizers
    except ImportError as exc:
        raise ImportError(
            "the 'bpe' tokenizer needs the Hugging Face 'tokenizers' package, which is not "
            "installed: pip install shardwise[bpe]  (or use the 'byte' tokenizer)") from exc
    return tokenizers


def _split_for_bpe(text: str) -> list[str]:
    """Cut ``text`` into ~_BPE_CHUNK_CHARS pieces at pre-tokenizer boundaries (see above)."""
    pieces: list[str] = []
    start = 0
    while start < len(text):
        cut = _BPE_SAFE_CUT.search(text, start + _BPE_CHUNK_CHARS)
        end = len(text) if cut is None else cut.end()
        pieces.append(text[start:end])
        start = end
    return pieces


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) backed by the Hugging Face ``tokenizers`` package.

    Build one with :meth:`train` or :meth:`load`; the constructor wraps an existing
    ``tokenizers.Tokenizer``.
    """

    kind = "bpe"

    def __init__(self, backend: "tokenizers.Tokenizer") -> None:
        self._backend = backend

    @classmethod
    def train(cls, text: str, vocab_size: int = DEFAULT_BPE_VOCAB_SIZE) -> "BPETokenizer":
        """Train a byte-level BPE vocabulary on ``text``.

        Args:
            text: training text (non-empty).
            vocab_size: target vocabulary size, at least 256 (the byte alphabet). Small texts
                may yield fewer tokens when no more pairs repeat; read ``vocab_size`` after.
                Default ``DEFAULT_BPE_VOCAB_SIZE`` (4096).

        Returns:
            The trained tokenizer.

        Raises:
            ValueError: empty ``text`` or ``vocab_size`` below 256.
            ImportError: ``tokenizers`` is not installed (``pip install shardwise[bpe]``).
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
                or vocab_size < _BYTE_VOCAB_SIZE:
            raise ValueError(
                f"bpe vocab_size must be an int >= {_BYTE_VOCAB_SIZE} (the byte alphabet), "
                f"got {vocab_size!r}")
        if not isinstance(text, str) or not text:
            raise ValueError(f"bpe tokenizer needs non-empty training text, got {text!r:.40}")
        tk = _import_tokenizers()
        backend = tk.Tokenizer(tk.models.BPE())
        # add_prefix_space=False keeps decode(encode(s)) == s exactly.
        backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size, show_progress=False, special_tokens=[],
            # Seeding all 256 byte symbols guarantees any later text is encodable.
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
        backend.train_from_iterator(_split_for_bpe(text), trainer=trainer)
        return cls(backend)

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        """Load a tokenizer written by :meth:`save`.

        Raises:
            ValueError: ``path`` does not exist.
            ImportError: ``tokenizers`` is not installed.
        """
        if not Path(path).is_file():
            raise ValueError(f"bpe tokenizer file {str(path)!r} does not exist")
        return cls(_import_tokenizers().Tokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        """Write the vocabulary and merges as one ``tokenizers`` JSON file at ``path``."""
        self._backend.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size()

    def encode(self, text: str) -> torch.Tensor:
        """Encode ``text`` to BPE ids.

        Args:
            text: any string.

        Returns:
            1-D int64 tensor of ids in ``[0, vocab_size)``.
        """
        # Long text is encoded as pieces in parallel; the cut points make the result identical
        # to one encode() call, which is also several times slower on MB-sized input.
        encodings = self._backend.encode_batch(_split_for_bpe(text))
        arrays = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
        return torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros(0, np.int64))

    def decode(self, ids: IdsLike) -> str:
        """Decode ids to text; bytes that are not valid UTF-8 become U+FFFD.

        Raises:
            ValueError: ``ids`` is not 1-D integers, or an id is outside ``[0, vocab_size)``.
        """
        arr = _ids_to_numpy(ids)
        _check_id_range(arr, self.vocab_size)
        return self._backend.decode(arr.tolist(), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


def build_tokenizer(kind: str, *, text: str | None = None,
                    vocab_size: int | None = None) -> ByteTokenizer | BPETokenizer:
    """Construct a tokenizer by name.

    Args:
        kind: ``"byte"`` or ``"bpe"``.
        text: training text; required for ``"bpe"``, ignored for ``"byte"``.
        vocab_size: for ``"bpe"`` the target size (default ``DEFAULT_BPE_VOCAB_SIZE``); for
            ``"byte"`` None or 256.

    Returns:
        A :class:`ByteTokenizer` or a freshly trained :class:`BPETokenizer`.

    Raises:
        ValueError: unknown ``kind``; ``"byte"`` with a vocab_size other than 256; ``"bpe"``
            without text or with vocab_size < 256.
        ImportError: ``"bpe"`` without the ``tokenizers`` package.
    """
    if kind == "byte":
        if vocab_size is not None and vocab_size != _BYTE_VOCAB_SIZE:
            raise ValueError(
                f"the byte tokenizer has vocab_size {_BYTE_VOCAB_SIZE}, got vocab_size="
                f"{vocab_size!r}; pass None or {_BYTE_VOCAB_SIZE}, or use kind='bpe'")
        return ByteTokenizer()
    if kind == "bpe":
        if text is None:
            raise ValueError("build_tokenizer('bpe') needs text= to train on, got None")
        return BPETokenizer.train(
            text, DEFAULT_BPE_VOCAB_SIZE if vocab_size is None else vocab_size)
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {list(TOKENIZER_KINDS)}")


def load_tokenizer(path: str | Path) -> ByteTokenizer | BPETokenizer:
    """Load a tokenizer saved with ``save(path)`` by either tokenizer class.

    Raises:
        ValueError: ``path`` does not exist or is not a tokenizer JSON file.
        ImportError: it is a BPE file and ``tokenizers`` is not installed.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"tokenizer file {str(path)!r} does not exist")
    try:
        content = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"tokenizer file {str(path)!r} is not JSON: {exc}") from exc
    if isinstance(content, dict) and _BYTE_FILE_KEY in content:
        return ByteTokenizer()
    if isinstance(content, dict) and isinstance(content.get("model"), dict):
        return BPETokenizer.load(p)
    raise ValueError(f"tokenizer file {str(path)!r} is neither a byte nor a bpe tokenizer file")
