"""Configuration dataclasses that load from TOML with overrides and print back as TOML.

Shared by `aggsrv serve` and `aggsrv simulate`: unknown keys are an error naming them (a typo
never silently falls back to a default), every value's type is checked against its field
(aggsrv.config_check), and `to_toml` prints every key with its value, so `--print-config`
output loads back to the same configuration.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Self

import tomli_w

from aggsrv.config_check import check_fields

__all__ = ["TomlConfig", "described_table"]


class TomlConfig:
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
                value = {k: value[k] for k in sorted(value)}
                for key, entry in value.items():
                    if entry is None:
                        raise ValueError(
                            f"[{f.name}] {key} = None cannot be written as TOML (it has no "
                            "null); leave the key out for its default or give a value"
                        )
            data[f.name] = value
        return tomli_w.dumps(data)


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
    lines = [f"[{name}]", *(f"# {line}" for line in header)]
    tables = []
    for key, value in values.items():
        note = descriptions.get(key, "")
        suffix = f"  # {note}" if note else ""
        if value is None:
            lines.append(f"# {key} = ...{suffix}")
        elif isinstance(value, Mapping):
            tables.append((key, value, note))
        else:
            lines.append(tomli_w.dumps({key: value}).rstrip("\n") + suffix)
    text = "\n".join(lines) + "\n"
    for key, value, note in tables:
        body = tomli_w.dumps({name: {key: dict(value)}})
        text += "\n" + (f"# {key}: {note}\n" if note else "") + body
    return text
