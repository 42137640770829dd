"""The docs cannot drift: every code block of README.md and docs/*.md runs (or is checked) here.

Every page is picked up by itself (``docs/*.md``); its blocks run in order in one scratch
folder of its own (a copy of ``configs/``; later blocks see the files earlier ones wrote).
Every fenced block names its language, which decides what happens to it:

    python   run in a fresh process at world size 1, with a Gloo group already up
             (``shardwise.distributed.init()`` joins it); ``ranks=N`` runs it on N ranks
    bash     each command runs in the scratch folder; ``pip install``, ``torchrun`` /
             ``python -m torch.distributed.run`` and ``srun`` commands are parsed and checked,
             not run (the files and extras they name exist, torchrun's parser accepts the
             options, shardwise's parser and config loader accept the shardwise part)
    toml     parsed; a shardwise config (``[section]`` tables) must load, unknown keys fail
    json     parsed
    text     output, error messages, pictures: not run

Options are HTML comments on the lines directly above the fence (other comments, such as
``<!-- test-command -->``, and blank lines may stand between), one ``key=value`` each::

    <!-- docs-test: args=--train.steps 2 -->      appended to every `shardwise train` and
                                                  `shardwise doctor` in the block
    <!-- docs-test: ranks=2 -->                   a python block runs on 2 Gloo ranks
    <!-- docs-test: file=my.toml -->              the block's text is written to this file in
                                                  the scratch folder first (any language)
    <!-- docs-test: exit=1 -->                    the commands run must exit with this code
    <!-- docs-test: expect=rank 1 failed -->      this text must appear in some command's
                                                  output (repeatable)
    <!-- docs-test: timeout=300 -->               seconds per command or python block (120)
    <!-- docs-test: check-only=REASON -->         parse and check every command, run none
    <!-- docs-test: illustrative=REASON -->       not run at all: a sketch, say why

An unknown option, a marker that is not directly above a block, a block without a language,
or ``check-only`` / ``illustrative`` without a reason fail :func:`test_every_block_is_
understood`. Paths the docs name (``shardwise/...``, ``docs/...``, ``bench/...``,
``tests/...``, ``configs/...``, relative links) must exist, and each ``[Note: ...]`` they
cite must be defined in the code. The whole module stays under 3 minutes on 2 cores: give
``shardwise train`` blocks ``args=--train.steps 2`` (or fewer ranks) rather than letting
them train for minutes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_blocks import ROOT, Block, DocsError, commands, parse_page, run_block, scratch_folder

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


# ----------------------------------------------------------------------------- the markers


def test_every_block_is_understood():
    blocks = [b for page in PAGES for b in parse_page(page)]
    assert blocks, "no code blocks found"
    for b in blocks:
        if b.lang == "python" and b.mode == "run":
            compile(b.text, b.where, "exec")  # a syntax error names the block
    assert {_page_id(p) for p in PAGES} >= {"README.md", "docs/engine.md"}


@pytest.mark.parametrize("text, error", [
    ("<!-- docs-test: arg=--x -->\n```bash\nls\n```\n", "unknown docs-test option 'arg'"),
    ("<!-- docs-test: illustrative= -->\n```python\nx\n```\n", "needs a value"),
    ("<!-- docs-test: ranks=2 -->\n\nSome prose.\n```python\nx\n```\n", "not directly above"),
    ("```\nplain\n```\n", "code block language ''"),
    ("```sh\nls\n```\n", "code block language 'sh'"),
    ("<!-- docs-test: ranks=2 -->\n<!-- docs-test: ranks=3 -->\n```python\nx\n```\n",
     "given twice"),
    ("text\n<!-- docs-test: ranks=2 -->\n", "not directly above a code block"),
])
def test_markers_that_cannot_be_understood_are_refused(tmp_path, monkeypatch, text, error):
    import docs_parse

    monkeypatch.setattr(docs_parse, "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text(text)
    with pytest.raises(DocsError, match=error):
        parse_page(page)


def test_markers_and_modes(tmp_path, monkeypatch):
    import docs_parse

    monkeypatch.setattr(docs_parse, "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: args=--train.steps 2 -->\n<!-- test-command -->\n\n"
                    "```bash\nshardwise train  # x\n```\n\n"
                    "<!-- docs-test: illustrative=a sketch -->\n```python\nmodel(x)\n```\n"
                    "```toml\n[train]\nsteps = 3\n```\n```text\nout\n```\n")
    blocks = parse_page(page)
    assert [(b.lang, b.line, b.mode) for b in blocks] == [
        ("bash", 4, "run"), ("python", 9, "skip"), ("toml", 12, "check"), ("text", 16, "skip")]
    assert blocks[0].options == {"args": ["--train.steps 2"]}
    assert commands("A=1 shardwise train \\\n  --x 2 && ls | head -1; echo 'a # b'  # c\n") == [
        ["A=1", "shardwise", "train", "--x", "2"], ["ls", "|", "head", "-1"], ["echo", "a # b"]]


def test_checks_catch_what_does_not_exist(tmp_path):
    def block(lang: str, text: str, **options: str) -> Block:
        return Block(ROOT / "README.md", 1, lang, text, {k: [v] for k, v in options.items()})

    bad = [
        block("bash", "shardwise train --train.stepz 2\n", **{"check-only": "x"}),
        block("bash", "torchrun --nproc_per_node 8 -m shardwise.train.cli train --optim.lr x\n"),
        block("bash", "torchrun --nprocs 8 -m shardwise.train.cli train\n"),
        block("bash", "srun --kill-on-bad-exit=1 shardwise train --parallel.stage 7\n"),
        block("bash", "pip install -c constraints.txt -e \".[tset]\"\n"),
        block("bash", "pip install -c nowhere.txt -e .\n"),
        block("bash", "python -m shardwise.nothing_here\n", **{"check-only": "x"}),
        block("toml", "[optim]\nlr_max = 3\n"),
    ]
    for b in bad:
        with pytest.raises(DocsError):
            run_block(b, tmp_path)
    good = block("bash", "pip install -c constraints.txt -e \".[test]\" && "
                         "torchrun --standalone --nproc_per_node 8 -m shardwise.train.cli "
                         "train --config configs/debug.toml\n")
    assert run_block(good, scratch_folder(tmp_path / "s")) == "checked"


# ----------------------------------------------------------------------------- the pages


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_the_blocks_of(page, tmp_path):
    """Run or check every block of the page, in order, in one scratch folder."""
    cwd = scratch_folder(tmp_path / "scratch")
    for block in parse_page(page):
        run_block(block, cwd)


_PATH = re.compile(r"(?<![\w./-])((?:shardwise|docs|bench|tests|configs|\.ci)/[\w./-]*\w/?)")
_LINK = re.compile(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)")
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")
_NOTE_DEF = re.compile(r"^\s*(?:#\s*|\"\"\"\s*)?\[Note: ([^\]]+)\]")


def note_definitions() -> set[str]:
    """The notes written in the code: a line that starts with ``[Note: name]``."""
    names = set()
    for file in (ROOT / "shardwise").rglob("*.py"):
        for line in file.read_text(encoding="utf-8").splitlines():
            if m := _NOTE_DEF.match(line):
                names.add(m[1])
    return names


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_paths_and_notes_named_in_the_docs_exist(page):
    text = page.read_text(encoding="utf-8")
    missing = [m[1] for m in _PATH.finditer(text)  # placeholders (test_<feature>.py) aside
               if text[m.end():m.end() + 1] != "<" and not (ROOT / m[1]).exists()]
    missing += [link for link in _LINK.findall(text)
                if not link.startswith(("http", "mailto")) and not (page.parent / link).exists()]
    assert not missing, f"{_page_id(page)} names paths that do not exist: {missing}"
    notes = note_definitions()
    unknown = [n for n in (" ".join(n.split()) for n in _NOTE.findall(text))
               if n not in notes and n != "..."]  # [Note: ...] names the syntax itself
    assert not unknown, f"{_page_id(page)} cites notes no code defines: {unknown}"


