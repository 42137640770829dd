"""The machinery of tests/test_docs.py: find the fenced blocks of a markdown page with their
``<!-- docs-test: ... -->`` options, and run or check each one.

The marker syntax is documented in tests/test_docs.py's docstring and in README.md
(Development). This module holds no tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
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
_OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>", "2>&1", "(", ")"}
_SEPARATORS = {"&&", "||", ";"}
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_",
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


def _python_module(argv: list[str]) -> str | None:
    if argv and Path(argv[0]).name in ("python", "python3") and len(argv) > 2 \
            and argv[1] == "-m":
        return argv[2]
    return None


def kind(argv: list[str]) -> str:
    """What a command is: shardwise, torchrun, srun, pip, python, export, cd, or other."""
    program = Path(argv[0]).name if argv else ""
    module = _python_module(argv)
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
    return argv[3:] if _python_module(argv) else argv[1:]


# ----------------------------------------------------------------------------- checks


def _fail(block: Block, message: str) -> DocsError:
    return DocsError(f"{block.where}: {message}")


def check_shardwise(block: Block, args: list[str], cwd: Path) -> None:
    """Parse a ``shardwise`` command line and load its config, as the command would."""
    from shardwise.train.cli import _attach_values, _check_aliases, build_parser
    from shardwise.train.config import load_config

    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            parsed, extra = build_parser().parse_known_args(_attach_values(args))
    except SystemExit as exc:
        if exc.code == 0:  # --help
            return
        raise _fail(block, f"shardwise {' '.join(args)}: {err.getvalue().strip()}") from None
    try:
        if extra:
            from shardwise.train.cli import _unknown_argument

            raise _unknown_argument(extra)
        if parsed.command in ("train", "doctor"):
            _check_aliases(parsed)
            overrides = {k: v for k, v in vars(parsed).items() if "." in k}
            load_config(parsed.config and cwd / parsed.config, overrides)
    except ValueError as exc:
        raise _fail(block, f"shardwise {' '.join(args)}: {exc}") from None


def check_torchrun(block: Block, argv: list[str], extra: list[str], cwd: Path) -> None:
    """torchrun's own parser on the options, then the program it would start."""
    from torch.distributed.run import get_args_parser

    rest = argv[3:] if _python_module(argv) else argv[1:]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = get_args_parser().parse_args(rest)
    except SystemExit:
        raise _fail(block, f"torchrun {' '.join(rest)}: {err.getvalue().strip()}") from None
    if ns.module:
        if importlib.util.find_spec(ns.training_script) is None:
            raise _fail(block, f"torchrun -m {ns.training_script}: no such module")
        if ns.training_script == "shardwise.train.cli":
            check_shardwise(block, [*ns.training_script_args, *extra], cwd)
    elif not (cwd / ns.training_script).exists() and not (ROOT / ns.training_script).exists():
        raise _fail(block, f"torchrun {ns.training_script}: no such script")


def check_pip(block: Block, argv: list[str]) -> None:
    """``pip install``: the constraint / requirement files and the extras named exist."""
    args = argv[3:] if _python_module(argv) else argv[1:]
    if not args or args[0] != "install":
        raise _fail(block, f"pip {' '.join(args)}: only 'pip install' is understood")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    words = iter(args[1:])
    for word in words:
        if word in ("-c", "--constraint", "-r", "--requirement"):
            name = next(words, "")
            if not (ROOT / name).is_file():
                raise _fail(block, f"pip install {word} {name}: no such file in the repository")
        elif word in ("-e", "--editable") or not word.startswith("-"):
            spec = next(words, "") if word.startswith("-") else word
            m = re.fullmatch(r"(?P<what>[^\[]+)(\[(?P<extras>[^\]]*)\])?", spec)
            if not m or m["what"] not in (".", "shardwise"):
                continue  # another package: nothing of ours to check
            for extra in filter(None, (m["extras"] or "").split(",")):
                if extra.strip() not in extras:
                    raise _fail(block, f"pip install {spec}: no extra {extra!r} in "
                                       f"pyproject.toml (has {', '.join(extras)})")


def check_python(block: Block, argv: list[str], cwd: Path) -> None:
    """``python -m X``: X can be imported; ``python -c CODE`` compiles; a script exists."""
    module = _python_module(argv)
    if module is not None:
        if importlib.util.find_spec(module) is None:
            raise _fail(block, f"python -m {module}: no such module")
    elif len(argv) > 2 and argv[1] == "-c":
        compile(argv[2], block.where, "exec")
    elif len(argv) > 1 and not (cwd / argv[1]).exists():
        raise _fail(block, f"python {argv[1]}: no such script")


def check_command(block: Block, argv: list[str], cwd: Path) -> None:
    """Everything that can be checked of one command without running it."""
    k = kind(argv)
    if k == "srun":  # srun's own options, then the program it starts
        starts = next((i for i, w in enumerate(argv[1:], 1) if not w.startswith("-")), None)
        if starts is not None:
            check_command(block, argv[starts:], cwd)
    elif k == "shardwise":
        check_shardwise(block, shardwise_args(argv), cwd)
    elif k == "torchrun":
        check_torchrun(block, argv, [], cwd)
    elif k == "pip":
        check_pip(block, argv)
    elif k == "python":
        check_python(block, argv, cwd)


def check_data(block: Block, cwd: Path) -> None:
    """A toml block parses (a shardwise config loads); a json block parses."""
    if block.lang == "json":
        json.loads(block.text)
        return
    from shardwise.train.config import Config, load_config

    doc = tomllib.loads(block.text)
    sections = {f for f in Config.__dataclass_fields__}
    if doc and any(k in sections for k in doc):
        path = cwd / ".docs-test-config.toml"
        path.write_text(block.text, encoding="utf-8")
        try:
            load_config(path)
        except ValueError as exc:
            raise _fail(block, f"this config does not load: {exc}") from None


# ----------------------------------------------------------------------------- running


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without launcher variables, the venv's scripts first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _executable(argv: list[str], args: list[str]) -> list[str]:
    if kind(argv) == "shardwise":
        rest = shardwise_args(argv)
        script = Path(sys.executable).parent / "shardwise"
        head = [str(script)] if script.exists() else [sys.executable, "-m", "shardwise.train.cli"]
        extra = args if rest and rest[0] in ("train", "doctor") else []
        return [*head, *rest, *extra]
    if kind(argv) == "python":
        return [sys.executable, *argv[1:]]
    return argv


def run_shell(block: Block, cwd: Path) -> int:
    """Run (or check) a bash block's commands in order; returns the number run."""
    args = shlex.split(block.option("args", ""))
    timeout = float(block.option("timeout", str(DEFAULT_TIMEOUT_S)))
    expected = int(block.option("exit", "0"))
    env: dict[str, str] = {}
    outputs, ran = [], 0
    syntax = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
    if syntax.returncode:
        raise _fail(block, f"bash syntax: {syntax.stderr.strip()}")
    for words in commands(block.text):
        assigned, argv = split_env(words)
        k = kind(argv)
        if k == "export":
            env.update(split_env(argv[1:])[0])
            continue
        if k == "cd" and len(argv) == 2:
            cwd = cwd / argv[1]
            continue
        if block.mode == "check" or k in ("pip", "torchrun", "srun") or not argv:
            check_command(block, argv, cwd)
            continue
        if any(w in _OPERATORS for w in argv):  # a pipe or a redirection: the shell does it
            cmd = ["bash", "-c", " ".join(w if w in _OPERATORS else shlex.quote(w)
                                          for w in _executable(argv, args))]
        else:
            cmd = _executable(argv, args)
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=clean_env({**env, **assigned}),
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise _fail(block, f"{shlex.join(cmd)} ran past {timeout:g} s "
                               "(docs-test: timeout=...)") from None
        ran += 1
        outputs.append(proc.stdout + proc.stderr)
        if proc.returncode != expected:
            raise _fail(block, f"{shlex.join(cmd)} exited with {proc.returncode}, expected "
                               f"{expected}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    for text in block.options.get("expect", []):
        if not any(text in out for out in outputs):
            raise _fail(block, f"no command printed {text!r}:\n" + "\n".join(outputs)[-3000:])
    return ran


def exec_python(source: str, where: str, cwd: str) -> None:
    """One rank of a python block (module level: run_ranks pickles it by name)."""
    os.chdir(cwd)
    exec(compile(source, where, "exec"), {"__name__": "__main__"})  # noqa: S102 - the docs


def run_python(block: Block, cwd: Path) -> None:
    """Run a python block on ``ranks`` Gloo ranks (default 1), each in a fresh process."""
    from shardwise.testing.dist import RankFailure, run_ranks

    ranks = int(block.option("ranks", "1"))
    timeout = float(block.option("timeout", str(DEFAULT_TIMEOUT_S)))
    try:
        run_ranks(exec_python, ranks, args=(block.text, block.where, str(cwd)),
                  timeout_s=timeout)
    except RankFailure as exc:
        raise _fail(block, f"the python block failed:\n{str(exc)[-4000:]}") from None


def scratch_folder(path: Path) -> Path:
    """A page's working folder: what its commands may name (configs/) copied in."""
    shutil.copytree(ROOT / "configs", path / "configs")
    return path


def run_block(block: Block, cwd: Path) -> str:
    """Do what the block's mode says; returns "run", "checked" or "skipped"."""
    if "file" in block.options:
        (cwd / block.option("file")).write_text(block.text, encoding="utf-8")
    if block.mode == "skip":
        return "skipped"
    if block.lang in CHECKED:
        check_data(block, cwd)
        return "checked"
    if block.lang in SHELL:
        ran = run_shell(block, cwd)
        return "run" if ran else "checked"
    if block.mode == "check":
        compile(block.text, block.where, "exec")
        return "checked"
    run_python(block, cwd)
    return "run"
