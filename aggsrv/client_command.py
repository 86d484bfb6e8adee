"""`aggsrv client`: a real client process. It registers, then repeats: wait for a job, train
it by the job's recipe (`aggsrv.client.train`) on its part of a data set, push the update. While
it trains it sends heartbeats, so the server keeps the job's lease.

- **Data and model** are the simulator's (`aggsrv.sim`): a built-in data set or
  `module:callable` returning an `aggsrv.data.Dataset`, split by `--partition` among `--clients`,
  of which this process trains part `--index`; a built-in model or `module:callable`. Every
  client of a federation gives the same data set, partition, client count, model and seed, so
  the parts are disjoint and the models match.
- **Restarts.** With `--state-dir` the process keeps there the number of updates it pushed and
  the update it is pushing (its job, delta and id) until the server answered it. A restarted
  process pushes that update again under the same id (the server applies it at most once), then
  goes on numbering its updates where it stopped.
- **The server away.** Each call retries an unreachable server with exponential backoff
  (`aggsrv.client.Client`). The loop waits and reconnects until `--give-up-after` seconds pass
  without an answer.
- **Ending.** After `--updates` accepted updates, when the server's privacy budget is spent, or
  on SIGTERM/SIGINT (after the push in flight, never in the middle of one). Exit 0; 2 for bad
  options or a refused connection (TLS, token); 3 when the server stayed away.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from aggsrv.client.client import Client, ClientJob
from aggsrv.values import Recipe, Status, UpdateKind

__all__ = ["ClientOptions", "run_client"]

log = logging.getLogger("aggsrv.client_command")

STATE_FILE = "client.json"
PENDING_FILE = "pending.pt"
# A refused call that no retry mends: a wrong token, a certificate the client does not trust.
FATAL = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


@dataclass
class ClientOptions:
    """What `aggsrv client` takes (its options, one for one)."""

    server: str
    client_id: str
    token: str | None = None
    token_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    data: str = "digits"
    data_dir: str | None = None
    partition: str = "iid"
    clients: int = 1
    index: int = 0
    model: str = "mlp"
    seed: int = 0
    state_dir: str | None = None
    # Stop once this many updates were accepted in all, those before a restart included (None:
    # run on).
    updates: int | None = None
    poll_seconds: float = 5.0  # how long one wait for a job lasts before it is asked again
    give_up_after: float = 300.0  # seconds without an answer from the server


class _Stop:
    """Set by SIGTERM/SIGINT (or the caller): the loop ends after the push in flight."""

    def __init__(self, event: threading.Event | None) -> None:
        self.event = event or threading.Event()

    def __call__(self) -> bool:
        return self.event.is_set()


def _check(opts: ClientOptions) -> None:
    if not 0 <= opts.index < opts.clients:
        raise ValueError(f"--index must be in [0, {opts.clients}), got {opts.index}")
    if opts.updates is not None and opts.updates < 1:
        raise ValueError(f"--updates must be >= 1, got {opts.updates}")
    if opts.poll_seconds <= 0 or opts.give_up_after <= 0:
        raise ValueError("--poll-seconds and --give-up-after must be > 0")


def _trainer(opts: ClientOptions) -> Any:
    """The simulator's set-up of this client's data and model (the same split in every
    client of the federation)."""
    from aggsrv.sim.config import SimConfig
    from aggsrv.sim.setup import prepare

    config = SimConfig.from_mapping({
        "dataset": opts.data, "data_dir": opts.data_dir, "partition": opts.partition,
        "clients": opts.clients, "model": opts.model, "seed": opts.seed, "profile": "none",
    })  # fmt: skip
    return prepare(config)


class _State:
    """The updates pushed and the one in flight, kept in ``--state-dir`` (or in memory)."""

    def __init__(self, directory: str | None, client_id: str) -> None:
        self.dir = Path(directory) if directory else None
        self.pushed = 0
        self.accepted = 0
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.dir / STATE_FILE
            if path.exists():
                saved = json.loads(path.read_text())
                if saved.get("client_id") != client_id:
                    raise ValueError(
                        f"{path} belongs to client {saved.get('client_id')!r}, not "
                        f"{client_id!r}: give each client its own --state-dir"
                    )
                self.pushed = int(saved["pushed"])
                self.accepted = int(saved.get("accepted", 0))
        self.client_id = client_id

    def update_id(self) -> str:
        return f"{self.client_id}-{self.pushed}"

    def save(self) -> None:
        if self.dir is None:
            return
        path = self.dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        state = {"client_id": self.client_id, "pushed": self.pushed, "accepted": self.accepted}
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)

    def keep_pending(self, job: ClientJob, push: dict[str, Any]) -> None:
        """The update about to be pushed, so that a restart pushes it again under its id."""
        if self.dir is None:
            return
        record = {
            "job": {"job_id": job.job_id, "base_version": job.base_version,
                    "deadline": job.deadline, "recipe": job.recipe.to_dict(),
                    "tensors": dict(job.tensors)},
            "push": push,
        }  # fmt: skip
        tmp = self.dir / (PENDING_FILE + ".tmp")
        torch.save(record, tmp)
        os.replace(tmp, self.dir / PENDING_FILE)

    def pending(self) -> tuple[ClientJob, dict[str, Any]] | None:
        path = None if self.dir is None else self.dir / PENDING_FILE
        if path is None or not path.exists():
            return None
        record = torch.load(path, weights_only=False)
        j = record["job"]
        job = ClientJob(j["job_id"], j["base_version"], j["deadline"],
                        Recipe.from_dict(j["recipe"]), j["tensors"])  # fmt: skip
        return job, record["push"]

    def done_pending(self, accepted: bool) -> None:
        self.pushed += 1
        self.accepted += accepted
        self.save()
        if self.dir is not None:
            (self.dir / PENDING_FILE).unlink(missing_ok=True)


class _Heartbeats:
    """Heartbeats for the job being trained, every third of the server's lease."""

    def __init__(self, client: Client, job_id: str, every: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(client, job_id, every), name="aggsrv-heartbeat", daemon=True
        )

    def _run(self, client: Client, job_id: str, every: float) -> None:
        while not self._stop.wait(every):
            try:
                client.heartbeat(job_id)
            except grpc.RpcError as exc:  # the push will tell; training goes on
                log.debug("heartbeat failed: %s", exc.code().name)

    def __enter__(self) -> _Heartbeats:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _push(client: Client, job: ClientJob, push: dict[str, Any]) -> Any:
    return client.push(
        job, push["delta"], kind=UpdateKind.DELTA, num_samples=push["num_samples"],
        steps=push["steps"], epochs=push["epochs"], complete=push["complete"],
        update_id=push["update_id"], buffers=push["buffers"],
    )  # fmt: skip


def _lease_seconds(client: Client) -> float:
    limits = client.status().limits
    seconds = limits.lease.seconds + limits.lease.nanos / 1e9
    return seconds if seconds > 0 else 60.0


def _serve_jobs(opts: ClientOptions, client: Client, setup: Any, state: _State, stop: _Stop):
    """The loop: a pending push first, then job, train, push, until a budget or a stop."""
    trainer = setup.trainer()
    samples = trainer.num_samples(opts.index)
    beat = max(1.0, _lease_seconds(client) / 3)
    waited_since: float | None = None
    pending = state.pending()
    if pending is not None:
        job, push = pending
        log.info("pushing again update %s, in flight when the client stopped", push["update_id"])
        result = _push(client, job, push)
        state.done_pending(result.status in (Status.APPLIED, Status.BUFFERED)
                           or result.original in (Status.APPLIED, Status.BUFFERED))  # fmt: skip
    while not stop() and (opts.updates is None or state.accepted < opts.updates):
        try:
            job = client.get_job(timeout=opts.poll_seconds)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                continue  # no job yet: ask again (and look at the stop flag)
            if code == grpc.StatusCode.FAILED_PRECONDITION and "budget" in (exc.details() or ""):
                log.info("the server's privacy budget is spent: no more jobs")
                return 0
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                waited_since = waited_since or time.monotonic()
                if time.monotonic() - waited_since > opts.give_up_after:
                    log.error("the server stayed away for %.0f s: giving up", opts.give_up_after)
                    return 3
                time.sleep(min(5.0, opts.poll_seconds))
                continue
            raise
        waited_since = None
        with _Heartbeats(client, job.job_id, beat):
            result = trainer.run(opts.index, state.pushed, job.weights, job.recipe,
                                 basis=job.tensors.get("basis"), buffers=job.buffers)  # fmt: skip
        push = {"delta": result.delta, "buffers": result.buffers, "num_samples": samples,
                "steps": result.steps, "epochs": result.epochs, "complete": result.complete,
                "update_id": state.update_id()}  # fmt: skip
        state.keep_pending(job, push)
        answer = _push(client, job, push)
        accepted = answer.status in (Status.APPLIED, Status.BUFFERED)
        state.done_pending(accepted)
        log.info("update %s: %s (version %d)", push["update_id"], answer.status.name,
                 answer.version)  # fmt: skip
    return 0


def run_client(opts: ClientOptions, stop_event: threading.Event | None = None) -> int:
    """Run the client until its budget, a stop or a failure; the process's exit code."""
    _check(opts)
    stop = _Stop(stop_event)
    state = _State(opts.state_dir, opts.client_id)
    setup = _trainer(opts)
    client = Client(
        opts.server, opts.client_id, token=opts.token, token_file=opts.token_file,
        tls_ca=opts.tls_ca, tls_cert=opts.tls_cert, tls_key=opts.tls_key, timeout=60.0,
    )  # fmt: skip
    try:
        since = time.monotonic()
        while True:
            try:
                client.register(
                    layout=setup.layout, initial=setup.initial,
                    initial_buffers=setup.initial_buffers,
                )  # fmt: skip
                break
            except grpc.RpcError as exc:
                away = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                if away and time.monotonic() - since < opts.give_up_after and not stop():
                    time.sleep(min(5.0, opts.poll_seconds))
                    continue
                log.error("cannot register with %s: %s: %s", opts.server, exc.code().name,
                          exc.details())  # fmt: skip
                return 3 if away else 2
        try:
            return _serve_jobs(opts, client, setup, state, stop)
        except grpc.RpcError as exc:
            log.error("the server refused a call: %s: %s", exc.code().name, exc.details())
            return 2 if exc.code() in FATAL else 1
    finally:
        client.close()


def install_signal_handlers(event: threading.Event) -> None:
    """SIGTERM and SIGINT end the loop after the push in flight."""

    def handler(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping after the update in flight", signum)
        event.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
