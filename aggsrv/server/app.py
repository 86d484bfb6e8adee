"""Build and run the gRPC server: the Aggregation service, health checking and reflection, with
authentication, TLS, limits, checkpoints and the write-ahead log, metrics and evaluation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from aggsrv.fused_dots import warm_up as warm_up_fused_dots
from aggsrv.server import auth as A
from aggsrv.server import shard_recovery
from aggsrv.server.config import ServerConfig
from aggsrv.server.dashboard.status import status_document
from aggsrv.server.dashboard.web import DashboardServer
from aggsrv.server.evaluation import Evaluator, load_hook
from aggsrv.server.federation import Federation
from aggsrv.server.metrics import ServerMetrics
from aggsrv.server.persistence import StateStore
from aggsrv.server.service import AggregationService, add_to_server
from aggsrv.server.shards import ShardGroup, ShardLost
from aggsrv.v1 import aggregation_pb2

log = logging.getLogger(__name__)
SERVICE_NAME = aggregation_pb2.DESCRIPTOR.services_by_name["Aggregation"].full_name


class Server:
    """One running aggsrv server (started with :meth:`start`, stopped with :meth:`stop`)."""

    def __init__(self, config: ServerConfig, shards: ShardGroup | None = None) -> None:
        """``shards``: for a sharded config, a process group joined already (tests run several
        federations in one); None joins the one ``config.dist_url`` names."""
        self.config = config
        self._shards = shards
        self.metrics = ServerMetrics(shard=config.rank if config.shards > 1 else None)
        self.federation = Federation(config, metrics=self.metrics)
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.dashboard_port: int | None = None  # --dashboard-port, once bound
        self._dashboard: DashboardServer | None = None
        self.authenticator: A.Authenticator = A.NoAuth()
        self.admin_token: str | None = None  # hmac mode: the token printed at start
        self.secret_path: Path | None = None
        self.stop_requested = asyncio.Event()
        self.stop_grace = 5.0
        self._grpc: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._evaluator: Evaluator | None = None
        self._ticker: asyncio.Task | None = None
        self._keep_alive: asyncio.Task | None = None
        self._follower: threading.Thread | None = None  # a shard of rank >= 1's aggregation
        self._healing: asyncio.Task | None = None  # rejoining after a lost shard

    async def start(self) -> int:
        """Bind, start serving and return the port (the chosen one when the config says 0)."""
        cfg = self.config
        fed = self.federation
        fed.fail_stop.loop = asyncio.get_running_loop()
        self.authenticator = self._make_authenticator()
        await self._open_state()
        if cfg.shards > 1:
            # Blocks until every shard has joined (up to shard_timeout_seconds).
            fed.shards = self._shards or ShardGroup.connect(cfg)
        if cfg.eval:
            self._evaluator = Evaluator(
                self.federation, load_hook(cfg.eval), cfg.eval_every_versions
            )
        limit = cfg.max_receive_message_bytes
        self._grpc = grpc.aio.server(
            # Beyond this many calls at once gRPC answers RESOURCE_EXHAUSTED itself.
            maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                # Uploads waiting for a staging slot are not read, but gRPC buffers up to each
                # stream's flow-control window for them. BDP probing grows the windows to
                # megabytes on a fast link (64 waiting 16 MB uploads held ~0.8 GB more), so the
                # window is fixed instead: stream_window_bytes, large enough for full speed on
                # loopback (bench/README.md "Ingest").
                ("grpc.http2.bdp_probe", 0),
                ("grpc.http2.lookahead_bytes", cfg.stream_window_bytes),
                ("grpc.max_concurrent_streams", cfg.max_streams_per_connection),
            ],
        )
        service = AggregationService(
            self.federation, self.authenticator, on_shutdown=self.request_stop
        )
        add_to_server(service, self._grpc)
        self._close_service = service.close  # rank 0's channels to the other shards
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            self._grpc,
        )  # fmt: skip
        address = f"{cfg.host}:{cfg.port}"
        credentials = tls_credentials(cfg)
        if credentials is None:
            self.port = self._grpc.add_insecure_port(address)
        else:
            self.port = self._grpc.add_secure_port(address, credentials)
        if self.port == 0:
            raise RuntimeError(f"could not bind {cfg.host}:{cfg.port}")
        if fed.shards is not None:
            self._join_shards()
        if cfg.model_init and fed.strategy is None and not fed.follower:
            self._load_initial_model(cfg.model_init)
        fed.open_trace()
        await asyncio.get_running_loop().run_in_executor(None, warm_up_fused_dots)
        self._watch_metrics()
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(cfg.metrics_host, cfg.metrics_port)
        if cfg.dashboard_port is not None:
            self._dashboard = DashboardServer(
                cfg.dashboard_host,
                cfg.dashboard_port,
                lambda: status_document(fed, service.shard_watch),
                allowed_hosts=cfg.dashboard_allowed_hosts,
            )
            self.dashboard_port = self._dashboard.port
        if fed.shards is None:
            fed.fail_stop.on_failure = lambda reason: self.request_stop(1.0)
        else:
            # The surviving shards stay up, refusing writes (UNAVAILABLE, with the reason) and
            # answering reads, until an operator restarts the federation.
            fed.fail_stop.on_failure = self._shard_failed
        await self._grpc.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        await self._health.set("", serving)
        await self._health.set(SERVICE_NAME, serving)
        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        if fed.shards is not None and fed.shards.is_coordinator:
            self._keep_alive = asyncio.get_running_loop().create_task(
                fed.replication.keep_alive(fed.call)
            )
        log.info(
            "aggsrv listening on %s:%d (%s, auth %s, durability %s, strategy %s, device %s, %s)",
            cfg.host, self.port, "TLS" if credentials else "plaintext", self.authenticator.mode,
            "on" if fed.store is not None and fed.store.durable else "off", cfg.strategy,
            fed.device,
            f"version {fed.version}" if fed.strategy else "waiting for the first client's model",
        )  # fmt: skip
        if getattr(cfg.strategy_settings, "dp_seed", None) is not None:
            log.warning(
                "differential privacy with a fixed dp_seed (dp_insecure_seed): the noise can be "
                "recomputed from the seed, so the published models carry NO privacy guarantee"
            )
        if credentials is None and self.authenticator.mode != "none":
            log.warning(
                "tokens travel in plaintext: use --tls-cert and --tls-key outside a trusted network"
            )
        return self.port

    # ------------------------------------------------------------------ setup

    def _join_shards(self) -> None:
        """Meet the other shards (:meth:`_meet`) and start following rank 0's calls (shards of
        rank >= 1)."""
        fed = self.federation
        shards = fed.shards
        assert shards is not None
        self._meet()
        # A lost shard rejoins by itself when every shard can reload from its state directory.
        fed.fail_stop.heals = fed.store is not None and shards.rendezvous is not None
        self._follow()

    def _follow(self) -> None:
        fed = self.federation
        if fed.follower:
            fed.shard_follower.on_coordinator_stop = lambda: self.request_stop(1.0)
            self._follower = threading.Thread(
                target=fed.shard_follower.follow, name="aggregation", daemon=True
            )
            self._follower.start()

    def _meet(self) -> None:
        """Tell the other shards where this one answers, check they serve the same strategy and
        keep the same state, and recover with them from the state directories (the same
        collectives, in the same order, at a start and when the group formed again)."""
        cfg = self.config
        fed = self.federation
        shards = fed.shards
        assert shards is not None and self.port is not None
        address = cfg.shard_address or f"{_reachable_host(cfg.host)}:{self.port}"
        shards.exchange_addresses(address)
        settings = json.dumps([cfg.strategy, cfg.strategy_config, cfg.max_clients], sort_keys=True)
        shards.agree(settings, "strategy settings (strategy, strategy_config, max_clients)")
        kept = json.dumps([bool(cfg.state_dir), cfg.durability])
        shards.agree(kept, "state settings (a state_dir or '', durability)")
        if fed.store is not None:
            # Every shard at rank 0's state: those behind recover alone (docs/sharding.md).
            fed.aggregation.on_aggregation_thread(shard_recovery.sync, fed, fed.store)
        log.info(
            "shard %d of %d at %s; shards: %s", shards.rank, shards.world_size, address,
            ", ".join(shards.addresses),
        )  # fmt: skip

    async def _heal(self) -> None:
        """A shard was lost (docs/sharding.md "Crashes and recovery"): leave the broken group,
        wait until every shard is back in a new one (the lost one restarted with --resume),
        reload this shard's state from its state directory with the others, as a restart
        does, and take writes again. Reads answer all the while."""
        fed = self.federation
        shards = fed.shards
        assert shards is not None
        loop = asyncio.get_running_loop()
        if self._keep_alive is not None:
            self._keep_alive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keep_alive
        done: asyncio.Future[BaseException | None] = loop.create_future()

        def meet_again() -> None:
            error: BaseException | None = None
            try:
                if self._follower is not None:
                    self._follower.join()  # it returns on the loss
                shards.reform(self.stop_requested.is_set)
                self._meet()
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop
                error = exc
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(error))

        # A daemon thread: a stop while the group waits for the lost shard does not wait for it.
        threading.Thread(target=meet_again, name="shard-rejoin", daemon=True).start()
        error = await done
        if self.stop_requested.is_set():
            return
        if error is not None:
            log.critical("shard %d could not rejoin the federation: %s", shards.rank, error)
            fed.fail_stop.heals = False
            self.request_stop(1.0)
            return
        fed.closing = False
        fed.fail_stop.healed()
        self._follow()
        if shards.is_coordinator:
            self._keep_alive = loop.create_task(fed.replication.keep_alive(fed.call))
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        fed.publication.notify()
        log.warning("shard %d: the federation is whole again at version %d; taking writes",
                    shards.rank, fed.version)  # fmt: skip

    def _shard_failed(self, reason: str) -> None:
        """(any thread: the aggregation thread notices a lost shard first)"""
        fed = self.federation
        loop = fed.fail_stop.loop
        assert loop is not None

        def on_loop() -> None:
            loop.create_task(
                self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
            )
            if fed.fail_stop.lost_shard and fed.fail_stop.heals:
                if self._healing is None or self._healing.done():
                    self._healing = loop.create_task(self._heal())
                return
            if fed.shards is not None and fed.shards.is_coordinator:
                # Leaving the group makes the other shards' pending collectives fail now rather
                # than at their timeout, so the whole federation stops taking writes at once.
                loop.create_task(self._leave_shards())

        loop.call_soon_threadsafe(on_loop)

    async def _leave_shards(self, announce: bool = False) -> None:
        """Leave the process group (rank 0 first tells the others to stop with it: they cannot
        take writes without it). The other shards may be gone already: nothing to report."""
        shards = self.federation.shards
        assert shards is not None

        def leave() -> None:
            if announce:
                with contextlib.suppress(ShardLost):
                    shards.announce("stop", {}, self.federation.replication.durable_seq)
            shards.close()

        loop = asyncio.get_running_loop()
        if self.federation.follower:
            # The aggregation thread may be blocked in a collective: leave from another one.
            await loop.run_in_executor(None, shards.close)
        else:
            with contextlib.suppress(Exception):
                await self.federation.call(leave, after_failure=True)

    def _make_authenticator(self) -> A.Authenticator:
        cfg = self.config
        if cfg.auth == "none":
            log.warning("authentication is off (--auth none): anyone who reaches the port can act")
            return A.NoAuth()
        if cfg.auth == "tokens":
            return A.TokensFileAuthenticator(cfg.tokens_file)
        path = Path(cfg.auth_secret_file or Path(cfg.state_dir) / "auth" / "secret")
        self.secret_path = path
        if path.exists():
            secret = A.load_secret(path)
        elif cfg.auth_secret_file:
            raise ValueError(f"auth_secret_file {path} does not exist (aggsrv token --new-secret)")
        else:
            secret = A.new_secret()
            A.save_secret(path, secret)
            log.warning(
                "no auth secret configured: generated one in %s (keep it private; "
                "issue client tokens with: aggsrv token --secret-file %s CLIENT_ID)",
                path, path,
            )  # fmt: skip
        authenticator = A.HmacAuthenticator(secret)
        self.admin_token = authenticator.issue(A.ADMIN_SUBJECT, A.ROLE_ADMIN)
        admin_file = path.parent / "admin.token"
        A.write_private_file(admin_file, self.admin_token + "\n")
        # The token is a password: logs are shipped and kept, so they only say where it is.
        log.warning(
            "admin token written to %s (mode 0600; for aggsrv status / checkpoint / shutdown "
            "--token-file)", admin_file,
        )  # fmt: skip
        show_admin_token(self.admin_token, admin_file)
        return authenticator

    async def _open_state(self) -> None:
        """Attach the state directory: resume from it, or refuse one an earlier run left."""
        cfg = self.config
        if not cfg.state_dir:
            log.warning(
                "no state_dir: nothing is written to disk (durability off, no checkpoints); a "
                "restart starts from scratch (--state-dir DIR keeps the run)"
            )
            return
        store = StateStore(cfg.state_dir, durable=cfg.durability == "on", keep=cfg.checkpoint_keep)
        fed = self.federation
        if store.has_state():
            if not cfg.resume:
                raise ValueError(
                    f"state_dir {cfg.state_dir} holds the checkpoints of an earlier run: pass "
                    "--resume to continue it, or choose an empty state_dir"
                )
            if cfg.shards == 1:  # the shards recover together, once they have met
                # Replayed where live aggregation runs (its thread, its kernels, its speed).
                await fed.call(fed.recover, store)
        elif cfg.resume:
            log.warning("--resume: %s holds no checkpoint yet; starting fresh", cfg.state_dir)
        fed.store = store
        # A long replay counts toward the next checkpoint: take it now if it is due, so that a
        # server killed again and again before each threshold does not replay more each time.
        if cfg.shards == 1:
            fed.checkpoints.checkpoint_if_due()

    def _watch_metrics(self) -> None:
        fed = self.federation
        m = self.metrics
        m.gauge("queue_depth", "Validated updates waiting for the aggregation loop",
                fed.queue_depth)  # fmt: skip
        m.gauge("uploads_in_progress", "Uploads holding a staging slot",
                lambda: fed.uploads_in_progress)  # fmt: skip
        m.gauge("clients_known", "Clients registered", lambda: len(fed.clients))
        m.gauge("clients_active", "Clients whose lease has not expired", fed.active_clients)
        m.gauge("global_version", "The latest global model version", lambda: fed.version)
        m.gauge("cache_bytes", "Bytes held by the strategy's tensors and retained versions",
                fed.cache_bytes_between_calls)  # fmt: skip
        m.gauge("cache_rows", "Rows in use in the strategy's per-client row cache (0 without one)",
                lambda: fed.row_cache().rows)  # fmt: skip
        m.gauge("cache_row_bytes", "Bytes one row of that cache takes, its scales included "
                "(cache_dtype; 0 without one)", lambda: fed.row_cache().bytes_per_row)  # fmt: skip
        m.gauge("wal_bytes", "Bytes in the write-ahead log since the newest checkpoint",
                lambda: fed.store.wal_bytes() if fed.store is not None else 0)  # fmt: skip
        m.watch_clients(fed.clients_now)
        m.gauge("clients_flagged_dropped", "Clients the strategy flags as dropped out now "
                "(FedDGIC's dropout detection; 0 for strategies without one)",
                lambda: len(fed.strategy_events.dropped))  # fmt: skip
        m.gauge("buffer_updates", "Updates waiting in a buffered strategy's buffer (0 for others)",
                lambda: fed.publication.buffer_now()[0])  # fmt: skip
        m.gauge("buffer_size", "The buffer's size: a step when it is full (0: not buffered)",
                lambda: fed.publication.buffer_now()[1])  # fmt: skip

        def privacy(key: str, off: float) -> Callable[[], float]:
            return lambda: float((fed.privacy_now() or {key: off})[key])

        m.gauge("dp_epsilon", "Differential privacy: the worst-off client's epsilon at dp_delta "
                "for the versions published so far (NaN without DP)",
                privacy("epsilon", math.nan))  # fmt: skip
        m.gauge("dp_releases", "Differential privacy: versions published with contributions",
                privacy("releases", 0.0))  # fmt: skip
        m.gauge("dp_budget_spent", "Differential privacy: 1 once dp_target_epsilon stopped the "
                "publications", privacy("budget_spent", 0.0))  # fmt: skip
        m.gauge(
            "dp_updates_clipped",
            "Differential privacy: updates scaled down to the "
            "clipping norm since this process started",
            privacy("updates_clipped", 0.0),
        )

    async def _tick(self) -> None:
        """Once a second: the time-based checkpoint and the evaluation hook."""
        cfg = self.config
        fed = self.federation
        while not fed.closing:
            await asyncio.sleep(0.5 if self._evaluator else 1.0)
            if self._evaluator is not None:
                self._evaluator.poll()
            last = fed.checkpoints.last_checkpoint
            if (
                cfg.checkpoint_every_seconds
                and last is not None
                and fed.call_log.updates_since_checkpoint > 0
                and fed.clock() - last[1] >= cfg.checkpoint_every_seconds
            ):
                fed.checkpoints.checkpoint_soon()

    def request_stop(self, grace: float = 5.0) -> None:
        """Ask :func:`serve` to stop (an operator's Shutdown call, or a failed log write)."""
        self.stop_grace = grace
        self.stop_requested.set()

    def _load_initial_model(self, path: str) -> None:
        # Laid out as the clients of that model lay it out, or none of them could register.
        # (Imported here: only --model-init needs the client package.)
        from aggsrv.client.model_init import load_model_init

        layout, weights, buffers = load_model_init(path)
        self.federation.adopt(layout, weights, buffers)

    async def stop(self, grace: float = 5.0) -> None:
        """Refuse new calls, let in-flight ones finish within `grace` seconds, write a final
        checkpoint, then stop."""
        fed = self.federation
        await self._health.enter_graceful_shutdown()
        if self._grpc is not None:
            # In-flight uploads still finish (and are logged) while new calls are refused.
            fed.closing = True
            fed.publication.notify()  # waiting job streams see closing and end at once
            t0 = time.perf_counter()
            await self._grpc.stop(grace)
            # A stop that took its whole grace had a call that did not end by itself.
            log.info("calls ended in %.2f s (grace %g s)", time.perf_counter() - t0, grace)
        if (close_service := getattr(self, "_close_service", None)) is not None:
            await close_service()
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        if self._evaluator is not None:
            await self._evaluator.close()
        if self._keep_alive is not None:
            self._keep_alive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keep_alive
        final = fed.store is not None and fed.strategy is not None and fed.failure is None
        if fed.shards is not None:
            if final and fed.shards.is_coordinator:
                # Every shard cuts this checkpoint at the same call: ordered before they stop.
                try:
                    await fed.checkpoint()
                except Exception:
                    log.exception("final checkpoint failed (the logs still hold every update)")
            final = False
            await self._leave_shards(announce=fed.shards.is_coordinator and fed.failure is None)
        await fed.close()
        if final:
            try:
                await fed.checkpoint()
            except Exception:
                log.exception("final checkpoint failed (the log still holds every update)")
        if fed.store is not None:
            fed.store.close()
        await fed.shutdown_executors()
        self.metrics.close()
        if self._dashboard is not None:
            self._dashboard.close()
            self._dashboard = None
        log.info("aggsrv stopped")

    async def wait(self) -> None:
        assert self._grpc is not None
        await self._grpc.wait_for_termination()


def show_admin_token(token: str, path: Path, stream: TextIO | None = None) -> None:
    """Print the admin token once for the operator at the terminal; nothing when stderr is not
    a terminal (then it is a log file or a journal, and the token stays in its private file)."""
    stream = sys.stderr if stream is None else stream
    if stream.isatty():
        stream.write(f"aggsrv admin token (also in {path}): {token}\n")
        stream.flush()


def _reachable_host(host: str) -> str:
    """The host part of the address other machines reach a wildcard bind on."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        return socket.getfqdn()
    return host


def tls_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    """Server TLS credentials from PEM files; mutual TLS when a client CA is given."""
    if not cfg.tls_cert:
        return None

    def read(path: str, what: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read the {what} {path}: {exc}") from exc

    pair = (read(cfg.tls_key, "TLS key"), read(cfg.tls_cert, "TLS certificate"))
    client_ca = read(cfg.tls_client_ca, "client CA") if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


async def serve(config: ServerConfig) -> int:
    """Run until SIGINT/SIGTERM or an operator's Shutdown, then shut down cleanly. The exit
    code: 1 when the federation had stopped taking writes (a failure: restart with --resume),
    else 0."""
    server = Server(config)
    await server.start()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        log.info("signal received (%s): finishing in-flight calls", sig.name)
        server.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    await server.stop_requested.wait()
    await server.stop(server.stop_grace)
    code = 1 if server.federation.failure is not None else 0
    if server._follower is not None and server._follower.is_alive():
        # A shard stopped on its own is still waiting in a gloo receive for rank 0, which
        # nothing can interrupt; at interpreter exit that native wait would abort the process.
        logging.shutdown()
        os._exit(code)
    return code
