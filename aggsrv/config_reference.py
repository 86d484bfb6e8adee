"""docs/config.md, generated from the configuration classes: every key of `aggsrv serve`
(ServerConfig), `aggsrv simulate` (SimConfig) and each registered strategy's [strategy_config]
table, with its type, default and description (the classes' ``HELP``).

``python -m aggsrv.config_reference > docs/config.md`` regenerates the page;
tests/project/test_config_reference.py fails when the page differs from what this prints.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Annotated, Any

import annotated_types

from aggsrv.config_file import Described, toml_inline
from aggsrv.server.config import ServerConfig
from aggsrv.sim.config import SimConfig
from aggsrv.strategies import STRATEGIES, StrategyConfig
from aggsrv.strategies.privacy import PrivacyConfig

__all__ = ["COMMAND", "reference", "type_text"]

COMMAND = "python -m aggsrv.config_reference > docs/config.md"

_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
_NAMES = {int: "int", float: "float", str: "str", bool: "bool", Any: "any"}


def type_text(hint: Any) -> str:
    """An annotation as a user reads it: ``int``, ``int >= 1`` (a Count), ``list of str``,
    ``table``, ``str or table``, ``optional float``."""
    members = typing.get_args(hint) if _is_union(hint) else (hint,)
    kept = [m for m in members if m is not type(None)]
    text = " or ".join(_one_type(m) for m in kept)
    return f"optional {text}" if len(kept) < len(members) else text


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _one_type(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Annotated:
        base, *extra = typing.get_args(hint)
        metadata = [m for item in extra for m in getattr(item, "metadata", [item])]
        bounds = [f"{op} {getattr(m, attr)}" for m in metadata
                  if isinstance(m, annotated_types.BaseMetadata)
                  for attr, op in _BOUNDS if getattr(m, attr, None) is not None]  # fmt: skip
        return " ".join([_one_type(base), *bounds])
    if origin is list:
        return f"list of {_one_type(typing.get_args(hint)[0])}"
    if origin is dict:
        entry = typing.get_args(hint)[1]
        return "table" if entry is Any else f"table of {_one_type(entry)}"
    if hint in _NAMES:
        return _NAMES[hint]
    return getattr(hint, "__name__", str(hint))


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _default_text(value: Any) -> str:
    """The default as TOML writes it; None (TOML has none) as "unset"."""
    return "unset" if value is None else f"`{toml_inline(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(cls: type[Described], keys: Iterable[str] | None = None) -> list[str]:
    """The Markdown table of ``cls``'s keys (all of them, or ``keys`` in that order)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls, include_extras=True)
    described = cls.field_help()
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for name in keys if keys is not None else fields:
        cells = (
            f"`{name}`",
            type_text(hints[name]),
            _default_text(_default(fields[name])),
            described[name],
        )
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def _strategy_keys(cls: type[StrategyConfig]) -> list[str]:
    """The strategy's own keys first, then those every strategy shares, then the ``dp_`` keys
    (each group in the class's order)."""
    shared = {f.name for f in dataclasses.fields(StrategyConfig)}
    private = {f.name for f in dataclasses.fields(PrivacyConfig)}
    names = cls.offered_keys()
    own = [n for n in names if n not in shared and n not in private]
    return own + [n for n in names if n in shared] + [n for n in names if n in private]


def _strategy_section(name: str, cls: type[StrategyConfig]) -> list[str]:
    lines = [f"### `{name}`", ""]
    if cls.PRESETS:
        presets = [
            f"`{preset}`" + (f" ({cls.PRESET_NOTES[preset]})" if preset in cls.PRESET_NOTES else "")
            for preset in sorted(cls.PRESETS)
        ]
        lines += [f'Presets (`preset = "NAME"`): {"; ".join(presets)}.', ""]
    return lines + _table(cls, _strategy_keys(cls)) + [""]


def reference() -> str:
    """The whole of docs/config.md."""
    lines = [
        "# Configuration reference",
        "",
        "This page is generated from the configuration classes' key descriptions; regenerate it "
        f"with `{COMMAND}` (edit the `HELP` tables in the code, not this page).",
        "",
        "Every key below can be set in the TOML file given with `--config`; many have a "
        "command-line option of their own, whose `--help` shows the same description. "
        "`--print-config` prints every key with the value a command would run with (a key "
        "that is unset as a comment), and its output loads back with `--config`. Defaults are "
        "shown as TOML writes them; TOML has no null, so a key left out is unset.",
        "",
        "## `aggsrv serve`",
        "",
        "The server's keys (`ServerConfig`, aggsrv/server/config.py). docs/operations.md "
        "explains authentication, TLS, durability, metrics and limits; the strategy's own keys "
        "go in the `[strategy_config]` table (Strategies, below).",
        "",
        *_table(ServerConfig),
        "",
        "## `aggsrv simulate`",
        "",
        "The simulator's keys (`SimConfig`, aggsrv/sim/config.py); any of them can also be "
        "given as `--set KEY=VALUE`, a table's entry as `--set strategy_config.KEY=VALUE`.",
        "",
        *_table(SimConfig),
        "",
        "## Strategies",
        "",
        "The keys of the `[strategy_config]` table of each registered strategy (its config "
        "class's), the strategy's own first, then those every strategy shares, then the "
        "differential-privacy (`dp_`) keys where the strategy has them (docs/privacy.md). A "
        "key given beside `preset` overrides the preset's value.",
        "",
    ]
    for name, strategy in STRATEGIES.items():
        lines += _strategy_section(name, strategy.config_class)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(reference())
