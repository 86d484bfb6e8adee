"""Type checks for configuration dataclasses: each value against its field's annotation.

pydantic validates in strict mode (no "3" for 3, no 2.0 for an int, no bool for a number;
an int is a number), and the error is rewritten to name the key and what it takes in words,
e.g. ``fedbuff: buffer_size must be an integer >= 1, got 2.5 (float)``. Values are checked,
never converted, so a checked config holds exactly what it was given.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any

import annotated_types
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

__all__ = ["Count", "check_fields", "describe"]

# A whole number of something that must exist at least once (buffer sizes, client counts,
# periods): the one place the ">= 1" bound is written.
Count = Annotated[int, Field(ge=1)]

_STRICT = ConfigDict(strict=True)
_ADAPTERS: dict[type, dict[str, tuple[Any, TypeAdapter]]] = {}


def check_fields(config: Any, kind: str) -> None:
    """Check every field of the dataclass instance ``config``; ValueError naming the first
    wrong one as ``KIND: KEY must be WHAT, got VALUE (TYPE)``."""
    for name, (hint, adapter) in _adapters(type(config)).items():
        value = getattr(config, name)
        try:
            adapter.validate_python(value)
        except ValidationError as exc:
            raise ValueError(_message(kind, name, hint, value, exc)) from None


def _adapters(cls: type) -> dict[str, tuple[Any, TypeAdapter]]:
    found = _ADAPTERS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        found = {
            f.name: (hints[f.name], TypeAdapter(hints[f.name], config=_STRICT))
            for f in dataclasses.fields(cls)
        }
        _ADAPTERS[cls] = found
    return found


def _message(kind: str, name: str, hint: Any, value: Any, exc: ValidationError) -> str:
    key, want, got = name, hint, value
    table = _table_values(hint)
    if table is not None and isinstance(value, Mapping):
        # A table's entry is wrong: name the entry and what an entry takes.
        entry_adapter = TypeAdapter(table, config=_STRICT)
        for k, v in value.items():
            try:
                entry_adapter.validate_python(v)
            except ValidationError:
                key, want, got = f"{name}[{k!r}]", table, v
                break
    text = f"{kind}: {key} must be {describe(want)}, got {got!r}"
    if got is not None and not all(e["type"] in _BOUND_ERRORS for e in exc.errors()):
        text += f" ({type(got).__name__})"
    return text


_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _table_values(hint: Any) -> Any:
    """The entry type of a ``dict[str, X]`` annotation (optional or in a union), else None."""
    for member in _members(hint):
        if typing.get_origin(member) is dict:
            return typing.get_args(member)[1]
    return None


def _members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def describe(hint: Any) -> str:
    """An annotation in words: ``int | None`` -> "an integer or None"."""
    members = [m for m in _members(hint) if m is not type(None)]
    optional = len(members) < len(_members(hint))
    words: list[str] = []
    for member in members:
        word = _word(member)
        if word not in words:
            words.append(word)
    if "a number" in words and "an integer" in words:
        words.remove("an integer")  # an integer is a number
    if optional:
        words.append("None")
    return " or ".join(words)


def _word(hint: Any) -> str:
    if typing.get_origin(hint) is Annotated:
        base, *extra = typing.get_args(hint)
        bounds = [f"{op} {getattr(m, attr)}" for m in _constraints(extra)
                  for attr, op in _BOUNDS if getattr(m, attr, None) is not None]  # fmt: skip
        return " ".join([_word(base), *bounds])
    if hint is bool:
        return "true or false"
    if hint is int or hint is float:
        return "an integer" if hint is int else "a number"
    if hint is str:
        return "a string"
    if typing.get_origin(hint) is dict:
        entry = typing.get_args(hint)[1]
        return "a table" if entry is Any else f"a table (each value {_word(entry)})"
    return getattr(hint, "__name__", str(hint))


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _constraints(extra: list[Any]) -> list[Any]:
    out: list[Any] = []
    for item in extra:
        # pydantic's Field(...) carries its bounds as annotated_types metadata.
        out.extend(getattr(item, "metadata", [item]))
    return [m for m in out if isinstance(m, annotated_types.BaseMetadata)]
