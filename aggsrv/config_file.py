"""Configuration dataclasses that load from TOML with overrides and print back as TOML.

Shared by `aggsrv serve` and `aggsrv simulate`: unknown keys are an error naming them (a typo
never silently falls back to a default), every value's type is checked against its field
(aggsrv.config_check), and `to_toml` prints every key with its value, so a run's config.toml
loads back to the same configuration. Every key has a one-line description (:class:`Described`,
shared with the strategies' configs): `--print-config` prints each key beside it
(:meth:`TomlConfig.described_toml`), and docs/config.md is generated from them
(aggsrv.config_reference).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Self

import tomli_w

from aggsrv.config_check import check_fields

__all__ = ["Described", "TomlConfig", "described_table", "toml_inline"]


class Described:
    """Mixin for a dataclass of settings whose keys each have a one-line description.

    ``HELP`` maps a key to what it does, its unit where it has one and, where the key may be
    None, what unset means. The tables are merged along the class hierarchy (:meth:`field_help`),
    so a subclass that only changes a default keeps its parent's description. They are the one
    source of `--print-config`'s comments, the command-line options' help and docs/config.md.
    """

    HELP: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """The one-line description of each key (empty where none is written)."""
        merged: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            merged.update(vars(klass).get("HELP", {}))
        return {f.name: merged.get(f.name, "") for f in dataclasses.fields(cls)}


class TomlConfig(Described):
    """Mixin for a dataclass of settings; ``KIND`` names it in error messages."""

    KIND: ClassVar[str] = "config"

    def __post_init__(self) -> None:
        """Check every value's type; subclasses call this first, then check ranges."""
        check_fields(self, self.KIND)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> Self:
        """Build from a plain mapping; unknown keys raise ValueError naming them."""
        unknown = sorted(set(data) - set(cls.keys()))
        if unknown:
            raise ValueError(
                f"unknown {cls.KIND} config key(s): {', '.join(unknown)}; known keys: "
                f"{', '.join(cls.keys())}"
            )
        return cls(**data)

    @classmethod
    def load(
        cls,
        path: str | Path | None,
        overrides: Mapping[str, Any] | None = None,
        tables: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Self:
        """TOML file (optional) with overrides on top (None values are ignored), then
        ``tables``' entries merged into those tables (``{"strategy_config": {"seed": 1}}`` sets
        one key and keeps the file's others), so the whole is built and checked once. A table
        the file gives as a name (``profile = "tiers"``) becomes ``{"name": "tiers"}`` first."""
        data: dict[str, Any] = {}
        if path is not None:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        for key, value in (overrides or {}).items():
            if value is not None:
                data[key] = value
        for table, entries in (tables or {}).items():
            current = data[table] if table in data else cls._default(table)
            if isinstance(current, str):
                current = {"name": current}
            data[table] = {**current, **entries}
        return cls.from_mapping(data)

    @classmethod
    def _default(cls, key: str) -> Any:
        field = next(f for f in dataclasses.fields(cls) if f.name == key)
        if field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
        return field.default

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self, exclude: Iterable[str] = ()) -> str:
        """Every key (but ``exclude``) as TOML: scalars first, then each mapping as a [table].

        A top-level None is left out (every such key defaults to None); a None inside a table
        is an error, since TOML has no null and leaving the key out would bring back its
        default (e.g. a 60 s round_timeout instead of none).
        """
        data: dict[str, Any] = {}
        skip = set(exclude)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in skip or value is None:
                continue
            if isinstance(value, Mapping):
                _refuse_none(f.name, value)
                value = {k: value[k] for k in sorted(value)}
            data[f.name] = value
        return tomli_w.dumps(data)

    def described_toml(self, exclude: Iterable[str] = ()) -> str:
        """Every key (but ``exclude``) as TOML with its description (--print-config): one
        ``key = value  # description`` line per scalar, a None key as the comment ``# key =
        ...  # description`` (TOML has no null; loading leaves it at its default, None), then
        each mapping as a [table] under a comment describing it. Loads back to this config."""
        skip = set(exclude)
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values = {k: v for k, v in values.items() if k not in skip}
        return _described_lines((), values, self.field_help())


def described_table(
    name: str,
    values: Mapping[str, Any],
    descriptions: Mapping[str, str],
    header: Iterable[str] = (),
) -> str:
    """``[name]`` with one ``key = value  # description`` line per key, after ``header``
    comment lines.

    A None value cannot be written (TOML has no null), so its line is a comment,
    ``# key = ...  # description``, and loading the table leaves the key at its default.
    Mapping values become ``[name.key]`` sub-tables after the scalars, each described by a
    comment above it.
    """
    return _described_lines((name,), values, descriptions, header)


def _described_lines(
    table: tuple[str, ...],
    values: Mapping[str, Any],
    descriptions: Mapping[str, str],
    header: Iterable[str] = (),
) -> str:
    """The keys of ``values`` in the table named by the path ``table`` (() for the top level):
    scalars and None keys first, then each mapping as a sub-table (see described_table)."""
    lines = [f"[{'.'.join(map(_toml_key, table))}]"] if table else []
    lines += [f"# {line}" for line in header]
    tables = []
    for key, value in values.items():
        note = descriptions.get(key, "")
        suffix = f"  # {note}" if note else ""
        if value is None:
            lines.append(f"# {_toml_key(key)} = ...{suffix}")
        elif isinstance(value, Mapping):
            tables.append((key, value, note))
        else:
            lines.append(f"{_toml_key(key)} = {toml_inline(value)}{suffix}")
    text = "\n".join(lines) + "\n" if lines else ""
    for key, value, note in tables:
        _refuse_none(key, value)
        nested: dict[str, Any] = {key: dict(value)}
        for part in reversed(table):
            nested = {part: nested}
        body = tomli_w.dumps(nested)
        text += ("\n" if text else "") + (f"# {key}: {note}\n" if note else "") + body
    return text


def _refuse_none(name: str, table: Mapping[str, Any]) -> None:
    for key, entry in table.items():
        if entry is None:
            raise ValueError(
                f"[{name}] {key} = None cannot be written as TOML (it has no null); leave the "
                "key out for its default or give a value"
            )
        if isinstance(entry, Mapping):
            _refuse_none(f"{name}.{key}", entry)


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else toml_inline(key)


def toml_inline(value: Any) -> str:
    """``value`` as one line of TOML (arrays and inline tables on one line too)."""
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        items = ", ".join(f"{_toml_key(k)} = {toml_inline(v)}" for k, v in value.items())
        return "{ " + items + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_inline(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").rstrip("\n")
