"""Reading profile specs: strings, mappings and lists of them, as (preset, keys) pairs."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from aggsrv.spec_text import parse_value

from .presets import PROFILES

_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _value(text: str) -> Any:
    """A ``key=value`` value from a string spec: ``lo..hi`` (a pair of numbers) or one value
    read as the other specs read theirs (aggsrv.spec_text)."""
    text = text.strip()
    if ".." in text:
        lo, _, hi = text.partition("..")
        if _NUMBER.match(lo.strip()) and _NUMBER.match(hi.strip()):
            return [_value(lo), _value(hi)]
    return parse_value(text)


def _parse_string(spec: str) -> list[tuple[str, dict[str, Any]]]:
    parts = []
    # "+" joins presets; "1e+3" is a number, so only a "+" followed by a name splits.
    for chunk in re.split(r"\+(?=\s*[A-Za-z_])", spec):
        name, _, rest = chunk.partition(":")
        params: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, val = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"profile {spec!r}: expected key=value, got {item!r}")
            if key.strip() in params:
                raise ValueError(f"profile {spec!r}: {key.strip()!r} given twice")
            params[key.strip()] = _value(val)
        parts.append((name.strip(), params))
    return parts


def _parse_mapping(spec: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    rest = dict(spec)
    name = rest.pop("name", None)
    parts = []
    for key in list(rest):
        value = rest[key]
        if key in PROFILES and (isinstance(value, Mapping) or value is None or value is True):
            del rest[key]
            parts.append((key, dict(value) if isinstance(value, Mapping) else {}))
        elif key in PROFILES and value is False:
            del rest[key]  # {"dropout": false} switches a component off
    if name is not None:
        if not isinstance(name, str):
            raise ValueError(f"profile name must be a string, got {name!r}")
        parts.insert(0, (name, rest))
    elif set(rest) - {"base_time"}:
        raise ValueError(
            f"profile mapping has unknown keys {sorted(set(rest) - {'base_time'})}: use "
            "{'name': preset, key: value, ...} or {preset: {key: value}, ...}; presets: "
            f"{', '.join(PROFILES)}"
        )
    elif "base_time" in rest:
        parts.append(("none", {"base_time": rest["base_time"]}))
    return parts or [("none", {})]


def parse_spec(spec: Any) -> list[tuple[str, dict[str, Any]]]:
    if isinstance(spec, str):
        if not spec.strip():
            raise ValueError(f"empty profile spec; presets: {', '.join(PROFILES)}")
        return _parse_string(spec)
    if isinstance(spec, Mapping):
        return _parse_mapping(spec)
    if isinstance(spec, Sequence):
        return [part for item in spec for part in parse_spec(item)]
    raise ValueError(f"a profile spec is a string, a mapping or a list of them, got {spec!r}")
