"""Resolve the ``package.module:attr.path`` names users give for their own code (strategies,
models, data sets, partitions, the server's evaluation hook), with errors that say what is
missing."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_object(spec: str, what: str) -> Any:
    """The object ``spec`` names; ValueError "<what> <spec>: ..." when it cannot be found."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r}: a user {what} is 'module:callable'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(
                f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    return obj


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """Like :func:`load_object`, and the object must be callable."""
    obj = load_object(spec, what)
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} does not name a callable")
    return obj
