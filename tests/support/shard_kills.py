"""Shard processes that are killed and restarted, and an exact oracle of what survived
(tests/sharding/test_shard_recovery.py, bench/test_soak_shard_kills.py).

Clients push FedBuff DELTA updates, each client's delta a one-hot of its own coordinate;
FedBuff's step is server_lr / buffer_size = 0.25 (exact in float32), and the buffer is flushed
at the end by a filler client with a coordinate of its own, so coordinate c of the joined model
is 0.25 times the number of client c's acknowledged updates, bit for bit.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
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
wal_part_bytes = 64

[strategy_config]
buffer_size = 4
server_lr = 1.0
"""


def layout() -> ModelLayout:
    return ModelLayout.from_named_shapes([("w", (D,))])


def coordinate(client: str) -> int:
    return (17 * (int(client[1:]) + 1)) % D if client != FILLER else D - 1


class ShardProcesses:
    """N `aggsrv serve --shards N` processes with a state directory each, restartable."""

    def __init__(
        self, tmp: Path, shards: int, strategy: str = "fedbuff", settings: str = SETTINGS
    ) -> None:
        from server_helpers import free_port

        self.tmp = tmp
        self.n = shards
        self.strategy = strategy
        self.ports = [free_port() for _ in range(shards)]
        self.url = f"tcp://127.0.0.1:{free_port()}"  # rank 0's store: where a shard rejoins
        self.settings = tmp / "shards.toml"
        self.settings.write_text(settings)
        self.procs: list = [None] * shards
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"

    def start(
        self, resume: bool, ranks: list[int] | None = None, extra: Any = lambda rank: []
    ) -> None:
        """Start the shards ``ranks`` (default all), each with the arguments ``extra(rank)``
        gives; the others, if running, wait for them."""
        from server_helpers import ServeProcess

        self.starts += 1
        ranks = list(range(self.n)) if ranks is None else ranks
        for r in ranks:
            state = ["--resume" if resume else "--state-dir", str(self.tmp / f"shard{r}")]
            args = ["--shards", str(self.n), "--rank", str(r), "--dist-url", self.url, *state,
                    "--strategy", self.strategy, "--config", str(self.settings),
                    *extra(r)]  # fmt: skip
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


def push_until_acked(client_id: str, address: str, count: int, acked: list[str],
                      stop: threading.Event, first: int = 0, model: ModelLayout | None = None,
                      delta: torch.Tensor | None = None) -> None:  # fmt: skip
    """Push ``count`` updates (ids ``client-k``; by default one-hot of the client's coordinate
    in :func:`layout`), each until it is acknowledged; a refused or failed push is retried with
    the same update id after re-registering."""
    if model is None:
        model = layout()
    if delta is None:
        delta = torch.zeros(D)
        delta[coordinate(client_id)] = 1.0
    k = first
    while k < first + count and not stop.is_set():
        update_id = f"{client_id}-{k}"
        try:
            with Client(address, client_id, timeout=15, retries=0) as client:
                client.register(layout=model)
                job = client.get_job()
                result = client.push(job, delta, update_id=update_id, encoding="dense")
            if result.status in (Status.APPLIED, Status.BUFFERED, Status.DUPLICATE):
                acked.append(update_id)
                k += 1
        except grpc.RpcError:
            time.sleep(0.1)


def joined_model(address: str) -> tuple[int, torch.Tensor]:
    with Client(address, "reader", timeout=20, retries=3) as client:
        client.register(layout=layout())
        return client.get_model()


def flush(address: str, acked: list[str]) -> None:
    """Push filler updates until FedBuff's buffer of 4 is empty: with every acknowledged update
    applied once, that is when the number acknowledged is a multiple of 4."""
    i = 0
    while len(set(acked)) % 4:
        push_until_acked(FILLER, address, 1, acked, threading.Event(), first=i)
        i += 1


def check_exactly_once(fed: ShardProcesses, acked: list[str]) -> int:
    version, model = joined_model(fed.address)
    ids = [u for u in acked if not u.startswith(FILLER)]
    assert len(ids) == len(set(ids)), "an update id was acknowledged twice as new"
    expected = torch.zeros(D)
    for u in ids:
        expected[coordinate(u.split("-")[0])] += 0.25
    real = [coordinate(f"c{i}") for i in range(CLIENTS)]
    got = model[real]
    assert torch.equal(got, expected[real]), (got, expected[real], fed.logs())
    others = torch.ones(D, dtype=torch.bool)
    others[real] = False
    others[D - 1] = False
    assert torch.equal(model[others], torch.zeros(int(others.sum())))
    return version


def start_pushing(fed: ShardProcesses, count: int, acked: list[str], stop: threading.Event,
                  model: ModelLayout | None = None, delta: Any = None,
                  first: int = 0) -> list[threading.Thread]:  # fmt: skip
    """CLIENTS threads, each pushing ``count`` updates (ids from ``first``) until acknowledged
    (``delta(client)``: its update, default :func:`push_until_acked`'s one-hot)."""
    threads = [
        threading.Thread(
            target=push_until_acked,
            args=(
                f"c{i}",
                fed.address,
                count,
                acked,
                stop,
                first,
                model,
                None if delta is None else delta(f"c{i}"),
            ),
        )  # fmt: skip
        for i in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    return threads


def kill_at_random(fed: ShardProcesses, rng: random.Random, kills: int = 3) -> None:
    """``kills`` times, after a random while: SIGKILL one shard, rank 0 or all of them, then
    the rest, and restart every shard with --resume."""
    for _ in range(kills):
        time.sleep(rng.uniform(0.3, 2.0))
        victims = rng.choice([[0], [fed.n - 1], list(range(fed.n))])
        fed.kill(victims)
        time.sleep(rng.uniform(0.0, 0.5))
        fed.kill(list(range(fed.n)))
        fed.start(resume=True)


def wait_for(fed: ShardProcesses, threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), fed.logs()
