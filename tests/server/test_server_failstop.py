"""Failure semantics and concurrency of one server (issue 17, "Timing must not decide the
arithmetic" and the sharded Register bound):

* an unexpected exception on the aggregation thread stops the server taking writes (fail-stop):
  UNAVAILABLE, one CRITICAL line with the traceback, `aggsrv serve` exits non-zero, and the
  restarted server is the log's replay, without the half-applied change;
* reads of strategy state from the event loop (Heartbeat, GetStatus) never see a call half
  made, even with the interpreter switching threads every microsecond;
* a sharded rank 0 reading offered weights holds at most max_concurrent_uploads whole-model
  buffers at a time;
* a staging slot whose bytes a device copy may still be reading is not handed to the next upload
  until the copy's event completes (a simulated device: a thread that reads the slot late).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys
import threading
import time
import weakref
from pathlib import Path

import grpc
import pytest
import torch
from fault_strategies import TRIGGER_SAMPLES
from server_helpers import RunningServer, ServeProcess, flat, free_port, tiny_model
from state_helpers import assert_same_state

from aggsrv import protocol as P
from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import federation as F
from aggsrv.server import service as S
from aggsrv.server.config import ServerConfig
from aggsrv.sharding import ShardLayout, ShardMap
from aggsrv.strategies import Status, Update, UpdateKind
from aggsrv.transport import decoder as transport_decoder
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import tensor_pb2 as tpb

TESTS = Path(__file__).resolve().parent
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


# ------------------------------------------------------------------ fail-stop


def test_unexpected_exception_on_the_aggregation_thread_stops_writes_keeps_reads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A strategy that raises MemoryError half-way through an update: that push and every later
    write get UNAVAILABLE naming the exception; GetModel, GetStatus still answer, with the last
    version published before it (never the half-applied one); one CRITICAL line has the
    traceback."""
    srv = RunningServer(
        strategy="fault_strategies:HalfApplies", state_dir=str(tmp_path / "state"),
        durability="on", rate_limit_per_second=0.0,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    model = tiny_model(3)
    try:
        with caplog.at_level(logging.INFO), Client(srv.address, "c0", retries=0) as c0:
            c0.register(model)
            for _ in range(2):
                job = c0.get_job()
                assert c0.push(job, torch.randn(flat(model).numel(), generator=gen),
                               num_samples=4).status is Status.APPLIED  # fmt: skip
            good_version, good_model = c0.get_model()
            assert good_version == 2
            job = c0.get_job()
            delta = torch.randn(good_model.numel(), generator=gen)
            error = _refused(lambda: c0.push(job, delta, num_samples=TRIGGER_SAMPLES))
            assert error.code() == UNAVAILABLE, error
            assert "MemoryError" in error.details() and "injected" in error.details()
            # The strategy's own version moved (half-applied); nothing of it is served.
            assert srv.strategy.version == 3
            with Client(srv.address, "c1", retries=0) as c1:
                error = _refused(lambda: c1.register(model))
                assert error.code() == UNAVAILABLE and "stopped taking writes" in error.details()
            assert _refused(c0.get_job).code() == UNAVAILABLE
            error = _refused(lambda: c0.push(job, delta, num_samples=4, update_id="again"))
            assert error.code() == UNAVAILABLE
            version, served = c0.get_model()
            assert version == good_version and torch.equal(served, good_model)
            status = c0.status()
            assert status.version == good_version
            assert status.updates_applied == 2
        critical = [r for r in caplog.records if r.levelno == logging.CRITICAL]
        assert len(critical) == 1, [r.getMessage() for r in critical]
        assert critical[0].exc_info is not None
        assert critical[0].exc_info[0] is MemoryError
        assert "half-way" in critical[0].getMessage()
    finally:
        srv.stop()


def test_serve_exits_nonzero_on_an_unexpected_exception_and_resumes_to_the_log_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`aggsrv serve` with a plug-in strategy that breaks half-way through an update answers
    UNAVAILABLE, logs CRITICAL with the traceback and exits non-zero by itself. Resumed, the
    server equals the replay of its log (compared state dict by state dict), serves the model
    of before the failure, and the job the half-applied update had retired is open again."""
    state = tmp_path / "state"
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    proc = ServeProcess(
        tmp_path / "serve.log", free_port(), "--strategy", "fault_strategies:HalfApplies",
        "--state-dir", str(state),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    model = tiny_model(5)
    try:
        proc.wait_serving()
        with Client(proc.address, "c0", retries=0) as client:
            client.register(model)
            job = client.get_job()
            client.push(job, torch.randn(flat(model).numel(), generator=gen), num_samples=3)
            good_version, good_model = client.get_model()
            job = client.get_job()
            delta = torch.randn(good_model.numel(), generator=gen)
            error = _refused(lambda: client.push(job, delta, num_samples=TRIGGER_SAMPLES))
        assert error.code() == UNAVAILABLE, error
        rc = proc.proc.wait(timeout=20)
        log = proc.log()
        assert rc != 0, log
        assert log.count("CRITICAL") == 1, log
        assert "Traceback" in log and "MemoryError: injected" in log, log
    finally:
        proc.close()

    config = dict(strategy="fault_strategies:HalfApplies", state_dir=str(state), durability="on")
    oracle = F.rebuild(ServerConfig(auth="none", **config), state, 1)
    resumed = RunningServer(resume=True, **config)
    try:
        assert_same_state(resumed.state(), oracle.strategy.state_dict())
        assert resumed.federation.version == good_version
        with Client(resumed.address, "c0", retries=0) as client:
            version, served = client.get_model()
            assert version == good_version and torch.equal(served, good_model)
            client.register(model)
            # The half-applied update had retired this job: it is open again.
            result = client.push(job, delta, num_samples=3)
            assert result.status is Status.APPLIED and result.version == good_version + 1
    finally:
        resumed.stop()


# ------------------------------------------------------------------ reads from the event loop


class _Context:
    """What a handler needs of a grpc.aio context when authentication is off."""

    async def abort(self, code, details):  # noqa: ANN001, ANN201
        raise AssertionError(f"aborted {code}: {details}")


def test_heartbeat_and_status_never_see_a_call_half_made_while_updates_retire_jobs() -> None:
    """Heartbeat and GetStatus called back to back on the event loop while the aggregation
    thread retires and issues jobs, with a thread switch every microsecond. The oracle: a job
    whose client has not started pushing a newer one is CURRENT or COMPLETED, never another
    state (nor a KeyError); it never goes back from COMPLETED to CURRENT; and every version a
    reader is told is one GetModel can serve at that moment."""
    layout = ModelLayout.from_named_shapes([("w", (3,)), ("b", (2,))])
    srv = RunningServer(strategy="fedasync", rate_limit_per_second=0.0, retained_versions=4)
    clients = [f"c{i}" for i in range(3)]
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    with Client(srv.address, clients[0], retries=0) as first:
        first.register(layout=layout, initial=torch.randn(layout.numel, generator=gen))
    for cid in clients[1:]:
        with Client(srv.address, cid, retries=0) as c:
            c.register(layout=layout)
    fed = srv.federation
    service = S.AggregationService(fed)
    ctx = _Context()
    deltas = [torch.randn(layout.numel, generator=gen) for _ in range(8)]
    current: dict[str, int] = {}
    pushing: dict[str, int] = {}  # the job whose update the client has started to push
    problems: list[str] = []
    seen: dict[tuple[str, int], list[int]] = {}
    stop = asyncio.Event()

    async def updater(cid: str) -> None:
        n = 0
        while not stop.is_set():
            job, _, lease = await fed.next_job(cid)
            lease.release()  # no stream reads it
            current[cid] = job.job_id
            await asyncio.sleep(0)
            pushing[cid] = job.job_id
            tensor = deltas[n % len(deltas)]
            update = Update(cid, job.job_id, job.base_version, f"{cid}-{n}", 1, 1.0,
                            UpdateKind.DELTA, tensor)  # fmt: skip
            await fed.apply_update(update, {"update": tensor})
            n += 1

    async def hammer(deadline: float) -> int:
        calls = 0
        while time.monotonic() < deadline and not problems:
            for cid in clients:
                job_id = current.get(cid)
                if job_id is None:
                    continue
                request = pb.HeartbeatRequest(client_id=cid, job_id=str(job_id))
                try:
                    resp = await service.Heartbeat(request, ctx)
                except Exception as exc:  # noqa: BLE001 - any exception is the finding
                    problems.append(f"Heartbeat raised {type(exc).__name__}: {exc}")
                    break
                if resp.latest_version not in fed.snapshots:
                    problems.append(f"Heartbeat named v{resp.latest_version}, not published")
                states = seen.setdefault((cid, job_id), [])
                states.append(resp.job_state)
                if pushing.get(cid, 0) <= job_id and resp.job_state not in (
                    pb.JOB_STATE_CURRENT, pb.JOB_STATE_COMPLETED,
                ):  # fmt: skip
                    problems.append(
                        f"job {job_id} of {cid} read as {pb.JobState.Name(resp.job_state)}"
                    )
                if states[-1] == pb.JOB_STATE_CURRENT and pb.JOB_STATE_COMPLETED in states:
                    problems.append(f"job {job_id} of {cid} went back from COMPLETED to CURRENT")
                calls += 1
            if calls % 16 == 0:
                status = await service.GetStatus(pb.GetStatusRequest(), ctx)
                if status.version not in fed.snapshots:
                    problems.append(f"GetStatus named v{status.version}, not published")
            await asyncio.sleep(0)
        return calls

    async def run() -> int:
        tasks = [asyncio.ensure_future(updater(cid)) for cid in clients]
        try:
            return await hammer(time.monotonic() + 2.5)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        calls = srv.run(run())
    finally:
        sys.setswitchinterval(interval)
        srv.stop()
    assert not problems, problems[:5]
    print(f"{calls} heartbeats, {fed.version} versions")
    assert calls > 200 and fed.version > 50, (calls, fed.version)


# ------------------------------------------------------------------ offered weights on a shard


def test_a_sharded_rank0_reads_offered_weights_in_at_most_max_concurrent_uploads_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight Registers offer weights at once to a sharded rank 0 (its staging slots hold its
    slice only): at most max_concurrent_uploads whole-model buffers are alive at any time, the
    others wait their turn, and all eight are then read and checked (a corrupt one refused)."""
    whole = ModelLayout.from_named_shapes([("a", (37, 11)), ("b", (29,))])
    limit = 3
    config = ServerConfig(auth="none", state_dir="", durability="off", device="cpu",
                          max_concurrent_uploads=limit, rate_limit_per_second=0.0)  # fmt: skip
    fed = F.Federation(config)
    fed.layout = ShardLayout(whole, ShardMap.even(whole.numel, 2), 0)
    service = S.AggregationService(fed)
    alive: set[int] = set()
    peak = [0]
    real = F.staging_slot

    def counted(layout: ModelLayout, pin_memory: bool = False):  # noqa: ANN202
        slot = real(layout, pin_memory=pin_memory)
        if layout is whole:
            alive.add(id(slot))
            peak[0] = max(peak[0], len(alive))
            weakref.finalize(slot, alive.discard, id(slot))
        return slot

    monkeypatch.setattr(F, "staging_slot", counted)
    monkeypatch.setattr(S, "staging_slot", counted, raising=False)
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    weights = torch.randn(whole.numel, generator=gen)
    header = pb.RegisterHeader(
        client_id="x", layout=P.layout_to_pb(whole), layout_hash=whole.hash,
        initial_dtype=tpb.WIRE_DTYPE_FLOAT32,
        initial_tensors=[tpb.TensorInfo(name="weights", numel=whole.numel)],
    )  # fmt: skip
    body = list(P.chunk_stream({"weights": weights}, P.WireDtype.FLOAT32, 1024,
                               pb.RegisterRequest))  # fmt: skip
    corrupt = pb.RegisterRequest()
    corrupt.CopyFrom(body[-1])
    corrupt.trailer.crc32c ^= 1

    async def run() -> list[str]:
        gate = asyncio.Event()

        async def stream(i: int):  # noqa: ANN202
            yield body[0]
            await gate.wait()  # hold the buffer until every register has started
            for msg in body[1:-1]:
                yield msg
            yield corrupt if i == 7 else body[-1]

        async def one(i: int) -> str:
            try:
                await service._check_offered_weights(header, stream(i).__aiter__(), _Context())
            except AssertionError as exc:
                return str(exc)
            return "ok"

        tasks = [asyncio.ensure_future(one(i)) for i in range(8)]
        for _ in range(50):
            await asyncio.sleep(0.01)
        held = len(alive)
        gate.set()
        answers = await asyncio.gather(*tasks)
        return [str(held), *answers]

    try:
        held, *answers = asyncio.run(run())
    finally:
        fed.shutdown_threads()
    assert int(held) == limit, held
    assert peak[0] == limit, peak
    assert answers[:7] == ["ok"] * 7
    assert "DATA_LOSS" in answers[7] or "crc" in answers[7].lower(), answers[7]
    assert not alive


# ------------------------------------------------------------------ device copies from a slot


class _SimulatedDevice:
    """Copies to a "device" that reads the source later, as a non_blocking copy from pinned
    memory does: each copy's source bytes are read by a thread ``lag`` seconds after it was
    queued, and compared with what they were when it was queued (what the GPU should read).
    An event recorded after some copies completes when those copies' reads are done."""

    def __init__(self, lag: float) -> None:
        self.lag = lag
        self.reads: list[threading.Event] = []
        self.overwritten: list[str] = []

    def copy(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        expected = t.clone()
        done = threading.Event()
        self.reads.append(done)

        def read_late() -> None:
            time.sleep(self.lag)
            if not torch.equal(t, expected):
                self.overwritten.append("the slot changed before the device read it")
            done.set()

        threading.Thread(target=read_late, daemon=True).start()
        return expected  # what the strategy computes with (the stream orders it after the copy)

    def event(self, device: torch.device) -> _SimulatedEvent:
        return _SimulatedEvent(list(self.reads))


class _SimulatedEvent:
    def __init__(self, reads: list[threading.Event]) -> None:
        self._reads = reads

    def query(self) -> bool:
        return all(r.is_set() for r in self._reads)

    def synchronize(self) -> None:
        for r in self._reads:
            r.wait()


def test_a_slot_is_not_reused_before_the_device_copy_from_it_completes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One staging slot, two clients pushing in turn. The device copy out of the slot is read
    0.3 s late (a simulated non_blocking copy from pinned memory): the next upload must not be
    decoded into the slot before that read, and the event loop never waits for it meanwhile."""
    device = _SimulatedDevice(lag=0.3)
    monkeypatch.setattr(S, "_on_device", device.copy)
    monkeypatch.setattr(transport_decoder, "device_event", device.event, raising=False)
    layout = ModelLayout.from_named_shapes([("w", (64, 17)), ("b", (13,))])
    # The simulated device is the CPU (on a GPU machine the server would otherwise pick CUDA).
    srv = RunningServer(
        strategy="fedasync", max_concurrent_uploads=1, rate_limit_per_second=0.0, device="cpu"
    )
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    deltas = [torch.randn(layout.numel, generator=gen) for _ in range(6)]
    errors: list[str] = []
    try:
        with Client(srv.address, "c0", retries=0) as c0:
            c0.register(layout=layout, initial=torch.zeros(layout.numel))
        longest_gap = [0.0]

        def push(cid: str, mine: list[torch.Tensor]) -> None:
            _push_all(srv.address, cid, layout, mine, errors)

        async def probe_loop(stop: asyncio.Event) -> None:
            """The longest time the event loop did not run a 10 ms timer's callback."""
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                longest_gap[0] = max(longest_gap[0], now - last - 0.01)
                last = now

        stop = asyncio.Event()
        watcher = asyncio.run_coroutine_threadsafe(probe_loop(stop), srv.loop)
        pushers = [threading.Thread(target=push, args=(f"p{i}", deltas[i::2])) for i in range(2)]
        for t in pushers:
            t.start()
        for t in pushers:
            t.join(60)
        srv.loop.call_soon_threadsafe(stop.set)
        watcher.result(10)
        assert not errors, errors
        assert srv.federation.version == len(deltas)
        assert len(device.reads) == len(deltas)
        assert all(read.wait(5) for read in device.reads)
        assert not device.overwritten, device.overwritten
        assert longest_gap[0] < device.lag / 2, longest_gap  # the loop polled, never blocked
    finally:
        srv.stop()


# ------------------------------------------------------------------ the same on a real GPU


def _push_all(
    address: str, cid: str, layout: ModelLayout, deltas: list[torch.Tensor], errors: list[str]
) -> None:
    """Register ``cid`` and push each delta for a new job; errors are collected, not raised."""
    try:
        with Client(address, cid, retries=0) as c:
            c.register(layout=layout)
            for delta in deltas:
                c.push(c.get_job(), delta, num_samples=2)
    except Exception as exc:  # noqa: BLE001
        errors.append(repr(exc))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# GPU cycles the stream spends in a sleep kernel queued before a copy (about 0.2 s at 2 GHz),
# so that the copy out of pinned memory certainly has not run when the host goes on.
LATE_CYCLES = 400_000_000


@needs_cuda
def test_cuda_a_fenced_slot_is_idle_only_once_the_copy_read_it() -> None:
    """A non_blocking copy from a pinned slot, queued behind a sleeping kernel: overwriting the
    slot at once changes what the device gets (the hazard, shown), while waiting until the
    slot's fence says idle keeps the device's copy intact."""
    from aggsrv.transport import StagingSlot

    device = torch.device("cuda")
    slot = StagingSlot(1 << 22, pin_memory=True)
    before, after = torch.full((1 << 22,), 1.0), torch.full((1 << 22,), 2.0)

    slot.flat.copy_(before)
    torch.cuda._sleep(LATE_CYCLES)
    unfenced = slot.flat.to(device, non_blocking=True)
    slot.flat.copy_(after)  # what the server did: the next upload lands at once
    torch.cuda.synchronize()
    assert torch.equal(unfenced.cpu(), after)  # the device read the next upload's bytes

    slot.flat.copy_(before)
    torch.cuda._sleep(LATE_CYCLES)
    fenced = slot.flat.to(device, non_blocking=True)
    slot.fence(device)
    assert not slot.idle()
    while not slot.idle():
        time.sleep(0.001)
    slot.flat.copy_(after)
    torch.cuda.synchronize()
    assert torch.equal(fenced.cpu(), before)


@needs_cuda
def test_cuda_server_uploads_reach_the_device_intact_when_copies_run_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CUDA server with one staging slot and two clients pushing in turn, each copy to the
    device queued behind a sleeping kernel: every update the strategy got equals what its
    client sent."""
    real = S._on_device
    got: list[tuple[torch.Tensor, torch.Tensor]] = []

    def late(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        torch.cuda._sleep(LATE_CYCLES // 4)
        out = real(t, device)
        got.append((out, t.clone()))  # what the slot held when the copy was queued
        return out

    monkeypatch.setattr(S, "_on_device", late)
    layout = ModelLayout.from_named_shapes([("w", (512, 301)), ("b", (17,))])
    srv = RunningServer(strategy="fedasync", device="cuda", max_concurrent_uploads=1,
                        rate_limit_per_second=0.0)  # fmt: skip
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    deltas = [torch.randn(layout.numel, generator=gen) for _ in range(6)]
    errors: list[str] = []
    try:
        with Client(srv.address, "c0", retries=0) as c0:
            c0.register(layout=layout, initial=torch.zeros(layout.numel))

        def push(cid: str, mine: list[torch.Tensor]) -> None:
            _push_all(srv.address, cid, layout, mine, errors)

        pushers = [threading.Thread(target=push, args=(f"p{i}", deltas[i::2])) for i in range(2)]
        for t in pushers:
            t.start()
        for t in pushers:
            t.join(120)
        assert not errors, errors
        torch.cuda.synchronize()
        assert len(got) == len(deltas)
        for on_device, sent in got:
            assert torch.equal(on_device.cpu(), sent)
    finally:
        srv.stop()
