"""A durable server's log, checkpoints, recovery and publication, on loopback gRPC:

* GetJob appends (and fsyncs) a record only when it changed the strategy's state, and is rate
  limited per call; the log stays bounded under floods (``checkpoint_every_bytes``);
* a checkpoint holds a tensor shared by many jobs once, and a restored server holds what the
  live one held (``Federation.cache_bytes``);
* the log is replayed on the aggregation thread;
* DUPLICATE and refusal counters count since this start, accepted and applied ones survive;
* a version reaches readers only once its log record is fsynced;
* a device model is copied to the host once per version, off the event loop.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from server_helpers import RunningServer
from state_helpers import assert_same_state

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import durability as D
from aggsrv.server import federation as F
from aggsrv.server import versions as V
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.values import Status, UpdateKind


def durable(tmp_path: Path, **config) -> RunningServer:
    settings = {
        "durability": "on", "state_dir": str(tmp_path / "state"), "rate_limit_per_second": 0.0,
        **config,
    }  # fmt: skip
    return RunningServer(**settings)


def logged(srv: RunningServer) -> list[D.WalRecord]:
    return [r for _, r in D.iter_records(srv.config.state_dir, 0)]


def odd_layout(d: int) -> ModelLayout:
    return ModelLayout.from_named_shapes([("a.weight", (d // 3, 3)), ("a.bias", (d - d // 3 * 3,))])


def test_repeated_getjob_appends_and_syncs_nothing(tmp_path: Path) -> None:
    srv = durable(tmp_path, strategy="fedasync")
    layout = odd_layout(41)
    try:
        with Client(srv.address, "a") as c:
            c.register(layout=layout, initial=torch.randn(layout.numel))
            first = c.get_job()
            wal = srv.federation.store.wal
            written, syncs = wal.written_lsn, wal.fsync_count
            for _ in range(25):
                assert c.get_job().job_id == first.job_id  # the same job: nothing new
            assert (wal.written_lsn, wal.fsync_count) == (written, syncs)
            res = c.push(first, torch.randn(layout.numel) * 0.01, kind=UpdateKind.DELTA)
            assert res.status is Status.APPLIED
            second = c.get_job()
            assert second.job_id != first.job_id and second.base_version == 1
            assert wal.written_lsn > written
    finally:
        srv.stop()
    assert [r.kind for r in logged(srv)].count("job") == 2


def test_waiting_getjob_streams_log_nothing_when_woken(tmp_path: Path) -> None:
    # One of four clients is sampled per round: the other three wait in GetJob, woken by every
    # version and every pending_interval; only jobs that were created may reach the log.
    srv = durable(
        tmp_path, strategy="fedavg", pending_interval_seconds=0.05,
        strategy_config={"mode": "sync", "participation": 1, "min_clients": 1},
    )  # fmt: skip
    layout = odd_layout(29)
    stop = threading.Event()
    errors: list[str] = []

    def client(i: int) -> None:
        with Client(srv.address, f"c{i}", timeout=30) as c:
            c.register(layout=layout, initial=torch.randn(layout.numel) if i == 0 else None)
            registered.wait(10)
            while not stop.is_set():
                try:
                    job = c.get_job(timeout=1.0)
                    c.push(job, torch.randn(layout.numel) * 0.01, kind=UpdateKind.DELTA)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        errors.append(f"{exc.code().name}: {exc.details()}")

    registered = threading.Event()
    try:
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
        threads[0].start()
        while srv.strategy is None:
            time.sleep(0.01)
        for t in threads[1:]:
            t.start()
        while len(srv.federation.clients) < 4:
            time.sleep(0.01)
        registered.set()
        give_up = time.monotonic() + 30
        while srv.federation.version < 8 and time.monotonic() < give_up:
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        assert srv.federation.version >= 8, "too few rounds to mean anything"
        issued = srv.run(srv.federation.call(lambda: srv.strategy.jobs_issued))
    finally:
        stop.set()
        srv.stop()
    assert not errors, errors
    assert [r.kind for r in logged(srv)].count("job") == issued


def _get_job_stream(address: str, client_id: str, layout: ModelLayout):
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.AggregationStub(channel)
    request = pb.GetJobRequest(client_id=client_id, layout_hash=layout.hash)
    return channel, stub.GetJob(request, timeout=10)


def test_getjob_is_rate_limited_per_call_not_per_pending_message(tmp_path: Path) -> None:
    srv = RunningServer(
        strategy="fedavg", pending_interval_seconds=0.02, rate_limit_per_second=0.01,
        rate_limit_burst=3, strategy_config={"mode": "sync", "participation": 1},
    )  # fmt: skip
    layout = odd_layout(17)
    try:
        with Client(srv.address, "a") as a, Client(srv.address, "b") as b:
            a.register(layout=layout, initial=torch.randn(layout.numel))
            b.register(layout=layout)
            (sampled,) = srv.strategy.participants
            waiting = "b" if sampled == "a" else "a"
            # One call that waits: many pending messages, one token.
            channel, stream = _get_job_stream(srv.address, waiting, layout)
            for pending, msg in enumerate(stream, 1):
                assert msg.WhichOneof("kind") == "pending"
                if pending == 8:
                    break
            stream.cancel()
            channel.close()
            # Two tokens left for this client, then RESOURCE_EXHAUSTED naming the limit.
            for _ in range(2):
                channel, stream = _get_job_stream(srv.address, waiting, layout)
                assert next(stream).WhichOneof("kind") == "pending"
                stream.cancel()
                channel.close()
            channel, stream = _get_job_stream(srv.address, waiting, layout)
            with pytest.raises(grpc.RpcError) as refused:
                next(stream)
            channel.close()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "rate limit" in refused.value.details()
            # Per client: the other one still gets its job, and pushes keep their own budget.
            job = (a if sampled == "a" else b).get_job()
            assert job.base_version == 0
    finally:
        srv.stop()


def test_log_stays_bounded_under_getjob_and_register_floods(tmp_path: Path) -> None:
    limit = 6144
    srv = durable(
        tmp_path, strategy="fedasync", checkpoint_every_bytes=limit, checkpoint_keep=2,
        checkpoint_every_updates=0, checkpoint_every_seconds=0,
    )  # fmt: skip
    layout = odd_layout(23)
    state = Path(srv.config.state_dir)
    try:
        with Client(srv.address, "a") as c:
            c.register(layout=layout, initial=torch.randn(layout.numel))
            for i in range(100):
                c.get_job()
                c.heartbeat()
                c.register(layout=layout, labels={"round": str(i)})  # each one is logged
                on_disk = sum(p.stat().st_size for _, p in D.list_segments(state))
                assert on_disk <= 3 * limit, f"{on_disk} log bytes on disk after {i} floods"
            status = c.status()
        assert status.wal_bytes <= limit + 1024
        assert len(D.list_checkpoints(state)) == 2  # checkpoints were written, old ones pruned
    finally:
        srv.stop()


def test_log_stays_bounded_under_uploads_that_log_nothing(tmp_path: Path) -> None:
    """An upload is written to the log while it arrives, before anything decides whether it is
    applied: one refused once it arrived whole leaves its bytes in the log with no record. They
    count toward checkpoint_every_bytes like any others, so a flood of them is bounded."""
    limit = 64 * 1024
    srv = durable(
        tmp_path, strategy="fedasync", checkpoint_every_bytes=limit, checkpoint_keep=2,
        checkpoint_every_updates=0, checkpoint_every_seconds=0, wal_part_bytes=1024,
    )  # fmt: skip
    layout = odd_layout(3_001)
    state = Path(srv.config.state_dir)
    try:
        with Client(srv.address, "a") as c:
            c.register(layout=layout, initial=torch.randn(layout.numel))
            job = c.get_job()
            delta = torch.randn(layout.numel) * 0.01
            assert c.push(job, delta, update_id="u").status is Status.APPLIED
            bad = delta.clone()
            bad[-1] = float("nan")  # refused once it arrived whole: its parts are logged
            for i in range(60):  # 12 KB each
                with pytest.raises(grpc.RpcError) as refused:
                    c.push(job, bad, update_id=f"nan{i}")
                assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value
                on_disk = _log_bytes_on_disk(state)
                assert on_disk <= 3 * limit, f"{on_disk} log bytes on disk after {i} uploads"
    finally:
        srv.stop()


def test_fedogd_checkpoint_holds_a_basis_shared_by_fifty_jobs_once(tmp_path: Path) -> None:
    d = 30_011
    srv = durable(tmp_path, strategy="fedogd", retained_versions=1, max_clients=64)
    fed = srv.federation
    layout = odd_layout(d)
    try:
        with Client(srv.address, "c0") as c:
            c.register(layout=layout, initial=torch.randn(d))
        for i in range(1, 50):
            srv.run(fed.register(f"c{i}", {}))
        without_jobs = srv.run(fed.checkpoint()).bytes
        for i in range(50):
            job, _, lease = srv.run(fed.next_job(f"c{i}"))
            assert job is not None
            lease.release()
        with_jobs = srv.run(fed.checkpoint()).bytes
        live_bytes = srv.run(fed.call(fed.cache_bytes))
    finally:
        srv.stop()
    # Fifty jobs add their metadata, not fifty bases (each 4 * d bytes).
    assert with_jobs - without_jobs < 4 * d, (without_jobs, with_jobs)
    resumed = durable(tmp_path, strategy="fedogd", retained_versions=1, max_clients=64, resume=True)
    try:
        assert len(resumed.strategy.jobs.open) == 50
        restored_bytes = resumed.run(resumed.federation.call(resumed.federation.cache_bytes))
        # Equal but for the layout's small index tables, which are made when first used.
        assert abs(restored_bytes - live_bytes) < 1024, (restored_bytes, live_bytes)
    finally:
        resumed.stop()


def test_resume_replays_the_log_on_the_aggregation_thread(tmp_path, monkeypatch) -> None:
    srv = durable(tmp_path, strategy="fedbuff", strategy_config={"buffer_size": 2})
    layout = odd_layout(19)
    try:
        with Client(srv.address, "a") as c:
            c.register(layout=layout, initial=torch.randn(layout.numel))
            for _ in range(3):
                c.push(c.get_job(), torch.randn(layout.numel) * 0.01, kind=UpdateKind.DELTA)
        live = srv.state()
    finally:
        srv.stop()
    state = Path(srv.config.state_dir)
    D.list_checkpoints(state)[-1][1].unlink()  # the final one: recovery must replay the log
    threads: list[str] = []
    replay = F.Federation.replay

    def recording(fed, record) -> None:
        threads.append(threading.current_thread().name)
        replay(fed, record)

    monkeypatch.setattr(F.Federation, "replay", recording)
    resumed = durable(tmp_path, strategy="fedbuff", strategy_config={"buffer_size": 2}, resume=True)
    try:
        assert torch.equal(resumed.state()["model"], live["model"])
    finally:
        resumed.stop()
    assert len(threads) >= 6 and all(n.startswith("aggregation") for n in threads), threads


def test_duplicate_and_refusal_counters_count_since_this_start(tmp_path: Path) -> None:
    layout = odd_layout(13)
    srv = durable(tmp_path, strategy="fedasync")
    try:
        with Client(srv.address, "a") as c:
            c.register(layout=layout, initial=torch.randn(layout.numel))
            job = c.get_job()
            delta = torch.randn(layout.numel) * 0.01
            c.push(job, delta, kind=UpdateKind.DELTA, update_id="u1")
            assert c.push(job, delta, kind=UpdateKind.DELTA, update_id="u1").original
            with pytest.raises(grpc.RpcError):
                c.push(job, delta, kind=UpdateKind.DELTA, update_id="u2")  # job completed
            before = c.status()
        srv.run(srv.federation.checkpoint())  # the counters are in the newest checkpoint
    finally:
        srv.stop()
    assert (before.updates_accepted, before.updates_applied) == (1, 1)
    assert (before.updates_duplicate, before.updates_rejected) == (1, 1)
    resumed = durable(tmp_path, strategy="fedasync", resume=True)
    try:
        with Client(resumed.address, "a") as c:
            after = c.status()
            assert (after.updates_accepted, after.updates_applied) == (1, 1)  # in the log
            assert (after.updates_duplicate, after.updates_rejected) == (0, 0)  # since start
            assert dict(after.rejected_by_code) == {}
            c.layout = layout
            assert c.push(job, delta, kind=UpdateKind.DELTA, update_id="u1").original
            assert c.status().updates_duplicate == 1
    finally:
        resumed.stop()


def test_a_version_reaches_readers_only_once_its_record_is_durable(tmp_path, monkeypatch) -> None:
    layout = odd_layout(31)
    srv = durable(tmp_path, strategy="fedasync")
    gate = threading.Event()
    gate.set()
    real = D.os.fdatasync

    def gated(fd: int) -> None:
        assert gate.wait(20)
        real(fd)

    monkeypatch.setattr(D.os, "fdatasync", gated)
    try:
        with Client(srv.address, "a") as a, Client(srv.address, "reader") as reader:
            initial = torch.randn(layout.numel)
            a.register(layout=layout, initial=initial)
            job = a.get_job()
            wal = srv.federation.store.wal
            written = wal.written_lsn
            gate.clear()  # the next fsync hangs: the update's record is written, not durable
            acked: list = []
            push = threading.Thread(
                target=lambda: acked.append(
                    a.push(job, torch.randn(layout.numel) * 0.01, kind=UpdateKind.DELTA)
                ),
                daemon=True,
            )
            push.start()
            # The upload's bytes may reach the log before its update record: wait for the apply.
            give_up = time.monotonic() + 20
            while (
                wal.written_lsn == written or srv.strategy.version != 1
            ) and time.monotonic() < give_up:
                time.sleep(0.01)
            assert srv.strategy.version == 1 and wal.durable_lsn < wal.written_lsn
            version, weights = reader.get_model()
            assert version == 0 and torch.equal(weights, initial)
            assert reader.status().version == 0
            assert a.heartbeat().latest_version == 0
            assert not acked
            gate.set()
            push.join(timeout=20)
            assert acked and acked[0].version == 1
            assert reader.get_model()[0] == 1 and reader.status().version == 1
    finally:
        gate.set()
        srv.stop()


def test_device_models_are_copied_to_the_host_once_per_version_off_the_loop(monkeypatch) -> None:
    # No GPU needed: every tensor counts as a device tensor and the copy is slow and counted.
    copies: list[tuple[int, int]] = []  # (storage, numel) of each copy
    pinned: list[bool] = []  # whether each copy was asked for in pinned memory
    copying = threading.Event()

    def slow_copy(t: torch.Tensor, pin: bool = False) -> torch.Tensor:
        copies.append((t.untyped_storage().data_ptr(), t.numel()))
        pinned.append(pin)
        copying.set()
        time.sleep(0.4)
        return t.detach().clone()

    monkeypatch.setattr(V, "needs_host_copy", lambda t: True)
    monkeypatch.setattr(V, "to_host", slow_copy)
    layout = odd_layout(57)
    srv = RunningServer(strategy="fedasync", rate_limit_per_second=0.0)
    try:
        with Client(srv.address, "a") as a, Client(srv.address, "status") as probe:
            a.register(layout=layout, initial=torch.randn(layout.numel))
            want = srv.model()
            got: list[tuple[int, torch.Tensor]] = []

            def read() -> None:
                with Client(srv.address, "r") as r:
                    got.append(r.get_model())

            readers = [threading.Thread(target=read, daemon=True) for _ in range(6)]
            for t in readers:
                t.start()
            assert copying.wait(10)
            t0 = time.monotonic()
            probe.status()  # answered while the copy is still running: the loop is free
            assert time.monotonic() - t0 < 0.3
            for t in readers:
                t.join(timeout=20)
            assert len(got) == 6 and all(v == 0 and torch.equal(w, want) for v, w in got)
            assert len(copies) == 1
            a.push(a.get_job(), torch.randn(layout.numel) * 0.01, kind=UpdateKind.DELTA)
            assert len(copies) == 1  # the job carried version 0's host copy
            for _ in range(3):
                version, weights = a.get_model()
                assert version == 1 and torch.equal(weights, srv.model())
            job = a.get_job()
            assert torch.equal(job.weights, srv.model())
            assert len(copies) == 2, copies  # one for version 1, shared by readers and jobs
            assert all(pinned), pinned  # a copy every reader of a version shares: pinned
    finally:
        srv.stop()


def test_an_update_is_logged_once_while_it_arrives_and_replays_bit_for_bit(tmp_path) -> None:
    """The decoded upload goes to the log in parts while it arrives; the update's record names
    them: the log grows by the update's bytes once (not twice), and a resumed server reads the
    record back whole, so its model is the live one's."""
    d = 700_001  # 2.8 MB: two whole parts of 1 MiB and what is left
    srv = durable(tmp_path, strategy="fedasync", checkpoint_every_updates=0)
    layout = odd_layout(d)
    sent = []
    try:
        with Client(srv.address, "a") as c:
            c.register(layout=layout, initial=torch.randn(d))
            for _ in range(3):
                job = c.get_job()
                wal = srv.federation.store.wal
                before = wal.written_lsn
                sent.append(torch.randn(d) * 0.01)
                c.push(job, sent[-1], kind=UpdateKind.DELTA, encoding="dense")
                grown = wal.written_lsn - before
                assert 4 * d < grown < 4 * d + 2_048, grown
        live = srv.state()
    finally:
        srv.stop()
    raw = [kinds for _, path in D.list_segments(srv.config.state_dir) for kinds in _raw(path)]
    claims = [meta for kind, meta, tensors in raw if kind == "update"]
    assert len(claims) == 3 and all("parts" in m and m["part_tensors"] == [["update", d]]
                                    for m in claims)  # fmt: skip
    assert not [t for kind, _, t in raw if kind == "update" and t]  # no tensor bytes in them
    parts = [(meta["key"], meta["start"], t) for kind, meta, t in raw if kind == "part"]
    assert sorted(parts) == sorted(
        (m["parts"], start, [["data", min(MIB // 4, d - start)]])
        for m in claims for start in range(0, d, MIB // 4)
    )  # fmt: skip
    updates = [r for r in logged(srv) if r.kind == "update"]
    assert len(updates) == 3
    for record, delta in zip(updates, sent, strict=True):
        assert torch.equal(record.tensors["update"], delta)
        assert "parts" not in record.meta
    state = Path(srv.config.state_dir)
    D.list_checkpoints(state)[-1][1].unlink()  # the final one: recovery must replay the log
    resumed = durable(tmp_path, strategy="fedasync", checkpoint_every_updates=0, resume=True)
    try:
        assert torch.equal(resumed.state()["model"], live["model"])
    finally:
        resumed.stop()


MIB = 1 << 20


def _raw(path: Path) -> list[tuple[str, dict, list]]:
    """(kind, meta, tensors) of every record of a segment as it is on disk (the format of
    aggsrv.server.durability's docstring: magic, body length u64, CRC u32, then the body, whose
    first u32 is the meta's length)."""
    import json
    import struct

    out, data, at = [], path.read_bytes(), 0
    while at < len(data):
        magic, length, _ = struct.unpack_from("<4sQI", data, at)
        assert magic == b"AWL1"
        (meta_len,) = struct.unpack_from("<I", data, at + 16)
        doc = json.loads(data[at + 20 : at + 20 + meta_len])
        out.append((doc["kind"], doc["meta"], doc["tensors"]))
        at += 16 + length
    return out


def test_a_push_whose_caller_left_keeps_its_slot_until_its_update_is_applied(tmp_path) -> None:
    """A client that gives up (its deadline passes) while its update is being applied must not
    free the staging slot under it: the next upload would land there, and the model would
    apply those bytes while the log holds the first update's. The live model and the one a
    restart rebuilds from the log are the same."""
    d = 50_003
    srv = durable(tmp_path, strategy="fedasync", max_concurrent_uploads=1, wal_part_bytes=4096)
    layout = odd_layout(d)
    entered, release = threading.Event(), threading.Event()
    try:
        with Client(srv.address, "a") as a, Client(srv.address, "b", timeout=1.0) as b:
            a.register(layout=layout, initial=torch.randn(d))
            b.register(layout=layout)
            strategy = srv.federation.strategy
            on_update = strategy.on_update

            def slow_first(update, now):  # the aggregation thread, before it reads the update
                if not entered.is_set():
                    entered.set()
                    assert release.wait(30)
                return on_update(update, now)

            strategy.on_update = slow_first
            job_b, job_a = b.get_job(), a.get_job()
            first, second = torch.randn(d) * 0.01, torch.randn(d) * 0.01
            with pytest.raises(grpc.RpcError) as gave_up:
                b.push(job_b, first, update_id="b1")  # waits in on_update, then gives up
            assert gave_up.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert entered.is_set()
            pushed = threading.Thread(target=a.push, args=(job_a, second), daemon=True)
            pushed.start()  # its upload wants the one slot
            time.sleep(0.5)
            release.set()
            pushed.join(30)
            assert not pushed.is_alive()
        live = srv.state()
    finally:
        release.set()
        srv.stop()
    updates = [r.tensors["update"] for r in logged(srv) if r.kind == "update"]
    assert len(updates) == 2 and torch.equal(updates[0], first) and torch.equal(updates[1], second)
    D.list_checkpoints(Path(srv.config.state_dir))[-1][1].unlink()
    resumed = durable(tmp_path, strategy="fedasync", resume=True)
    try:
        assert torch.equal(resumed.state()["model"], live["model"])
    finally:
        resumed.stop()


def _log_bytes_on_disk(state: Path) -> int:
    """The segments' sizes (a checkpoint may delete one while they are counted)."""
    total = 0
    for _, path in D.list_segments(state):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


@pytest.mark.parametrize("how", ["int8", "int4", "coo"])
def test_a_compressed_update_is_logged_as_it_came_and_replays_bit_for_bit(tmp_path, how) -> None:
    """The log keeps a quantized or sparse update's wire bytes, not its float32 values: it grows
    by about the compressed size, and a resumed server decodes them to the model it had."""
    from aggsrv.client.compression import Compression
    from aggsrv.transport import Quantization, quantized_nbytes

    d = 40_001
    spec = Compression(quantization=None if how == "coo" else how,
                       top_k=0.01 if how == "coo" else None)  # fmt: skip
    srv = durable(tmp_path, strategy="fedasync", checkpoint_every_updates=0)
    layout = odd_layout(d)
    try:
        with Client(srv.address, "a", compression=spec) as c:
            c.register(layout=layout, initial=torch.randn(d))
            for _ in range(3):
                job = c.get_job()
                wal = srv.federation.store.wal
                before = wal.written_lsn
                c.push(job, torch.randn(d) * 0.01)
                grown = wal.written_lsn - before
                if how == "coo":
                    wire = 400 * 8  # 1 % of the entries: an index and a float32 value each
                else:
                    wire = quantized_nbytes(Quantization.parse(how), d, 128)
                assert wire < grown < wire + 2_048, (grown, wire)
        live = srv.state()
    finally:
        srv.stop()
    D.list_checkpoints(Path(srv.config.state_dir))[-1][1].unlink()
    resumed = durable(tmp_path, strategy="fedasync", checkpoint_every_updates=0, resume=True)
    try:
        assert torch.equal(resumed.state()["model"], live["model"])
    finally:
        resumed.stop()


@pytest.mark.parametrize("strategy", ["fedasync", "fedbuff"])
@pytest.mark.parametrize("parts", [True, False], ids=["logged-as-it-arrives", "logged-whole"])
def test_a_quantized_delta_folds_from_its_codes_live_and_in_replay(
    tmp_path, monkeypatch, parts, strategy
):
    """FedAsync and FedBuff take an INT8 DELTA as codes (no float32 copy) when the log records
    the codes as they came; logged whole (no parts), the values are decoded first, as the record
    holds them. Replay takes the same path as the live server: the resumed state is the same
    bits (FedBuff's: with a delta still in its running sum)."""
    from aggsrv.client.compression import Compression
    from aggsrv.strategies import strategy_class

    cls = strategy_class(strategy)
    folded: list[int] = []
    fold = cls._apply_codes

    def counted(self, update, *args):
        folded.append(update.quantized.numel)
        return fold(self, update, *args)

    monkeypatch.setattr(cls, "_apply_codes", counted)
    d = 20_011
    config = {"strategy": strategy, "checkpoint_every_updates": 0,
              "wal_part_bytes": 1 << 20 if parts else 0}  # fmt: skip
    if strategy == "fedbuff":
        config["strategy_config"] = {"buffer_size": 2}
    srv = durable(tmp_path, **config)
    layout = odd_layout(d)
    try:
        with Client(srv.address, "a", compression=Compression(quantization="int8")) as c:
            c.register(layout=layout, initial=torch.randn(d))
            for _ in range(3):
                assert c.push(c.get_job(), torch.randn(d) * 0.01).status in (
                    Status.APPLIED, Status.BUFFERED,
                )  # fmt: skip
        live = srv.state()
        codes_logged = [r for r in logged(srv) if r.kind == "update" and "update" in r.quantized]
    finally:
        srv.stop()
    assert folded == ([d] * 3 if parts else [])
    assert len(codes_logged) == (3 if parts else 0)
    folded.clear()
    D.list_checkpoints(Path(srv.config.state_dir))[-1][1].unlink()
    resumed = durable(tmp_path, resume=True, **config)
    try:
        assert_same_state(resumed.state(), live)
    finally:
        resumed.stop()
    assert folded == ([d] * 3 if parts else [])


def test_an_update_folded_from_its_codes_does_not_replay_as_decoded_values(
    tmp_path, monkeypatch
) -> None:
    """The log says an update was folded from its codes; a server that would decode them (its
    settings changed) refuses to resume rather than round differently."""
    from aggsrv.client.compression import Compression
    from aggsrv.server.fail_stop import AggregationFailed
    from aggsrv.strategies.fedasync import FedAsync

    config = {"strategy": "fedasync", "checkpoint_every_updates": 0}
    srv = durable(tmp_path, **config)
    try:
        with Client(srv.address, "a", compression=Compression(quantization="int8")) as c:
            c.register(layout=odd_layout(5_003), initial=torch.randn(5_003))
            assert c.push(c.get_job(), torch.randn(5_003) * 0.01).status is Status.APPLIED
        assert [r.meta.get("codes") for r in logged(srv) if r.kind == "update"] == [True]
    finally:
        srv.stop()
    D.list_checkpoints(Path(srv.config.state_dir))[-1][1].unlink()
    monkeypatch.setattr(FedAsync, "folds_quantized_updates", lambda self, kind: False)
    with pytest.raises(AggregationFailed, match="folded from its INT8/INT4 codes .* resume with"):
        durable(tmp_path, resume=True, **config)
