"""Every configuration checks the type of each value and names the key and the type it wants;
printed configurations (``--print-config``) hold and describe every key and load back, and the
options that set a key show its description as their help."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tomllib
from typing import Any

import pytest

from aggsrv.cli import _SERVE_OPTIONS, _SIM_OPTIONS, build_parser, main
from aggsrv.config_file import TomlConfig
from aggsrv.server.config import ServerConfig
from aggsrv.sim.config import SimConfig
from aggsrv.strategies import STRATEGIES, StrategyConfig
from aggsrv.strategies.fedbuff import BufferedConfig
from aggsrv.strategies.fedogd import CachedEpochConfig

# class, its name in messages, an int key with a good value, a float key with a good float
# and a good int.
CASES = [
    (StrategyConfig, "strategy", ("batch_size", 16), ("learning_rate", 0.5, 1)),
    (BufferedConfig, "buffered", ("buffer_size", 4), ("server_lr", 0.5, 1)),
    (CachedEpochConfig, "cachedepoch", ("min_updates", 2), ("epoch_timeout", 5.0, 5)),
    *[
        (cls.config_class, name, ints, floats)
        for name, cls in STRATEGIES.items()
        for n, ints, floats in [
            ("fedavg", ("k", 3), ("beta1", 0.5, 0)),
            ("fedasync", ("hinge_b", 2), ("alpha", 0.5, 1)),
            ("fedbuff", ("buffer_size", 4), ("server_lr", 0.5, 1)),
            ("fedprox", ("min_clients", 2), ("mu", 0.5, 0)),
            ("fedogd", ("hysteresis", 2), ("server_lr", 0.5, 1)),
            ("feden", ("min_available", 2), ("lam", 0.5, 0)),
            ("mifa", ("min_updates", 2), ("epoch_timeout", 5.0, 5)),
            ("orthofl", ("batch_size", 16), ("beta", 0.5, 1)),
            ("ca2fl", ("buffer_size", 4), ("server_lr", 0.5, 1)),
            ("fedhist", ("buffer_size", 4), ("gamma", 0.5, 1)),
            ("twafl", ("history", 4), ("sim_threshold", 0.5, 0)),
            ("feddgic", ("t_factor", 3), ("alpha_max", 0.5, 1)),
            ("fedfg", ("fixed_groups", 3), ("beta", 0.5, 1)),
        ]
        if n == name
    ],
    (ServerConfig, "server", ("retained_versions", 4), ("lease_seconds", 5.0, 5)),
    (SimConfig, "simulate", ("clients", 4), ("base_time", 0.5, 2)),
]
IDS = [c[0].__name__ for c in CASES]


def _build(cls: type, **values: Any) -> Any:
    if issubclass(cls, TomlConfig):
        return cls.from_mapping(values)
    return cls.from_dict(values)


def test_every_strategy_config_is_covered() -> None:
    assert {c[1] for c in CASES} >= set(STRATEGIES)


@pytest.mark.parametrize(("cls", "kind", "ints", "floats"), CASES, ids=IDS)
def test_a_wrong_type_names_the_key_and_the_type(cls, kind, ints, floats) -> None:
    ikey, floatkey = ints[0], floats[0]
    integer = r"an integer( >= 1)?( or None)?"
    wrong = [
        (ikey, 2.5, rf"{kind}: {ikey} must be {integer}, got 2\.5 \(float\)"),
        (ikey, True, rf"{kind}: {ikey} must be {integer}, got True \(bool\)"),
        (ikey, "3", rf"{kind}: {ikey} must be {integer}, got '3' \(str\)"),
        (floatkey, "0.5", rf"{kind}: {floatkey} must be a number( or None)?, got '0\.5' \(str\)"),
        (floatkey, False, rf"{kind}: {floatkey} must be a number( or None)?, got False \(bool\)"),
    ]
    for key, value, message in wrong:
        with pytest.raises(ValueError, match=f"^{message}$"):
            _build(cls, **{key: value})
        with pytest.raises(ValueError, match=message):  # constructed by keyword too
            cls(**{key: value})


@pytest.mark.parametrize(("cls", "kind", "ints", "floats"), CASES, ids=IDS)
def test_none_is_refused_where_a_key_is_not_optional(cls, kind, ints, floats) -> None:
    for key in (ints[0], floats[0]):
        field = next(f for f in dataclasses.fields(cls) if f.name == key)
        if "None" in str(field.type):
            continue  # optional: None is a value it takes
        with pytest.raises(ValueError, match=rf"^{kind}: {key} must be .*, got None$"):
            _build(cls, **{key: None})


@pytest.mark.parametrize(("cls", "kind", "ints", "floats"), CASES, ids=IDS)
def test_good_values_are_kept_and_an_int_is_a_number(cls, kind, ints, floats) -> None:
    (ikey, ivalue), (fkey, fvalue, whole) = ints, floats
    config = _build(cls, **{ikey: ivalue, fkey: fvalue})
    assert (getattr(config, ikey), getattr(config, fkey)) == (ivalue, fvalue)
    assert getattr(_build(cls, **{fkey: whole}), fkey) == whole


def test_the_bound_of_a_count_is_checked_once_with_the_same_message() -> None:
    cases = [
        (BufferedConfig, "buffer_size"),
        (StrategyConfig, "max_num_samples"),
        (STRATEGIES["fedavg"].config_class, "min_clients"),
        (STRATEGIES["fedavg"].config_class, "k"),
        (STRATEGIES["fedogd"].config_class, "hysteresis"),
        (STRATEGIES["fedhist"].config_class, "history"),
        (STRATEGIES["feddgic"].config_class, "regroup_every"),
    ]
    for cls, key in cases:
        with pytest.raises(ValueError, match=rf": {key} must be an integer >= 1.*, got 0$"):
            cls.from_dict({key: 0})
    with pytest.raises(ValueError, match=r"^fedogd: tiers\['c1'\] must be an integer >= 1, got 0$"):
        STRATEGIES["fedogd"].config_class.from_dict({"tiers": {"c1": 0}})
    with pytest.raises(ValueError, match=r"tiers\['c1'\] must be an integer >= 1, got 2.5 \(float"):
        STRATEGIES["fedogd"].config_class.from_dict({"tiers": {"c1": 2.5}})
    with pytest.raises(ValueError, match=r"^server: retained_versions must be an integer >= 1"):
        ServerConfig(retained_versions=0)


def test_tables_and_unions_name_what_they_take() -> None:
    with pytest.raises(ValueError, match=r"^simulate: strategy_config must be a table, got 3"):
        SimConfig(strategy_config=3)
    with pytest.raises(ValueError, match=r"profile must be a string or a table, got 3 \(int\)"):
        SimConfig(profile=3)
    fedavg = STRATEGIES["fedavg"].config_class
    with pytest.raises(ValueError, match=r"participation must be a number, got '1' \(str\)"):
        fedavg(participation="1")
    assert fedavg(participation=3).participation == 3  # a count stays an int


def test_strategy_keys_in_a_server_or_simulate_config_are_checked_too(tmp_path) -> None:
    path = tmp_path / "server.toml"
    path.write_text('strategy = "fedbuff"\nretained_versions = 2.5\n')
    message = r"server: retained_versions must be an integer >= 1, got 2\.5 \(float\)"
    with pytest.raises(ValueError, match=message):
        ServerConfig.load(path)
    path.write_text('strategy = "fedbuff"\n[strategy_config]\nbuffer_size = 2.5\n')
    message = r"fedbuff: buffer_size must be an integer >= 1, got 2\.5 \(float\)"
    with pytest.raises(ValueError, match=message):
        ServerConfig.load(path)
    with pytest.raises(ValueError, match=r"fedasync: alpha must be a number, got 'x' \(str\)"):
        SimConfig(strategy_config={"alpha": "x"})


def test_unknown_keys_are_still_refused_with_the_known_ones() -> None:
    message = r"unknown FedBuffConfig key 'bufer_size'; known keys: .*buffer_size"
    with pytest.raises(ValueError, match=message):
        STRATEGIES["fedbuff"].config_class.from_dict({"bufer_size": 3})
    message = r"unknown server config key\(s\): prot; known keys: host, port"
    with pytest.raises(ValueError, match=message):
        ServerConfig.from_mapping({"prot": 1})


# ----------------------------------------------------------------------------- writing TOML


def test_strings_with_newlines_quotes_backslashes_and_unicode_round_trip() -> None:
    nasty = 'line one\nline "two"\\ \t é ∑ \U0001f600 \'single\' """triple"""'
    config = SimConfig(scenario=nasty, label="tab\there", model_config={"note": nasty, "n": 2})
    again = SimConfig.from_mapping(tomllib.loads(config.to_toml()))
    assert again == config
    assert again.scenario == nasty and again.model_config == {"note": nasty, "n": 2}
    server = ServerConfig(host="::1", events_file='a\nb\\c"d.jsonl', state_dir="ü")
    assert ServerConfig.from_mapping(tomllib.loads(server.to_toml())) == server


# ----------------------------------------------------------------------------- --print-config


def test_every_strategy_key_has_a_one_line_description() -> None:
    for name, cls in STRATEGIES.items():
        config_class = cls.config_class
        described = config_class.field_help()
        for f in dataclasses.fields(config_class):
            text = described.get(f.name)
            assert text, f"{name}: {f.name} has no description"
            assert "\n" not in text and len(text) < 120, (name, f.name, text)
            if f.default is None or config_class.__dataclass_fields__[f.name].default is None:
                assert "unset" in text, f"{name}: {f.name} does not say what unset means"
        assert isinstance(config_class.PRESET_NOTES, dict | type(StrategyConfig.PRESET_NOTES))
        assert set(config_class.PRESET_NOTES) <= set(config_class.PRESETS), name
    assert StrategyConfig.PRESET_NOTES == {}


def _printed(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _section(text: str) -> str:
    return text.split("[strategy_config]\n", 1)[1]


@pytest.mark.parametrize("command", ["simulate", "serve"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_printed_config_lists_the_strategy_keys_and_loads_back(
    capsys, tmp_path, command: str, strategy: str
) -> None:
    text = _printed(capsys, command, "--strategy", strategy, "--print-config")
    config_class = STRATEGIES[strategy].config_class
    section = _section(text)
    help_ = config_class.field_help()
    defaults = config_class.from_dict({})
    presets = ", ".join(sorted(config_class.PRESETS)) or "none"
    assert f"# {strategy} presets: {presets}\n" in section
    offered = config_class.offered_keys()
    for f in dataclasses.fields(config_class):
        if f.name not in offered:  # a dp_ key of a strategy without DP: not offered
            assert not re.search(rf"^(# )?{f.name} = ", section, re.M)
            continue
        if f.default_factory is not dataclasses.MISSING:  # a table: [strategy_config.KEY]
            assert f"# {f.name}: {help_[f.name]}\n[strategy_config.{f.name}]\n" in section
            continue
        line = next(x for x in section.splitlines() if re.match(rf"^(# )?{f.name} = ", x))
        assert line.endswith(f"  # {help_[f.name]}"), line
        assert line.startswith("# ") == (getattr(defaults, f.name) is None), line
    loaded = tomllib.loads(text)
    settings = loaded["strategy_config"]
    path = tmp_path / "printed.toml"
    path.write_text(text)
    again = _printed(capsys, command, "--config", str(path), "--print-config")
    assert again == text  # a fixed point
    cls = ServerConfig if command == "serve" else SimConfig
    before = cls.from_mapping({"strategy": strategy})
    after = cls.load(path)
    assert config_class.from_dict(settings) == config_class.from_dict(
        before.effective_strategy_config() if command == "simulate" else {}
    )
    for f in dataclasses.fields(cls):
        if f.name != "strategy_config":
            assert getattr(after, f.name) == getattr(before, f.name), f.name


def test_printed_presets_carry_their_notes(capsys) -> None:
    fedogd = STRATEGIES["fedogd"].config_class
    assert set(fedogd.PRESET_NOTES) == set(fedogd.PRESETS)
    section = _section(_printed(capsys, "serve", "--strategy", "fedogd", "--print-config"))
    for name, note in fedogd.PRESET_NOTES.items():
        assert f"#   {name}: {note}\n" in section


def test_printed_values_are_the_configured_ones(capsys, tmp_path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        'strategy = "fedavg"\n[strategy_config]\nround_timeout = 5.0\nserver_opt = "adam"\n'
    )
    text = _printed(capsys, "serve", "--config", str(path), "--print-config")
    section = _section(text)
    assert re.search(r"^round_timeout = 5\.0  # ", section, re.M)
    assert re.search(r'^server_opt = "adam"  # ', section, re.M)
    assert re.search(r"^# server_lr = \.\.\.  # .*unset", section, re.M)
    sim = _section(_printed(capsys, "simulate", "--strategy", "fedavg", "--clients", "5",
                            "--print-config"))  # fmt: skip
    assert re.search(r"^min_available = 5  # ", sim, re.M)  # what the run uses


# ------------------------------------------------- every serve and simulate key: described, printed


@pytest.mark.parametrize("cls", [ServerConfig, SimConfig], ids=["serve", "simulate"])
def test_every_server_and_simulate_key_has_a_one_line_description(cls) -> None:
    described = cls.field_help()
    for f in dataclasses.fields(cls):
        text = described[f.name]
        assert text, f"{cls.__name__}: {f.name} has no description"
        assert "\n" not in text and len(text) < 120, (f.name, text)
        if f.default is None:
            assert "unset" in text, f"{cls.__name__}: {f.name} does not say what unset means"


# Configurations that set keys of every kind: None and not, lists, tables (and none at all).
GIVEN = {
    "serve": 'strategy = "fedbuff"\nport = 6000\nmetrics_port = 0\ntrace = "t.jsonl"\n'
    'dashboard_allowed_hosts = ["a.example"]\nstate_dir = ""\nauth = "none"\n'
    "[strategy_config]\nbuffer_size = 3\n",
    "simulate": 'strategy = "fedavg"\nout = "runs/x"\nlabel = "a \\"run\\""\nclients = 4\n'
    'attack = "sign_flip:fraction=0.25"\n[model_config]\nhidden = 16\n[profile]\nname = "tiers"\n'
    '[compression]\nquantization = "int8"\n',
}


@pytest.mark.parametrize("given", [False, True], ids=["defaults", "given"])
@pytest.mark.parametrize("command", ["serve", "simulate"])
def test_printed_config_has_every_key_and_loads_back(capsys, tmp_path, command, given) -> None:
    cls = ServerConfig if command == "serve" else SimConfig
    path = None
    if given:
        path = tmp_path / "given.toml"
        path.write_text(GIVEN[command])
    text = _printed(capsys, command, *(["--config", str(path)] if path else []), "--print-config")
    config = cls.load(path)
    described = cls.field_help()
    top = text.split("\n[", 1)[0].splitlines()  # the keys before the first table
    for f in dataclasses.fields(cls):
        value = getattr(config, f.name)
        if isinstance(value, dict):  # a table
            assert f"\n[{f.name}]\n" in text, f"{command} --print-config leaves out [{f.name}]"
            if f.name != "strategy_config":  # its header lists the strategy's presets
                assert f"\n# {f.name}: {described[f.name]}\n[{f.name}]\n" in text
            continue
        line = next((x for x in top if re.match(rf"^(# )?{f.name} = ", x)), None)
        assert line is not None, f"{command} --print-config leaves out {f.name}"
        assert line.endswith(f"  # {described[f.name]}"), line
        assert line.startswith(f"# {f.name} = ...  # ") == (value is None), line
    printed = tmp_path / "printed.toml"
    printed.write_text(text)
    loaded = cls.load(printed)
    for f in dataclasses.fields(cls):
        if f.name != "strategy_config":  # printed as the strategy runs with it: every key
            assert getattr(loaded, f.name) == getattr(config, f.name), f.name
    assert loaded.strategy_settings == config.strategy_settings
    assert _printed(capsys, command, "--config", str(printed), "--print-config") == text


def _command_parser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize(
    ("command", "cls", "options"),
    [("serve", ServerConfig, _SERVE_OPTIONS), ("simulate", SimConfig, _SIM_OPTIONS)],
    ids=["serve", "simulate"],
)
def test_an_option_that_sets_a_key_shows_the_keys_description(command, cls, options) -> None:
    parser = _command_parser(command)
    text = parser.format_help()
    described = cls.field_help()
    by_dest = {a.dest: a for a in parser._actions}
    for key in options:
        assert by_dest[key].help == described[key].replace("%", "%%"), key
    if command == "serve":
        flags = ("--host", "--metrics-host", "--dashboard-host", "--eval-every", "--rate-limit")
        for flag in flags:
            action = next(a for a in parser._actions if flag in a.option_strings)
            assert action.help == described[action.dest], flag
    shown = "".join(text.split())  # as argparse wraps it (at spaces and hyphens)
    for key in options:
        assert "".join(described[key].split()) in shown, key


def test_building_the_parser_imports_no_config_class() -> None:
    # The descriptions are read when --help is shown: `aggsrv status` does not load torch.
    code = (
        "import sys, aggsrv.cli; aggsrv.cli.build_parser(); print(sorted(m for m in sys.modules "
        "if m.split('.')[0] == 'torch' or m.startswith(('aggsrv.server', 'aggsrv.sim'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_keys_a_strategy_offers_are_the_keys_it_takes(name: str) -> None:
    """--print-config and docs/config.md list a strategy's offered keys: the dp_ keys only where
    the strategy takes them (FedEN has FedAvg's fields but refuses differential privacy)."""
    from aggsrv.strategies import strategy_settings
    from aggsrv.strategies.privacy import DP_STRATEGIES

    cls = type(strategy_settings(name, {}))
    offered = cls.offered_keys()
    assert any(k.startswith("dp_") for k in offered) == (name in DP_STRATEGIES)
    if name in DP_STRATEGIES:
        assert strategy_settings(name, {"dp_clip_norm": 1.0}).dp_clip_norm == 1.0
    elif any(f.name == "dp_clip_norm" for f in dataclasses.fields(cls)):
        with pytest.raises(ValueError, match="does not support differential privacy"):
            strategy_settings(name, {"dp_clip_norm": 1.0})
    printed = subprocess.run(
        [sys.executable, "-m", "aggsrv.cli", "serve", "--strategy", name, "--print-config"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    table = printed[printed.index("[strategy_config]") :]
    assert ("dp_clip_norm" in table) == (name in DP_STRATEGIES)
