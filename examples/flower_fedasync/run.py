"""Run the example in Flower's simulation engine (Ray backend, one CPU per node) without a
SuperLink: `python examples/flower_fedasync/run.py` from the repository root. Flower 1.42 marks
`run_simulation` as deprecated; `flwr run examples/flower_fedasync` runs the same app (README.md).

Knobs (environment): AGGSRV_EXAMPLE_STRATEGY and AGGSRV_EXAMPLE_UPDATES over the defaults in
pyproject.toml's [tool.flwr.app.config] (app.run_config), AGGSRV_EXAMPLE_NODES (4)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from app import client_app, server_app  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=int(os.environ.get("AGGSRV_EXAMPLE_NODES", "4")),
        # Ray on loopback only (its default is the machine's own network address).
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"_node_ip_address": "127.0.0.1"},
        },
    )
