"""`aggsrv serve --trace`: what a real server records per job and per update, rotation, and
reading a trace back (aggsrv.trace_format)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch
from server_helpers import RunningServer, raw_push, tiny_model, update_messages

from aggsrv import trace_format as F
from aggsrv.client.client import Client
from aggsrv.values import Status


def _server(path: Path, **extra) -> RunningServer:
    return RunningServer(
        strategy="fedasync",
        strategy_config={"alpha": 0.5, "staleness": "constant"},
        trace=str(path),
        rate_limit_per_second=0.0,
        **extra,
    )


def _push_through(srv: RunningServer, pushes: int, seed: int) -> None:
    """One client registers, then fetches a job and pushes its update ``pushes`` times; the
    server stops."""
    try:
        with Client(srv.address, "c1") as client:
            client.register(tiny_model(seed))
            for _ in range(pushes):
                client.push(client.get_job(), torch.randn(client.layout.numel))
    finally:
        srv.stop()


def test_a_real_server_records_every_job_and_update_once(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    srv = _server(path)
    try:
        with Client(srv.address, "c1") as c1, Client(srv.address, "c2") as c2:
            c1.register(tiny_model(5))
            c2.register(tiny_model(5))
            D = c1.layout.numel
            j1 = c1.get_job()
            again = c1.get_job()  # the same job handed out again: recorded once
            assert again.job_id == j1.job_id
            j2 = c2.get_job()
            r1 = c1.push(j1, torch.randn(D), update_id="u1")
            r2 = c2.push(j2, torch.randn(D), update_id="u2")  # trained on v0, applied at v2
            dup = c1.push(j1, torch.randn(D), update_id="u1")
            assert (r1.status, r2.status, dup.status) == (Status.APPLIED,) * 2 + (Status.DUPLICATE,)
            j3 = c1.get_job()
            nan = torch.randn(D)
            nan[D // 3] = float("nan")
            refused = raw_push(srv.address, update_messages(c1, j3, nan))
            assert isinstance(refused, grpc.RpcError)
            assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
            # A caller that is not the registered client it names writes no line.
            stranger = raw_push(srv.address, update_messages(c1, j3, nan, client_id="nobody"))
            assert stranger.code() == grpc.StatusCode.NOT_FOUND
            r3 = c1.push(j3, torch.randn(D))
    finally:
        srv.stop()
    trace = F.read_trace(path)
    assert trace.strategies == ("fedasync",) and trace.skipped_lines == 0
    jobs = [(j.client, j.job, j.base, j.bytes) for j in trace.jobs]
    assert jobs == [
        ("c1", int(j1.job_id), 0, 4 * D),
        ("c2", int(j2.job_id), 0, 4 * D),
        ("c1", int(j3.job_id), r2.version, 4 * D),
    ]
    ups = [(u.client, u.job, u.base, u.version, u.staleness, u.outcome) for u in trace.updates]
    assert ups == [
        ("c1", int(j1.job_id), 0, 1, 0, "applied"),
        ("c2", int(j2.job_id), 0, 2, 1, "applied"),
        ("c1", int(j1.job_id), 0, 1, None, "duplicate"),
        ("c1", int(j3.job_id), 2, 2, None, "invalid_argument"),
        ("c1", int(j3.job_id), 2, r3.version, 0, "applied"),
    ]
    # The decoder refused the NaN upload (its check is part of receiving it whole): 0 bytes.
    assert [u.bytes for u in trace.updates] == [4 * D] * 3 + [0, 4 * D]
    for j in trace.jobs:
        assert j.asked <= j.issued
    issued = {(j.client, j.job): j.issued for j in trace.jobs}
    for u in trace.updates:
        assert u.started <= u.received
        if (u.client, u.job) in issued:
            assert issued[(u.client, u.job)] <= u.started
    assert trace.clients() == ["c1", "c2"]
    assert {j.run for j in trace.jobs} | {u.run for u in trace.updates} == {0}


def test_the_trace_rotates_by_size_and_reads_back_oldest_first(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _push_through(_server(path, trace_max_bytes=4096, trace_backups=100), pushes=80, seed=6)
    files = F.trace_files(path)
    assert len(files) >= 4 and files[-1] == path and files[0].name.startswith("t.jsonl.")
    for f in files:
        first = json.loads(f.read_text().splitlines()[0])
        assert first["ev"] == "start" and first["format"] == F.FORMAT, f
        assert f.stat().st_size <= 4096 + 400, f  # one record past the limit at most
    trace = F.read_trace(path)
    assert [u.version for u in trace.updates] == list(range(1, 81))
    assert [j.base for j in trace.jobs] == list(range(80))


def test_only_the_newest_rotated_files_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _push_through(_server(path, trace_max_bytes=4096, trace_backups=2), pushes=80, seed=7)
    assert [f.name for f in F.trace_files(path)] == ["t.jsonl.2", "t.jsonl.1", "t.jsonl"]
    versions = [u.version for u in F.read_trace(path).updates]
    assert versions == list(range(versions[0], 81)) and versions[0] > 1  # the newest, in order


def _write(path: Path, *records, tail: str = "") -> None:
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    path.write_text(text)


START = {"ev": "start", "t": 1.0, "format": F.FORMAT, "run": "r1", "strategy": "fedbuff",
         "version": 0}  # fmt: skip
JOB = {"ev": "job", "t": 2.0, "asked": 1.5, "c": "a", "job": 1, "base": 0, "bytes": 40}
UPDATE = {
    "ev": "update", "t": 3.5, "start": 3.0, "c": "a", "job": 1, "base": 0, "v": 1, "s": 0,
    "bytes": 40, "out": "buffered",
}  # fmt: skip


def test_a_line_cut_by_a_kill_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "t"
    _write(path, START, JOB, UPDATE, tail='{"ev": "job", "t": 4.0, "as')
    trace = F.read_trace(path)
    assert trace.skipped_lines == 1 and len(trace.jobs) == 1 and len(trace.updates) == 1
    u = trace.updates[0]
    assert (u.started, u.received, u.staleness, u.folded_in) == (3.0, 3.5, 0, True)
    assert trace.start == 1.5


@pytest.mark.parametrize(
    "bad, message",
    [
        ({**JOB, "job": "1"}, "'job' must be int"),
        ({**UPDATE, "t": None}, "'t' must be float"),
        ({**UPDATE, "t": float("inf")}, "must be finite"),
        ({"ev": "vote"}, "not a trace record"),
        ({**START, "format": 99}, "trace format 99"),
    ],
)
def test_a_record_aggsrv_does_not_write_names_file_and_line(tmp_path, bad, message) -> None:
    path = tmp_path / "t"
    _write(path, START, JOB, bad, UPDATE)
    with pytest.raises(F.TraceFormatError, match=message) as err:
        F.read_trace(path)
    assert f"{path}:3" in str(err.value)


def test_not_a_trace(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no trace at"):
        F.read_trace(tmp_path / "missing")
    path = tmp_path / "t"
    _write(path, JOB)
    with pytest.raises(F.TraceFormatError, match="before the file.s start record"):
        F.read_trace(path)
    path.write_text("not json\n{}\n")
    with pytest.raises(F.TraceFormatError, match=":1: not JSON"):
        F.read_trace(path)


def test_a_path_that_cannot_be_written_fails_the_start_not_a_call(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        _server(tmp_path / "no" / "such" / "dir" / "t.jsonl")


def test_a_restart_after_a_kill_appends_a_readable_run(tmp_path: Path) -> None:
    """A server killed mid-line, then restarted on the same file: the cut line is skipped, and
    the two lives' job numbers (both from 1) are kept apart by their runs."""
    path = tmp_path / "t.jsonl"
    for life in range(2):
        _push_through(_server(path), pushes=2, seed=10)
        if life == 0:
            with open(path, "a") as f:
                f.write('{"ev":"update","t":17')  # the kill cut this line
    trace = F.read_trace(path)
    assert trace.skipped_lines == 1 and trace.strategies == ("fedasync", "fedasync")
    assert [(j.run, j.job) for j in trace.jobs] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert [u.run for u in trace.updates] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="trace_backups >= 1"):
        _server(path, trace_backups=0)


def test_the_first_ask_is_the_jobs_asked_time(tmp_path: Path) -> None:
    """A client asking again (its GetJob timed out while the strategy made it wait) keeps the
    time of its first ask: the wait was the strategy's, not the client's absence."""
    from aggsrv.server.trace import TraceWriter

    now = [10.0]
    w = TraceWriter(str(tmp_path / "t"), strategy="fedbuff", version=lambda: 0,
                    clock=lambda: now[0], max_bytes=1 << 20, backups=1)  # fmt: skip
    w.asking("a", 10.0)
    w.asking("a", 15.0)  # asked again
    now[0] = 20.0
    w.job("a", 1, 0, asked=15.0, nbytes=4)
    w.asking("a", 30.0)
    now[0] = 31.0
    w.job("a", 2, 0, asked=30.0, nbytes=4)
    w.close()
    w.job("a", 3, 0, asked=40.0, nbytes=4)  # after close: nothing, no reopened file
    jobs = F.read_trace(tmp_path / "t").jobs
    assert [(j.job, j.asked, j.issued) for j in jobs] == [(1, 10.0, 20.0), (2, 30.0, 31.0)]
