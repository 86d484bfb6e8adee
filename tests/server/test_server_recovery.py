"""Every strategy resumes bit-exactly: a durable server runs a few seconds of real pushes from
several clients (rounds, timers, grouping phases, caches and all), stops, and then

* replaying its whole log onto checkpoint 1 in a fresh federation, and
* resuming the state directory with its newest checkpoint removed (so recovery must replay the
  log after an older checkpoint)

both reach the stopped server's strategy state, compared tensor by tensor, byte for byte.
Replay repeats each logged call with the time the strategy saw, so this holds only if every
strategy is a deterministic function of its calls, their order and their times.

The clients run until enough has happened (updates, versions, checkpoints), not for a fixed
time, and the resumed state is taken when recovery ends, on the aggregation thread: a round or
epoch deadline that passed while the server was down fires as soon as it serves again, so a state
read later would already hold that timer's step.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from server_helpers import RunningServer
from state_helpers import assert_same_state
from strategy_cases import strategy_cases

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import durability
from aggsrv.server.federation import Federation, rebuild
from aggsrv.values import UpdateKind

CLIENTS = 5
# Enough for the checks below: versions, logged updates and periodic checkpoints (every 4).
ENOUGH_ACCEPTED = 10
RUN_LIMIT_SECONDS = 120.0  # a hang, not a slow machine, gets here
CASES = strategy_cases(CLIENTS)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(9, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def _drive(address: str, layout: ModelLayout, name: str, seed: int, stop: threading.Event):
    """One client's get_job -> push loop with fresh random deltas until `stop`."""
    gen = torch.Generator().manual_seed(seed)
    errors: list[str] = []
    with Client(address, name, timeout=10) as client:
        client.register(layout=layout)
        while not stop.is_set():
            try:
                job = client.get_job(timeout=1.0)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue
                errors.append(exc.code().name)
                continue
            delta = torch.randn(layout.numel, generator=gen) * 0.05
            recipe = job.recipe
            try:
                client.push(
                    job, delta, kind=UpdateKind.DELTA, num_samples=int(10 + seed % 7),
                    steps=recipe.local_steps or 0, epochs=recipe.local_epochs or 0.0,
                )  # fmt: skip
            except grpc.RpcError as exc:  # a round closed, a job superseded: next job
                if exc.code() != grpc.StatusCode.ABORTED:
                    errors.append(f"{exc.code().name}: {exc.details()}")
    return errors


def _enough(srv: RunningServer) -> bool:
    fed = srv.federation
    return fed.counters["accepted"] >= ENOUGH_ACCEPTED and fed.published_version >= 2


@pytest.mark.parametrize("strategy", list(CASES))
def test_every_strategy_resumes_bit_exactly(tmp_path: Path, strategy: str, monkeypatch) -> None:
    state_dir = tmp_path / "state"
    config = {
        "strategy": strategy, "strategy_config": CASES[strategy], "durability": "on",
        "state_dir": str(state_dir), "checkpoint_every_updates": 4, "checkpoint_keep": 1000,
        "rate_limit_per_second": 0.0,
    }  # fmt: skip
    srv = RunningServer(**config)
    model = _model()
    layout = ModelLayout.from_module(model)
    stop = threading.Event()
    errors: list[str] = []
    try:
        with Client(srv.address, "c0") as first:
            first.register(model)
        threads = []
        for i in range(CLIENTS):
            seed = int(torch.randint(1 << 30, (1,)))

            def run(i=i, seed=seed) -> None:
                errors.extend(_drive(srv.address, layout, f"c{i}", seed, stop))

            threads.append(threading.Thread(target=run, daemon=True))
        for t in threads:
            t.start()
        deadline = time.monotonic() + RUN_LIMIT_SECONDS
        while not _enough(srv) and time.monotonic() < deadline and not errors:
            assert srv.federation.failure is None, srv.federation.failure
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive()
    finally:
        stop.set()
        srv.stop()  # final checkpoint; no timer fires after this
    assert not errors, errors
    live = srv.strategy.state_dict()
    assert live["version"] >= 2, f"{strategy}: too little happened ({live['version']} versions)"
    records = [r.kind for _, r in durability.iter_records(state_dir, 1)]
    assert records.count("update") >= 4, records

    # 1. A fresh federation replays the whole log onto the first checkpoint.
    cfg = srv.config
    rebuilt = rebuild(cfg, state_dir, 1)
    assert_same_state(live, rebuilt.strategy.state_dict(), f"{strategy} replayed")

    # 2. Resume without the newest checkpoint: an older one plus the log after it.
    checkpoints = durability.list_checkpoints(state_dir)
    assert len(checkpoints) >= 3, checkpoints  # the first, some periodic ones, the final one
    checkpoints[-1][1].unlink()
    at_recovery: dict[str, dict] = {}
    recover = Federation.recover

    def recover_and_keep(fed: Federation, store) -> int:
        replayed = recover(fed, store)
        at_recovery["state"] = copy.deepcopy(fed.strategy.state_dict())
        return replayed

    monkeypatch.setattr(Federation, "recover", recover_and_keep)
    resumed = RunningServer(**{**config, "resume": True})
    try:
        assert_same_state(live, at_recovery["state"], f"{strategy} resumed")
        assert resumed.federation.counters["accepted"] == srv.federation.counters["accepted"]
        assert set(resumed.federation.clients) == set(srv.federation.clients)
    finally:
        resumed.stop()
    print(
        f"{strategy}: version {live['version']}, {records.count('update')} updates, "
        f"{records.count('job')} jobs, {records.count('timer')} timers, "
        f"{len(checkpoints)} checkpoints: replay and resume bit-exact"
    )
