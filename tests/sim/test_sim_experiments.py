"""Every experiment config in bench/experiments/ resolves (data set, split, model, profile,
strategy) and runs: a trimmed run (two versions, a tenth of the local work, at most
MAX_RUN_CLIENTS clients) of each."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from aggsrv.sim import SimConfig, run
from aggsrv.sim.setup import prepare

# The simulator trains every client's first job when it is issued, so a 1,000-client setting
# costs 1,000 trainings before its first version; the split of all of them is still checked.
MAX_RUN_CLIENTS = 100

EXPERIMENTS = sorted((Path(__file__).resolve().parents[2] / "bench" / "experiments").glob("*.toml"))


def test_there_is_one_config_per_paper_and_the_robust_table() -> None:
    names = {p.stem.split("_")[0] for p in EXPERIMENTS}
    assert names == {"fedogd", "orthofl", "feddgic", "fedhist", "feden", "robust", "dp"}


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_experiment_config_runs(path: Path, tmp_path: Path) -> None:
    cfg = SimConfig.load(path, {"out": str(tmp_path / "run"), "budget": "2v", "eval_every": "1v"})
    # The header comment says how to run it and which issue brought the strategy it runs.
    header = path.read_text().split("\n\n")[0]
    assert "aggsrv simulate --config bench/experiments/" in header and "issue" in header
    setup = prepare(cfg)
    assert len(setup.parts) == cfg.clients and all(len(p) > 0 for p in setup.parts)
    work = dict(cfg.strategy_config)
    if work.get("local_epochs"):
        work["local_epochs"] = work["local_epochs"] / 10
    # replace, not assignment: the config reads its strategy table once, when it is built.
    cfg = dataclasses.replace(cfg, strategy_config=work, clients=min(cfg.clients, MAX_RUN_CLIENTS))
    result = run(cfg, progress=False)
    assert result.summary["versions"] >= 2 and result.summary["updates_applied"] >= 2
    assert [m["version"] for m in result.metrics][:3] == [0, 1, 2]


def test_comparisons_are_valid_configs() -> None:
    """Every strategy a setting is compared with accepts the keys bench/experiments/compare.py
    gives it (the setting's recipe plus its own), so a comparison cannot fail half way."""
    import importlib.util

    path = EXPERIMENTS[0].parent / "compare.py"
    spec = importlib.util.spec_from_file_location("compare", path)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    stems = {p.stem for p in EXPERIMENTS}
    assert set(compare.COMPARISONS) <= stems
    for stem, entries in compare.COMPARISONS.items():
        base = SimConfig.load(EXPERIMENTS[0].parent / f"{stem}.toml")
        labels = [label for label, _, _ in entries]
        assert len(set(labels)) == len(labels) and base.strategy in {s for _, s, _ in entries}
        for label, strategy, own in entries:
            settings = compare.strategy_settings(base, strategy, own)
            assert settings.get("learning_rate") == base.strategy_config.get("learning_rate")
            cfg = dataclasses.replace(
                base, strategy=strategy, strategy_config=settings, label=label
            )
            SimConfig.from_mapping(cfg.to_dict())  # validates the strategy's keys


SWEEPS = sorted((EXPERIMENTS[0].parent / "sweeps").glob("*.toml"))


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_sweep_file_is_valid_in_every_cell(path: Path) -> None:
    """Every (cell, arm) of a regime-map sweep makes a valid config whose split and straggler
    profile resolve, so a sweep cannot fail an hour in; the header says how to run it."""
    from aggsrv.data.partitions import parse_partition
    from aggsrv.sim.profiles import make_profile
    from aggsrv.sim.sweep import load_sweep

    header = path.read_text().split("\n\n")[0]
    assert f"aggsrv sweep bench/experiments/sweeps/{path.name}" in header and "issue" in header
    sweep = load_sweep(path)  # checks every (cell, arm) config
    # 6-12 cells fit 2 cores; FedEN's map is 2 long cells (300 rounds each, its question).
    assert len(sweep.seeds) >= 2 and 2 <= len(sweep.cells()) <= 12
    for cell in sweep.cells():
        cfg = SimConfig.from_mapping(sweep.run_spec(cell, sweep.arms[0], 0, Path(".")).config)
        parse_partition(cfg.partition)
        counts = np.ones((cfg.clients, 10), dtype=np.int64)  # choose=label needs the split
        make_profile(cfg.profile, cfg.clients, 0, base_time=cfg.base_time, label_counts=counts)
