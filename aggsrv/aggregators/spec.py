"""An aggregator spec (``"norm_bound:max=10 > multi_krum:f=2,m=5"``) read into a validated
:class:`Aggregator`: the rule, its parameters with their defaults filled in, and the
optional norm bound that clips the rows before the rule (docs/robust.md lists each rule).

Only parsing and the arithmetic of requirements live here; :mod:`aggsrv.aggregators.combine`
runs a spec on rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aggsrv.aggregators.combine import combine as combine_rows
from aggsrv.spec_text import NamedSpec, check_params, parse_chain

__all__ = ["Aggregator", "NORM_BOUND", "RULES", "parse_aggregator"]

NORM_BOUND = "norm_bound"

# Each rule's parameters: name -> (accepted types, default). A default of None means "derived
# at aggregation time" (multi_krum's m = K - f, centered_clipping's adaptive tau).
RULES: Mapping[str, Mapping[str, tuple[type | tuple[type, ...], Any]]] = {
    "mean": {},
    "median": {},
    "trimmed_mean": {"trim": (float, 0.1)},
    "krum": {"f": (int, 1)},
    "multi_krum": {"f": (int, 1), "m": (int, None)},
    "bulyan": {"f": (int, 1)},
    "geometric_median": {
        "iters": (int, 100),
        "tol": (float, 1e-6),
        "eps": (float, 1e-8),
    },
    "centered_clipping": {"tau": (float, None), "iters": (int, 1)},
}
# Rules whose arithmetic uses the row weights (the others treat every row alike).
WEIGHTED = frozenset({"mean", "multi_krum", "geometric_median", "centered_clipping"})


@dataclass(frozen=True)
class Aggregator:
    """A parsed, checked aggregator: ``rule`` with ``params`` (every parameter of the rule,
    None where the value is derived per call) and ``norm_bound`` (None: rows are not clipped)."""

    rule: str = "mean"
    params: Mapping[str, Any] = field(default_factory=dict)
    norm_bound: float | None = None

    @classmethod
    def parse(cls, text: Any, what: str = "aggregator") -> Aggregator:
        """:func:`parse_aggregator`."""
        return parse_aggregator(text, what)

    # combine(X, weights, *, center, reduce, out): the aggregator is the spec the function runs.
    combine = combine_rows

    def __str__(self) -> str:
        rule = str(NamedSpec(self.rule, {k: v for k, v in self.params.items() if v is not None}))
        if self.norm_bound is None:
            return rule
        return f"{NORM_BOUND}:max={self.norm_bound:g} > {rule}"

    @property
    def is_mean(self) -> bool:
        """The plain weighted mean without clipping: strategies keep their running sums."""
        return self.rule == "mean" and self.norm_bound is None

    @property
    def weighted(self) -> bool:
        """Whether the rule's arithmetic uses the row weights."""
        return self.rule in WEIGHTED

    def min_rows(self) -> int:
        """The fewest rows the rule runs on as defined; with fewer it falls back
        (:func:`aggsrv.aggregators.combine.combine`). Trimmed mean: the rows for which
        ``floor(trim * K) >= 1`` (with fewer it would cut nothing, i.e. be the mean)."""
        p = self.params
        if self.rule in ("krum", "multi_krum"):
            return p["f"] + 3
        if self.rule == "bulyan":
            return 4 * p["f"] + 3
        if self.rule == "trimmed_mean" and p["trim"] > 0:
            return math.ceil(1.0 / p["trim"] - 1e-9)
        return 1

    def check_rows(self, rows: int, what: str) -> None:
        """Refuse (ValueError naming ``what``, e.g. "buffer_size") a known row count that is too
        small for the rule, so a config that would always fall back is refused when built."""
        need = self.min_rows()
        if rows < need:
            raise ValueError(
                f"aggregator {str(self)!r} needs at least {need} rows per aggregation "
                f"({_why(self)}), but {what} = {rows}"
            )
        m = self.params.get("m")
        if self.rule == "multi_krum" and m is not None and m > rows - self.params["f"]:
            raise ValueError(
                f"aggregator {str(self)!r}: m = {m} must be <= K - f = {rows - self.params['f']} "
                f"with {what} = {rows}"
            )


def _why(spec: Aggregator) -> str:
    f = spec.params.get("f")
    return {
        "krum": f"Krum needs K >= f + 3 with f = {f}",
        "multi_krum": f"Krum needs K >= f + 3 with f = {f}",
        "bulyan": f"Bulyan needs K >= 4f + 3 with f = {f}",
        "trimmed_mean": f"trim = {spec.params.get('trim')} cuts no row from fewer",
    }.get(spec.rule, "")


def _check_ranges(rule: str, p: dict[str, Any], what: str) -> None:
    def bad(msg: str) -> ValueError:
        return ValueError(f"{what} {rule!r}: {msg}")

    if "f" in p and p["f"] < 0:
        raise bad(f"f (the Byzantine rows tolerated) must be >= 0, got {p['f']}")
    if p.get("m") is not None and p["m"] < 1:
        raise bad(f"m (the rows Multi-Krum averages) must be >= 1, got {p['m']}")
    if rule == "trimmed_mean" and not 0.0 <= p["trim"] < 0.5:
        raise bad(f"trim (the fraction cut at each end) must be in [0, 0.5), got {p['trim']}")
    if "iters" in p and p["iters"] < (1 if rule == "centered_clipping" else 0):
        low = 1 if rule == "centered_clipping" else 0
        raise bad(f"iters must be >= {low}, got {p['iters']}")
    for key in ("tol",):
        if key in p and not (math.isfinite(p[key]) and p[key] >= 0):
            raise bad(f"{key} must be finite and >= 0, got {p[key]}")
    for key in ("eps", "tau"):
        if p.get(key) is not None and not (math.isfinite(p[key]) and p[key] > 0):
            raise bad(f"{key} must be finite and > 0, got {p[key]}")


def parse_aggregator(text: Any, what: str = "aggregator") -> Aggregator:
    """``"norm_bound:max=10 > krum:f=2"`` -> Aggregator; ValueError naming ``what``.

    At most one rule, optionally preceded by ``norm_bound:max=...``; a lone ``norm_bound`` clips
    the rows before the weighted mean."""
    steps = parse_chain(text, what)
    bound = None
    if steps[0].name == NORM_BOUND:
        params = check_params(what, steps[0], {"max": float})
        if "max" not in params:
            raise ValueError(f"{what} {text!r}: norm_bound needs max=<the largest row norm>")
        bound = params["max"]
        if not (bound is not None and math.isfinite(bound) and bound > 0):
            raise ValueError(f"{what} {text!r}: norm_bound's max must be finite and > 0")
        steps = steps[1:]
    if any(s.name == NORM_BOUND for s in steps):
        raise ValueError(f"{what} {text!r}: norm_bound may only come first")
    if len(steps) > 1:
        names = " > ".join(s.name for s in steps)
        raise ValueError(f"{what} {text!r}: at most one rule after norm_bound, got {names}")
    step = steps[0] if steps else NamedSpec("mean")
    if step.name not in RULES:
        known = ", ".join([*RULES, NORM_BOUND])
        raise ValueError(f"{what} {text!r}: unknown rule {step.name!r}; the rules: {known}")
    table = RULES[step.name]
    # "auto" (or none) asks for a derived value where the rule has one (m, tau).
    derived = {k for k, (_, default) in table.items() if default is None}
    step = NamedSpec(
        step.name,
        {k: None if k in derived and v == "auto" else v for k, v in step.params.items()},
    )
    # None passes the type check here; only the derived values may be None (checked next).
    given = check_params(what, step, {k: (t, type(None)) for k, (t, _) in table.items()})
    for key, value in given.items():
        if value is None and table[key][1] is not None:
            raise ValueError(f"{what} {step.name!r}: {key} must be a number, got none")
    params = {k: given.get(k, default) for k, (_, default) in table.items()}
    _check_ranges(step.name, params, what)
    return Aggregator(step.name, params, bound)
