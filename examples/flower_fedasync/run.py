"""Run the example in Flower's simulation engine (Ray backend, one CPU per node):
`python examples/flower_fedasync/run.py` from the repository root."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from app import NODES, client_app, server_app  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=NODES,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
