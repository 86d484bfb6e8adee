"""Helpers shared by the server test modules (tests/ is not a package: import as
`from server_helpers import ...`, pytest puts this folder on sys.path)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from aggsrv import protocol as P
from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server.app import Server
from aggsrv.server.config import ServerConfig
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb


class RunningServer:
    """A server on an ephemeral port, run by its own event loop in a background thread."""

    def __init__(self, **config) -> None:
        # In-process test servers: no auth and no state directory unless a test asks.
        defaults = {"auth": "none", "durability": "off", "state_dir": ""}
        self.config = ServerConfig(host="127.0.0.1", port=0, **{**defaults, **config})
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = Server(self.config)
        self.port = self.run(self.server.start())
        self.address = f"127.0.0.1:{self.port}"

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def stop(self) -> None:
        self.run(self.server.stop(grace=1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    @property
    def federation(self):
        return self.server.federation

    @property
    def strategy(self):
        return self.server.federation.strategy

    def model(self) -> torch.Tensor:
        return self.strategy.global_model().clone()

    def state(self) -> dict:
        """The strategy's state dict, taken on the aggregation thread (a point-in-time copy)."""
        strategy = self.strategy
        return self.run(self.federation.call(strategy.state_dict))


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def flat(model: torch.nn.Module) -> torch.Tensor:
    return ModelLayout.from_module(model).flatten(model, dtype=torch.float32)


def update_messages(
    client: Client,
    job,
    values: torch.Tensor | dict[str, torch.Tensor],
    chunk_bytes: int = 64,
    **header_overrides,
) -> list:
    """A PushUpdate stream (header, chunks, trailer) for a DELTA; header fields overridable.

    ``values`` is the "update" tensor (announced with the layout's D), or named tensors (e.g.
    "update" and "buffers") announced with their own lengths."""
    layout = client.layout
    tensors = values if isinstance(values, dict) else {"update": values}
    header = pb.UpdateHeader(
        client_id=client.client_id,
        job_id=job.job_id,
        base_version=job.base_version,
        update_id=uuid.uuid4().hex,
        num_samples=1,
        work=pb.WorkDone(epochs=1.0, complete=True),
        kind=pb.UPDATE_KIND_DELTA,
        dtype=tpb.WIRE_DTYPE_FLOAT32,
        layout_hash=layout.hash,
        tensors=(
            P.tensor_infos(tensors)
            if isinstance(values, dict)
            else [tpb.TensorInfo(name="update", numel=layout.numel)]
        ),
    )
    for key, value in header_overrides.items():
        if key == "tensors":
            del header.tensors[:]
            header.tensors.extend(value)
        else:
            setattr(header, key, value)
    body = list(P.chunk_stream(tensors, P.WireDtype.FLOAT32, chunk_bytes, pb.UpdateMessage))
    return [pb.UpdateMessage(header=header), *body]


def register_messages(
    layout: ModelLayout, client_id: str, tensors: dict[str, torch.Tensor], chunk_bytes: int = 64
) -> list:
    """A Register stream that offers an initial model (``tensors``: "weights" [, "buffers"])."""
    header = pb.RegisterHeader(
        client_id=client_id,
        layout=P.layout_to_pb(layout),
        layout_hash=layout.hash,
        initial_dtype=tpb.WIRE_DTYPE_FLOAT32,
        initial_tensors=P.tensor_infos(tensors),
    )
    body = P.chunk_stream(tensors, P.WireDtype.FLOAT32, chunk_bytes, pb.RegisterRequest)
    return [pb.RegisterRequest(header=header), *body]


def raw_push(address: str, messages) -> grpc.RpcError | pb.PushUpdateResponse:
    """Send a prepared PushUpdate stream; the response, or the RpcError it ended with."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.AggregationStub(channel)
        try:
            return stub.PushUpdate(iter(messages), timeout=30)
        except grpc.RpcError as exc:
            return exc


REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m aggsrv.cli [-v] serve --host 127.0.0.1 --port PORT ARGS...` with its log
    (stderr) in ``log_path``; ``--auth none`` unless ARGS name another."""

    def __init__(self, log_path: Path, port: int, *args: str, verbose: bool = False) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        cmd = [sys.executable, "-m", "aggsrv.cli", *(["-v"] if verbose else []), "serve"]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        if "--auth" not in args:
            cmd += ["--auth", "none"]
        cmd += list(args)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=self._log, cwd=REPO, env=dict(os.environ)
        )

    def wait_serving(self, limit: float = 30.0) -> float:
        """Seconds from process start until health answers SERVING."""
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() - self.started < limit:
                if self.proc.poll() is not None:
                    raise AssertionError(f"serve exited with {self.proc.returncode}: {self.log()}")
                try:
                    resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return time.monotonic() - self.started
                except grpc.RpcError:
                    pass
                time.sleep(0.02)
        raise AssertionError(f"not SERVING after {limit} s: {self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> tuple[int, float]:
        """Send `sig`; (exit code, seconds it took to exit)."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        return rc, time.monotonic() - t0

    def terminate(self, timeout: float = 20.0) -> int:
        return self.stop(signal.SIGTERM, timeout)[0]

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def scrape_metrics(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample of a server's /metrics: (sample name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
