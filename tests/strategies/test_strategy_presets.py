"""Each of the five papers' strategies has ``preset = "paper"`` (its paper's values), and the
presets chosen from the regime maps (issue 20) set exactly what their notes say."""

from __future__ import annotations

import dataclasses

import pytest

from aggsrv.strategies import strategy_class

PAPERS = ["fedogd", "orthofl", "fedhist", "feddgic", "feden"]


@pytest.mark.parametrize("name", PAPERS)
def test_every_paper_strategy_has_a_paper_preset_that_loads(name):
    config_class = strategy_class(name).config_class
    assert "paper" in config_class.PRESETS
    fields = {f.name for f in dataclasses.fields(config_class)}
    for preset, values in config_class.PRESETS.items():
        assert set(values) <= fields, (name, preset)
        loaded = config_class.from_dict({"preset": preset})
        for key, value in values.items():
            assert getattr(loaded, key) == value, (name, preset, key)
        # A key given beside the preset wins.
        key = next(iter(values))
        if isinstance(values[key], float):
            other = config_class.from_dict({"preset": preset, key: values[key] / 2})
            assert getattr(other, key) == values[key] / 2


def test_the_paper_presets_are_the_documented_defaults_where_the_defaults_are_the_papers():
    for name in ("orthofl", "feddgic", "feden"):
        config_class = strategy_class(name).config_class
        defaults = config_class.from_dict({})
        for key, value in config_class.PRESETS["paper"].items():
            if (name, key) == ("feden", "local_epochs"):
                assert defaults.local_epochs is None  # unset means the paper's E = 10
                continue
            assert getattr(defaults, key) == value, (name, key)


def test_orthofl_released_code_preset_is_variant_c_and_fedfg_has_no_paper_preset():
    orthofl = strategy_class("orthofl").config_class
    assert orthofl.from_dict({"preset": "released_code"}).shift_source == "client_chain"
    assert orthofl.from_dict({}).shift_source == "ma_global"
    assert set(orthofl.PRESET_NOTES) == {"released_code"}
    fedfg = strategy_class("fedfg").config_class
    assert fedfg.PRESETS == {}
    with pytest.raises(ValueError, match="preset"):
        fedfg.from_dict({"preset": "paper"})
