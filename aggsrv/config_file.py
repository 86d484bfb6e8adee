"""Configuration dataclasses that load from TOML with overrides and print back as TOML.

Shared by `aggsrv serve` and `aggsrv simulate`: unknown keys are an error naming them (a typo
never silently falls back to a default), and `to_toml` prints every key with its value, so
`--print-config` output loads back to the same configuration.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any, ClassVar, Self

__all__ = ["TomlConfig", "toml_value"]


class TomlConfig:
    """Mixin for a dataclass of settings; ``KIND`` names it in error messages."""

    KIND: ClassVar[str] = "config"

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
    def load(cls, path: str | Path | None, overrides: dict[str, Any] | None = None) -> Self:
        """TOML file (optional) with overrides on top (None values are ignored)."""
        data: dict[str, Any] = {}
        if path is not None:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        for key, value in (overrides or {}).items():
            if value is not None:
                data[key] = value
        return cls.from_mapping(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """Every key as TOML: scalars first, then each mapping as a [table]."""
        lines = []
        tables = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                tables[f.name] = value
            elif value is not None:
                lines.append(f"{f.name} = {toml_value(value)}")
        for name, table in tables.items():
            lines.append("")
            lines.append(f"[{name}]")
            for key, value in sorted(table.items()):
                if value is None:
                    # TOML has no null, and dropping the key would silently bring back its
                    # default (e.g. a 60 s round_timeout instead of none).
                    raise ValueError(
                        f"[{name}] {key} = None cannot be written as TOML (it has no null); "
                        "leave the key out for its default or give a value"
                    )
                lines.append(f"{key} = {toml_value(value)}")
        return "\n".join(lines) + "\n"


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
