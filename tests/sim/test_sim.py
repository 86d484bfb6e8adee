"""The simulator end to end: config and budgets, inproc determinism, output files, the report,
grpc against inproc, and the CLI's errors."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from aggsrv.sim import SimConfig, parse_budget, run
from aggsrv.sim.output import METRIC_FIELDS
from aggsrv.sim.report import find_runs, format_table, table_rows, time_to_target
from aggsrv.sim.setup import client_id

REPO = Path(__file__).resolve().parents[2]

# Small and quick: digits, a few clients with tiered stragglers, an MLP.
SMALL = {
    "strategy": "fedasync",
    "strategy_config": {"alpha": 0.6, "learning_rate": 0.05, "batch_size": 16},
    "dataset": "digits",
    "clients": 5,
    "model": "mlp",
    "profile": "tiers",
    "budget": "12s",
    "eval_every": "2s",
    "transport": "inproc",
    "seed": 3,
}


def _config(tmp_path: Path, name: str, **changes) -> SimConfig:
    return SimConfig.from_mapping({**SMALL, "out": str(tmp_path / name), **changes})


def _strip_wall(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in rows]


# ----------------------------------------------------------------------------- config


def test_budgets_parse_in_three_units() -> None:
    assert (parse_budget("600s").amount, parse_budget("600s").unit) == (600.0, "seconds")
    assert (parse_budget("500v").amount, parse_budget("500v").unit) == (500.0, "versions")
    assert (parse_budget("50r").amount, parse_budget("50r").unit) == (50.0, "rounds")
    assert parse_budget(90).unit == "seconds" and str(parse_budget("2.5s")) == "2.5s"
    for bad in ("10", "-3s", "0v", "1.5r", "ten rounds", "5x"):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)


def test_config_rejects_unknown_keys_and_bad_values(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown simulate config key.*cliens"):
        SimConfig.from_mapping({"cliens": 3})
    with pytest.raises(ValueError, match="transport"):
        SimConfig(transport="udp")
    with pytest.raises(ValueError, match="unknown strategy"):
        SimConfig(strategy="fedavgg")
    with pytest.raises(ValueError, match="alphaa"):
        SimConfig(strategy_config={"alphaa": 1})
    with pytest.raises(ValueError, match="fedhist: buffer_size must be an integer >= 1, got 0"):
        SimConfig(strategy="fedhist", strategy_config={"buffer_size": 0})
    cfg = _config(tmp_path, "x")
    again = SimConfig.from_mapping(
        __import__("tomllib").loads(cfg.to_toml())
    )  # the printed config loads back to the same config
    assert again == cfg
    no_timeout = SimConfig(strategy="fedavg", strategy_config={"round_timeout": None})
    with pytest.raises(ValueError, match="round_timeout = None cannot be written"):
        no_timeout.to_toml()  # not silently the 60 s default in a grpc run's server.toml


# ----------------------------------------------------------------------------- inproc


@pytest.fixture(scope="module")
def two_inproc_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("inproc")
    a = run(_config(base, "a"), progress=False)
    b = run(_config(base, "b"), progress=False)
    return a, b


def test_inproc_is_deterministic(two_inproc_runs) -> None:
    a, b = two_inproc_runs
    assert len(a.metrics) == 7  # t = 0, 2, ..., 12
    assert _strip_wall(a.metrics) == _strip_wall(b.metrics)
    assert a.summary["updates_applied"] == b.summary["updates_applied"] > 10
    # The model learned: digits with an MLP well above chance after 12 virtual seconds.
    assert a.metrics[0]["test_accuracy"] < 0.3 < 0.7 < a.final_accuracy


def test_other_seed_differs(tmp_path, two_inproc_runs) -> None:
    c = run(_config(tmp_path, "c", seed=4), progress=False)
    assert _strip_wall(c.metrics) != _strip_wall(two_inproc_runs[0].metrics)


def test_output_files_and_fields(two_inproc_runs) -> None:
    a, _ = two_inproc_runs
    d = a.out_dir
    for name in ("config.toml", "metrics.jsonl", "summary.json", "accuracy.png"):
        assert (d / name).is_file() and (d / name).stat().st_size > 0, name
    assert (d / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert rows == a.metrics
    for row in rows:
        assert set(METRIC_FIELDS) <= set(row)
    times = [r["virtual_time"] for r in rows]
    assert times == sorted(times) and times[0] == 0 and times[-1] == 12
    applied = [r["updates_applied"] for r in rows]
    assert applied == sorted(applied) and applied[0] == 0
    assert (
        rows[-1]["bytes_received"] == rows[-1]["updates_applied"] * a.summary["num_parameters"] * 4
    )
    summary = json.loads((d / "summary.json").read_text())
    for key in ("strategy", "dataset", "final_accuracy", "best_accuracy", "updates_applied",
                "virtual_time", "wall_time", "seed", "provenance"):  # fmt: skip
        assert key in summary, key
    assert summary["final_accuracy"] == rows[-1]["test_accuracy"]
    assert summary["best_accuracy"] == max(r["test_accuracy"] for r in rows)
    assert summary["provenance"]["packages"]["torch"]
    assert summary["seed"] == 3 and summary["strategy"] == "fedasync"
    cfg = __import__("tomllib").loads((d / "config.toml").read_text())
    assert cfg["clients"] == 5 and cfg["strategy_config"]["alpha"] == 0.6


def test_tiers_trace_by_hand(tmp_path) -> None:
    """The tier preset alone makes job durations exactly base_time x tier (1, 3 or 5): over 30
    virtual seconds a tier-P client's updates arrive at P, 2P, ..., so it sends floor(30 / P),
    and FedAsync accepts every one of them."""
    from aggsrv.sim.inproc import InprocRun
    from aggsrv.sim.setup import prepare

    cfg = _config(tmp_path, "tiers", budget="30s", clients=6, eval_every="10s")
    setup = prepare(cfg)
    engine = InprocRun(setup, lambda row: None)
    metrics = engine.run()
    tiers = [setup.profile.tier(c) for c in range(6)]
    assert sorted(tiers) == [1, 1, 3, 3, 5, 5]
    assert engine._sent == [30 // int(t) for t in tiers]
    assert engine.counters.applied == metrics[-1]["updates_applied"] == 2 * (30 + 10 + 6)
    assert metrics[-1]["version"] == 92 and metrics[-1]["virtual_time"] == 30
    # Evaluations at 0, 10, 20, 30 see every update that arrived up to then (t = 10 included).
    assert [m["updates_applied"] for m in metrics] == [0, 2 * (10 + 3 + 2), 2 * (20 + 6 + 4), 92]


def test_budget_in_versions_and_rounds(tmp_path) -> None:
    v = run(_config(tmp_path, "v", budget="15v", eval_every="5v"), progress=False)
    assert v.summary["versions"] == 15 and [m["version"] for m in v.metrics][:4] == [0, 5, 10, 15]
    r = run(
        _config(tmp_path, "r", strategy="fedavg", strategy_config={"learning_rate": 0.05},
                budget="3r", eval_every="1r"),
        progress=False,
    )  # fmt: skip
    # Sync FedAvg: a round is a version; with full participation all 5 clients report per round.
    assert [m["version"] for m in r.metrics] == [0, 1, 2, 3]
    assert r.summary["updates_applied"] == 15


# ----------------------------------------------------------------------------- report


def test_report_table_and_plot(tmp_path, two_inproc_runs) -> None:
    other = run(_config(tmp_path, "buff", strategy="fedbuff",
                        strategy_config={"buffer_size": 2, "learning_rate": 0.05}),
                progress=False)  # fmt: skip
    runs = find_runs([two_inproc_runs[0].out_dir, two_inproc_runs[1].out_dir, other.out_dir])
    rows = table_rows(runs, 0.5)
    by = {r["strategy"]: r for r in rows}
    assert by["fedasync"]["runs"] == 2 and by["fedbuff"]["runs"] == 1
    acc = [two_inproc_runs[0].final_accuracy, two_inproc_runs[1].final_accuracy]
    assert by["fedasync"]["final_accuracy"] == acc
    ttt = time_to_target(two_inproc_runs[0].metrics, 0.5)
    assert ttt is not None and by["fedasync"]["time_to_target"] == [ttt, ttt]
    table = format_table(runs, 0.5)
    assert "fedasync" in table and "fedbuff" in table and f"{statistics.fmean(acc):.3f}" in table
    out = tmp_path / "report.png"
    proc = subprocess.run(
        [sys.executable, "-m", "aggsrv.cli", "report", str(two_inproc_runs[0].out_dir),
         str(other.out_dir), "--target", "0.5", "--plot", str(out)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "fedbuff" in proc.stdout and out.read_bytes()[:4] == b"\x89PNG"
    missing = subprocess.run(
        [sys.executable, "-m", "aggsrv.cli", "report", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert missing.returncode == 2 and "does not exist" in missing.stderr


# ----------------------------------------------------------------------------- grpc


def test_grpc_agrees_with_inproc(tmp_path) -> None:
    """The same short run over a real server process and real clients on loopback ends near
    the inproc accuracy (not identical: arrival order at equal times is the OS's)."""
    cfg = dict(budget="8s", eval_every="4s", time_scale=0.25)
    ip = run(_config(tmp_path, "ip", **cfg), progress=False)
    gr = run(_config(tmp_path, "gr", transport="grpc", **cfg), progress=False)
    assert gr.summary["transport"] == "grpc" and gr.summary["updates_applied"] > 5
    assert (gr.out_dir / "server.log").is_file()
    assert gr.metrics[0]["version"] == 0 and gr.metrics[-1]["version"] > 5
    assert abs(gr.final_accuracy - ip.final_accuracy) < 0.15, (gr.final_accuracy, ip.final_accuracy)


# ----------------------------------------------------------------------------- CLI


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aggsrv.cli", "simulate", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )  # fmt: skip


def test_cli_print_config_and_errors(tmp_path) -> None:
    p = _cli("--clients", "7", "--set", "strategy_config.alpha=0.3", "--budget", "5v",
             "--print-config")  # fmt: skip
    assert p.returncode == 0, p.stderr
    cfg = __import__("tomllib").loads(p.stdout)
    assert cfg["clients"] == 7 and cfg["strategy_config"]["alpha"] == 0.3
    assert cfg["strategy_config"]["staleness"] == "polynomial"  # every key, with its default
    assert cfg["budget"] == "5v" and cfg["transport"] == "grpc" and cfg["dataset"] == "digits"
    bad = _cli("--set", "clientz=3", "--print-config")
    assert bad.returncode == 2 and "clientz" in bad.stderr
    bad_budget = _cli("--budget", "3 weeks", "--print-config")
    assert bad_budget.returncode == 2 and "budget" in bad_budget.stderr


def test_cli_missing_dataset_names_the_install_command(tmp_path) -> None:
    p = _cli("--dataset", "fashion_mnist", "--data-dir", str(tmp_path / "none"),
             "--transport", "inproc", "--budget", "1s", "--out", str(tmp_path / "o"))  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "apt-get install dataset-fashion-mnist" in p.stderr


def test_cli_simulate_inproc_prints_a_summary(tmp_path) -> None:
    out = tmp_path / "run"
    p = _cli("--transport", "inproc", "--clients", "4", "--budget", "4s", "--out", str(out),
             "--set", "strategy_config.learning_rate=0.05", "--no-progress")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "final accuracy" in p.stdout and "fedasync" in p.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clients"] == 4 and summary["virtual_time"] == 4


USER_STRATEGY = '''
from aggsrv.strategies import FedAsync

class Frozen(FedAsync):
    """Accepts every update and never changes the model (its version still advances)."""

    name = "frozen"

    def _apply(self, update, job, staleness, now):
        from aggsrv.strategies import Outcome, Status
        new = self._new_model_buffer().copy_(self._model)
        return Outcome(Status.APPLIED, self._publish(new))
'''


def test_user_strategy_plugs_in_as_module_callable(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_strategies.py").write_text(USER_STRATEGY)
    monkeypatch.syspath_prepend(str(tmp_path))
    r = run(_config(tmp_path, "user", strategy="my_strategies:Frozen", budget="6s"),
            progress=False)  # fmt: skip
    accs = {m["test_accuracy"] for m in r.metrics}
    assert len(accs) == 1  # the model never moved
    assert r.summary["versions"] == r.summary["updates_applied"] > 0
    with pytest.raises(ValueError, match="cannot import"):
        SimConfig(strategy="no_such_module:Thing")
    with pytest.raises(ValueError, match="not a subclass"):
        SimConfig(strategy="json:dumps")


@pytest.mark.parametrize(
    ("strategy", "settings"),
    [
        ("fedogd", {"epoch_timeout": 1.0}),  # an epoch per base period, as the experiments
        ("mifa", {"epoch_timeout": 1.0}),
        ("feden", {"participation": 1.0, "local_epochs": 1.0, "learning_rate": 0.05}),
        ("orthofl", {}),
        ("ca2fl", {}),
        ("fedhist", {"buffer_size": 3, "history": 2, "learning_rate": 0.1}),
        ("twafl", {"buffer_size": 3, "learning_rate": 0.1}),
        ("fedfg", {"min_available": 5, "fixed_groups": 2, "similarity_rounds": 2}),
        ("feddgic", {"min_available": 5, "similarity_rounds": 2}),
    ],
)
def test_seed_strategies_run_over_grpc(tmp_path, strategy, settings) -> None:
    """One short run of each paper's strategy against a real server process: every update is
    accepted and the global model's test loss goes down. The budget counts versions, not
    seconds, so a loaded CI machine (training lagging the virtual clock) still ends on a model
    that has moved."""
    r = run(
        _config(tmp_path, strategy, strategy=strategy, strategy_config=settings,
                transport="grpc", budget="6v", eval_every="4s", time_scale=0.25),
        progress=False,
    )  # fmt: skip
    s = r.summary
    if strategy == "fedfg":  # its grouping reached the run's events.jsonl from the server
        (event,) = [e for e in map(json.loads, (r.out_dir / "events.jsonl").open()) if
                    e["event"] == "grouping"]  # fmt: skip
        assert event["k"] == 2 and sorted(event["clients"]) == [client_id(c) for c in range(5)]
    assert s["updates_applied"] >= 5 and s["updates_rejected"] == 0, s
    assert r.metrics[-1]["version"] >= 1
    assert r.metrics[-1]["test_loss"] < r.metrics[0]["test_loss"]


def test_batchnorm_model_runs_with_its_statistics_on_both_transports(tmp_path) -> None:
    """A model with BatchNorm buffers: the statistics travel with jobs and updates, the
    evaluation loads the global ones, and sync FedAvg gives the same curve on both transports
    (each round averages the same updates; only the summation order may differ)."""
    curves = {}
    for transport in ("inproc", "grpc"):
        r = run(
            _config(tmp_path, transport, strategy="fedavg", model="small_cnn_bn",
                    strategy_config={"learning_rate": 0.1, "round_timeout": 1000.0},
                    transport=transport, budget="3v", eval_every="1v"),
            progress=False,
        )  # fmt: skip
        assert r.summary["updates_rejected"] == 0
        curves[transport] = {m["version"]: m["test_loss"] for m in r.metrics}
    assert set(curves["inproc"]) == set(curves["grpc"]) == {0, 1, 2, 3}
    for v, loss in curves["inproc"].items():
        assert abs(curves["grpc"][v] - loss) < 1e-4, (v, curves)
    assert curves["inproc"][3] < curves["inproc"][0]


def test_the_row_of_turned_down_updates_is_in_the_servers_order() -> None:
    """The gRPC run notes answers in the order its client threads get to them; the row of
    updates turned down since the last accepted one must follow the server's order, told by
    the version each answer carries."""
    from aggsrv.sim.grpc_transport import TurnedDownRow

    row = TurnedDownRow()
    assert [row.note(False, 0), row.note(False, 0)] == [1, 2]
    # The server: applied (made v1), then filtered twice at v1; the accepted one noted last.
    assert [row.note(False, 1), row.note(False, 1)] == [3, 4]
    assert row.note(True, 1) == 2  # the two at v1 came after it
    assert row.note(False, 0) == 2  # given before v1 existed: before the accepted one
    assert row.note(False, None) == 3  # a refusal by error joins the row
    # Buffered (no new version) at v1: an answer at v1 may be either side of it and stays.
    assert row.note(True, 1) == 2
    assert row.note(True, 2) == 0  # applied at v2: every answer so far came before it
    assert [row.note(False, 2), row.note(False, 3)] == [1, 2]
    with pytest.raises(ValueError, match="version"):
        row.note(True, None)


# The two ways the strategy turns an update down: a refusal (a gRPC error; the norm bound no
# delta meets, in practice a diverged model whose updates overflow) and the update filter's
# FILTERED answer (after the first accepted update, a bound of 1e-30 times its norm).
STALL_SCENARIOS = {
    "refused": ("strategy_config.max_update_norm=1e-30", 0),
    "filtered": ('strategy_config.update_filter="norm:factor=1e-30,warmup=1"', 1),
}


@pytest.mark.parametrize("refusal", sorted(STALL_SCENARIOS))
@pytest.mark.parametrize("transport", ["inproc", "grpc"])
def test_a_run_whose_every_update_is_refused_ends_as_stalled(tmp_path, transport, refusal) -> None:
    """A budget in rounds counts accepted updates: with every update turned down it is never
    reached, and the run must end, marked stalled, instead of training forever: after
    max(STALL_ARRIVALS, STALL_ROUNDS * clients) = max(200, 20 * 3) = 200 arrivals in a row
    with none accepted, in the server's order, on either transport (grpc: the other clients'
    pushes already under way when the run stops may still arrive, at most one each)."""
    setting, accepted = STALL_SCENARIOS[refusal]
    out = tmp_path / "run"
    # One local step of logistic regression per job: 200 arrivals in a few seconds. Its own
    # session, so that a run that hangs is killed with its server process.
    proc = subprocess.Popen(
        [sys.executable, "-m", "aggsrv.cli", "simulate", "--transport", transport,
         "--clients", "3", "--budget", "3r", "--model", "logreg", "--threads", "1",
         "--time-scale", "0.001", "--out", str(out), "--set", setting,
         "--set", "strategy_config.local_steps=1", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        start_new_session=True,
    )  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the {transport} run with every update {refusal} did not end in 120 s")
    assert proc.returncode == 0, stderr
    assert "every update of the last 200 arrivals was refused or filtered" in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stalled"] is True and summary["transport"] == transport
    assert summary["updates_applied"] == accepted
    turned_down = summary["updates_rejected"] + summary["updates_filtered"]
    in_flight = 0 if transport == "inproc" else 2  # the other clients' pushes
    assert 200 <= turned_down <= 200 + in_flight, summary
    if refusal == "refused":
        code = "UpdateNormTooLarge" if transport == "inproc" else "INVALID_ARGUMENT"
        assert summary["rejected_by"] == {code: summary["updates_rejected"]}, summary
        assert summary["updates_filtered"] == 0
    else:
        assert summary["updates_rejected"] == 0, summary
    # The run ended with an evaluation of the model it had (the initial one, or the one update).
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert metrics[-1]["version"] == summary["versions"] == accepted
    assert metrics[-1]["updates_applied"] == accepted
