"""Issue 18, defaults that learn: every strategy, with no strategy keys set, reaches 0.8 test
accuracy in the default scenario of `aggsrv simulate --strategy NAME --transport inproc`
(digits, 8 clients in tiers, 60 virtual seconds).

The runs go through `aggsrv.sim.run` with the `SimConfig` the command line builds from
``--strategy NAME --transport inproc``: nothing else set, except ``threads = 1``, which does not
change the scenario (only how many threads torch uses in this process: the same numbers, and
on a loaded 2-core machine several times faster than torch's default). Once with the command's
default seed, once with a fresh seed (``AGGSRV_TEST_SEED`` replays one), because the defaults
must learn in general, not only for seed 0.
"""

from __future__ import annotations

import dataclasses
import os
import secrets

import pytest
import torch

from aggsrv.sim import run
from aggsrv.sim.config import SimConfig
from aggsrv.strategies import STRATEGIES

TARGET = 0.8
FRESH_SEED = int(os.environ.get("AGGSRV_TEST_SEED") or secrets.randbits(31))


@pytest.fixture(autouse=True)
def _torch_threads():
    """``threads = 1`` sets torch's thread count for the process: give the later tests theirs."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def cli_config(strategy: str, **keys) -> SimConfig:
    """The config of `aggsrv simulate --strategy NAME --transport inproc`, built as
    cli._simulate builds it: no file, the options given, every other key at its default."""
    config = SimConfig.load(None, {"strategy": strategy, "transport": "inproc", **keys})
    return SimConfig.from_mapping(config.to_dict())


def test_the_scenario_is_the_command_lines_default() -> None:
    """The runs below are the default scenario: threads aside, the config equals the one that
    a bare `aggsrv simulate --transport inproc` uses, and no strategy key is set."""
    default = SimConfig(strategy="fedasync", transport="inproc")
    ours = cli_config("fedasync", threads=1)
    assert dataclasses.replace(ours, threads=0) == default
    assert (default.dataset, default.clients, default.profile, default.budget) == (
        "digits", 8, "tiers", "60s"
    )  # fmt: skip
    assert default.strategy_config == {}
    assert len(STRATEGIES) >= 13  # the parametrisation below covers every registered one


@pytest.mark.parametrize("seed", [None, FRESH_SEED], ids=["default_seed", "fresh_seed"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_learns_with_its_defaults(strategy: str, seed: int | None, tmp_path) -> None:
    keys = {"threads": 1} if seed is None else {"threads": 1, "seed": seed}
    config = cli_config(strategy, **keys)
    assert config.strategy_config == {}
    result = run(config, progress=False, out_dir=tmp_path)
    s = result.summary
    assert s["virtual_time"] == 60.0 and not s["stalled"], s
    assert s["final_accuracy"] >= TARGET, (
        f"{strategy} with its default keys, seed {config.seed} (AGGSRV_TEST_SEED={config.seed} "
        f"replays a fresh one): final accuracy {s['final_accuracy']:.3f} < {TARGET} after "
        f"{s['versions']} versions, {s['updates_applied']} updates"
    )
