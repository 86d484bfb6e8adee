"""The configuration keys the docs show exist, with the defaults the docs state:

- a TOML block that is a `serve` or `simulate` configuration (it sets a key of either, or has a
  `[strategy_config]` table) holds only keys of those commands and, in `[strategy_config]`, keys
  its strategy offers (any strategy's when the block names none);
- "`key` (default V)" in prose, for a key of `serve`, `simulate` or a strategy, states the
  default the code has (for a strategy key: the default of some strategy that offers it).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from aggsrv.server.config import ServerConfig
from aggsrv.sim.config import SimConfig
from aggsrv.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
COMMAND_KEYS = set(ServerConfig.keys()) | set(SimConfig.keys())


def _strategy_defaults() -> dict[str, dict[str, object]]:
    """Each strategy's offered keys with their defaults."""
    out = {}
    for name, cls in STRATEGIES.items():
        defaults = cls.config_class.from_dict({}).to_dict()
        out[name] = {k: defaults[k] for k in cls.config_class.offered_keys()}
    return out


STRATEGY_DEFAULTS = _strategy_defaults()
STRATEGY_KEYS = {k for keys in STRATEGY_DEFAULTS.values() for k in keys}


def _toml_blocks() -> list[tuple[str, int, dict]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^```toml\n(.*?)^```", text, re.S | re.M):
            line = text[: m.start()].count("\n") + 1
            found.append((str(doc.relative_to(ROOT)), line, tomllib.loads(m.group(1))))
    return found


def _is_a_config(block: dict) -> bool:
    return "strategy_config" in block or bool(set(block) & COMMAND_KEYS)


def test_the_docs_hold_configuration_blocks() -> None:
    assert sum(_is_a_config(block) for *_, block in _toml_blocks()) >= 3


@pytest.mark.parametrize(("where", "line", "block"), _toml_blocks(), ids=lambda v: None)
def test_a_configuration_block_sets_only_keys_that_exist(where: str, line: int, block: dict):
    if not _is_a_config(block):
        return  # a tokens file, a sweep: formats of their own
    unknown = sorted(set(block) - COMMAND_KEYS)
    assert not unknown, f"{where}:{line}: no serve or simulate key {unknown}"
    strategy = block.get("strategy")
    offered = set(STRATEGY_DEFAULTS[strategy]) if strategy else STRATEGY_KEYS
    unknown = sorted(set(block.get("strategy_config", {})) - offered)
    assert not unknown, f"{where}:{line}: {strategy or 'no strategy'} has no key {unknown}"


STATED = re.compile(r"`([a-z][a-z0-9_]*)` \(default (?:`([^`]+)`|([^`);]+?))(?:[);]|: )")


def _stated_defaults() -> list[tuple[str, int, str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in STATED.finditer(text):
            key = m.group(1)
            if key in COMMAND_KEYS or key in STRATEGY_KEYS:
                line = text[: m.start()].count("\n") + 1
                stated = (m.group(2) or m.group(3)).strip()
                found.append((str(doc.relative_to(ROOT)), line, key, stated))
    return found


def _value(text: str) -> object:
    """A stated default as a value: TOML where it parses (1,000,000 counts as 1000000)."""
    try:
        return tomllib.loads(f"v = {text.replace(',', '_') if text[0].isdigit() else text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def test_the_docs_state_defaults() -> None:
    assert len(_stated_defaults()) >= 4


@pytest.mark.parametrize(("where", "line", "key", "stated"), _stated_defaults())
def test_a_stated_default_is_the_codes(where: str, line: int, key: str, stated: str) -> None:
    value = _value(stated)
    actual = []
    for cls in (ServerConfig, SimConfig):
        names = cls.keys()
        if key in names:
            actual.append(getattr(cls.from_mapping({}), key))
    actual += [d[key] for d in STRATEGY_DEFAULTS.values() if key in d]
    assert value in actual, f"{where}:{line}: `{key}` (default {stated}); the code has {actual}"


def test_the_extraction_reads_what_the_docs_write() -> None:
    line = "`max_num_samples` (default 1,000,000), `aggregator` (default `mean`: the rest)"
    assert [(m.group(1), _value((m.group(2) or m.group(3)).strip())) for m in STATED.finditer(line)
            ] == [("max_num_samples", 1_000_000), ("aggregator", "mean")]  # fmt: skip
    assert _value('["int8", "int4"]') == ["int8", "int4"] and _value("0.2") == 0.2
