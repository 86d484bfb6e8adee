"""A sharded federation keeps the single server's promise across crashes: every update a client
saw acknowledged is in the model exactly once after any SIGKILL of any subset of the shards and a
restart with --resume (docs/sharding.md "Crashes and recovery").

The oracle is an exact count: each client's delta is a one-hot of its own coordinate, FedBuff's
step is server_lr / buffer_size = 0.25 (exact in float32), and the buffer is flushed at the end
by a filler client with a coordinate of its own, so coordinate c of the joined model is 0.25
times the number of client c's acknowledged updates, bit for bit.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from aggsrv.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.strategies import Status

D = 389  # odd: the slices' cut falls inside the one tensor
CLIENTS = 5
FILLER = "filler"
SETTINGS = """
shard_slice_wait_seconds = 2.0
shard_heartbeat_seconds = 0.2
shard_timeout_seconds = 20.0
rate_limit_per_second = 0.0
checkpoint_every_updates = 7
lease_seconds = 600.0

[strategy_config]
buffer_size = 4
server_lr = 1.0
"""


def _layout() -> ModelLayout:
    return ModelLayout.from_named_shapes([("w", (D,))])


def _coordinate(client: str) -> int:
    return (17 * (int(client[1:]) + 1)) % D if client != FILLER else D - 1


class Federation:
    """N `aggsrv serve --shards N` processes with a state directory each, restartable."""

    def __init__(self, tmp: Path, shards: int) -> None:
        from server_helpers import free_port

        self.tmp = tmp
        self.n = shards
        self.ports = [free_port() for _ in range(shards)]
        self.url = f"tcp://127.0.0.1:{free_port()}"  # rank 0's store: where a shard rejoins
        self.settings = tmp / "shards.toml"
        self.settings.write_text(SETTINGS)
        self.procs: list = [None] * shards
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"

    def start(self, resume: bool, ranks: list[int] | None = None) -> None:
        """Start the shards ``ranks`` (default all); the others, if running, wait for them."""
        from server_helpers import ServeProcess

        self.starts += 1
        ranks = list(range(self.n)) if ranks is None else ranks
        for r in ranks:
            state = ["--resume" if resume else "--state-dir", str(self.tmp / f"shard{r}")]
            args = ["--shards", str(self.n), "--rank", str(r), "--dist-url", self.url, *state,
                    "--strategy", "fedbuff", "--config", str(self.settings)]  # fmt: skip
            log = self.tmp / f"shard{r}-{self.starts}.log"
            self.procs[r] = ServeProcess(log, self.ports[r], *args)
        for r in ranks:
            self.procs[r].wait_serving(90)

    def kill(self, ranks: list[int]) -> None:
        for r in ranks:
            p = self.procs[r]
            if p is not None and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGKILL)
                p.proc.wait(20)

    def close(self) -> None:
        for p in self.procs:
            if p is not None:
                p.close()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("shard*.log"))
        )


def _push_until_acked(client_id: str, address: str, count: int, acked: list[str],
                      stop: threading.Event, first: int = 0) -> None:  # fmt: skip
    """Push ``count`` one-hot updates (ids ``client-k``), each until it is acknowledged; a
    refused or failed push is retried with the same update id after re-registering."""
    layout = _layout()
    delta = torch.zeros(D)
    delta[_coordinate(client_id)] = 1.0
    k = first
    while k < first + count and not stop.is_set():
        update_id = f"{client_id}-{k}"
        try:
            with Client(address, client_id, timeout=15, retries=0) as client:
                client.register(layout=layout)
                job = client.get_job()
                result = client.push(job, delta, update_id=update_id, encoding="dense")
            if result.status in (Status.APPLIED, Status.BUFFERED, Status.DUPLICATE):
                acked.append(update_id)
                k += 1
        except grpc.RpcError:
            time.sleep(0.1)


def _joined_model(address: str) -> tuple[int, torch.Tensor]:
    with Client(address, "reader", timeout=20, retries=3) as client:
        client.register(layout=_layout())
        return client.get_model()


def _flush(address: str, acked: list[str]) -> None:
    """Push filler updates until FedBuff's buffer of 4 is empty: with every acknowledged update
    applied once, that is when the number acknowledged is a multiple of 4."""
    i = 0
    while len(set(acked)) % 4:
        _push_until_acked(FILLER, address, 1, acked, threading.Event(), first=i)
        i += 1


def _check_exactly_once(fed: Federation, acked: list[str]) -> None:
    version, model = _joined_model(fed.address)
    ids = [u for u in acked if not u.startswith(FILLER)]
    assert len(ids) == len(set(ids)), "an update id was acknowledged twice as new"
    expected = torch.zeros(D)
    for u in ids:
        expected[_coordinate(u.split("-")[0])] += 0.25
    real = [_coordinate(f"c{i}") for i in range(CLIENTS)]
    got = model[real]
    assert torch.equal(got, expected[real]), (got, expected[real], fed.logs())
    others = torch.ones(D, dtype=torch.bool)
    others[real] = False
    others[D - 1] = False
    assert torch.equal(model[others], torch.zeros(int(others.sum())))
    return version


@pytest.mark.parametrize("shards", [2])
def test_every_acknowledged_update_survives_killing_every_shard(tmp_path: Path,
                                                                shards: int) -> None:  # fmt: skip
    """SIGKILL all shards between two batches of pushes, resume: the count is exact."""
    fed = Federation(tmp_path, shards)
    acked: list[str] = []
    try:
        fed.start(resume=False)
        with Client(fed.address, "init", timeout=20) as c:
            c.register(layout=_layout(), initial=torch.zeros(D))
        stop = threading.Event()
        for batch in range(2):
            threads = [
                threading.Thread(target=_push_until_acked,
                                 args=(f"c{i}", fed.address, 5, acked, stop, 5 * batch))
                for i in range(CLIENTS)
            ]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            fed.kill(list(range(shards)))
            fed.start(resume=True)
        _flush(fed.address, acked)
        _check_exactly_once(fed, acked)
    finally:
        fed.close()


@pytest.mark.parametrize("shards", [2, 3])
def test_random_sigkills_lose_no_acknowledged_update(tmp_path: Path, shards: int) -> None:
    """Clients push all the while; at random moments one shard, rank 0 or all of them are
    SIGKILLed, then the federation is restarted with --resume (every shard: a shard that lost
    its peers refuses writes until it is restarted). Every acknowledged update is counted
    exactly once."""
    rng = random.Random()
    fed = Federation(tmp_path, shards)
    acked: list[str] = []
    stop = threading.Event()
    try:
        fed.start(resume=False)
        with Client(fed.address, "init", timeout=20) as c:
            c.register(layout=_layout(), initial=torch.zeros(D))
        threads = [
            threading.Thread(target=_push_until_acked,
                             args=(f"c{i}", fed.address, 12, acked, stop))
            for i in range(CLIENTS)
        ]  # fmt: skip
        for t in threads:
            t.start()
        for _ in range(3):
            time.sleep(rng.uniform(0.3, 2.0))
            victims = rng.choice([[0], [shards - 1], list(range(shards))])
            fed.kill(victims)
            time.sleep(rng.uniform(0.0, 0.5))
            fed.kill(list(range(shards)))
            fed.start(resume=True)
        for t in threads:
            t.join(150)
        assert not any(t.is_alive() for t in threads), fed.logs()
        _flush(fed.address, acked)
        _check_exactly_once(fed, acked)
    finally:
        stop.set()
        fed.close()


def _health(address: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


@pytest.mark.parametrize(("shards", "victim"), [(2, 1), (2, 0), (3, 2), (3, 0)])
def test_a_shard_restarted_alone_rejoins_while_the_others_stay_up(
    tmp_path: Path, shards: int, victim: int
) -> None:
    """SIGKILL one shard while clients push; the others stay up (same processes), answer reads
    and refuse writes with UNAVAILABLE and a retry hint; the killed shard alone is restarted
    with --resume, the federation is whole again, and every acknowledged update is counted
    exactly once."""
    fed = Federation(tmp_path, shards)
    acked: list[str] = []
    stop = threading.Event()
    try:
        fed.start(resume=False)
        survivors = [r for r in range(shards) if r != victim]
        pids = {r: fed.procs[r].proc.pid for r in survivors}
        with Client(fed.address, "init", timeout=20) as c:
            c.register(layout=_layout(), initial=torch.zeros(D))
        threads = [
            threading.Thread(target=_push_until_acked,
                             args=(f"c{i}", fed.address, 10, acked, stop))
            for i in range(CLIENTS)
        ]  # fmt: skip
        for t in threads:
            t.start()
        time.sleep(random.uniform(0.5, 1.5))
        fed.kill([victim])
        survivor = fed.procs[survivors[0]].address
        deadline = time.monotonic() + 20
        while True:  # the survivors notice at once, within a heartbeat when idle
            with Client(survivor, "reader", timeout=5, retries=0) as op:
                failure = op.status().failure
            if failure or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert "not whole" in failure and "retry" in failure, failure
        if victim != 0:  # rank 0 answers reads of its slice meanwhile; writes are refused
            with Client(fed.address, "reader", timeout=5, retries=0) as op:
                assert op.status().version >= 0
                with pytest.raises(grpc.RpcError) as refused:
                    op.register(layout=_layout())
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "retry" in refused.value.details()
        time.sleep(random.uniform(0.0, 1.0))
        fed.start(resume=True, ranks=[victim])
        for t in threads:
            t.join(150)
        assert not any(t.is_alive() for t in threads), fed.logs()
        assert {r: fed.procs[r].proc.pid for r in survivors} == pids  # never restarted
        assert all(fed.procs[r].proc.poll() is None for r in range(shards))
        from grpc_health.v1 import health_pb2

        assert _health(fed.address) == health_pb2.HealthCheckResponse.SERVING
        _flush(fed.address, acked)
        _check_exactly_once(fed, acked)
    finally:
        stop.set()
        fed.close()


def test_stopping_rank_0_checkpoints_every_shard_at_the_same_call(tmp_path: Path) -> None:
    """SIGTERM to rank 0 stops both shards cleanly (exit 0), each with a final checkpoint cut at
    the same call; the resumed federation starts from it and goes on exactly."""
    from aggsrv.server import durability as DUR

    fed = Federation(tmp_path, 2)
    acked: list[str] = []
    try:
        fed.start(resume=False)
        with Client(fed.address, "init", timeout=20) as c:
            c.register(layout=_layout(), initial=torch.zeros(D))
        _push_until_acked("c0", fed.address, 6, acked, threading.Event())
        assert fed.procs[0].terminate() == 0
        assert fed.procs[1].proc.wait(30) == 0
        seqs = []
        for r in range(2):
            number, path = DUR.latest_checkpoint(tmp_path / f"shard{r}")
            payload = DUR.load_checkpoint(path)
            assert payload["shard"]["rank"] == r and payload["shard"]["shards"] == 2
            seqs.append((payload["shard"]["seq"], payload["state"]["version"]))
        assert seqs[0] == seqs[1] and seqs[0][1] == 1  # 6 updates: one step of 4
        fed.start(resume=True)
        _push_until_acked("c1", fed.address, 2, acked, threading.Event())
        _check_exactly_once(fed, acked)
    finally:
        fed.close()
