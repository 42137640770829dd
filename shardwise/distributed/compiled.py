"""Refuse collectives that would run inside a ``torch.compile`` region.

[Note: collectives outside compiled regions] The library's collectives are eager c10d calls
with Python bookkeeping around them: asynchronous work handles, byte counters, labels and
sequence numbers, identity trailers checked after each gather, pooled buffers whose storage
is swapped in and out. Dynamo cannot trace any of that: it breaks the graph at each piece,
falls back to eager for some frames and recompiles others until it gives up (measured on
``torch.compile`` of a whole stage-3 model: two dozen graphs, a recompile limit hit, the
engine's code compiled in fragments). So shardwise keeps every collective outside compiled
graphs: :func:`shardwise.compile_blocks` compiles each block's ``forward`` while the
engine's gather / reduce hooks run eagerly around it, and anything that issues collectives
calls :func:`refuse_in_compiled_region` first, which raises a ``ValueError`` that says what
to do instead.

The check works both while Dynamo traces (``torch.compiler.is_compiling()`` is constant True
there) and in the eager fallback of a compiled frame (Dynamo's frame callback is still
installed then). Traced with ``fullgraph=False``, the raise sends Dynamo back to eager, where
the check raises for real; with ``fullgraph=True`` Dynamo reports an "Observed exception"
that keeps only the text, which :func:`refusal_in` turns back into this module's
``ValueError`` (``compile_blocks`` does so around each compiled block).
"""

from __future__ import annotations

import re

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback  # C; imports no Dynamo

__all__ = ["in_compiled_region", "refuse_in_compiled_region", "refusal_in"]

_MARK = "issue collectives, and they are running inside a torch.compile region"


def in_compiled_region() -> bool:
    """Whether the caller runs inside ``torch.compile``: traced, or the eager fallback of a
    compiled frame (``torch._dynamo.disable`` regions excepted)."""
    if torch.compiler.is_compiling():
        return True
    return get_eval_frame_callback() not in (None, False)


def refuse_in_compiled_region(what: str) -> None:
    """Raise if ``what`` (something about to issue collectives) runs in a compiled region.

    Args:
        what: names the caller, e.g. ``"the sharding hooks of unit 'layers.0'"``.

    Raises:
        ValueError: inside ``torch.compile`` (see
            [Note: collectives outside compiled regions]).
    """
    if in_compiled_region():
        raise ValueError(
            f"{what} {_MARK} "
            "(torch.compile of the whole sharded model, of a module holding sharded units or "
            "MoE layers, or of the training step); these collectives are not traceable. "
            "Compile the blocks instead: shardwise.compile_blocks(model) compiles the forward "
            "of each block and keeps the all-gathers and reduce-scatters of the engine outside "
            "the compiled graphs (docs/compile.md)")


def refusal_in(exc: BaseException) -> ValueError | None:
    """The :func:`refuse_in_compiled_region` error inside a Dynamo error, or None.

    Args:
        exc: an exception raised by a compiled function (its causes are searched too).

    Returns:
        A ``ValueError`` with the refusal's message, or None when ``exc`` is another error.
    """
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        if _MARK in text:
            # Dynamo renders the traced exception as: raised exception ValueError("...")
            found = re.search(r'ValueError\("(.*?)"\)', text, re.S)
            return ValueError(found.group(1) if found else text)
        err = err.__cause__ or err.__context__
    return None
