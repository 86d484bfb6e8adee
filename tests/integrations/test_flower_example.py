"""examples/flower_fedasync in Flower's own simulation engine (Ray): aggsrv's FedAsync as the
ServerApp's asynchronous loop, ClientApps training by the job's recipe, on real digits data.
Both routes: `run_simulation` (run.py) and `flwr run` against a local simulation SuperLink."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

APP = Path(__file__).resolve().parents[2] / "examples" / "flower_fedasync"
EXAMPLE = APP / "run.py"
BIN = Path(sys.executable).parent  # flwr, flower-superlink and the processes they start


def _check_output(out: str, updates: int) -> None:
    line = re.search(r"aggsrv fedasync in Flower: (\d+) updates, version (\d+), accuracy by "
                     r"version (\{.*\})", out)  # fmt: skip
    assert line, out[-4000:]
    assert int(line.group(1)) == updates and int(line.group(2)) == updates
    accuracy = {int(k): float(v) for k, v in re.findall(r"(\d+): ([0-9.]+)", line.group(3))}
    assert set(accuracy) >= {0, updates}
    # Ten classes: the initial model is near chance; the federation learns.
    assert accuracy[updates] > accuracy[0] + 0.15, accuracy
    print(line.group(0))


def test_flower_simulation_runs_aggsrv_fedasync(tmp_path: Path) -> None:
    updates = 12
    # Ray keeps its sockets under /tmp/ray (a pytest tmp_path is too long for a socket path).
    env = {**os.environ, "AGGSRV_EXAMPLE_UPDATES": str(updates), "AGGSRV_EXAMPLE_NODES": "3"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, env=env,
        cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    _check_output(out, updates)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_flwr_run_runs_the_app_on_a_local_superlink(tmp_path: Path) -> None:
    """`flwr run examples/flower_fedasync <connection> --stream` against a simulation SuperLink
    on 127.0.0.1 that this test starts and stops itself, with its SuperExec (which starts the
    simulation, and that Ray) in a session of its own. (The CLI's default `local` connection
    starts both in the background instead, and leaves them running.)"""
    updates, port = 8, _free_port()
    home = tmp_path / "flwr-home"  # FLWR_HOME: the CLI's config.toml, the installed app
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local-simulation"\n\n[superlink.local-simulation]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "RAY_DEDUP_LOGS": "0",
    }
    superlink_log = tmp_path / "superlink.log"
    started: list[subprocess.Popen] = []
    try:
        started.append(subprocess.Popen(
            [BIN / "flower-superlink", "--insecure", "--simulation", "--isolation", "process",
             "--host", "127.0.0.1", "--port", str(port), "--log-file", str(superlink_log)],
            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True,
        ))  # fmt: skip
        _wait_healthy(started[0], port, superlink_log)
        # Without --allow-runtime-dependency-installation: the app runs on this environment's
        # aggsrv and torch, with no `uv sync` into a fresh one.
        started.append(subprocess.Popen(
            [BIN / "flower-superexec", "--insecure", "--runtime-api-address",
             f"127.0.0.1:{port}", "--parent-pid", str(started[0].pid)],
            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=True,
        ))  # fmt: skip
        proc = subprocess.run(
            [BIN / "flwr", "run", str(APP), "local-simulation", "--stream",
             "--run-config", f"num-updates={updates}",
             "--federation-config", "num-supernodes=3 client-resources-num-cpus=1"],
            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
        )  # fmt: skip
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        assert "Successfully started run" in out, out[-4000:]
        _check_output(out, updates)
    finally:
        for process in reversed(started):  # the SuperExec's group first, then the SuperLink
            _stop(process)


def _wait_healthy(superlink: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 30
    while True:
        assert superlink.poll() is None, log.read_text()[-4000:] if log.exists() else ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"no SuperLink on 127.0.0.1:{port} after 30 s"
        time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process's group (its own session), SIGKILL what is left after 10 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, so that only live members keep the group
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(5)
