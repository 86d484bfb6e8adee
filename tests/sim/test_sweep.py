"""`aggsrv sweep`: the grid a sweep file expands to, the resumable results table, the paired
margins and their verdicts, the report (Markdown and heat maps) and one real sweep end to end."""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aggsrv.sim import SimConfig
from aggsrv.sim.sweep import load_results, load_sweep, pending, plan, run_sweep, summarize
from aggsrv.sim.sweep import runner as sweep_runner
from aggsrv.sim.sweep.margins import ahead_from, verdict
from aggsrv.sim.sweep.report import report_sweep
from aggsrv.sim.sweep.table import FIELDS, TABLE_NAME, health, run_dir_of

SETTING = """
strategy = "fedasync"
dataset = "digits"
clients = 4
model = "mlp"
profile = "tiers"
budget = "4s"
eval_every = "2s"
transport = "inproc"
[strategy_config]
learning_rate = 0.05
batch_size = 16
alpha = 0.6
"""

SWEEP = """
setting = "setting.toml"
seeds = [0, 1]

[[axis]]
name = "split"
key = "partition"
values = ["iid", "dirichlet_per_client:alpha=0.3", "shards:shards_per_client=2"]
labels = ["iid", "dir0.3", "shards"]

[[axis]]
name = "stragglers"
[axis.points]
none = { profile = "none" }
tiers = { profile = "tiers", "strategy_config.buffer_size" = 3 }

[[arm]]
label = "fedbuff"
strategy = "fedbuff"
role = "method"

[[arm]]
label = "fedbuff lr2"
strategy = "fedbuff"
role = "ablation"
of = "fedbuff"
config = { server_lr = 2.0 }

[[arm]]
label = "fedasync"
strategy = "fedasync"
config = { staleness = "polynomial" }

[[arm]]
label = "fedavg"
strategy = "fedavg"
"""


def _write(tmp_path: Path, sweep: str = SWEEP, setting: str = SETTING) -> Path:
    (tmp_path / "setting.toml").write_text(setting)
    path = tmp_path / "sweep.toml"
    path.write_text(sweep)
    return path


# ---------------------------------------------------------------- the grid


def test_grid_is_every_combination_first_axis_slowest(tmp_path):
    sweep = load_sweep(_write(tmp_path))
    cells = sweep.cells()
    assert [c.labels for c in cells] == [
        (s, t) for s in ("iid", "dir0.3", "shards") for t in ("none", "tiers")
    ]
    assert cells[3].as_dict() == {"split": "dir0.3", "stragglers": "tiers"}
    assert cells[3].overrides == {
        "partition": "dirichlet_per_client:alpha=0.3",
        "profile": "tiers",
        "strategy_config.buffer_size": 3,
    }


def test_a_run_gets_the_setting_the_cell_and_the_arm(tmp_path):
    sweep = load_sweep(_write(tmp_path))
    cell = sweep.cells()[3]
    out = tmp_path / "out"
    buff = sweep.run_spec(cell, sweep.arm("fedbuff lr2"), 1, out).config
    # The setting's recipe (not its fedasync-only alpha), the arm's key, the axis's key.
    assert buff["strategy_config"] == {
        "learning_rate": 0.05, "batch_size": 16, "server_lr": 2.0, "buffer_size": 3,
    }  # fmt: skip
    assert (buff["strategy"], buff["seed"], buff["partition"], buff["profile"]) == (
        "fedbuff", 1, "dirichlet_per_client:alpha=0.3", "tiers",
    )  # fmt: skip
    assert buff["threads"] == 1 and buff["clients"] == 4 and buff["budget"] == "4s"
    assert Path(buff["out"]) == out / "runs" / "dir0.3__tiers" / "fedbuff_lr2-s1"
    # An axis's strategy key reaches only the strategies that have it.
    asy = sweep.run_spec(cell, sweep.arm("fedasync"), 1, out).config
    assert asy["strategy_config"] == {
        "learning_rate": 0.05, "batch_size": 16, "staleness": "polynomial",
    }  # fmt: skip
    SimConfig.from_mapping(buff)
    SimConfig.from_mapping(asy)


def test_the_digest_follows_what_decides_a_result_not_where_it_is_written(tmp_path):
    sweep = load_sweep(_write(tmp_path))
    cell, arm = sweep.cells()[0], sweep.arm("fedbuff")
    a = sweep.run_spec(cell, arm, 0, tmp_path / "a").digest()
    assert a == sweep.run_spec(cell, arm, 0, tmp_path / "b").digest()
    assert a != sweep.run_spec(cell, arm, 1, tmp_path / "a").digest()
    assert a != sweep.run_spec(sweep.cells()[1], arm, 0, tmp_path / "a").digest()
    edited = load_sweep(
        _write(
            tmp_path,
            SWEEP.replace('role = "method"', 'role = "method"\nconfig = { buffer_size = 4 }'),
        )
    )
    assert a != edited.run_spec(edited.cells()[0], edited.arm("fedbuff"), 0, tmp_path).digest()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('role = "method"', 'role = "leader"'), "role must be one of"),
        (('role = "method"', 'role = "baseline"'), "at least one arm with role 'method'"),
        (('of = "fedbuff"', 'of = "fedavg"'), "is not a method arm"),
        (('of = "fedbuff"\n', ""), "an ablation names its method"),
        (('key = "partition"', 'key = "partitoin"'), "'partitoin' is neither a simulate key"),
        (('labels = ["iid", "dir0.3", "shards"]', 'labels = ["a", "a", "b"]'), "labels repeat"),
        (('labels = ["iid", "dir0.3", "shards"]', 'labels = ["a"]'), "3 values but labels"),
        (("config = { server_lr = 2.0 }", "config = { server_lr = -1.0 }"), "'fedbuff lr2'"),
        (('strategy = "fedavg"', 'strategy = "fedavgg"'), "arm 'fedavg'"),
        (("seeds = [0, 1]", "seeds = []"), "seeds must be a non-empty list"),
        (("seeds = [0, 1]", "seeds = [0, 1]\nbudget = 3"), "unknown key(s) ['budget']"),
        (('label = "fedavg"', 'label = "fedasync"'), "arm labels repeat"),
        (("seeds = [0, 1]", "seeds = [0, 1, 0]"), "seeds repeat"),
        (('label = "fedavg"', 'label = "fedbuff/lr2"'), "name the same directories"),
        (
            ('labels = ["iid", "dir0.3", "shards"]', 'labels = ["iid", "dir 0.3", "dir_0.3"]'),
            "name the same directories",
        ),
        (("alpha=0.3", "alhpa=0.3"), "unknown parameter(s) alhpa"),
        (('none = { profile = "none" }', 'none = { profile = "nonee" }'), "unknown profile"),
        (
            ('"strategy_config.buffer_size" = 3', '"strategy_config.bufer_size" = 3'),
            "no arm's strategy has the key 'bufer_size'",
        ),
    ],
)
def test_a_bad_sweep_file_is_refused_before_anything_runs(tmp_path, change, message):
    old, new = change
    assert old in SWEEP
    with pytest.raises(ValueError, match="sweep .*" + _re(message)):
        load_sweep(_write(tmp_path, SWEEP.replace(old, new, 1)))


def _re(text: str) -> str:
    import re

    return re.escape(text)


# ---------------------------------------------------------------- the table and resuming


def _fake_execute(calls: list[dict]):
    """A stand-in simulation: accuracy from the arm, seed and cell, deterministic."""

    def execute(config):
        calls.append(config)
        acc = {"fedbuff": 0.80, "fedbuff lr2": 0.75, "fedasync": 0.70, "fedavg": 0.77}
        final = acc[config["label"]] + 0.01 * config["seed"]
        if config["partition"] == "iid" and config["label"] == "fedbuff":
            final = 0.70 + 0.01 * config["seed"]  # the method loses in the iid cells
        summary = {
            "final_accuracy": final, "best_accuracy": final, "virtual_time": 4.0,
            "versions": 8, "updates_applied": 8, "stalled": False, "wall_time": 0.5,
        }  # fmt: skip
        # Every arm starts at 0.1; the last of three evaluations is the final accuracy.
        metrics = [
            {"virtual_time": t, "version": 2 * t, "rounds": t / 2, "test_accuracy": a,
             "test_loss": loss}
            for t, a, loss in ((0.0, 0.1, 2.3), (2.0, 0.1 + final / 2, 1.0), (4.0, final, 0.9))
        ]  # fmt: skip
        return summary, metrics, None

    return execute


def test_the_table_has_one_line_per_run_and_a_rerun_runs_nothing(tmp_path, monkeypatch):
    sweep = load_sweep(_write(tmp_path))
    out = tmp_path / "out"
    calls: list[dict] = []
    monkeypatch.setattr(sweep_runner, "_execute", _fake_execute(calls))
    assert run_sweep(sweep, out, log=lambda _: None) == 0
    main = 6 * 3 * 2
    # The ablation runs only in the cells where its method wins clearly: the 4 non-iid ones.
    assert len(calls) == main + 4 * 2
    ablation_cells = {(c["partition"], c["profile"]) for c in calls if c["label"] == "fedbuff lr2"}
    assert {p for p, _ in ablation_cells} == {"dirichlet_per_client:alpha=0.3",
                                             "shards:shards_per_client=2"}  # fmt: skip
    lines = (out / TABLE_NAME).read_text().splitlines()
    assert len(lines) == len(calls)
    for line in lines:
        record = json.loads(line)
        assert list(record) == [*FIELDS, "curve"]
        assert set(record["cell"]) == {"split", "stragglers"}
        final = record["final_accuracy"]
        assert record["curve"] == {
            "x": "virtual_time", "points": [[0.0, 0.1], [2.0, 0.1 + final / 2], [4.0, final]],
        }  # fmt: skip
    calls.clear()
    assert run_sweep(sweep, out, log=lambda _: None) == 0
    assert calls == []


def test_a_torn_last_line_and_an_edited_arm_rerun_exactly_those_runs(tmp_path, monkeypatch):
    out = tmp_path / "out"
    calls: list[dict] = []
    monkeypatch.setattr(sweep_runner, "_execute", _fake_execute(calls))
    sweep = load_sweep(_write(tmp_path))
    run_sweep(sweep, out, log=lambda _: None, phases=("main",))
    table = out / TABLE_NAME
    text = table.read_text()
    last = json.loads(text.splitlines()[-1])
    table.write_text(text[: -len(text.splitlines()[-1]) // 2 - 1])  # killed mid-write
    assert len(load_results(out)) == 35
    calls.clear()
    run_sweep(sweep, out, log=lambda _: None, phases=("main",))
    assert [(c["label"], c["seed"]) for c in calls] == [(last["arm"], last["seed"])]
    assert len(load_results(out)) == 36  # the torn line is skipped, the new one complete
    edited = load_sweep(_write(tmp_path, SWEEP.replace(
        'config = { staleness = "polynomial" }', 'config = { staleness = "hinge" }')))  # fmt: skip
    calls.clear()
    run_sweep(edited, out, log=lambda _: None, phases=("main",))
    assert {c["label"] for c in calls} == {"fedasync"} and len(calls) == 12


def test_a_failed_run_is_recorded_reported_and_retried(tmp_path, monkeypatch):
    out = tmp_path / "out"
    sweep = load_sweep(_write(tmp_path))
    ok = _fake_execute([])

    def flaky(config):
        if config["label"] == "fedavg" and config["seed"] == 1:
            return None, [], "RuntimeError: out of memory"
        return ok(config)

    monkeypatch.setattr(sweep_runner, "_execute", flaky)
    assert run_sweep(sweep, out, log=lambda _: None, phases=("main",)) == 6
    failed = [r for r in load_results(out) if r["error"]]
    assert len(failed) == 6 and all(r["final_accuracy"] is None for r in failed)
    assert len(pending(plan(sweep, out, "main"), out)) == 6
    summaries = summarize(sweep, load_results(out), out)
    assert summaries[0].arms["fedavg"].errors == {1: "RuntimeError: out of memory"}
    text, _ = report_sweep(sweep, out, plot=False)
    assert "(1 failed)" in text
    monkeypatch.setattr(sweep_runner, "_execute", ok)
    assert run_sweep(sweep, out, log=lambda _: None, phases=("main",)) == 0
    assert pending(plan(sweep, out, "main"), out) == []


def _fails_in_the_worker(config):
    """A module-level stand-in (the pool's workers inherit it by fork)."""
    if config["label"] == "fedavg" and config["seed"] == 1:
        if config["profile"] == "none":
            os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, say
        raise RuntimeError("boom")
    return _fake_execute([])(config)


def test_with_several_workers_a_raising_or_killed_run_is_recorded_and_the_rest_go_on(
    tmp_path, monkeypatch
):
    sweep = load_sweep(_write(tmp_path))
    out = tmp_path / "out"
    monkeypatch.setattr(sweep_runner, "_execute", _fails_in_the_worker)
    lines: list[str] = []
    failed = run_sweep(sweep, out, jobs=2, log=lines.append, phases=("main",))
    records = load_results(out)
    assert len(records) == 36  # every run has a line, none lost with the dead worker
    errors = {(r["cell"]["split"], r["cell"]["stragglers"], r["arm"], r["seed"]): r["error"]
              for r in records if r["error"]}  # fmt: skip
    assert failed == len(errors)
    died = sweep_runner.WORKER_DIED
    for split in ("iid", "dir0.3", "shards"):
        assert errors[(split, "none", "fedavg", 1)] == died
        # Its own error, unless it ran beside a killed run: the pool can notice a death late.
        assert errors[(split, "tiers", "fedavg", 1)] in ("RuntimeError: boom", died)
    assert "RuntimeError: boom" in errors.values()
    # At most the run beside a killed one (two workers) is lost with it; it is retried later.
    assert len(errors) <= 3 + 3 * 2
    for key, error in errors.items():
        assert key[2:] == ("fedavg", 1) or error == sweep_runner.WORKER_DIED
    monkeypatch.setattr(sweep_runner, "_execute", _fake_execute([]))
    assert run_sweep(sweep, out, jobs=2, log=lines.append, phases=("main",)) == 0
    assert pending(plan(sweep, out, "main"), out) == []


# ---------------------------------------------------------------- health and margins


@pytest.mark.parametrize(
    ("losses", "diverged"),
    [
        ([2.3, 0.5, 0.4], False),
        ([2.3, 0.3, 0.7], False),  # overfits, still far better than the untrained model
        ([2.3, 0.5, 3.0], True),  # worse than where it started, 6x its best
        ([2.3, 1.0, 90.0], True),
        ([2.3, 0.5, float("nan")], True),
        ([2.3, float("inf")], True),
        ([2.3, 2.2, 2.4], False),  # never learned, but did not blow up
    ],
)
def test_health_flags_a_run_that_ends_worse_than_it_started(losses, diverged):
    final, lowest, flag = health(losses)
    assert flag is diverged
    assert final == losses[-1] or (math.isnan(final) and math.isnan(losses[-1]))
    assert lowest == min(v for v in losses if math.isfinite(v))


def test_verdict_needs_every_seed_to_agree_and_the_mean_beyond_one_sd():
    assert verdict([0.02, 0.03]) == "wins"
    assert verdict([-0.02, -0.01, -0.03]) == "loses"
    assert verdict([0.05, -0.01]) == "noise"  # the seeds disagree
    assert verdict([0.001, 0.05]) == "noise"  # same sign, but the mean 0.0255 < sd 0.0347
    assert verdict([0.04]) == "n<2"
    rng = np.random.default_rng(7)
    for _ in range(50):
        m = rng.normal(0.01, 0.02, size=int(rng.integers(2, 6)))
        same = bool(np.all(m > 0) or np.all(m < 0))
        want = ("wins" if m.mean() > 0 else "loses") if same and abs(m.mean()) > m.std(
            ddof=1) else "noise"  # fmt: skip
        assert verdict(m.tolist()) == want


def test_ahead_from_is_where_the_mean_paired_lead_turns_positive_for_good():
    def c(xs, accs):
        return np.array([xs, accs], dtype=np.float64).T

    xs = [0, 10, 20, 30, 40]
    # The baseline is evaluated elsewhere: 0.3 at 10 and 0.6 at 30 by interpolation.
    base = {0: c([0, 20, 40], [0.1, 0.5, 0.7]), 1: c([0, 20, 40], [0.1, 0.5, 0.7])}
    seed0 = c(xs, [0.1, 0.25, 0.55, 0.62, 0.80])  # leads -0.05, +0.05, +0.02, +0.10
    seed1 = c(xs, [0.1, 0.20, 0.41, 0.66, 0.75])  # leads -0.10, -0.09, +0.06, +0.05
    assert ahead_from({0: seed0}, base) == 20.0
    assert ahead_from({0: seed0, 1: seed1}, base) == 30.0  # mean lead at 20: -0.02
    assert ahead_from({1: seed1}, base) == 30.0
    behind_at_end = c(xs, [0.1, 0.4, 0.6, 0.7, 0.69])
    assert ahead_from({0: behind_at_end}, base) is None
    always = c(xs, [0.1, 0.35, 0.6, 0.7, 0.8])
    assert ahead_from({0: always}, base) == 10.0
    dips = c(xs, [0.1, 0.35, 0.45, 0.65, 0.8])  # ahead, behind at 20, ahead again
    assert ahead_from({0: dips}, base) == 30.0
    assert ahead_from({2: always}, base) is None  # no seed in common
    # Curves of different lengths (a stalled run) compare up to the shorter one.
    short = c([0, 20], [0.1, 0.5])  # leads +0.05 at 10 and +0.10 at 20; 30 and 40 not compared
    assert ahead_from({0: always}, {0: short}) == 10.0


def _record(sweep, out, cell, arm, seed, acc, diverged=False):
    spec = sweep.run_spec(cell, sweep.arm(arm), seed, out)
    return {
        "cell": cell.as_dict(), "arm": arm, "role": spec.arm.role, "strategy": spec.arm.strategy,
        "seed": seed, "digest": spec.digest(), "final_accuracy": acc, "best_accuracy": acc,
        "final_loss": 1.0, "min_loss": 0.5, "diverged": diverged, "virtual_time": 4.0,
        "versions": 1, "updates_applied": 1, "stalled": False, "wall_time": 1.0,
        "run_dir": "x", "error": None,
    }  # fmt: skip


def test_margins_are_paired_by_seed_against_the_best_healthy_baseline(tmp_path):
    sweep = load_sweep(_write(tmp_path))
    out = tmp_path / "out"
    c0, c1 = sweep.cells()[0], sweep.cells()[1]
    rng = np.random.default_rng(11)
    method, asy, avg = rng.uniform(0.6, 0.9, (3, 2))
    records = []
    for s in (0, 1):
        records += [
            _record(sweep, out, c0, "fedbuff", s, method[s]),
            _record(sweep, out, c0, "fedasync", s, asy[s]),
            _record(sweep, out, c0, "fedavg", s, avg[s]),
            # In c1 the strongest baseline diverged on seed 1: it is not the one to beat.
            _record(sweep, out, c1, "fedbuff", s, 0.80),
            _record(sweep, out, c1, "fedasync", s, 0.95, diverged=s == 1),
            _record(sweep, out, c1, "fedavg", s, 0.70 + 0.01 * s),
        ]
    # A line for an older version of the sweep (another digest) is not used.
    stale = _record(sweep, out, c0, "fedbuff", 0, 0.0)
    stale["digest"] = "0" * 16
    summaries = summarize(sweep, [stale, *records], out)
    first = summaries[0]
    best = "fedasync" if asy.mean() > avg.mean() else "fedavg"
    ref = asy if best == "fedasync" else avg
    margin = first.margins["fedbuff"]
    assert first.best_baseline == best and margin.baseline == best
    assert margin.per_seed == pytest.approx({0: method[0] - ref[0], 1: method[1] - ref[1]})
    assert margin.mean == pytest.approx(statistics.fmean(method - ref))
    assert margin.sd == pytest.approx(statistics.stdev(method - ref))
    assert first.arms["fedavg"].mean == pytest.approx(avg.mean())
    second = summaries[1]
    assert second.best_baseline == "fedavg" and not second.baselines_broken
    assert second.arms["fedasync"].diverged == [1]
    assert second.margins["fedbuff"].per_seed == pytest.approx({0: 0.10, 1: 0.09})
    assert second.margins["fedbuff"].verdict == "wins"
    assert "fedbuff lr2" not in second.margins  # not run there
    assert summaries[2].best_baseline is None and summaries[2].margins == {}
    # A partial table: which cells may still change their best baseline.
    assert [x.missing_baseline_runs for x in summaries[:3]] == [0, 0, 4]
    partial = summarize(sweep, [r for r in records if (r["arm"], r["seed"]) != ("fedavg", 1)],
                        out)  # fmt: skip
    assert partial[0].missing_baseline_runs == 1
    out.mkdir()
    (out / TABLE_NAME).write_text(
        "".join(json.dumps(r) + "\n" for r in records if (r["arm"], r["seed"]) != ("fedavg", 1))
    )
    text, _ = report_sweep(sweep, out, plot=False)
    assert text.count("(partial: 1 baseline run to come)") == 2  # cells c0 and c1


def test_a_cell_whose_baselines_all_diverged_says_so(tmp_path):
    sweep = load_sweep(_write(tmp_path))
    out = tmp_path / "out"
    cell = sweep.cells()[0]
    records = [
        _record(sweep, out, cell, "fedbuff", s, 0.5) for s in (0, 1)
    ] + [_record(sweep, out, cell, b, s, 0.3, diverged=True)
         for b in ("fedasync", "fedavg") for s in (0, 1)]  # fmt: skip
    summary = summarize(sweep, records, out)[0]
    assert summary.baselines_broken and summary.best_baseline in ("fedasync", "fedavg")
    # +20 points on every seed against broken baselines is not a win, and explains nothing.
    assert summary.margins["fedbuff"].verdict == "broken"
    assert summary.margins["fedbuff"].mean == pytest.approx(0.2)
    out.mkdir()
    (out / TABLE_NAME).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [s.cell.labels for s in plan(sweep, out, "ablations")] == []
    text, _ = report_sweep(sweep, out, plot=False)
    assert "D0,1" in text and "| !+20.0 ± 0.0 vs fed" in text and "**+" not in text


def test_a_stalled_baseline_is_not_the_one_to_beat_and_a_nan_accuracy_is_a_failure(tmp_path):
    sweep = load_sweep(_write(tmp_path))
    out = tmp_path / "out"
    cell = sweep.cells()[0]
    records = []
    for s in (0, 1):
        records.append(_record(sweep, out, cell, "fedbuff", s, 0.5 + 0.01 * s))
        stalled = _record(sweep, out, cell, "fedasync", s, 0.9)
        stalled["stalled"] = s == 0  # stopped early on one seed: its 0.9 is not at equal time
        records += [stalled, _record(sweep, out, cell, "fedavg", s, 0.4)]
    records.append(_record(sweep, out, sweep.cells()[1], "fedavg", 0, float("nan")))
    summaries = summarize(sweep, records, out)
    assert summaries[0].best_baseline == "fedavg" and summaries[0].arms["fedasync"].stalled == [0]
    assert summaries[0].margins["fedbuff"].verdict == "wins"
    assert summaries[1].arms["fedavg"].errors == {0: "final accuracy nan"}
    out.mkdir()
    (out / TABLE_NAME).write_text("".join(json.dumps(r) + "\n" for r in records))
    text, _ = report_sweep(sweep, out, plot=False)
    assert "0.900 ± 0.000 S0" in text and "(1 failed)" in text


def test_cells_whose_joined_labels_look_alike_stay_apart(tmp_path):
    sweep_text = SWEEP.replace(
        'labels = ["iid", "dir0.3", "shards"]', 'labels = ["a / b", "a", "c"]'
    )
    sweep_text = sweep_text.replace("none = {", '"b / c" = {').replace("tiers = {", "c = {")
    sweep = load_sweep(_write(tmp_path, sweep_text))
    out = tmp_path / "out"
    by_labels = {c.labels: c for c in sweep.cells()}
    one, other = by_labels[("a / b", "c")], by_labels[("a", "b / c")]
    assert one.key() == other.key()  # the same text: the table keys by the labels themselves
    records = [_record(sweep, out, one, arm, s, 0.7) for arm in ("fedbuff", "fedavg")
               for s in (0, 1)]  # fmt: skip
    found = {s.cell.labels: s for s in summarize(sweep, records, out)}
    assert found[("a / b", "c")].arms["fedbuff"].accuracy == {0: 0.7, 1: 0.7}
    assert found[("a", "b / c")].arms["fedbuff"].accuracy == {}


# ---------------------------------------------------------------- the report


def test_the_report_tables_and_heat_maps_show_the_margins(tmp_path, monkeypatch):
    import matplotlib.image as mpimg

    sweep = load_sweep(_write(tmp_path))
    out = tmp_path / "out"
    monkeypatch.setattr(sweep_runner, "_execute", _fake_execute([]))
    run_sweep(sweep, out, log=lambda _: None)
    text, plots = report_sweep(sweep, out)
    # fedbuff: 0.70 vs fedavg 0.77 in the iid cells (loses by 7 points), 0.80 vs 0.77 elsewhere.
    grid = text.split("**fedbuff**")[1].split("**fedbuff lr2**")[0]
    assert "| iid | -7.0 ± 0.0 vs fedavg | -7.0 ± 0.0 vs fedavg |" in grid
    # The fake curves are linear from 0.1: a higher final accuracy leads from the first point.
    assert (
        "| dir0.3 | **+3.0 ± 0.0** vs fedavg, ahead from 2 s | **+3.0 ± 0.0** vs fedavg, "
        "ahead from 2 s |" in grid
    )
    assert "| iid / none | 0.705 ± 0.007 | - |" in text
    assert (out / "sweep.md").read_text() == text
    assert text.startswith("**fedbuff**")  # no description in this file: the grids come first
    assert [p.name for p in plots] == ["heatmap-fedbuff.png", "heatmap-fedbuff_lr2.png"]
    image = mpimg.imread(plots[0])
    h, w = image.shape[:2]
    assert h > 100 and w > 100
    # The map's colours: the losing row is red (more red than green), the winning rows green.
    left = image[:, : int(0.7 * w)]  # the map, not the colour bar at the right
    red = left[..., 0] > left[..., 1] + 0.15
    green = left[..., 1] > left[..., 0] + 0.15
    rows_red = np.nonzero(red.any(axis=1))[0]
    rows_green = np.nonzero(green.any(axis=1))[0]
    assert rows_red.size and rows_green.size
    assert np.median(rows_red) < np.median(rows_green)  # iid (the first row) is on top


def test_a_moved_table_still_finds_its_runs(tmp_path, monkeypatch):
    """Lines name their runs relative to the table, so a table copied elsewhere together with
    its runs (or committed) reports the same, also where a line has no curve of its own."""
    import shutil

    sweep = load_sweep(_write(tmp_path))
    out = tmp_path / "out"
    monkeypatch.setattr(sweep_runner, "_execute", _fake_execute([]))
    run_sweep(sweep, out, log=lambda _: None)
    before, _ = report_sweep(sweep, out, plot=False)
    lines = [json.loads(line) for line in (out / TABLE_NAME).read_text().splitlines()]
    moved = tmp_path / "elsewhere" / "out"
    moved.mkdir(parents=True)
    with open(moved / TABLE_NAME, "w") as fh:
        for record in lines:
            assert not Path(record["run_dir"]).is_absolute()
            run = moved / record["run_dir"]
            run.mkdir(parents=True)
            points = record.pop("curve")["points"]  # a line from before curves were recorded
            rows = [{"virtual_time": x, "test_accuracy": a, "test_loss": 1.0} for x, a in points]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            fh.write(json.dumps(record) + "\n")
    shutil.rmtree(out)
    after, _ = report_sweep(sweep, moved, plot=False)
    assert "ahead from 2 s" in after and after == before


def test_the_description_opens_the_report(tmp_path, monkeypatch):
    text_in = 'description = """FedBuff against K-async FedAvg,\non three splits."""\n' + SWEEP
    sweep = load_sweep(_write(tmp_path, text_in))
    assert sweep.description == "FedBuff against K-async FedAvg,\non three splits."
    out = tmp_path / "out"
    monkeypatch.setattr(sweep_runner, "_execute", _fake_execute([]))
    run_sweep(sweep, out, log=lambda _: None)
    text, _ = report_sweep(sweep, out, plot=False)
    assert text.startswith("FedBuff against K-async FedAvg,\non three splits.\n\n**fedbuff**")


def test_a_description_that_is_not_text_is_refused(tmp_path):
    with pytest.raises(ValueError, match="description"):
        load_sweep(_write(tmp_path, "description = 3\n" + SWEEP))


# ---------------------------------------------------------------- end to end


def test_a_real_sweep_runs_resumes_and_reports_from_the_command_line(tmp_path):
    sweep = """
setting = "setting.toml"
seeds = [0, 1]
[[axis]]
name = "split"
key = "partition"
values = ["iid", "shards:shards_per_client=1"]
labels = ["iid", "1 shard"]
[[arm]]
label = "fedbuff"
strategy = "fedbuff"
role = "method"
config = { buffer_size = 2 }
[[arm]]
label = "fedasync"
strategy = "fedasync"
"""
    path = _write(tmp_path, sweep)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "aggsrv.cli", "sweep", str(path), "--out", str(out),
           "--jobs", "2", "--no-progress"]  # fmt: skip
    # A run killed before it was recorded left files behind: the sweep starts it afresh.
    stale = out / "runs" / "1_shard" / "fedasync-s1"
    stale.mkdir(parents=True)
    (stale / "events.jsonl").write_text('{"left": "from a killed run"}\n')
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    records = load_results(out)
    assert len(records) == 8
    for r in records:
        assert r["run_dir"].startswith("runs/")  # relative to the table: the two move together
        summary = json.loads((run_dir_of(r, out) / "summary.json").read_text())
        assert r["final_accuracy"] == summary["final_accuracy"]
        assert r["versions"] == summary["versions"] and r["strategy"] == summary["strategy"]
        metrics = (run_dir_of(r, out) / "metrics.jsonl").read_text().splitlines()
        assert r["final_loss"] == json.loads(metrics[-1])["test_loss"]
    assert "**fedbuff**" in first.stdout and (out / "heatmap-fedbuff.png").is_file()
    assert not (stale / "events.jsonl").exists() and (stale / "summary.json").is_file()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "main: 8 runs, 8 already in the table" in again.stdout
    assert len(load_results(out)) == 8
    bad = subprocess.run([*cmd[:4], str(tmp_path / "missing.toml"), "--out", str(out)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "aggsrv sweep:" in bad.stderr
    twice = subprocess.run([*cmd, "--seeds", "1", "1"], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert twice.returncode == 2 and "seeds repeat: [1, 1]" in twice.stderr


@pytest.mark.parametrize("axes", [0, 1, 3])
def test_the_report_draws_any_number_of_axes(tmp_path, monkeypatch, axes):
    """One axis: a single column; three: one panel per point of the third; none: one cell."""
    import matplotlib.image as mpimg

    blocks = SWEEP.split("[[axis]]")
    head, axis_blocks, arms = blocks[0], blocks[1:], ""
    arms = "[[arm]]" + axis_blocks[-1].split("[[arm]]", 1)[1]
    axis_blocks[-1] = axis_blocks[-1].split("[[arm]]", 1)[0]
    third = '\nname = "lr"\nkey = "strategy_config.learning_rate"\nvalues = [0.05, 0.1]\n\n'
    chosen = (axis_blocks + [third])[:axes]
    text = head + "".join("[[axis]]" + b for b in chosen) + arms
    sweep = load_sweep(_write(tmp_path, text))
    assert len(sweep.cells()) == {0: 1, 1: 3, 3: 12}[axes]
    out = tmp_path / "out"
    monkeypatch.setattr(sweep_runner, "_execute", _fake_execute([]))
    run_sweep(sweep, out, log=lambda _: None)
    report, plots = report_sweep(sweep, out)
    assert report.count("vs fedavg") >= len(sweep.cells())
    if axes == 3:
        assert "*lr = 0.05*" in report and "*lr = 0.1*" in report
    width = mpimg.imread(plots[0]).shape[1]
    assert width > (600 if axes == 3 else 100)
