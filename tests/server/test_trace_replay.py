"""`--profile trace:file=FILE`: a recorded trace's timing replayed by the simulator, checked
against hand-computed timelines and against a trace recorded from a real server."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from aggsrv import trace_format as F
from aggsrv.sim.config import SimConfig
from aggsrv.sim.profiles import make_profile
from aggsrv.sim.profiles.trace_replay import client_timelines
from aggsrv.sim.runner import run
from aggsrv.sim.setup import client_id


def _job(c: str, job: int, asked: float, issued: float) -> dict:
    return {"ev": "job", "t": issued, "asked": asked, "c": c, "job": job, "base": 0, "bytes": 8}


def _up(c: str, job: int, t: float, out: str = "applied") -> dict:
    return {"ev": "update", "t": t, "start": t - 0.01, "c": c, "job": job, "base": 0, "v": 1,
            "s": 0, "bytes": 8 if out == "applied" else 0, "out": out}  # fmt: skip


def _trace(path: Path, records: list[dict]) -> Path:
    start = {"ev": "start", "t": 100.0, "format": F.FORMAT, "run": "r", "strategy": "fedasync",
             "version": 0}  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in [start, *records]))
    return path


# Client "b" joins 2 s after "a"; "a" waits 0.5 s for its first job (not its own time), is away
# 3 s after its first update, abandons job 3 (no update: away from 107.5 to 110), refuses one
# NaN update (still a job it did); "b" stops at 106 and the trace runs to 121: gone.
RECORDS = [
    _job("a", 1, 100.0, 100.5), _job("b", 2, 102.0, 102.0),
    _up("a", 1, 102.5),  # a: 2.0 s
    _up("b", 2, 106.0),  # b: 4.0 s, then silent
    _job("a", 3, 105.5, 105.5), _up("a", 3, 107.5),  # a: away 3.0 s, then 2.0 s
    _job("a", 4, 107.5, 107.5),  # abandoned
    _job("a", 5, 110.0, 110.0), _up("a", 5, 111.0, "invalid_argument"),  # a: away 2.5, 1.0 s
    _job("a", 6, 111.0, 111.0), _up("a", 6, 121.0),  # a: 10 s
]  # fmt: skip


def test_timelines_keep_what_each_client_did(tmp_path: Path) -> None:
    trace = F.read_trace(_trace(tmp_path / "t", RECORDS))
    a, b = client_timelines(trace, gone_after=3.0)
    assert (a.client_id, a.joined, a.durations) == ("a", 0.0, (2.0, 2.0, 1.0, 10.0))
    assert a.absences == (3.0, 2.5, 0.0) and not a.gone
    assert (b.client_id, b.joined, b.durations, b.absences) == ("b", 2.0, (4.0,), ())
    assert b.gone  # silent for 15 s > 3 x its 4 s median


def test_the_profile_replays_durations_absences_and_leaving(tmp_path: Path) -> None:
    path = _trace(tmp_path / "t", RECORDS)
    p = make_profile(f"trace:file={path},scale=0.5", num_clients=4, seed=1)
    assert [p.plan(0, r).duration for r in range(6)] == [1.0, 1.0, 0.5, 5.0, 1.0, 1.0]
    assert p.plan(1, 0).duration == 2.0 and p.plan(1, 7).duration == 2.0
    # Joining: b only from 1.0 (2 s x 0.5).
    assert p.online(0, 0.0, 0) and not p.online(1, 0.5, 0) and p.online(1, 1.0, 0)
    assert p.next_change(1, 0.5, 0) == 1.0
    # a's first update arrives at 1.3 (any time: the replay measures from the arrival).
    assert not p.online(0, 1.3, 1) and p.next_change(0, 1.3, 1) == pytest.approx(2.8)
    assert p.online(0, 2.8, 1) and p.next_change(0, 2.8, 1) is None
    assert not p.online(0, 4.0, 2) and p.online(0, 5.25, 2)  # 2.5 s x 0.5 after 4.0
    # After its last recorded update a starts over: the third absence is 0, then 3.0 again.
    assert p.online(0, 9.0, 4) and not p.online(0, 12.0, 5)
    # b left after its one update, for good.
    assert not p.online(1, 50.0, 1) and p.next_change(1, 50.0, 1) is None
    assert p.dropout_clients == (1,)
    # Clients beyond the trace: recorded durations, drawn per (seed, client, round), always on.
    pool = {1.0, 0.5, 5.0, 2.0}
    drawn = [p.plan(c, r).duration for c in (2, 3) for r in range(40)]
    assert set(drawn) <= pool and len(set(drawn)) > 1
    again = make_profile(f"trace:file={path},scale=0.5", num_clients=4, seed=1)
    assert drawn == [again.plan(c, r).duration for c in (2, 3) for r in range(40)]
    assert p.online(3, 0.0, 0) and p.online(3, 99.0, 7)


def test_job_numbers_are_matched_within_one_server_life(tmp_path: Path) -> None:
    """A restarted server numbers its jobs from 1 again: an update answers the job of its own
    run, never the same number of the run before."""
    path = tmp_path / "t"
    second = {"ev": "start", "t": 200.0, "format": F.FORMAT, "run": "r2", "strategy": "fedasync",
              "version": 0}  # fmt: skip
    records = [_job("a", 1, 100.0, 100.0), _up("a", 1, 101.0), _job("a", 2, 101.0, 101.0),
               second, _job("a", 1, 200.0, 200.0), _job("a", 2, 203.0, 203.0),
               _up("a", 2, 207.0), _up("a", 1, 210.0)]  # fmt: skip
    (a,) = client_timelines(F.read_trace(_trace(path, records)), gone_after=3.0)
    # Run 1: job 1 took 1 s; its job 2 was never answered. Run 2: job 1 took 10 s, job 2 4 s.
    assert a.durations == (1.0, 10.0, 4.0) and a.absences == (99.0, 0.0)


def test_bad_trace_profiles_say_why(tmp_path: Path) -> None:
    path = _trace(tmp_path / "t", RECORDS)
    with pytest.raises(ValueError, match="cannot be combined"):
        make_profile(f"trace:file={path}+tiers", num_clients=2, seed=0)
    with pytest.raises(ValueError, match="file=PATH"):
        make_profile("trace", num_clients=2, seed=0)
    with pytest.raises(FileNotFoundError):
        make_profile(f"trace:file={tmp_path / 'nope'}", num_clients=2, seed=0)
    with pytest.raises(ValueError, match="no job that a client completed"):
        make_profile(f"trace:file={_trace(tmp_path / 'e', [RECORDS[0]])}", 2, 0)
    with pytest.raises(ValueError, match="scale must be > 0"):
        make_profile(f"trace:file={path},scale=0", num_clients=2, seed=0)


def _updates_by_client(trace: F.Trace) -> Counter:
    return Counter(u.client for u in trace.updates if u.folded_in)


def _staleness_shares(trace: F.Trace) -> np.ndarray:
    """Shares of folded-in updates with staleness 0, 1, 2, 3-4, 5-8, > 8."""
    edges = [0, 1, 2, 3, 5, 9, 10**9]
    s = [u.staleness for u in trace.updates if u.folded_in]
    return np.histogram(s, bins=edges)[0] / max(len(s), 1)


@pytest.mark.parametrize(
    "strategy, settings",
    [
        ("fedasync", {"alpha": 0.6}),
        # Sync rounds: clients wait for the round (asking again every second), so the trace's
        # "asked" must be their first ask, or the replay takes the waits for absences.
        ("fedavg", {"mode": "sync", "round_timeout": 30.0}),
    ],
)
def test_a_trace_recorded_from_a_real_server_replays_its_arrivals(
    tmp_path: Path, strategy: str, settings: dict
) -> None:
    """Tiered stragglers against a real `aggsrv serve` (the grpc transport), recorded, then
    replayed on the virtual clock. Tolerances: each client's count of folded-in updates within
    1 + 15 % of the recorded one (the two runs end at slightly different points of a job), and
    the staleness histograms within 0.2 in total variation (arrivals at nearly equal times may
    swap order on a real server)."""
    common = {
        "strategy": strategy,
        "strategy_config": {**settings, "learning_rate": 0.05, "batch_size": 16},
        "dataset": "digits", "clients": 6, "model": "mlp", "budget": "16s",
        "eval_every": "8s", "seed": 4,
    }  # fmt: skip
    scale = 0.25
    live = run(
        SimConfig.from_mapping({**common, "out": str(tmp_path / "live"), "transport": "grpc",
                                "profile": "tiers", "time_scale": scale}),
        progress=False,
    )  # fmt: skip
    recorded = F.read_trace(live.out_dir / "trace.jsonl")
    replay = run(
        SimConfig.from_mapping({**common, "out": str(tmp_path / "replay"), "transport": "inproc",
                                "profile": f"trace:file={live.out_dir / 'trace.jsonl'},"
                                           f"scale={1 / scale}"}),
        progress=False,
    )  # fmt: skip
    replayed = F.read_trace(replay.out_dir / "trace.jsonl")
    # Simulated client i replays the i-th recorded client (by first job).
    order = [t.client_id for t in client_timelines(recorded, gone_after=3.0)]
    got = _updates_by_client(replayed)
    want = _updates_by_client(recorded)
    pairs = {order[i]: (want[order[i]], got[client_id(i)]) for i in range(len(order))}
    assert sum(want.values()) >= 12, pairs
    for client, (w, g) in pairs.items():
        assert abs(g - w) <= 1 + 0.15 * w, (client, pairs)
    tv = 0.5 * np.abs(_staleness_shares(recorded) - _staleness_shares(replayed)).sum()
    assert tv <= 0.2, (tv, _staleness_shares(recorded), _staleness_shares(replayed))


def test_tune_replays_a_trace_under_each_setting(tmp_path: Path) -> None:
    """`aggsrv tune` on a trace (here the one an inproc run writes, in the same format): the
    current setting and each grid point run on the replayed clients, each run's own trace has
    the recorded clients' arrivals, and the table names every point."""
    rec = run(
        SimConfig.from_mapping({"strategy": "fedasync", "dataset": "digits", "clients": 4,
                                "model": "mlp", "profile": "tiers", "budget": "6s",
                                "eval_every": "3s", "transport": "inproc", "seed": 2,
                                "out": str(tmp_path / "rec")}),
        progress=False,
    )  # fmt: skip
    trace = rec.out_dir / "trace.jsonl"
    out = tmp_path / "tune"
    p = subprocess.run(
        [sys.executable, "-m", "aggsrv.cli", "tune", "--trace", str(trace), "--strategy",
         "fedbuff", "--grid", "buffer_size=2,3", "--seeds", "0", "--out", str(out),
         "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "buffer_size=2" in p.stdout and "buffer_size=3" in p.stdout and "current" in p.stdout
    rows = [json.loads(line) for line in (out / "results.jsonl").open()]
    assert sorted(r["arm"] for r in rows) == ["buffer_size=2", "buffer_size=3", "current"]
    recorded = _updates_by_client(F.read_trace(trace))
    for run_dir in (out / "runs").glob("*/*"):
        replayed = F.read_trace(run_dir / "trace.jsonl")
        # FedBuff folds every update in (buffered): each client sends what it sent recorded,
        # give or take the one job in flight when the budget ends.
        sent = Counter(u.client for u in replayed.updates)
        assert sum(sent.values()) >= sum(recorded.values()) - len(recorded), run_dir
    _check_tune_table(out, trace, p.stdout)
    bad = subprocess.run(
        [sys.executable, "-m", "aggsrv.cli", "tune", "--trace", str(trace), "--strategy",
         "fedbuff", "--grid", "buffer_sise=2", "--out", str(out / "bad")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "buffer_sise" in bad.stderr


def _raw_updates(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["ev"] == "update"]


def _table_rows(text: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def _check_tune_table(out: Path, recorded: Path, printed: str) -> None:
    """Each setting's row against its runs' files, read as plain JSON: the versions in the
    summaries, the answered uploads per virtual second, and the staleness of the folded-in
    updates pooled over the seeds; the recorded row against the recording."""
    rows = _table_rows((out / "tune.md").read_text())
    assert rows == _table_rows(printed)
    assert list(rows) == ["recorded (fedasync)", "current", "buffer_size=2", "buffer_size=3"]
    by_arm: dict[str, list[Path]] = {}
    for r in map(json.loads, (out / "results.jsonl").read_text().splitlines()):
        by_arm.setdefault(r["arm"], []).append(out / r["run_dir"])
    for arm, dirs in by_arm.items():
        versions, rates, stale = [], [], []
        for d in dirs:
            summary = json.loads((d / "summary.json").read_text())
            ups = _raw_updates(d / "trace.jsonl")
            versions.append(summary["versions"])
            rates.append(len(ups) / summary["virtual_time"])
            stale += [u["s"] for u in ups if u["out"] in ("applied", "buffered")]
        row = rows[arm]
        assert float(row[2]) == pytest.approx(np.mean(versions), abs=0.05), (arm, row)
        assert float(row[3]) == pytest.approx(np.mean(rates), rel=1e-2), (arm, row)
        assert float(row[5]) == pytest.approx(np.mean(stale), abs=0.005), (arm, row)
        assert float(row[6]) == pytest.approx(np.percentile(stale, 90), abs=0.5), (arm, row)
        assert float(row[7]) == max(stale), (arm, row)
        accuracy = [json.loads((d / "summary.json").read_text())["final_accuracy"] for d in dirs]
        assert float(row[0].split()[0]) == pytest.approx(np.mean(accuracy), abs=5e-4)
    assert rows["current"][1] == "baseline"
    ups = _raw_updates(recorded)
    row = rows["recorded (fedasync)"]
    assert float(row[7]) == max(u["s"] for u in ups)
    assert float(row[5]) == pytest.approx(np.mean([u["s"] for u in ups]), abs=0.005)
    span = max(u["t"] for u in ups) - min(
        [r["asked"] for r in map(json.loads, recorded.read_text().splitlines()) if r["ev"] == "job"]
        + [u["start"] for u in ups]
    )  # fmt: skip
    assert float(row[3]) == pytest.approx(len(ups) / span, rel=1e-2)
