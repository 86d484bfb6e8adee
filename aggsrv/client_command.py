"""`aggsrv client`: a real client process. It registers, then repeats: wait for a job, train
it by the job's recipe (`aggsrv.client.train`) on its part of a data set, push the update. While
it trains it sends heartbeats, so the server counts it as active (the job's own lease runs from
its issue, `job_lease_seconds`, whatever the heartbeats).

- **Data and model** are the simulator's (`aggsrv.sim`): a built-in data set or
  `module:callable` returning an `aggsrv.data.Dataset`, split by `--partition` among `--clients`,
  of which this process trains part `--index`; a built-in model or `module:callable`. Every
  client of a federation gives the same data set, partition, client count, model and seed, so
  the parts are disjoint and the models match.
- **Restarts.** Update ids are a run id (random, kept in `--state-dir`) and a count. With
  `--state-dir` the process keeps there the count and the update it is pushing (its job, delta
  and id) until the server answered it. A restarted process pushes that update again under the
  same id (the server applies it at most once), then goes on counting. Without `--state-dir`
  every start is a new run: nothing it sends is taken for an earlier run's update.
- **Refusals.** An update the server refuses (its job superseded or expired, too stale, not
  finite, too large) is logged and dropped, and the client goes on to its next job.
- **The server away.** Each call retries an unreachable server with exponential backoff
  (`aggsrv.client.Client`); registering, waiting for a job and pushing go on retrying until
  `--give-up-after` seconds pass without an answer.
- **Ending.** After `--updates` accepted updates, when the server's privacy budget is spent, or
  on SIGTERM/SIGINT (after the push in flight, never in the middle of one; while it waits for a
  job, at the server's next pending message, at least every 30 s). Exit 0; 2 for bad options or
  a token the server refuses; 3 when the server stayed away (a server whose certificate the
  client does not trust looks away: the TLS handshake fails); 1 for anything else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
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
    # The longest one GetJob call lasts, the wait and the job's download together (then it is
    # asked again): longer than a model's download on the slowest link.
    job_wait_seconds: float = 300.0
    give_up_after: float = 300.0  # seconds without an answer from the server
    retry_seconds: float = 2.0  # between tries while the server is away


class _Stopped(Exception):
    """The stop flag was seen while waiting for a job."""


def _check(opts: ClientOptions) -> None:
    if not 0 <= opts.index < opts.clients:
        raise ValueError(f"--index must be in [0, {opts.clients}), got {opts.index}")
    if opts.updates is not None and opts.updates < 1:
        raise ValueError(f"--updates must be >= 1, got {opts.updates}")
    if min(opts.job_wait_seconds, opts.give_up_after, opts.retry_seconds) <= 0:
        raise ValueError("--job-wait-seconds and --give-up-after must be > 0")


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


def _write_durably(path: Path, write: Any) -> None:
    """``write(tmp)`` then fsync and rename over ``path`` and fsync the folder: a crash leaves
    the old file or the new one, whole."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


class _State:
    """The run id, the updates pushed and the one in flight, kept in ``--state-dir`` (or, without
    one, for this process only)."""

    def __init__(self, directory: str | None, client_id: str) -> None:
        self.dir = Path(directory) if directory else None
        self.client_id = client_id
        self.run = uuid.uuid4().hex[:16]
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
                self.run = str(saved["run"])
                self.pushed = int(saved["pushed"])
                self.accepted = int(saved.get("accepted", 0))
            self.save()

    def update_id(self) -> str:
        """The id of the next update: this run's and its number (ids the server keeps per
        client, so the client id need not be in it)."""
        return f"{self.run}-{self.pushed}"

    def save(self) -> None:
        if self.dir is None:
            return
        state = {"client_id": self.client_id, "run": self.run, "pushed": self.pushed,
                 "accepted": self.accepted}  # fmt: skip
        _write_durably(self.dir / STATE_FILE, lambda tmp: tmp.write_text(json.dumps(state)))

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
        _write_durably(self.dir / PENDING_FILE, lambda tmp: torch.save(record, tmp))

    def pending(self) -> tuple[ClientJob, dict[str, Any]] | None:
        """The update in flight when the process stopped, if it is still the next one: a record
        whose update the count already passed (a stop between the two writes) is dropped, and
        so is one that cannot be read (it was never pushed whole)."""
        path = None if self.dir is None else self.dir / PENDING_FILE
        if path is None or not path.exists():
            return None
        try:
            record = torch.load(path, weights_only=True)
            j, push = record["job"], record["push"]
            job = ClientJob(j["job_id"], j["base_version"], j["deadline"],
                            Recipe.from_dict(j["recipe"]), j["tensors"])  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - any damage: the record is not usable
            log.warning("%s cannot be read (%s): dropping it", path, exc)
            path.unlink()
            return None
        if push["update_id"] != self.update_id():
            path.unlink()
            return None
        return job, push

    def done_pending(self, accepted: bool) -> None:
        self.pushed += 1
        self.accepted += accepted
        self.save()
        if self.dir is not None:
            (self.dir / PENDING_FILE).unlink(missing_ok=True)


class _Heartbeats:
    """Heartbeats while a job trains, every third of the server's client lease: the server then
    counts the client as active (the job's own lease runs from its issue regardless)."""

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


AWAY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class _Patience:
    """How long the server has been away, against ``--give-up-after``."""

    def __init__(self, opts: ClientOptions, stop: threading.Event) -> None:
        self.opts, self.stop = opts, stop
        self.since: float | None = None

    def answered(self) -> None:
        self.since = None

    def wait(self) -> bool:
        """The server is away: True after a pause to try again, False once it was away too long
        (or a stop came)."""
        now = time.monotonic()
        self.since = self.since if self.since is not None else now
        if now - self.since > self.opts.give_up_after:
            log.error("the server stayed away for %.0f s: giving up", self.opts.give_up_after)
            return False
        return not self.stop.wait(self.opts.retry_seconds)


def _push(client: Client, job: ClientJob, push: dict[str, Any], state: _State,
          patience: _Patience) -> int | None:  # fmt: skip
    """Push the update in flight until the server answers; an exit code to end with, or None to
    go on. A refused update is dropped (the next job is another chance)."""
    while True:
        try:
            answer = client.push(
                job, push["delta"], kind=UpdateKind.DELTA, num_samples=push["num_samples"],
                steps=push["steps"], epochs=push["epochs"], complete=push["complete"],
                update_id=push["update_id"], buffers=push["buffers"],
            )  # fmt: skip
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code in AWAY:
                if patience.wait():
                    continue
                return 0 if patience.stop.is_set() else 3  # the update stays in flight
            if code in FATAL:
                log.error("the server refused this client: %s: %s", code.name, details)
                return 2
            log.warning("update %s refused: %s: %s", push["update_id"], code.name, details)
            state.done_pending(False)
            if code == grpc.StatusCode.FAILED_PRECONDITION and "budget" in details:
                log.info("the server's privacy budget is spent: no more jobs")
                return 0
            return None
        patience.answered()
        taken = (Status.APPLIED, Status.BUFFERED)
        state.done_pending(answer.status in taken or answer.original in taken)
        log.info("update %s: %s (version %d)", push["update_id"], answer.status.name,
                 answer.version)  # fmt: skip
        return None


def _lease_seconds(client: Client) -> float:
    try:
        limits = client.status().limits
    except grpc.RpcError:
        return 60.0
    seconds = limits.lease.seconds + limits.lease.nanos / 1e9
    return seconds if seconds > 0 else 60.0


def _serve_jobs(opts: ClientOptions, client: Client, setup: Any, state: _State,
                stop: threading.Event) -> int:  # fmt: skip
    """The loop: a pending push first, then job, train, push, until a budget or a stop."""
    trainer = setup.trainer()
    samples = trainer.num_samples(opts.index)
    beat = max(1.0, _lease_seconds(client) / 3)
    patience = _Patience(opts, stop)
    pending = state.pending()
    if pending is not None:
        job, push = pending
        log.info("pushing again update %s, in flight when the client stopped", push["update_id"])
        code = _push(client, job, push, state, patience)
        if code is not None:
            return code

    def on_pending(_: Any) -> None:
        if stop.is_set():
            raise _Stopped

    while not stop.is_set() and (opts.updates is None or state.accepted < opts.updates):
        try:
            job = client.get_job(timeout=opts.job_wait_seconds, on_pending=on_pending)
        except _Stopped:
            break
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                continue  # no job within the wait: ask again
            if code == grpc.StatusCode.FAILED_PRECONDITION and "budget" in (exc.details() or ""):
                log.info("the server's privacy budget is spent: no more jobs")
                return 0
            if code in AWAY:
                if patience.wait():
                    continue
                return 0 if stop.is_set() else 3
            raise
        patience.answered()
        with _Heartbeats(client, job.job_id, beat):
            result = trainer.run(opts.index, state.pushed, job.weights, job.recipe,
                                 basis=job.tensors.get("basis"), buffers=job.buffers)  # fmt: skip
        push = {"delta": result.delta, "buffers": result.buffers, "num_samples": samples,
                "steps": result.steps, "epochs": result.epochs, "complete": result.complete,
                "update_id": state.update_id()}  # fmt: skip
        state.keep_pending(job, push)
        code = _push(client, job, push, state, patience)
        if code is not None:
            return code
    return 0


def run_client(opts: ClientOptions, stop_event: threading.Event | None = None) -> int:
    """Run the client until its budget, a stop or a failure; the process's exit code."""
    _check(opts)
    stop = stop_event or threading.Event()
    state = _State(opts.state_dir, opts.client_id)
    setup = _trainer(opts)
    client = Client(
        opts.server, opts.client_id, token=opts.token, token_file=opts.token_file,
        tls_ca=opts.tls_ca, tls_cert=opts.tls_cert, tls_key=opts.tls_key, timeout=60.0,
    )  # fmt: skip
    patience = _Patience(opts, stop)
    try:
        while True:
            try:
                client.register(
                    layout=setup.layout, initial=setup.initial,
                    initial_buffers=setup.initial_buffers,
                )  # fmt: skip
                break
            except grpc.RpcError as exc:
                if exc.code() in AWAY and patience.wait():
                    continue
                if stop.is_set():
                    return 0
                log.error("cannot register with %s: %s: %s", opts.server, exc.code().name,
                          exc.details())  # fmt: skip
                return 3 if exc.code() in AWAY else 2
        try:
            return _serve_jobs(opts, client, setup, state, stop)
        except grpc.RpcError as exc:
            log.error("the server refused a call: %s: %s", exc.code().name, exc.details())
            return 2 if exc.code() in FATAL else 1
    finally:
        client.close()


@contextlib.contextmanager
def signals_stop(event: threading.Event) -> Iterator[None]:
    """While inside: SIGTERM and SIGINT set ``event`` (the loop ends after the push in flight);
    the handlers before are put back at the end."""

    def handler(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping after the update in flight", signum)
        event.set()

    before = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, previous in before.items():
            signal.signal(sig, previous)
