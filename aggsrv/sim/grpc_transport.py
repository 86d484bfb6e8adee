"""The `grpc` transport: a real `aggsrv serve` process and real clients on loopback.

Every simulated client is a thread with its own :class:`aggsrv.client.Client` (its own channel)
and its own model copy, running the same local training as `inproc` (an attacker's trainer
crafts what it then pushes through the same client library); the profile's virtual durations
become wall time through ``time_scale`` (wall seconds per virtual second): a client fetches a job,
trains, sleeps until its update is due, and pushes it. Virtual time is wall time since the start
divided by ``time_scale``. This transport proves the service end to end; it is not
deterministic (thread scheduling decides arrival order at equal times).

A run in which no update is accepted any more ends as stalled after the same count of arrivals
in a row as on `inproc` (``STALL_ARRIVALS``, ``STALL_ROUNDS`` per client): the clients stop, the
model is evaluated once more, and the summary says ``stalled``.

Strategy settings measured in seconds (FedAvg's ``round_timeout``) are virtual seconds in the
config and are scaled to the server's wall clock here.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggsrv.client import Client
from aggsrv.server.auth import (
    ADMIN_SUBJECT,
    ROLE_ADMIN,
    ROLE_CLIENT,
    issue_token,
    load_secret,
    new_secret,
    save_secret,
)
from aggsrv.server.config import ServerConfig
from aggsrv.sim.inproc import STALL_ARRIVALS, STALL_ROUNDS, Counters, is_round_based
from aggsrv.sim.progress import Progress
from aggsrv.sim.setup import RunSetup, client_id
from aggsrv.strategies import Status, UpdateKind

__all__ = ["GrpcRun"]

log = logging.getLogger(__name__)

TIME_KEYS = ("round_timeout", "epoch_timeout", "grouping_round_timeout")  # virtual seconds
JOB_POLL = 1.0  # wall seconds a client waits on GetJob before checking whether the run ended


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TurnedDownRow:
    """The updates turned down (refused, filtered) since the last accepted one, in the server's
    order, from answers noted in the order the client threads get to them: a thread that got
    an accepted answer may note it after another thread noted a later answer.

    An answer carries the model version it was given at; an accepted one names the version it
    made (applied) or found (buffered). So an accepted answer ends the row of the answers with
    an older version only, and an answer older than an accepted one already noted never joins
    the row. Answers at a buffered update's own version may have come before or after it and
    stay in the row. A refusal by error names no version: it joins the row, and any accepted
    answer ends it (the caller holds a lock)."""

    def __init__(self) -> None:
        self._versions: list[int | None] = []  # of the answers in the row
        self._accepted = -1  # the newest version an accepted answer was given at

    def note(self, accepted: bool, version: int | None) -> int:
        """Note one answer; the length of the row after it."""
        if accepted:
            if version is None:
                raise ValueError("an accepted answer names its version")
            self._accepted = max(self._accepted, version)
            self._versions = [v for v in self._versions if v is not None and v >= self._accepted]
        elif version is None or version >= self._accepted:
            self._versions.append(version)
        return len(self._versions)


class GrpcRun:
    """One simulation over gRPC; :meth:`run` returns the metric rows."""

    def __init__(
        self, setup: RunSetup, on_metric, progress: Progress | None, out_dir: Path
    ) -> None:
        cfg = setup.config
        self.setup = setup
        self.cfg = cfg
        self.n = cfg.clients
        self.scale = cfg.time_scale
        self.profile = setup.profile
        self.on_metric = on_metric
        self.progress = progress
        self.out_dir = Path(out_dir)
        self.budget = cfg.budget_spec()
        self.every = cfg.eval_spec()
        self.counters = Counters()
        self.metrics: list[dict[str, Any]] = []
        self.lag_seconds = 0.0  # virtual time clients ran behind their profile (slow training)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self.stalled = False
        self._stall_after = max(STALL_ARRIVALS, STALL_ROUNDS * self.n)
        self._row = TurnedDownRow()  # all clients' answers
        settings = cfg.strategy_settings
        self.round_based = is_round_based(settings)
        self._private = getattr(settings, "private", False)  # the dp_ keys
        self._privacy: dict[str, Any] | None = None
        self.privacy_spent = False
        self.t0 = 0.0
        self.wall0 = time.perf_counter()

    # ------------------------------------------------------------------ clock

    def vnow(self) -> float:
        return (time.monotonic() - self.t0) / self.scale

    def _sleep_until_virtual(self, vt: float) -> bool:
        """Sleep until virtual time ``vt``; False if the run ended meanwhile."""
        delay = (vt - self.vnow()) * self.scale
        return not self._stop.wait(max(0.0, delay))

    # ------------------------------------------------------------------ server process

    def _server_config(self, port: int) -> ServerConfig:
        strategy_config = self.cfg.effective_strategy_config()
        for key in TIME_KEYS:
            if strategy_config.get(key) is not None:
                strategy_config[key] = strategy_config[key] * self.scale
        return ServerConfig(
            host="127.0.0.1",
            port=port,
            strategy=self.cfg.strategy,
            strategy_config=strategy_config,
            device="cpu",
            max_clients=self.n + 1,
            max_concurrent_uploads=4,
            lease_seconds=3600.0,
            pending_interval_seconds=JOB_POLL,
            events_file=str(self.out_dir / "events.jsonl"),
            trace=str(self.out_dir / "trace.jsonl"),
            # The simulator issues its clients' tokens from a secret of its own; an experiment
            # needs no crash recovery, so no state directory.
            auth="hmac",
            auth_secret_file=str(self._secret_path()),
            durability="off",
            state_dir="",
            rate_limit_per_second=0.0,
        )

    def _secret_path(self) -> Path:
        path = self.out_dir / "auth-secret"
        if not path.exists():
            save_secret(path, new_secret())
        return path

    def _token(self, subject: str, role: str = ROLE_CLIENT) -> str:
        return issue_token(load_secret(self._secret_path()), subject, role=role)

    def _start_server(self) -> tuple[subprocess.Popen, str]:
        port = _free_port()
        path = self.out_dir / "server.toml"
        path.write_text(self._server_config(port).to_toml())
        log_file = open(self.out_dir / "server.log", "w")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen(
            [sys.executable, "-m", "aggsrv.cli", "serve", "--config", str(path)],
            stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log_file.close()
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"aggsrv serve exited with {proc.returncode}; see {self.out_dir}/server.log"
                    )
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return proc, address
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"aggsrv serve did not start; see {self.out_dir}/server.log")
                time.sleep(0.05)

    # ------------------------------------------------------------------ clients

    def _client_loop(self, c: int, client: Client) -> None:
        trainer = self.setup.trainer()  # its own model copy: clients train concurrently
        samples = trainer.num_samples(c)
        attacker = self.setup.attack is not None and self.setup.attack.is_attacker(c)
        rounds = sent = 0
        try:
            while not self._stop.is_set():
                vt = self.vnow()
                if not self.profile.online(c, vt, sent):
                    back = self.profile.next_change(c, vt, sent)
                    if back is None:
                        return  # gone for good
                    self._sleep_until_virtual(back)
                    continue
                try:
                    job = client.get_job(timeout=JOB_POLL * 5)
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        continue  # no job yet; check whether the run ended
                    spent = "privacy budget" in (exc.details() or "")
                    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and spent:
                        self._end_for_privacy()
                        return
                    raise
                started = self.vnow()
                plan = self.profile.plan(c, rounds)
                t_train = time.perf_counter()
                result = trainer.run(c, rounds, job.weights, job.recipe, plan.work_fraction,
                                     basis=job.tensors.get("basis"),
                                     buffers=job.buffers)  # fmt: skip
                with self._lock:
                    self.counters.train_seconds += time.perf_counter() - t_train
                rounds += 1
                due = started + plan.duration
                late = self.vnow() - due
                if late > 0:
                    with self._lock:
                        self.lag_seconds += late
                if not self._sleep_until_virtual(due):
                    return
                away = self.profile.next_change(c, started, sent)
                if (away is not None and away <= self.vnow()) or not self.profile.online(
                    c, self.vnow(), sent
                ):
                    with self._lock:
                        self.counters.lost += 1
                    continue
                try:
                    res = client.push(
                        job,
                        result.delta,
                        kind=UpdateKind.DELTA,
                        num_samples=samples,
                        steps=result.steps,
                        epochs=result.epochs,
                        complete=result.complete,
                        update_id=f"{client_id(c)}-{rounds - 1}",
                        buffers=result.buffers,
                    )
                    ok = res.status in (Status.APPLIED, Status.BUFFERED)
                    version: int | None = res.version
                    with self._lock:
                        self.counters.applied += ok
                        self.counters.filtered += res.status is Status.FILTERED
                        received = ok or res.status is Status.FILTERED  # as inproc counts
                        # What crossed the wire: compressed bytes when the client compresses.
                        self.counters.bytes_received += res.payload_bytes if received else 0
                except grpc.RpcError as exc:
                    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                        if self._stop.is_set():
                            return
                        raise
                    ok = False
                    version = None
                    with self._lock:
                        self.counters.rejected += 1
                        name = exc.code().name
                        self.counters.rejected_by[name] = self.counters.rejected_by.get(name, 0) + 1
                if attacker:
                    with self._lock:
                        self.counters.count_crafted(client_id(c), ok)
                sent += 1
                self._note_arrival(ok, version)
        except BaseException as exc:  # noqa: BLE001 - reported by run()
            if not self._stop.is_set():
                self._errors.append(exc)
                self._stop.set()

    def privacy_now(self) -> dict[str, Any] | None:
        """Differential privacy's spending at the last evaluation (None without DP)."""
        return self._privacy

    def _end_for_privacy(self) -> None:
        """The server spent its privacy budget (dp_target_epsilon): the run ends."""
        with self._lock:
            if self.privacy_spent:
                return
            self.privacy_spent = True
        log.info("the privacy budget is spent at virtual time %.3f: the run ends", self.vnow())
        self._stop.set()

    def _note_arrival(self, accepted: bool, version: int | None) -> None:
        """Count an update the server answered with model ``version`` (None: refused with an
        error); stop the run as stalled once ``max(STALL_ARRIVALS, STALL_ROUNDS * clients)`` in
        a row were not accepted (refused, filtered): a budget in rounds or versions counts
        accepted updates, so it is never reached then (a diverged model whose updates overflow,
        a bound no update meets).

        "In a row" is the server's order (:class:`TurnedDownRow`)."""
        with self._lock:
            if self._row.note(accepted, version) < self._stall_after or self.stalled:
                return
            self.stalled = True
        log.warning(
            "the run stalled at virtual time %.3f: every update of the last %d arrivals was "
            "refused or filtered",
            self.vnow(), self._stall_after,
        )  # fmt: skip
        self._stop.set()

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self, evaluator, observer: Client) -> dict[str, Any]:
        version, weights, buffers = observer.get_model(include_buffers=True)
        vt = self.vnow()
        t0 = time.perf_counter()
        acc, loss = evaluator(weights, buffers)
        self.counters.eval_seconds += time.perf_counter() - t0
        epsilon = None
        if self._private:
            status = observer.status()
            if status.HasField("privacy"):
                self._privacy = _privacy_of(status.privacy)
                epsilon = self._privacy["epsilon"]
        with self._lock:
            row = self.counters.metric_row(
                version, round(vt, 6), time.perf_counter() - self.wall0, acc, loss,
                self._rounds_done(version), epsilon,
            )  # fmt: skip
        self.metrics.append(row)
        self.on_metric(row)
        if self.progress is not None:
            self.progress.update(self._position(self.budget.unit, version), row)
        return row

    def _rounds_done(self, version: int) -> float:
        return float(version) if self.round_based else self.counters.applied / self.n

    def _position(self, unit: str, version: int) -> float:
        if unit == "seconds":
            return self.vnow()
        if unit == "versions":
            return float(version)
        return self._rounds_done(version)

    # ------------------------------------------------------------------ main

    def run(self) -> list[dict[str, Any]]:
        proc, address = self._start_server()
        clients: list[Client] = []
        threads: list[threading.Thread] = []
        observer = Client(
            address, "aggsrv-sim-observer", token=self._token(ADMIN_SUBJECT, ROLE_ADMIN)
        )
        evaluator = self.setup.evaluator()
        try:
            for c in range(self.n):
                client = Client(
                    address, client_id(c), timeout=120, token=self._token(client_id(c)),
                    compression=self.setup.config.compression_spec(),
                )  # fmt: skip
                clients.append(client)
                if c == 0:
                    resp = client.register(
                        layout=self.setup.layout,
                        initial=self.setup.initial,
                        initial_buffers=self.setup.initial_buffers,
                    )
                    if not resp.initial_model_adopted:
                        raise RuntimeError("the fresh server did not adopt the initial model")
                else:
                    client.register(layout=self.setup.layout)
            self.t0 = time.monotonic()
            for c, client in enumerate(clients):
                t = threading.Thread(
                    target=self._client_loop, args=(c, client), name=f"sim-{client_id(c)}",
                    daemon=True,
                )  # fmt: skip
                t.start()
                threads.append(t)
            self._drive_evaluations(evaluator, observer)
            if self.stalled or self.privacy_spent:  # stopped early: the model it ended with
                self._evaluate(evaluator, observer)
        finally:
            self._stop.set()
            for t in threads:
                t.join(timeout=JOB_POLL * 10)
            for client in clients:
                client.close()
            observer.close()
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._errors:
            raise RuntimeError(f"a simulated client failed: {self._errors[0]!r}") from self._errors[
                0
            ]
        if self.lag_seconds > 0:
            log.info(
                "clients ran %.1f virtual seconds behind their profile in all (training slower "
                "than time_scale allows); raise time_scale for a faithful timeline",
                self.lag_seconds,
            )
        return self.metrics

    def _drive_evaluations(self, evaluator, observer: Client) -> None:
        budget, every = self.budget, self.every
        if budget.unit == "seconds" and every.unit == "seconds":
            k = 0
            while True:
                at = min(k * every.amount, budget.amount)
                if not self._sleep_until_virtual(at):
                    break
                self._evaluate(evaluator, observer)
                if at >= budget.amount:
                    return
                k += 1
            return
        # Counted budgets or evaluation intervals: poll the server's version.
        next_eval = 0.0
        while not self._stop.is_set():
            status = observer.status()
            version = int(status.version)
            pos_e = self._position(every.unit, version)
            if pos_e >= next_eval:
                self._evaluate(evaluator, observer)
                next_eval += every.amount
            if self._position(budget.unit, version) >= budget.amount:
                self._evaluate(evaluator, observer)
                return
            time.sleep(0.02)


def _privacy_of(p) -> dict[str, Any]:
    """A PrivacyStatus as the summary's dict (the inproc transport's snapshot)."""
    return {
        "epsilon": p.epsilon,
        "delta": p.delta,
        "clip_norm": p.clip_norm,
        "noise_multiplier": p.noise_multiplier,
        "releases": p.releases,
        "target_epsilon": p.target_epsilon if p.HasField("target_epsilon") else None,
        "budget_spent": p.budget_spent,
        "updates_clipped": p.updates_clipped,
    }
