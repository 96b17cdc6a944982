"""Type checks of a manifest's entries against the dataclass fields they fill.

A hand-edited or foreign manifest can hold a string where a count belongs; without a check
that string travels until some arithmetic fails deep in the replay. Here each entry is
checked once, on reading, against its field's annotation, and the first mismatch becomes one
sentence that names the entry.
"""

from __future__ import annotations

import types
import typing
from typing import Any

_SCALARS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        text = " or ".join(_describe(a) for a in options)
        return text + " or null" if len(options) < len(typing.get_args(hint)) else text
    if origin is list:
        return "a list"
    if origin is dict:
        return "an object"
    return _SCALARS.get(hint, getattr(hint, "__name__", str(hint)))


def _matches(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits an annotation (nested lists and dicts checked item by
    item; a dataclass-typed entry is the caller's to check)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(hint) or (Any, Any)
        return isinstance(value, dict) and all(
            _matches(k, key) and _matches(v, item) for k, v in value.items()
        )
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint) if hint in _SCALARS else True
    return True


def check_entries(cls: type, data: dict[str, Any], where: str, prefix: str) -> None:
    """Raise ``ValueError`` naming the first entry of ``data`` whose value does not fit the
    annotation of ``cls``'s field of that name (unknown names are the caller's choice)."""
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        hint = hints.get(name)
        if hint is None or _matches(value, hint):
            continue
        raise ValueError(f"{where}: {prefix}{name} must be {_describe(hint)}, not {value!r:.60}")
