"""Reading the fenced blocks of a markdown page for tests/test_docs.py: each block with its
``<!-- docs-test: ... -->`` options, and a shell block's command lines split into words,
environment assignments and the kind of program they run (docs_blocks.py runs and checks
them).

The marker syntax is documented in tests/test_docs.py's docstring and in README.md
(Development). This module holds no tests.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PYTHON = {"python"}
SHELL = {"bash"}
CHECKED = {"toml", "json"}
NOT_RUN = {"text"}
LANGUAGES = PYTHON | SHELL | CHECKED | NOT_RUN

# key -> repeatable; every value is a non-empty string
OPTIONS = {"args": False, "ranks": False, "file": False, "exit": False, "expect": True,
           "timeout": False, "check-only": False, "illustrative": False}
DEFAULT_TIMEOUT_S = 120.0

_MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
_COMMENT = re.compile(r"^<!--.*-->\s*$")
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>[^`]*)$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>", "2>&1", "(", ")"}
_SEPARATORS = {"&&", "||", ";"}
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_",
                 "TORCHELASTIC", "SLURM_", "GROUP_RANK", "ROLE_")


class DocsError(AssertionError):
    """A block that failed, or a marker that cannot be understood; names page and line."""


@dataclass
class Block:
    """One fenced block: where it is, its language, its text and its options."""

    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    options: dict[str, list[str]] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def option(self, key: str, default: str | None = None) -> str | None:
        return self.options.get(key, [default])[-1]

    @property
    def mode(self) -> str:
        """``run``, ``check`` or ``skip`` (what the test does with the block)."""
        if "illustrative" in self.options or self.lang in NOT_RUN:
            return "skip"
        if "check-only" in self.options or self.lang in CHECKED:
            return "check"
        return "run"


def _parse_marker(body: str, where: str) -> tuple[str, str]:
    key, sep, value = body.partition("=")
    key, value = key.strip(), value.strip()
    if key not in OPTIONS:
        raise DocsError(f"{where}: unknown docs-test option {key!r}; expected one of "
                        f"{', '.join(OPTIONS)} (as key=value)")
    if not sep or not value:
        raise DocsError(f"{where}: docs-test option {key!r} needs a value: {key}=...")
    return key, value


def parse_page(page: Path) -> list[Block]:
    """Every top-level fenced block of ``page`` with the options written above it.

    Raises:
        DocsError: a block without a language or with one not in :data:`LANGUAGES`, a marker
            not followed by a block, an unknown option, an option given twice, an indented
            fence, or ``illustrative`` / ``check-only`` without a reason.
    """
    lines = page.read_text(encoding="utf-8").splitlines()
    rel = page.relative_to(ROOT)
    blocks: list[Block] = []
    pending: dict[str, list[str]] = {}
    pending_at = 0
    i = 0
    while i < len(lines):
        line, where = lines[i], f"{rel}:{i + 1}"
        marker, fence = _MARKER.match(line), _FENCE.match(line)
        if marker:
            key, value = _parse_marker(marker["body"], where)
            if key in pending and not OPTIONS[key]:
                raise DocsError(f"{where}: docs-test option {key!r} given twice")
            pending.setdefault(key, []).append(value)
            pending_at = pending_at or i + 1
        elif fence:
            if fence["indent"]:
                raise DocsError(f"{where}: indented code fence; the docs test reads top-level "
                                "fences only")
            lang = fence["info"].strip().split(" ")[0]
            if lang not in LANGUAGES:
                raise DocsError(f"{where}: code block language {lang!r}; expected one of "
                                f"{', '.join(sorted(LANGUAGES))} (text for output or "
                                "pictures)")
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")),
                       None)
            if end is None:
                raise DocsError(f"{where}: code block never closed")
            blocks.append(Block(page, i + 1, lang, "\n".join(lines[i + 1:end]) + "\n",
                                pending))
            pending, pending_at, i = {}, 0, end
        elif pending and line.strip() and not _COMMENT.match(line):
            raise DocsError(f"{rel}:{pending_at}: docs-test marker not directly above a code "
                            "block")
        i += 1
    if pending:
        raise DocsError(f"{rel}:{pending_at}: docs-test marker not directly above a code block")
    return blocks


# ----------------------------------------------------------------------------- shell words


def commands(text: str) -> list[list[str]]:
    """The block's commands: ``a && b; c`` gives ``[[a...], [b...], [c...]]``; pipes and
    redirections stay inside their command as separate words."""
    out: list[list[str]] = []
    for line in text.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words, current = list(lex), []
        for word in words:
            if word in _SEPARATORS:
                if current:
                    out.append(current)
                current = []
            else:
                current.append(word)
        if current:
            out.append(current)
    return out


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """``A=1 B=2 prog args`` -> ``({"A": "1", "B": "2"}, ["prog", "args"])``."""
    env = {}
    while words and _ASSIGNMENT.match(words[0]):
        name, _, value = words[0].partition("=")
        env[name] = value
        words = words[1:]
    return env, words


def python_module(argv: list[str]) -> str | None:
    if argv and Path(argv[0]).name in ("python", "python3") and len(argv) > 2 \
            and argv[1] == "-m":
        return argv[2]
    return None


def kind(argv: list[str]) -> str:
    """What a command is: shardwise, torchrun, srun, pip, python, export, cd, or other."""
    program = Path(argv[0]).name if argv else ""
    module = python_module(argv)
    if program == "shardwise" or module == "shardwise.train.cli":
        return "shardwise"
    if program == "torchrun" or module == "torch.distributed.run":
        return "torchrun"
    if program == "pip" or module == "pip":
        return "pip"
    if program in ("srun", "export", "cd"):
        return program
    if program in ("python", "python3"):
        return "python"
    return "other"


def shardwise_args(argv: list[str]) -> list[str]:
    """The arguments after ``shardwise`` / ``python -m shardwise.train.cli``."""
    return argv[3:] if python_module(argv) else argv[1:]
