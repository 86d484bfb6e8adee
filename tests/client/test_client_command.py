"""`aggsrv client` against a real server on loopback: clients train their parts of the digits
set and push until their budget; a restart pushes the update in flight again under its id (the
server applies it once); SIGTERM ends a running client after its push; a refused token and an
absent server end it with their exit codes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from server_helpers import RunningServer

from aggsrv import client_command
from aggsrv.cli import main
from aggsrv.client_command import ClientOptions, run_client


def _server(**config) -> RunningServer:
    return RunningServer(strategy="fedasync", rate_limit_per_second=0.0, **config)


def _options(srv: RunningServer, index: int, state: Path | None, **more) -> ClientOptions:
    where = str(state) if state else None
    return ClientOptions(server=srv.address, client_id=f"c{index}", clients=2, index=index,
                         state_dir=where, job_wait_seconds=30.0, **more)  # fmt: skip


def _applied(srv: RunningServer) -> int:
    """Versions published: every applied FedAsync update makes one (0 before any model)."""
    return 0 if srv.strategy is None else int(srv.state()["version"])


def test_two_clients_train_their_parts_until_their_budget(tmp_path: Path) -> None:
    srv = _server()
    try:
        codes: dict[int, int] = {}
        runs = [
            threading.Thread(target=lambda i=i: codes.update(
                {i: run_client(_options(srv, i, tmp_path / f"c{i}", updates=3))}))
            for i in range(2)
        ]  # fmt: skip
        for t in runs:
            t.start()
        for t in runs:
            t.join(timeout=120)
        assert codes == {0: 0, 1: 0}
        assert _applied(srv) == 6
        before = srv.model()
        # The budget counts what was accepted before a restart: nothing more to do.
        assert run_client(_options(srv, 0, tmp_path / "c0", updates=3)) == 0
        assert _applied(srv) == 6 and srv.model().equal(before)
    finally:
        srv.stop()


@pytest.mark.parametrize("crash", ["before the push", "after the push"])
def test_a_restart_pushes_the_update_in_flight_again_and_it_counts_once(
    tmp_path: Path, monkeypatch, crash: str
) -> None:
    srv = _server()
    state = tmp_path / "state"
    try:
        die_after_push(monkeypatch, crash)
        with pytest.raises(RuntimeError, match="killed"):
            run_client(_options(srv, 0, state, updates=2))
        assert (state / client_command.PENDING_FILE).exists()
        assert _applied(srv) == (1 if crash == "after the push" else 0)
        monkeypatch.undo()
        assert run_client(_options(srv, 0, state, updates=2)) == 0
        assert _applied(srv) == 2  # the update in flight was applied once, then one more
        assert not (state / client_command.PENDING_FILE).exists()
    finally:
        srv.stop()


def die_after_push(monkeypatch, crash: str) -> None:
    """The next push kills the process: before it reaches the server, or after it was applied
    but before the client wrote that down."""
    push = client_command.Client.push

    def dying(self, *args, **kwargs):
        if crash == "after the push":
            push(self, *args, **kwargs)
        raise RuntimeError("killed")

    monkeypatch.setattr(client_command.Client, "push", dying)


def test_an_update_in_flight_that_the_server_now_refuses_is_dropped(tmp_path, monkeypatch):
    """Its job's lease ran out while the client was down: the push is refused, the record
    dropped, and the client goes on to new jobs (no crash at every start)."""
    srv = _server(strategy_config={"job_lease_seconds": 1.0})
    state = tmp_path / "state"
    try:
        die_after_push(monkeypatch, "before the push")
        with pytest.raises(RuntimeError, match="killed"):
            run_client(_options(srv, 0, state, updates=2))
        monkeypatch.undo()
        time.sleep(1.5)  # the job's lease ends
        assert run_client(_options(srv, 0, state, updates=2)) == 0
        assert _applied(srv) == 2 and not (state / client_command.PENDING_FILE).exists()
        saved = (state / client_command.STATE_FILE).read_text()
        assert '"pushed": 3' in saved and '"accepted": 2' in saved  # the refused one counted
    finally:
        srv.stop()


def test_without_a_state_dir_every_start_sends_new_updates(tmp_path: Path) -> None:
    srv = _server()
    try:
        assert run_client(_options(srv, 0, None, updates=2)) == 0
        assert run_client(_options(srv, 0, None, updates=2)) == 0
        assert _applied(srv) == 4  # none of the second run's taken for the first's
    finally:
        srv.stop()


def test_sigterm_ends_a_running_client_after_its_push(tmp_path: Path) -> None:
    srv = _server()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aggsrv.cli", "client", "--server", srv.address,
             "--client-id", "c0", "--state-dir", str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while _applied(srv) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _applied(srv) >= 2, "the client did not train"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "stopping after the update in flight" in out
        saved = (tmp_path / client_command.STATE_FILE).read_text()
        assert f'"pushed": {_applied(srv)}' in saved  # every push it made, and nothing in flight
        assert not (tmp_path / client_command.PENDING_FILE).exists()
    finally:
        srv.stop()


def test_a_refused_token_and_an_absent_server_end_with_their_codes(tmp_path: Path, capsys):
    srv = _server(auth="hmac", state_dir=str(tmp_path / "srv"))
    handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    try:
        code = main(["client", "--server", srv.address, "--client-id", "c0", "--token", "forged"])
        assert code == 2
        # The command's SIGTERM/SIGINT handlers are put back when it returns.
        assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == handlers
    finally:
        srv.stop()
    opts = ClientOptions(server=srv.address, client_id="c0", retry_seconds=0.2, give_up_after=1.0)
    start = time.monotonic()
    assert run_client(opts) == 3  # the server is gone: it waited its second, then gave up
    assert time.monotonic() - start < 60
    assert main(["client", "--server", srv.address, "--client-id", "c0", "--index", "2"]) == 2
    assert "--index must be in [0, 1)" in capsys.readouterr().err
