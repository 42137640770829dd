"""The API reference, generated from the docstrings with pdoc, builds, and nothing in it points
nowhere.

The modules are those of the ``pdoc`` command in README.md (Development), read from there so
that what users build and what CI builds are one list. A package's page shows what its
``__all__`` exports; pdoc does not descend into submodules a package does not export, so
each public package is named on the command line.

The build fails when a module cannot be imported (pdoc warns and skips it), when a docstring
cross-reference (``:func:`shardwise.shard```, ``:class:`~shardwise.checkpoint.Checkpointer```,
``:meth:`wait``` inside a class, ...) names nothing that exists, or when a ``[Note: ...]``
cited in the code is defined nowhere (a note is defined by a line that starts with it).
"""

from __future__ import annotations

import importlib
import re
import shlex
import warnings
from pathlib import Path

import pdoc  # the test extra installs it: a missing pdoc fails here, it is not skipped
import pdoc.doc
import pdoc.render
import pytest

ROOT = Path(__file__).resolve().parents[1]
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):`~?([\w.]+)(?:\(\))?`")
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")
_NOTE_DEF = re.compile(r"^\s*(?:#\s*|\"\"\"\s*)?\[Note: ([^\]]+)\]")


def documented_modules() -> list[str]:
    """The modules named by README.md's ``pdoc -d google ...`` command."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8").replace("\\\n", " ")
    line = next(ln for ln in readme.splitlines() if ln.startswith("pdoc -d google "))
    words = shlex.split(line, comments=True)[1:]
    modules, skip = [], False
    for word in words:
        if skip or word in ("-d", "-o"):
            skip = not skip
            continue
        modules.append(word)
    return modules


def _exists(dotted: str) -> bool:
    """Whether ``a.b.c`` names a module, or an attribute reached from one."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        try:
            for name in parts[k:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def _resolves(target: str, doc: pdoc.doc.Doc) -> bool:
    """A reference as Sphinx reads it: absolute, or relative to the enclosing classes, the
    module, or a package above it."""
    modname, qualname = doc.taken_from  # where it is defined, not where it is re-exported
    qual = qualname.split(".") if qualname else []
    mod = modname.split(".")
    scopes = [".".join([*mod, *qual[:k]]) for k in range(len(qual), 0, -1)]
    scopes += [".".join(mod[:k]) for k in range(len(mod), 0, -1)] + [""]
    return any(_exists(f"{s}.{target}" if s else target) for s in scopes)


def _walk(module: pdoc.doc.Module):
    """Every documented object: the module, its members (classes' own members too), then
    its submodules."""
    yield module
    stack = list(module.own_members)
    while stack:
        doc = stack.pop()
        yield doc
        if isinstance(doc, pdoc.doc.Class):
            stack.extend(doc.own_members)
    for sub in module.submodules:
        yield from _walk(sub)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    pdoc.render.configure(docformat="google", show_source=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*documented_modules(), output_directory=out)
    problems = [str(w.message) for w in caught if "pdoc" in w.filename]
    return out, problems


def test_every_module_builds(reference):
    out, problems = reference
    assert not problems, "pdoc could not document everything:\n" + "\n".join(problems)
    pages = {p.relative_to(out).as_posix() for p in out.rglob("*.html")}
    for module in documented_modules():
        assert module.replace(".", "/") + ".html" in pages, module
    shard_page = (out / "shardwise" / "shard.html").read_text()
    for arg in ("device", "bucket_mb", "sync_module_states", "init_weights"):
        assert arg in shard_page, arg  # the signature as it is, not as someone remembered it


def test_docstring_cross_references_resolve():
    broken = []
    docs = (d for m in documented_modules() for d in _walk(pdoc.doc.Module.from_name(m)))
    for doc in docs:
        if isinstance(doc, (pdoc.doc.Function, pdoc.doc.Class)) and not doc.obj.__doc__:
            continue  # a docstring inherited from torch's classes: not ours to check
        for target in _ROLE.findall(doc.docstring or ""):
            if not _resolves(target, doc):
                broken.append(f"{doc.fullname}: {target}")
    assert not broken, "docstring references that name nothing:\n" + "\n".join(broken)


def test_cited_notes_are_defined():
    defined, cited = set(), []
    for file in sorted((ROOT / "shardwise").rglob("*.py")):
        text = file.read_text(encoding="utf-8")
        defined |= {m[1] for line in text.splitlines() if (m := _NOTE_DEF.match(line))}
        cited += [(file.relative_to(ROOT), " ".join(n.split())) for n in _NOTE.findall(text)]
    missing = [f"{file}: [Note: {name}]" for file, name in cited if name not in defined]
    assert not missing, "notes cited but defined nowhere:\n" + "\n".join(missing)
