"""--eval on a sharded federation (docs/sharding.md): rank 0 makes each version whole from every
shard's slice and runs the hook on it; the evaluation rows (version, metrics) equal those of
one server fed the same updates, the hook's digest of the state dict included."""

from __future__ import annotations

import hashlib
import random
import time
from pathlib import Path

import torch
from test_shard_relay import Federations, _layout

from aggsrv.client.client import Client

UPDATES = 4


def digest(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """The eval hook: exact digests of the whole state dict (the bytes of every tensor, by
    name) and two sums."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].contiguous().numpy().tobytes())
    flat = torch.cat([t.reshape(-1).double() for t in state.values()])
    return {
        "sha": float(int.from_bytes(h.digest()[:6], "little")),
        "sum": float(flat.sum()),
        "tensors": float(len(state)),
    }


HOOK = f"{__name__}:digest"
SETTINGS = {"eval": HOOK, "eval_every_versions": 1}


def _rows(client: Client, seed: int) -> list[tuple[int, dict[str, float]]]:
    """Register with the first model, push UPDATES deltas one by one; after each version, the
    evaluation row GetStatus shows for it."""
    layout = _layout()
    gen = torch.Generator().manual_seed(seed)
    client.register(layout=layout, initial=torch.randn(layout.numel, generator=gen))
    rows = [_row_of(client, 0)]
    for _ in range(UPDATES):
        job = client.get_job(timeout=20)
        answer = client.push(job, 0.1 * torch.randn(layout.numel, generator=gen), num_samples=4)
        rows.append(_row_of(client, answer.version))
    return rows


def _row_of(client: Client, version: int) -> tuple[int, dict[str, float]]:
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up:
        status = client.status()
        if status.HasField("eval_version") and status.eval_version >= version:
            assert status.eval_version == version, (status.eval_version, version)
            return version, dict(status.eval_metrics)
        time.sleep(0.05)
    raise AssertionError(f"version {version} was not evaluated within 30 s")


def test_eval_on_two_shards_writes_one_servers_rows(servers, tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    one = servers(strategy="fedasync", strategy_config={"alpha": 0.5}, **SETTINGS)
    with Client(one.address, "c0", timeout=30) as client:
        want = _rows(client, seed)
    feds = Federations(2, ["fedasync"], tmp_path, SETTINGS)
    try:
        addresses = feds.next_addresses()
        with feds.client(addresses[0], "c0") as client:
            got = _rows(client, seed)
        # Shard 1 does not evaluate: it shows no row.
        with feds.client(addresses[1], "operator") as op:
            assert not op.status().HasField("eval_version")
        feds.shut_down(addresses[0])
    finally:
        feds.close()
    assert [v for v, _ in got] == list(range(UPDATES + 1)), got
    assert got == want, (seed, got, want)
    assert all(m["tensors"] == len(_layout().names) for _, m in got)
