"""No acknowledged update is lost: `aggsrv serve` is killed with SIGKILL at random moments while
clients push updates, restarted with --resume each time, and at the end

* every update a client saw acknowledged (APPLIED, BUFFERED, or DUPLICATE of one of those) is in
  the write-ahead log exactly once, and
* the recovered server's model equals, bit for bit, the model that a fresh process computes by
  applying the logged calls (registrations, jobs, acknowledged updates, timers) to the initial
  checkpoint: the oracle shares no state with the server that crashed.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from server_helpers import ServeProcess, free_port

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import durability as D
from aggsrv.values import Status, UpdateKind

REPO = Path(__file__).resolve().parents[2]
ACKED = (Status.APPLIED, Status.BUFFERED)

# Replays the log in a fresh interpreter: checkpoint 1 (version 0) plus every segment.
ORACLE = r"""
import json, sys, torch
from aggsrv.server import durability as D
from aggsrv.server.federation import rebuild
from aggsrv.server.config import ServerConfig
state_dir, config_path, out = sys.argv[1:4]
fed = rebuild(ServerConfig.load(config_path), state_dir, 1)
kinds = {}
for _, record in D.iter_records(state_dir, 1):
    kinds[record.kind] = kinds.get(record.kind, 0) + 1
torch.save({"model": fed.strategy.global_model().clone(), "version": fed.version}, out)
print(json.dumps(kinds))
"""


class Supervisor:
    """Starts, kills and restarts one `aggsrv serve` process on a fixed port."""

    def __init__(self, tmp: Path, config: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.config = config
        self.state = tmp / "state"
        self.runs: list[ServeProcess] = []

    def start(self) -> None:
        args = ["--resume", str(self.state)] if self.runs else ["--state-dir", str(self.state)]
        log = self.tmp / f"serve-{len(self.runs)}.log"
        self.runs.append(ServeProcess(log, self.port, "--config", str(self.config), *args))
        self.runs[-1].wait_serving()

    def kill(self) -> None:
        self.runs[-1].stop(signal.SIGKILL, timeout=10)

    def stop(self) -> int:
        return self.runs[-1].terminate(timeout=30)

    def read_log(self) -> str:
        return "".join(run.log() for run in self.runs)

    def close(self) -> None:
        for run in self.runs:
            run.close()


class Pusher(threading.Thread):
    """A client that pushes until told to stop; retries an update with the same id until it is
    acknowledged (UNAVAILABLE while the server is down), takes a new job on ABORTED."""

    def __init__(self, address: str, name: str, layout: ModelLayout, seed: int) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.name = name
        self.layout = layout
        self.gen = torch.Generator().manual_seed(seed)
        self.stop = threading.Event()
        self.acked: list[str] = []
        self.errors: dict[str, int] = {}

    def _client(self) -> Client:
        client = Client(self.address, self.name, timeout=20, retries=10, backoff=0.1)
        client.register(layout=self.layout)
        return client

    def run(self) -> None:
        n = 0
        client = self._client()
        try:
            while not self.stop.is_set():
                try:
                    job = client.get_job(timeout=10)
                    update_id = f"{self.name}-{n}"
                    delta = torch.randn(self.layout.numel, generator=self.gen) * 0.01
                    while not self.stop.is_set():
                        try:
                            res = client.push(
                                job, delta, kind=UpdateKind.DELTA, num_samples=5, epochs=1.0,
                                update_id=update_id,
                            )  # fmt: skip
                            break
                        except grpc.RpcError as exc:
                            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                                raise
                    else:
                        return
                    n += 1
                    if res.status in ACKED or res.original in ACKED:
                        self.acked.append(update_id)
                except grpc.RpcError as exc:
                    # ABORTED: the job was superseded or is too stale; NOT_FOUND: the restarted
                    # server lost a registration that was never acknowledged. Start over.
                    code = exc.code().name
                    self.errors[code] = self.errors.get(code, 0) + 1
                    assert code in ("ABORTED", "UNAVAILABLE", "NOT_FOUND", "DEADLINE_EXCEEDED"), (
                        f"{self.name}: {code}: {exc.details()}"
                    )
                    if code == "NOT_FOUND":
                        client.close()
                        client = self._client()
        finally:
            client.close()


def _acked(pushers: list[Pusher]) -> int:
    return sum(len(p.acked) for p in pushers)


LAST_RUN_ACKS = 20


def _wait_for_acks(pushers: list[Pusher], count: int, limit: float = 120.0) -> None:
    """Until the pushers saw ``count`` more updates acknowledged (the bound only ends a hang)."""
    want = _acked(pushers) + count
    give_up = time.monotonic() + limit
    while _acked(pushers) < want:
        assert time.monotonic() < give_up, f"{_acked(pushers)} of {want} acks after {limit} s"
        assert any(p.is_alive() for p in pushers), "every pusher ended"
        time.sleep(0.02)


# (strategy, [strategy_config] lines): the plain ones, and the robust forms whose extra state
# (FedBuff's kept buffer rows under a robust rule; the filters' accepted norms and momentum) must
# come back from the checkpoint and the log as well.
CRASH_CASES = {
    "fedasync": ("fedasync", ""),
    "fedbuff": ("fedbuff", "buffer_size = 3\n"),
    "fedbuff-median": ("fedbuff", 'buffer_size = 3\naggregator = "median"\n'),
    "fedasync-filters": (
        "fedasync",
        'update_filter = "norm:factor=3,warmup=2 > centered_clip:warmup=2"\n',
    ),
}


@pytest.mark.parametrize("case", sorted(CRASH_CASES))
def test_sigkill_loses_no_acknowledged_update(tmp_path: Path, case: str) -> None:
    strategy, strategy_lines = CRASH_CASES[case]
    rng = random.Random()
    torch.manual_seed(rng.randrange(1 << 30))
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5))
    layout = ModelLayout.from_module(model)
    config = tmp_path / "server.toml"
    config.write_text(
        f'host = "127.0.0.1"\nstrategy = "{strategy}"\nauth = "none"\n'
        # Small checkpoint interval: kills land before, during and after checkpoints. Small
        # log parts: an update (668 floats) is logged in 11 of them while it arrives, so kills
        # land between its parts and its record too.
        "checkpoint_every_updates = 9\ncheckpoint_keep = 1000\nrate_limit_per_second = 0.0\n"
        "wal_part_bytes = 256\n[strategy_config]\n" + strategy_lines
    )
    sup = Supervisor(tmp_path, config)
    pushers: list[Pusher] = []
    try:
        sup.start()
        with Client(sup.address, "seed") as c:
            c.register(model)
        pushers = [Pusher(sup.address, f"p{i}", layout, rng.randrange(1 << 30)) for i in range(4)]
        for p in pushers:
            p.start()
        kills = 3
        for _ in range(kills):
            time.sleep(rng.uniform(0.4, 2.0))
            sup.kill()
            time.sleep(rng.uniform(0.0, 0.5))
            sup.start()
        # The last server must take updates after its recovery, not only be killed and resumed.
        _wait_for_acks(pushers, LAST_RUN_ACKS)
        for p in pushers:
            p.stop.set()
        for p in pushers:
            p.join(timeout=60)
            assert not p.is_alive(), f"{p.name} hung"
        with Client(sup.address, "reader") as c:
            version, served = c.get_model()
        assert sup.stop() == 0
    finally:
        for p in pushers:
            p.stop.set()
        sup.close()
    log_text = sup.read_log()
    assert log_text.count("resumed from checkpoint") == kills, log_text[-3000:]

    # Every acknowledged update is in the log exactly once.
    logged = [r.meta["update_id"] for _, r in D.iter_records(sup.state, 1) if r.kind == "update"]
    assert len(logged) == len(set(logged)), "an update was logged (applied) twice"
    acked = [u for p in pushers for u in p.acked]
    assert len(acked) >= 20, f"too few updates acknowledged to mean anything: {len(acked)}"
    missing = set(acked) - set(logged)
    assert not missing, f"{len(missing)} acknowledged updates were lost: {sorted(missing)[:5]}"

    # A fresh process replays the log onto checkpoint 1 and must land on the served model.
    out = tmp_path / "oracle.pt"
    proc = subprocess.run(
        [sys.executable, "-c", ORACLE, str(sup.state), str(config), str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    kinds = json.loads(proc.stdout.strip().splitlines()[-1])
    oracle = torch.load(out, weights_only=True)
    assert oracle["version"] == version
    assert torch.equal(oracle["model"], served), "recovered model differs from the log's replay"
    errors = {k: sum(p.errors.get(k, 0) for p in pushers) for k in ("ABORTED", "NOT_FOUND")}
    print(
        f"{case}: {kills} SIGKILLs, {len(acked)} acknowledged updates, {len(logged)} logged "
        f"({len(logged) - len(acked)} applied but unacknowledged at a kill), records {kinds}, "
        f"final version {version}, refusals {errors}, lost 0"
    )


def test_kills_before_each_checkpoint_threshold_still_checkpoint(tmp_path: Path) -> None:
    # Updates since the last checkpoint are counted from the checkpoint, across restarts: a
    # server killed before each run reaches checkpoint_every_updates still checkpoints, so what
    # a restart replays stays below the threshold instead of growing with every crash.
    every = 6
    config = tmp_path / "server.toml"
    config.write_text(
        'host = "127.0.0.1"\nstrategy = "fedasync"\nauth = "none"\nrate_limit_per_second = 0.0\n'
        f"checkpoint_every_updates = {every}\ncheckpoint_every_seconds = 0\n"
    )
    torch.manual_seed(random.randrange(1 << 30))
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    layout = ModelLayout.from_module(model)
    sup = Supervisor(tmp_path, config)
    try:
        for run in range(2):
            sup.start()
            with Client(sup.address, "a", timeout=20) as c:
                c.register(model) if run == 0 else c.register(layout=layout)
                for _ in range(every - 2):  # each run stays below the threshold on its own
                    delta = torch.randn(layout.numel) * 0.01
                    c.push(c.get_job(), delta, kind=UpdateKind.DELTA, num_samples=3)
            give_up = time.monotonic() + 10
            while (
                run == 1 and len(D.list_checkpoints(sup.state)) < 2 and time.monotonic() < give_up
            ):
                time.sleep(0.05)
            sup.kill()
    finally:
        sup.close()
    assert "after replaying 9 logged records" in sup.read_log()  # run 1: register, 4 x 2
    number, _ = D.latest_checkpoint(sup.state)
    replayed = [r.kind for _, r in D.iter_records(sup.state, number)]
    assert number >= 2 and replayed.count("update") < every, (number, replayed)
