"""Nested frozen dataclasses <-> TOML text and dotted ``--section.key`` overrides.

Generic over the root dataclass: a root whose fields are section dataclasses, each field
followed by a docstring (PEP 257 attribute docstrings, read back with ``ast``). Supported field
types: ``int``, ``float``, ``bool``, ``str``, ``X | None`` and ``tuple[X, ...]`` /
``tuple[X, Y]`` (TOML arrays, or comma-separated on the command line).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Any

__all__ = ["field_docs", "iter_fields", "parse_value", "apply_overrides", "flatten_toml",
           "to_toml", "to_toml_value", "type_name", "unknown_key_message", "differences"]


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls``, whitespace collapsed.

    Returns:
        ``{field: doc}``; empty when the source is unavailable.
    """
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def iter_fields(root: Any) -> Iterator[tuple[str, str, Any, Any, str]]:
    """Yield ``(section, key, type_hint, value, doc)`` for every field, in declaration order."""
    for section in dataclasses.fields(root):
        sec_obj = getattr(root, section.name)
        hints = typing.get_type_hints(type(sec_obj))
        docs = field_docs(type(sec_obj))
        for f in dataclasses.fields(sec_obj):
            value = getattr(sec_obj, f.name)
            yield section.name, f.name, hints[f.name], value, docs.get(f.name, "")


def type_name(hint: Any) -> str:
    """A short human name for a field type: ``int``, ``int or none``, ``list of 2 float``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("none" if a is type(None) else type_name(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_name(args[0])}"
        return f"list of {len(args)} {type_name(args[0])}"
    return getattr(hint, "__name__", str(hint))


_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def parse_value(key: str, value: Any, hint: Any, from_cli: bool = False) -> Any:
    """Check (TOML) or parse (command line) one value against a field's type.

    Args:
        key: dotted key, for messages (``"train.steps"``).
        value: the TOML value, or the command-line string when ``from_cli``.
        hint: the field's type hint.
        from_cli: parse strings ("30", "true", "0.9,0.95", "none") instead of checking types.

    Returns:
        The value converted to the field's type (ints widen to floats; lists become tuples).

    Raises:
        ValueError: naming the key, the value and the expected type.
    """
    def bad() -> ValueError:
        return ValueError(f"{key}: expected {type_name(hint)}, got {value!r} "
                          f"({type(value).__name__})")

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (from_cli and value.strip().lower() in ("none", "null")):
            return None
        inner = [a for a in args if a is not type(None)]
        try:
            return parse_value(key, value, inner[0], from_cli)
        except ValueError:
            raise bad() from None
    if origin is tuple:
        return _parse_tuple(key, value, args, from_cli, bad)
    if from_cli:
        return _parse_scalar(value, hint, bad)
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    raise bad()


def _parse_tuple(key: str, value: Any, args: tuple, from_cli: bool, bad) -> tuple:  # noqa: ANN001
    items = value
    if from_cli:
        text = value.strip().removeprefix("[").removesuffix("]")
        items = [s.strip().strip("'\"") for s in text.split(",") if s.strip()]
    if not isinstance(items, (list, tuple)):
        raise bad()
    variadic = len(args) == 2 and args[1] is Ellipsis
    if not variadic and len(items) != len(args):
        raise bad()
    item_hints = [args[0]] * len(items) if variadic else list(args)
    try:
        return tuple(parse_value(key, v, h, from_cli) for v, h in zip(items, item_hints))
    except ValueError:
        raise bad() from None


def _parse_scalar(text: str, hint: Any, bad) -> Any:  # noqa: ANN001 - bad: () -> ValueError
    if hint is str:
        return text
    if hint is bool:
        word = text.strip().lower()
        if word in _TRUE | _FALSE:
            return word in _TRUE
        raise bad()
    try:
        return hint(text)
    except (TypeError, ValueError):
        raise bad() from None


def _suggest(word: str, choices: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def unknown_key_message(dotted: str, valid_keys: list[str], origin: str, flag: str = "") -> str:
    """``unknown key --train.step in the command line; did you mean --train.steps?``.

    Args:
        dotted: the unknown key as written (without ``flag``).
        valid_keys: every valid dotted key.
        origin: where it was found.
        flag: prefix shown before keys ("--" on the command line).
    """
    sections = list(dict.fromkeys(k.split(".")[0] for k in valid_keys))
    listing = "" if dotted.split(".")[0] in sections else f" (sections: {', '.join(sections)})"
    return (f"unknown key {flag}{dotted} in {origin}{_suggest(dotted, valid_keys, flag)}"
            f"{listing}")


def apply_overrides(root: Any, values: dict[str, Any], origin: str, from_cli: bool = False) -> Any:
    """Return ``root`` with dotted-key values applied (``dataclasses.replace``, no mutation).

    Args:
        root: the nested dataclass to start from.
        values: ``{"train.steps": 30, ...}`` (command-line strings when ``from_cli``).
        origin: where the values came from, for messages ("the command line", a file name).
        from_cli: the values are command-line strings to parse.

    Returns:
        A new root dataclass.

    Raises:
        ValueError: for an unknown section or key (with the closest valid key) or a value of
            the wrong type.
    """
    sections = {f.name: getattr(root, f.name) for f in dataclasses.fields(root)}
    all_keys = [f"{s}.{k}" for s, k, *_ in iter_fields(root)]
    flag = "--" if from_cli else ""
    changes: dict[str, dict[str, Any]] = {}
    for dotted, value in values.items():
        section, _, key = dotted.partition(".")
        hints = typing.get_type_hints(type(sections[section])) if section in sections else {}
        if key not in hints:
            raise ValueError(unknown_key_message(dotted, all_keys, origin, flag))
        changes.setdefault(section, {})[key] = parse_value(dotted, value, hints[key], from_cli)
    return dataclasses.replace(root, **{
        s: dataclasses.replace(sections[s], **kv) for s, kv in changes.items()})


def flatten_toml(doc: dict[str, Any], root: Any, origin: str) -> dict[str, Any]:
    """Turn a parsed TOML document ``{section: {key: value}}`` into ``{"section.key": value}``.

    Raises:
        ValueError: for a key outside any table (naming the section it belongs to, if any) or
            an unknown table (with the closest valid section).
    """
    sections = [f.name for f in dataclasses.fields(root)]
    all_keys = [f"{s}.{k}" for s, k, *_ in iter_fields(root)]
    flat: dict[str, Any] = {}
    for section, table in doc.items():
        if not isinstance(table, dict):
            owners = [k for k in all_keys if k.endswith("." + section)]
            owner_table = owners[0].split(".")[0] if owners else ""
            where = (f"; did you mean {owners[0]} (key {section!r} under [{owner_table}])?"
                     if owners else _suggest(section, sections))
            raise ValueError(f"unknown key {section} = {table!r} in {origin}, outside any "
                             f"[section]{where} (sections: {', '.join(sections)})")
        if section not in sections:
            raise ValueError(f"unknown section [{section}] in {origin}"
                             f"{_suggest(section, sections)} (sections: {', '.join(sections)})")
        flat.update({f"{section}.{key}": value for key, value in table.items()})
    return flat


def to_toml_value(value: Any) -> str:
    """One value in TOML syntax: ``true``, ``30``, ``0.003``, ``"runs/x"``, ``[0.9, 0.95]``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(to_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(root: Any, comments: bool = True) -> str:
    """The nested dataclass as TOML that reads back (via :func:`flatten_toml`) to an equal one.

    Args:
        root: the nested dataclass.
        comments: put each field's docstring above it as a comment.

    Returns:
        TOML text. Unset optional fields (None) become comments, since TOML has no null.
    """
    lines: list[str] = []
    current = None
    for section, key, _hint, value, doc in iter_fields(root):
        if section != current:
            lines += ([""] if lines else []) + [f"[{section}]"]
            current = section
        if comments and doc:
            lines.extend(f"# {line}" for line in textwrap.wrap(doc, 94))
        lines.append(f"# {key} = (unset)" if value is None else f"{key} = {to_toml_value(value)}")
    return "\n".join(lines) + "\n"


def differences(root: Any, base: Any) -> list[tuple[str, Any]]:
    """``[("train.steps", 30), ...]``: the dotted keys whose value in ``root`` is not the one
    in ``base`` (same root dataclass type), in declaration order."""
    base_values = {(s, k): v for s, k, _h, v, _d in iter_fields(base)}
    return [(f"{s}.{k}", v) for s, k, _h, v, _d in iter_fields(root) if base_values[s, k] != v]
