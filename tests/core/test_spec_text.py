"""`name:key=value` specs (aggregators, update filters, attacks): parsing, typing, errors."""

from __future__ import annotations

import math

import pytest

from aggsrv.spec_text import NamedSpec, check_params, parse_chain, parse_named


def test_values_are_typed_in_order_bool_none_int_float_str() -> None:
    spec = parse_named("rule:a=true,b=False,c=none,d=3,e=-2,f=1e-3,g=.5,h=inf,i=word", "x")
    assert spec.name == "rule"
    assert spec.params == {
        "a": True, "b": False, "c": None, "d": 3, "e": -2, "f": 1e-3, "g": 0.5,
        "h": math.inf, "i": "word",
    }  # fmt: skip
    assert isinstance(spec.params["d"], int) and isinstance(spec.params["f"], float)


def test_a_bare_name_has_no_params_and_prints_back() -> None:
    assert parse_named("  median ", "aggregator") == NamedSpec("median", {})
    text = "multi_krum:f=2,m=5"
    assert str(parse_named(text, "aggregator")) == text
    assert str(parse_named("a:x=true,y=none", "s")) == "a:x=true,y=none"


def test_a_chain_splits_on_the_arrow_and_keeps_exponents() -> None:
    steps = parse_chain("norm_bound:max=1e+3 > krum:f=2", "aggregator")
    assert steps == [NamedSpec("norm_bound", {"max": 1e3}), NamedSpec("krum", {"f": 2})]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "non-empty"),
        ("krum:f", "expected key=value"),
        ("krum:=2", "expected key=value"),
        ("krum:f=2,f=3", "'f' given twice"),
        ("kr-um", "is not a name"),
    ],
)
def test_malformed_specs_name_the_setting_and_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        parse_named(text, "aggregator")
    assert "aggregator" in str(err.value)


def test_a_non_string_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        parse_chain(3, "update_filter")


def test_check_params_lists_the_known_names_and_checks_types() -> None:
    allowed = {"f": int, "m": (int, type(None)), "tau": float, "on": bool}
    spec = parse_named("multi_krum:f=2,m=none,tau=1,on=true", "aggregator")
    got = check_params("aggregator", spec, allowed)
    assert got == {"f": 2, "m": None, "tau": 1.0, "on": True}
    assert isinstance(got["tau"], float)  # an int where a float goes becomes a float
    with pytest.raises(ValueError, match=r"no parameter 'g' \(its parameters: f, m, on, tau\)"):
        check_params("aggregator", parse_named("krum:g=1", "aggregator"), allowed)
    with pytest.raises(ValueError, match="f must be int, got 2.5"):
        check_params("aggregator", parse_named("krum:f=2.5", "aggregator"), allowed)
    with pytest.raises(ValueError, match="f must be int, got True"):
        check_params("aggregator", parse_named("krum:f=true", "aggregator"), allowed)
    with pytest.raises(ValueError, match="f must be int, got None"):
        check_params("aggregator", parse_named("krum:f=none", "aggregator"), allowed)
    with pytest.raises(ValueError, match="tau must be float, got 'big'"):
        check_params("aggregator", parse_named("cc:tau=big", "aggregator"), allowed)
