"""Text corpora for training: the Python standard library, or the user's own files.

Nothing here downloads anything. ``load_corpus("stdlib")`` builds a corpus from text that ships
with every Python install (the standard library's ``.py`` sources plus the interactive help
texts in ``pydoc_data.topics``), so a debug run works offline on any machine::

    text = load_corpus("stdlib")                  # first DEFAULT_STDLIB_MAX_BYTES (4 MiB)
    text = load_corpus("stdlib", max_bytes=None)  # same default cap; pass a larger int for more
    text = load_corpus("data/shakespeare.txt")    # one file
    text = load_corpus("data/books/")             # every text file below the folder, sorted
"""

from __future__ import annotations

import codecs
import os
import sysconfig
from pathlib import Path

__all__ = ["load_corpus", "DEFAULT_STDLIB_MAX_BYTES", "STDLIB_SOURCE"]

#: The ``source`` value that selects the standard-library corpus.
STDLIB_SOURCE = "stdlib"

#: Cap (UTF-8 bytes) on the stdlib corpus when ``max_bytes`` is None: ~4M byte tokens is plenty
#: for debug models and keeps loading well under a second.
DEFAULT_STDLIB_MAX_BYTES = 4 * 1024 * 1024

# Directories of the stdlib that are not representative prose/code or are install-specific:
# test suites (huge, repetitive), IDLE/turtle demos, bundled wheels, compiled extensions, the
# codec tables in encodings/ (mostly 256-entry charmap literals) and installed third-party code.
_STDLIB_SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "__pycache__",
    "ensurepip", "lib-dynload", "encodings", "__phello__",
})
# pydoc_data/topics.py is added as text, not as source (it would appear twice otherwise);
# this.py is rot13 noise.
_STDLIB_SKIP_FILES = frozenset({"pydoc_data/topics.py", "this.py"})
# _sysconfigdata_* embeds this machine's build paths, which would break cross-host determinism.
_STDLIB_SKIP_FILE_PREFIX = "_sysconfigdata"

# Documents are joined with a blank line so no file's last line runs into the next file's first.
_DOC_SEPARATOR = b"\n\n"

# Bytes sniffed for a NUL when deciding whether a file is binary (what git and grep also do).
_SNIFF_BYTES = 8192


def load_corpus(source: str, max_bytes: int | None = None) -> str:
    """Load a training corpus as one string.

    Args:
        source: ``"stdlib"`` for the corpus built from the running Python's standard library
            (``pydoc_data`` help topics first, then every ``.py`` source file outside test
            suites and site-packages, in sorted path order); otherwise a path to a UTF-8 text
            file, or to a folder whose text files are read recursively in sorted path order
            (hidden entries, binary and non-UTF-8 files are skipped). A file or folder that is
            itself named ``stdlib`` must be given as ``./stdlib``.
        max_bytes: upper bound on the UTF-8 size of the returned text; the text is cut at the
            last whole character within the bound. Default None: ``DEFAULT_STDLIB_MAX_BYTES``
            for ``"stdlib"``, no bound for a path.

    Returns:
        The corpus text; documents from several files are separated by a blank line. The
        result is a pure function of the files read (same install, same text).

    Raises:
        ValueError: ``max_bytes`` is not a positive int; the path does not exist or is neither
            a file nor a folder; a file is empty or not UTF-8 text; a folder has no readable
            text.
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                  or max_bytes <= 0):
        raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
    if source == STDLIB_SOURCE:
        cap = DEFAULT_STDLIB_MAX_BYTES if max_bytes is None else max_bytes
        return _decode_prefix(_stdlib_bytes(cap), cap)
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(
            f"corpus source {source!r} does not exist; expected {STDLIB_SOURCE!r}, a text file "
            "or a folder of text files")
    if path.is_file():
        return _decode_prefix(_read_text_file(path, source, max_bytes), max_bytes)
    if path.is_dir():
        return _decode_prefix(_read_folder(path, source, max_bytes), max_bytes)
    raise ValueError(f"corpus source {source!r} is neither a regular file nor a folder")


def _decode_prefix(data: bytes, max_bytes: int | None) -> str:
    """Decode UTF-8 ``data`` cut to ``max_bytes``, dropping a character split by the cut."""
    if max_bytes is None or len(data) <= max_bytes:
        return data.decode("utf-8")
    # final=False makes the decoder hold back (and so drop) a trailing partial character.
    return codecs.getincrementaldecoder("utf-8")().decode(data[:max_bytes], final=False)


def _stdlib_files(root: Path) -> list[Path]:
    """The stdlib ``.py`` files that make up the corpus, in sorted relative-path order."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into skipped trees at all.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS
                       and not d.startswith("config-")]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            rel = os.path.normpath(os.path.join(rel_dir, name)).replace(os.sep, "/")
            if (name.endswith(".py") and not name.startswith(_STDLIB_SKIP_FILE_PREFIX)
                    and rel not in _STDLIB_SKIP_FILES):
                found.append(rel)
    # Sorting the '/'-joined relative paths (not walk order) is what makes the order portable.
    return [root / rel for rel in sorted(found)]


def _stdlib_bytes(cap: int) -> bytes:
    """At least ``min(cap, everything)`` bytes of stdlib corpus, reading files only as needed."""
    # Imported here: the help topics are ~0.5 MB of strings nobody else needs in memory.
    from pydoc_data.topics import topics

    chunks = [_DOC_SEPARATOR.join(topics[k].encode("utf-8") for k in sorted(topics))]
    size = len(chunks[0])
    for path in _stdlib_files(Path(sysconfig.get_paths()["stdlib"])):
        if size >= cap:
            break
        try:
            data = path.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # unreadable or non-UTF-8 file: skip rather than poison the corpus
        if data:
            chunks.append(data)
            size += len(_DOC_SEPARATOR) + len(data)
    return _DOC_SEPARATOR.join(chunks)


def _is_text(data: bytes, truncated: bool = False) -> bool:
    """Whether ``data`` looks like UTF-8 text: no NUL in its head and decodes strictly.

    ``truncated`` tolerates a character split at the end (a prefix read of a longer file).
    """
    if b"\x00" in data[:_SNIFF_BYTES]:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=not truncated)
    except UnicodeDecodeError:
        return False
    return True


def _read_text_file(path: Path, source: str, max_bytes: int | None) -> bytes:
    """The bytes of one user-named text file (a UTF-8 BOM removed)."""
    # Read only what the cap allows (+3 for the BOM) so a huge file costs max_bytes, not its size.
    limit = -1 if max_bytes is None else max_bytes + len(codecs.BOM_UTF8)
    try:
        with path.open("rb") as f:
            data = f.read(limit)
            truncated = limit >= 0 and f.read(1) != b""
    except OSError as exc:
        raise ValueError(f"corpus file {source!r} cannot be read: {exc}") from exc
    data = data.removeprefix(codecs.BOM_UTF8)
    if not data:
        raise ValueError(f"corpus file {source!r} is empty; expected a non-empty text file")
    if not _is_text(data, truncated):
        raise ValueError(f"corpus file {source!r} is not UTF-8 text (binary or other encoding)")
    return data


def _read_folder(root: Path, source: str, max_bytes: int | None) -> bytes:
    """The text files below ``root`` in sorted order, joined; skips what is not text."""
    rel_paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Hidden folders (.git, .venv, ...) hold tooling state, not corpus text.
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel_dir = os.path.relpath(dirpath, root)
        rel_paths += [os.path.normpath(os.path.join(rel_dir, n)).replace(os.sep, "/")
                      for n in filenames if not n.startswith(".")]
    chunks: list[bytes] = []
    size = -len(_DOC_SEPARATOR)  # length of the joined result: no separator before the first
    for rel in sorted(rel_paths):
        if max_bytes is not None and size >= max_bytes:
            break
        try:
            data = (root / rel).read_bytes().removeprefix(codecs.BOM_UTF8)
        except OSError:
            continue
        if data and _is_text(data):
            chunks.append(data)
            size += len(_DOC_SEPARATOR) + len(data)
    if not chunks:
        raise ValueError(
            f"corpus folder {source!r} has no readable text: expected at least one non-empty "
            f"UTF-8 text file below it ({len(rel_paths)} files found, none usable)")
    return _DOC_SEPARATOR.join(chunks)
