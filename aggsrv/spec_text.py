"""One-line specs of the form ``name:key=value,key=value`` (an aggregator, an update filter, an
attack), read into a name and typed parameters with errors that name what is wrong.

A spec may chain steps with ``>`` (``"norm_bound:max=10 > krum:f=2"``: the norm bound, then
Krum). Values become bool (``true``/``false``), None (``none``), int, float (``1e-3``, ``inf``)
or str, in that order of preference.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NamedSpec", "check_params", "parse_chain", "parse_named", "parse_value"]

_INT = re.compile(r"[+-]?\d+$")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


@dataclass(frozen=True)
class NamedSpec:
    """A parsed ``name:key=value,...``."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_text(v)}" for k, v in self.params.items())


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)


def parse_value(text: str) -> Any:
    """One stripped value: bool, None, int, float (``inf`` and ``nan`` too) or, failing those,
    the text itself."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if low in ("inf", "+inf", "-inf", "nan"):
        return float(low)
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    return text


def parse_named(text: Any, what: str) -> NamedSpec:
    """``"krum:f=2"`` -> NamedSpec("krum", {"f": 2}); `what` names the setting in errors."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{what} must be a non-empty string like 'name:key=value', got {text!r}")
    name, _, rest = text.strip().partition(":")
    name = name.strip()
    if not name.replace("_", "").isalnum():
        raise ValueError(f"{what} {text!r}: {name!r} is not a name")
    params: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if not eq or not key or not val:
            raise ValueError(f"{what} {text!r}: expected key=value, got {item!r}")
        if key in params:
            raise ValueError(f"{what} {text!r}: {key!r} given twice")
        params[key] = parse_value(val)
    return NamedSpec(name, params)


def parse_chain(text: Any, what: str) -> list[NamedSpec]:
    """Steps joined by ``>``, each a :func:`parse_named` spec."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{what} must be a non-empty string like 'name:key=value', got {text!r}")
    return [parse_named(part, what) for part in text.split(">")]


def check_params(
    what: str, spec: NamedSpec, allowed: Mapping[str, type | tuple[type, ...]]
) -> dict[str, Any]:
    """The spec's params after checking each name against `allowed` (name -> accepted types;
    an int is accepted where a float is) and its type; errors list the accepted names."""
    out: dict[str, Any] = {}
    for key, value in spec.params.items():
        if key not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise ValueError(
                f"{what} {spec.name!r} has no parameter {key!r} (its parameters: {known})"
            )
        types = allowed[key] if isinstance(allowed[key], tuple) else (allowed[key],)
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            want = " or ".join(t.__name__ for t in types)
            raise ValueError(f"{what} {spec.name!r}: {key} must be {want}, got {value!r}")
        out[key] = value
    return out
