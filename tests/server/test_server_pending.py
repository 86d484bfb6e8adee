"""GetJob's pending answers say why there is no job (JobPending.code), over real gRPC on loopback.

Each case drives a strategy into one waiting state through the public calls only, then reads
the first message of a GetJob stream: a pending whose code names that state, and whose
model_version is the server's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import grpc
import pytest
import torch
from server_helpers import RunningServer

from aggsrv.client import Client, Pending, PendingReason
from aggsrv.layout import ModelLayout
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.values import Status, UpdateKind

LAYOUT = ModelLayout.from_named_shapes([("w", (5,))])


def first_message(address: str, client_id: str) -> pb.JobMessage:
    """The first message of a GetJob stream (the call is then cancelled)."""
    with grpc.insecure_channel(address) as channel:
        stream = pb_grpc.AggregationStub(channel).GetJob(
            pb.GetJobRequest(client_id=client_id, layout_hash=LAYOUT.hash), timeout=30
        )
        try:
            return next(iter(stream))
        finally:
            stream.cancel()


def pending_code(address: str, client_id: str) -> int:
    msg = first_message(address, client_id)
    assert msg.WhichOneof("kind") == "pending", msg
    return msg.pending.code


def register(address: str, client_id: str, first: bool = False) -> Client:
    c = Client(address, client_id)
    if first:
        c.register(layout=LAYOUT, initial=torch.zeros(LAYOUT.numel))
    else:
        c.register(layout=LAYOUT)
    return c


def test_the_wire_enum_and_the_python_enum_agree() -> None:
    wire = {v.name.removeprefix("PENDING_REASON_"): v.number
            for v in pb.DESCRIPTOR.enum_types_by_name["PendingReason"].values}  # fmt: skip
    assert wire == {r.name: r.value for r in PendingReason}
    assert wire["UNSPECIFIED"] == 0


def test_no_round_open_then_not_selected() -> None:
    # One participant per round, and rounds wait for two registered clients.
    cfg = {"mode": "sync", "participation": 1, "min_clients": 1, "min_available": 2}
    srv = RunningServer(strategy="fedavg", strategy_config=cfg, rate_limit_per_second=0.0)
    try:
        a = register(srv.address, "a", first=True)
        msg = first_message(srv.address, "a")
        assert msg.WhichOneof("kind") == "pending"
        assert msg.pending.code == pb.PENDING_REASON_NO_ROUND_OPEN
        assert msg.pending.model_version == 0 and msg.pending.reason
        b = register(srv.address, "b")
        # The round opened with one of the two: the other is told it was not selected.
        kinds = {cid: first_message(srv.address, cid) for cid in ("a", "b")}
        pending = [cid for cid, m in kinds.items() if m.WhichOneof("kind") == "pending"]
        assert len(pending) == 1, kinds
        (left_out,) = pending
        assert kinds[left_out].pending.code == pb.PENDING_REASON_NOT_SELECTED
        assert sorted(srv.strategy._participants) == sorted({"a", "b"} - {left_out})
        a.close()
        b.close()
    finally:
        srv.stop()


def test_already_reported_reaches_the_python_client() -> None:
    # Both clients are in the round; after a reports, the round waits for b.
    cfg = {"mode": "sync", "participation": 2, "min_clients": 2, "min_available": 2}
    srv = RunningServer(strategy="fedavg", strategy_config=cfg, rate_limit_per_second=0.0)
    try:
        a = register(srv.address, "a", first=True)
        b = register(srv.address, "b")
        job = a.get_job()
        assert a.push(job, torch.ones(LAYOUT.numel), kind=UpdateKind.DELTA).status is (
            Status.BUFFERED
        )
        assert pending_code(srv.address, "a") == pb.PENDING_REASON_ALREADY_REPORTED
        # The Python client hands each pending notice to on_pending while it waits.
        seen: list[Pending] = []
        got: list = []
        waiter = threading.Thread(
            target=lambda: got.append(a.get_job(timeout=30, on_pending=seen.append)), daemon=True
        )
        waiter.start()
        b_job = b.get_job()
        # b's update closes the round; a's stream then carries the next round's job.
        b.push(b_job, torch.ones(LAYOUT.numel), kind=UpdateKind.DELTA)
        waiter.join(timeout=30)
        assert got and got[0].base_version == 1
        assert seen and seen[0].reason is PendingReason.ALREADY_REPORTED
        assert seen[0].model_version == 0 and seen[0].text
        a.close()
        b.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("strategy", ["fedhist", "twafl"])
def test_update_buffered(strategy: str) -> None:
    srv = RunningServer(
        strategy=strategy, strategy_config={"buffer_size": 2}, rate_limit_per_second=0.0
    )
    try:
        a = register(srv.address, "a", first=True)
        b = register(srv.address, "b")
        job = a.get_job()
        pushed = a.push(
            job, torch.ones(LAYOUT.numel) * 0.1, kind=UpdateKind.DELTA, num_samples=1, steps=1
        )
        assert pushed.status is Status.BUFFERED
        assert pending_code(srv.address, "a") == pb.PENDING_REASON_UPDATE_BUFFERED
        # b has nothing in the buffer: it gets a job.
        assert first_message(srv.address, "b").WhichOneof("kind") == "header"
        a.close()
        b.close()
    finally:
        srv.stop()


def _round_of_two_server() -> RunningServer:
    """A server whose rounds wait for two registered clients, with pending notices a minute
    apart: a stream that sleeps through a change waits far longer than these tests allow."""
    cfg = {"mode": "sync", "participation": 2, "min_clients": 2, "min_available": 2}
    return RunningServer(
        strategy="fedavg", strategy_config=cfg, rate_limit_per_second=0.0,
        pending_interval_seconds=60.0,
    )  # fmt: skip


def _ended_after(srv: RunningServer, stop: Callable[[], None]) -> tuple[grpc.RpcError, float]:
    """Open a GetJob stream for a registered client that waits (no round yet), call ``stop``,
    and return how the stream ended and how long after ``stop`` it did."""
    a = register(srv.address, "a", first=True)
    with grpc.insecure_channel(srv.address) as channel:
        stream = pb_grpc.AggregationStub(channel).GetJob(
            pb.GetJobRequest(client_id="a", layout_hash=LAYOUT.hash), timeout=60
        )
        messages = iter(stream)
        assert next(messages).WhichOneof("kind") == "pending"  # open and waiting
        asked = time.monotonic()
        stop()
        with pytest.raises(grpc.RpcError) as ended:
            next(messages)
        took = time.monotonic() - asked
    a.close()
    return ended.value, took


def test_a_change_made_while_a_stream_decides_to_wait_wakes_it_at_once() -> None:
    """The lost wake-up: the round opens (b registers) after a's stream found no job but before
    it waits. The stream must not sleep through that change for pending_interval_seconds."""
    srv = _round_of_two_server()
    try:
        a = register(srv.address, "a", first=True)
        fed = srv.federation
        real_next_job = fed.next_job
        others: list[Client] = []

        async def next_job_then_b_registers(client_id: str):
            found = await real_next_job(client_id)
            if client_id == "a" and not others:
                assert found[0] is None  # one client registered: no round yet
                loop = asyncio.get_running_loop()
                others.append(await loop.run_in_executor(None, register, srv.address, "b"))
            return found

        fed.next_job = next_job_then_b_registers
        job = a.get_job(timeout=10)  # far below the 60 s a missed wake-up would sleep
        assert job.base_version == 0 and others
        a.close()
        others[0].close()
    finally:
        srv.stop()


def test_a_stream_waiting_for_a_job_ends_at_once_when_the_server_stops() -> None:
    """Shutdown wakes a waiting GetJob after it marks the server closing: the stream ends with
    UNAVAILABLE (a client retries later) at once, not when the grace period runs out or at the
    next pending notice."""
    srv = _round_of_two_server()
    stopping = threading.Thread(target=lambda: srv.run(srv.server.stop(grace=20.0)))
    ended, took = _ended_after(srv, stopping.start)
    stopping.join(timeout=60)
    srv.loop.call_soon_threadsafe(srv.loop.stop)
    assert ended.code() == grpc.StatusCode.UNAVAILABLE, ended
    assert took < 5.0, took


def test_a_stream_waiting_for_a_job_ends_at_once_when_the_server_stops_taking_writes() -> None:
    """A fail-stop (here: the log could not be written) wakes waiting GetJob streams, which end
    with UNAVAILABLE and the reason, instead of sleeping until their next pending notice."""
    srv = _round_of_two_server()
    try:
        ended, took = _ended_after(
            srv, lambda: srv.federation.fail_stop.fail("the write-ahead log could not be written")
        )
        assert ended.code() == grpc.StatusCode.UNAVAILABLE, ended
        assert "write-ahead log" in ended.details()
        assert took < 5.0, took
    finally:
        srv.stop()
