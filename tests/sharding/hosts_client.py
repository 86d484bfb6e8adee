"""The client host of tests/sharding/test_shards_on_hosts.py, run inside its network namespace:
``python hosts_client.py SPEC.json``.

K clients register with the federation at ``address`` (the first one offers the initial model),
each takes a job, then each pushes its DELTA, then one fetches the joined model. Between the
steps it prints one JSON line on stdout and waits for a line on stdin, so the test can read the
hosts' byte counters while nothing moves.

SPEC: address (rank 0's), direct (stream to every shard, or to rank 0 only), ca (the CA's PEM),
tokens ({client id: token}), shapes ([[name, shape], ...]), initial (a torch.save'd [D] tensor),
deltas (a torch.save'd [K, D] tensor), model_out (where the joined model is saved).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout


def step(name: str, **payload) -> None:
    """Say what is done, then wait until the test says to go on."""
    print(json.dumps({"step": name, **payload}), flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(f"told to stop after {name}")


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    layout = ModelLayout.from_named_shapes([(name, tuple(shape)) for name, shape in spec["shapes"]])
    initial = torch.load(spec["initial"])
    deltas = torch.load(spec["deltas"])
    clients = [
        Client(
            spec["address"],
            cid,
            token=token,
            tls_ca=spec["ca"],
            timeout=30,
            retries=2,
            direct_to_shards=spec["direct"],
        )  # fmt: skip
        for cid, token in spec["tokens"].items()
    ]
    try:
        clients[0].register(layout=layout, initial=initial)
        for client in clients[1:]:
            client.register(layout=layout)
        shard_map = clients[0].shard_map
        jobs = [client.get_job() for client in clients]
        step(
            "jobs",
            bounds=list(shard_map.bounds) if shard_map is not None else None,
            base_versions=[job.base_version for job in jobs],
            weights_equal=all(torch.equal(job.weights, initial) for job in jobs),
        )
        results = [
            client.push(job, delta, num_samples=1, epochs=1.0, encoding="dense")
            for client, job, delta in zip(clients, jobs, deltas, strict=True)
        ]
        step("pushed", outcomes=[[r.status.name, r.version] for r in results])
        version, model = clients[0].get_model()
        torch.save(model, spec["model_out"])
        # Rank 0's view of every shard (it asks the others over their TLS, with its own token).
        shards = [[r.address, r.reachable, r.error] for r in clients[0].status().shards]
        step("model", version=version, shards=shards)
    finally:
        for client in clients:
            client.close()


if __name__ == "__main__":
    main(sys.argv[1])
