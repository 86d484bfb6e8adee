"""examples/flower_fedasync in Flower's own simulation engine (Ray): aggsrv's FedAsync as the
ServerApp's asynchronous loop, ClientApps training by the job's recipe, on real digits data."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower_fedasync" / "run.py"


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
    line = re.search(r"aggsrv fedasync in Flower: (\d+) updates, version (\d+), accuracy by "
                     r"version (\{.*\})", out)  # fmt: skip
    assert line, out[-4000:]
    assert int(line.group(1)) == updates and int(line.group(2)) == updates
    accuracy = {int(k): float(v) for k, v in re.findall(r"(\d+): ([0-9.]+)", line.group(3))}
    assert set(accuracy) >= {0, updates}
    # Ten classes: the initial model is near chance; the federation learns.
    assert accuracy[updates] > accuracy[0] + 0.15, accuracy
    print(line.group(0))
