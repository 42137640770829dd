"""The machinery of tests/test_docs.py: run or check each fenced block docs_parse.py found
in a markdown page.

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
from pathlib import Path

from docs_parse import (CHECKED, DEFAULT_TIMEOUT_S, LAUNCHER_ENV, OPERATORS, ROOT, SHELL, Block,
                        DocsError, commands, kind, parse_page, python_module, shardwise_args,
                        split_env)

__all__ = ["ROOT", "Block", "DocsError", "commands", "parse_page", "run_block",
           "scratch_folder"]

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

    rest = argv[3:] if python_module(argv) else argv[1:]
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
    args = argv[3:] if python_module(argv) else argv[1:]
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
    module = python_module(argv)
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
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_ENV)}
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
        if any(w in OPERATORS for w in argv):  # a pipe or a redirection: the shell does it
            cmd = ["bash", "-c", " ".join(w if w in OPERATORS else shlex.quote(w)
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
