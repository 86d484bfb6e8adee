"""Helpers for the network benchmarks (bench/test_bench_ingest.py).

- `LoopThread`: an asyncio event loop in a daemon thread, to run grpc.aio servers beside a
  synchronous client (the approach of `RunningServer` in tests/server/test_server_grpc.py);
- `AggsrvServer`: `aggsrv.server.app.Server` on an ephemeral loopback port in such a thread;
- `BareReceiver`: a grpc.aio server that answers `aggsrv.v1.Aggregation/PushUpdate` by iterating
  the stream and counting `len(msg.chunk.data)` (no decode, no CRC, no strategy): the floor of a
  gRPC client-streaming upload of the same messages;
- `FlowerReceiver` / `flower_push`: a Flower-style upload, the model as ONE unary message of
  per-tensor NPY bytes (`np.save` into a BytesIO per tensor, as Flower's `ndarray_to_bytes`),
  decoded on arrival with `np.load` per tensor (Flower's `bytes_to_ndarray`);
- `interleaved_prepared`: round-robin timing where each candidate has an untimed `prepare`
  step (a `get_job`) and a timed `run` step (the push);
- `proc_status_kb` / `reset_peak_rss` / `process_cpu_seconds` (`stat_cpu_seconds` for a thread):
  VmRSS / VmHWM / CPU seconds of a process from /proc.

Run as a script, it starts an aggsrv server in this process and prints `PORT <n>` once it
serves; it stops when its stdin closes (the memory benchmark runs it in a subprocess):

    python bench/ingest_helpers.py serve --strategy fedbuff --strategy-config '{"buffer_size": 64}'

`--config '{"max_clients": 2048}'` sets further ServerConfig keys (the load benchmark,
bench/test_bench_load.py, raises the client and call limits and turns the rate limit off).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import json
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np
import torch
from conftest import rescale_sizes

from aggsrv import protocol as P
from aggsrv.layout import ModelLayout
from aggsrv.server.app import Server
from aggsrv.server.config import ServerConfig
from aggsrv.transport import WireDtype
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.values import Recipe

MIB = 1 << 20
PUSH_METHOD = "PushUpdate"
JOB_METHOD = "GetJob"
AGG_SERVICE = "aggsrv.v1.Aggregation"
FLOWER_SERVICE = "bench.FlowerStyle"
FLOWER_METHOD = f"/{FLOWER_SERVICE}/Upload"
FLOWER_LIMIT = 256 * MIB


class LoopThread:
    """An event loop run forever by a daemon thread; `run` executes a coroutine on it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class AggsrvServer(LoopThread):
    """`aggsrv.server.app.Server` on 127.0.0.1:<ephemeral> in a background loop."""

    def __init__(self, **config: Any) -> None:
        super().__init__("aggsrv-server")
        defaults = {"auth": "none", "durability": "off", "state_dir": ""}
        self.config = ServerConfig(host="127.0.0.1", port=0, **{**defaults, **config})
        self.server = Server(self.config)
        self.port = self.run(self.server.start())
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.run(self.server.stop(grace=1))
        self.close()


class _GrpcThread(LoopThread):
    """A grpc.aio server with one generic handler, on an ephemeral loopback port."""

    def __init__(self, name: str, handler: grpc.GenericRpcHandler, limit: int) -> None:
        super().__init__(name)
        self.limit = limit
        self.port = self.run(self._start(handler))
        self.address = f"127.0.0.1:{self.port}"

    async def _start(self, handler: grpc.GenericRpcHandler) -> int:
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.limit),
                ("grpc.max_send_message_length", self.limit),
            ]
        )
        self.server.add_generic_rpc_handlers((handler,))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def stop(self) -> None:
        self.run(self.server.stop(grace=1))
        self.close()


class BareReceiver(_GrpcThread):
    """Answers PushUpdate after counting the chunk bytes of the stream; nothing else. Given a
    model, it also answers GetJob with the messages aggsrv's GetJob would send for it (a
    JobHeader, the model's chunks, the trailer), serialized once at start, so a get_job + push
    loop against it costs the same gRPC-level work per update as against aggsrv (the same calls,
    messages and bytes in both directions) and none of the server's own.

    Same message limits as aggsrv's default config (4 MiB), so the only difference from the
    real server is the work done per message.
    """

    def __init__(
        self,
        limit: int = 4 * MIB,
        layout: ModelLayout | None = None,
        model: torch.Tensor | None = None,
    ) -> None:
        self.bytes_received = 0
        self.streams = 0
        self.jobs = 0

        async def push(request_iterator: Any, context: Any) -> pb.PushUpdateResponse:
            n = 0
            update_id = ""
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "chunk":
                    n += len(msg.chunk.data)  # read the bytes field once, as a decoder would
                elif kind == "header":
                    update_id = msg.header.update_id
            self.bytes_received += n
            self.streams += 1
            return pb.PushUpdateResponse(outcome=pb.OUTCOME_APPLIED, update_id=update_id)

        methods = {
            PUSH_METHOD: grpc.stream_unary_rpc_method_handler(
                push,
                request_deserializer=pb.UpdateMessage.FromString,
                response_serializer=pb.PushUpdateResponse.SerializeToString,
            )
        }
        if layout is not None and model is not None:
            job_messages = _job_messages(layout, model)

            async def get_job(request: pb.GetJobRequest, context: Any):
                self.jobs += 1
                for message in job_messages:
                    yield message

            methods[JOB_METHOD] = grpc.unary_stream_rpc_method_handler(
                get_job,
                request_deserializer=pb.GetJobRequest.FromString,
                response_serializer=None,  # the messages are bytes already
            )
        handler = grpc.method_handlers_generic_handler(AGG_SERVICE, methods)
        super().__init__("bare-receiver", handler, limit)


def _job_messages(layout: ModelLayout, model: torch.Tensor) -> list[bytes]:
    """The serialized JobMessages of a job on `model` (float32, aggsrv's default chunk size):
    one flat "weights" tensor, as aggsrv sends a model without float buffers."""
    assert model.numel() == layout.numel and not layout.buffer_numel
    tensors = {"weights": model.reshape(-1)}
    header = pb.JobHeader(
        job_id="1",
        base_version=0,
        layout_hash=layout.hash,
        recipe=P.recipe_to_pb(Recipe()),
        dtype=P.WIRE_TO_PB[WireDtype.FLOAT32],
        tensors=P.tensor_infos(tensors),
        update_kind=pb.UPDATE_KIND_DELTA,
        upload_dtype=P.WIRE_TO_PB[WireDtype.FLOAT32],
    )
    chunks = P.serialized_chunk_stream(
        tensors, WireDtype.FLOAT32, ServerConfig().chunk_bytes, pb.JobMessage
    )
    return [pb.JobMessage(header=header).SerializeToString(), *chunks]


# A few tensors, conv/FC-like proportions (1-D shapes: the layout only needs the sizes).
LAYER_SIZES = [1_728, 64, 73_728, 128, 2_359_296, 512, 8_388_608, 4_096, 5_869_568, 10]


def layered_layout(D: int) -> ModelLayout:
    """LAYER_SIZES rescaled to D elements in all (one tensor when D is below 10)."""
    sizes = rescale_sizes(LAYER_SIZES, D) if len(LAYER_SIZES) <= D else [D]
    return ModelLayout.from_named_shapes(
        [(f"layer{i}.{'weight' if i % 2 == 0 else 'bias'}", (int(n),)) for i, n in enumerate(sizes)]
    )


# --------------------------------------------------------------------------------------------
# Flower-style upload: one unary message of per-tensor NPY bytes
# --------------------------------------------------------------------------------------------


def ndarray_to_bytes(a: np.ndarray) -> bytes:
    """Flower's `ndarray_to_bytes`: np.save into a BytesIO (no pickle)."""
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def encode_flower(arrays: Sequence[np.ndarray]) -> bytes:
    """The message: tensor count, then per tensor its NPY length and bytes (u64 little-endian)."""
    parts = [struct.pack("<Q", len(arrays))]
    for a in arrays:
        b = ndarray_to_bytes(a)
        parts.append(struct.pack("<Q", len(b)))
        parts.append(b)
    return b"".join(parts)


def decode_flower(msg: bytes) -> list[np.ndarray]:
    """Flower's `bytes_to_ndarray` per tensor: one bytes object per tensor (as a protobuf bytes
    field hands it out), np.load from a BytesIO over it."""
    (count,) = struct.unpack_from("<Q", msg, 0)
    off = 8
    out = []
    for _ in range(count):
        (n,) = struct.unpack_from("<Q", msg, off)
        off += 8
        tensor = msg[off : off + n]
        off += n
        out.append(np.load(io.BytesIO(tensor), allow_pickle=False))
    if off != len(msg):
        raise ValueError(f"{len(msg) - off} trailing bytes in the upload")
    return out


class FlowerReceiver(_GrpcThread):
    """A unary handler taking raw bytes (limits raised to 256 MB) that decodes every NPY tensor."""

    def __init__(self, limit: int = FLOWER_LIMIT) -> None:
        self.values_received = 0

        async def upload(request: bytes, context: Any) -> bytes:
            arrays = decode_flower(request)
            n = sum(a.size for a in arrays)
            self.values_received += n
            return struct.pack("<Q", n)

        handler = grpc.method_handlers_generic_handler(
            FLOWER_SERVICE,
            {"Upload": grpc.unary_unary_rpc_method_handler(upload)},  # raw bytes both ways
        )
        super().__init__("flower-receiver", handler, limit)


class FlowerClient:
    """The sending side: a channel with 256 MB limits, one unary call per model upload."""

    def __init__(self, address: str, limit: int = FLOWER_LIMIT) -> None:
        self.channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ],
        )
        self.call = self.channel.unary_unary(FLOWER_METHOD)

    def push(self, arrays: Sequence[np.ndarray], timeout: float = 120.0) -> int:
        (n,) = struct.unpack("<Q", self.call(encode_flower(arrays), timeout=timeout))
        return n

    def close(self) -> None:
        self.channel.close()


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def interleaved_prepared(
    cands: dict[str, tuple[Callable[[], Any] | None, Callable[[Any], Any]]], reps: int
) -> dict[str, list[float]]:
    """Seconds of each candidate's `run(prepare())`, timing only `run`, over `reps` rounds.

    Each candidate runs once untimed first (connections, page faults). Round r starts at
    candidate r mod n (as conftest.interleaved); index r of every list is round r. The GC is
    off while timing.
    """
    names = list(cands)
    for n in names:
        prepare, run = cands[n]
        run(prepare() if prepare else None)
    times: dict[str, list[float]] = {n: [] for n in names}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(reps):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                prepare, run = cands[n]
                arg = prepare() if prepare else None
                t0 = time.perf_counter()
                run(arg)
                times[n].append(time.perf_counter() - t0)
    finally:
        if was_enabled:
            gc.enable()
    return times


# --------------------------------------------------------------------------------------------
# /proc
# --------------------------------------------------------------------------------------------


def stop_server_process(proc: subprocess.Popen) -> None:
    """Stop a `serve` subprocess: close its stdin (it stops when stdin closes), kill it if it
    has not exited within 30 s."""
    if proc.stdin:
        proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def proc_status_kb(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (peak RSS) and friends of a process, in kB."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key.startswith("Vm") or key.startswith("Rss"):
                out[key] = int(rest.split()[0])
    return out


def stat_cpu_seconds(path: str) -> float:
    """CPU seconds (utime + stime) in a /proc stat file: /proc/PID/stat for a process,
    /proc/PID/task/TID/stat for a thread."""
    with open(path) as fh:
        rest = fh.read().rpartition(")")[2].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds of a whole process (ended threads included)."""
    return stat_cpu_seconds(f"/proc/{pid}/stat")


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM to the current RSS (`echo 5 > /proc/PID/clear_refs`); False if refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# Subprocess server
# --------------------------------------------------------------------------------------------


async def _serve(config: ServerConfig) -> None:
    server = Server(config)
    port = await server.start()
    print(f"PORT {port}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    await server.stop(grace=1)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run an aggsrv server on an ephemeral port, print it")
    s.add_argument("--strategy", default="fedbuff")
    s.add_argument("--strategy-config", default="{}", help="JSON object")
    s.add_argument("--max-concurrent-uploads", type=int, default=None)
    s.add_argument(
        "--config", default="{}", help="JSON object of further ServerConfig keys (override)"
    )
    args = p.parse_args(argv)
    cfg: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "strategy": args.strategy,
        "strategy_config": json.loads(args.strategy_config),
        "auth": "none",
        "durability": "off",
        "state_dir": "",
    }
    if args.max_concurrent_uploads is not None:
        cfg["max_concurrent_uploads"] = args.max_concurrent_uploads
    cfg.update(json.loads(args.config))
    asyncio.run(_serve(ServerConfig(**cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
