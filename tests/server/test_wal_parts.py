"""A record whose tensors were logged ahead of it in parts (aggsrv.server.upload_log): it reads
back whole and bit for bit, with parts out of order, interleaved with other records and with
parts that no record claims; it is never written into another segment than its parts; a log
whose claimed parts are missing is refused, not read short; a torn tail through the parts
loses nothing before it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from aggsrv.server import durability as D
from aggsrv.server.call_log import CallLog
from aggsrv.server.fail_stop import FailStop
from aggsrv.server.metrics import ServerMetrics
from aggsrv.server.persistence import RecoveryError, StateStore
from aggsrv.server.upload_log import UploadLog


def _records(directory: Path) -> list[D.WalRecord]:
    return [r for _, r in D.iter_records(directory, 0)]


def _parts(wal: D.WriteAheadLog, key: str, name: str, t: torch.Tensor, cuts: list[int]) -> int:
    """Log ``t`` as parts cut at ``cuts``, in a shuffled order; the first part's LSN."""
    bounds = [0, *cuts, t.numel()]
    pieces = list(zip(bounds, bounds[1:], strict=False))
    random.shuffle(pieces)
    lsns = [
        wal.append(D.PART_KIND, {"key": key, "tensor": name, "start": a}, {"data": t[a:b]})
        for a, b in pieces
    ]
    return min(lsns)


def test_a_record_written_in_parts_reads_back_whole(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    random.seed(int(torch.randint(0, 2**31, (1,), generator=g)))
    update = torch.randn(10_007, generator=g)
    buffers = torch.randn(13, generator=g)
    stray = torch.randn(999, generator=g)
    with D.WriteAheadLog(tmp_path, 1) as wal:
        wal.append("job", {"n": 1})
        # Another upload's parts that nothing claims (it was refused), under a key of its own.
        _parts(wal, "refused", "update", stray, [500])
        _parts(wal, "k1", "update", update, sorted(random.sample(range(1, 10_007), 6)))
        wal.append("job", {"n": 2})
        _parts(wal, "k1", "buffers", buffers, [])
        claim = {"parts": "k1", "part_tensors": [["update", 10_007], ["buffers", 13]]}
        wal.append("update", {"client": "a", **claim})
        wal.append("update", {"client": "b"}, {"update": stray[:5]})
    records = _records(tmp_path)
    assert [r.kind for r in records] == ["job", "job", "update", "update"]
    whole = records[2]
    assert whole.meta == {"client": "a"}  # the claim is the reader's business
    assert list(whole.tensors) == ["update", "buffers"]
    assert torch.equal(whole.tensors["update"], update)
    assert torch.equal(whole.tensors["buffers"], buffers)
    assert torch.equal(records[3].tensors["update"], stray[:5])


def test_a_claim_is_not_written_into_another_segment_than_its_parts(tmp_path: Path) -> None:
    data = torch.arange(300, dtype=torch.float32)
    with D.WriteAheadLog(tmp_path, 1) as wal:
        first = _parts(wal, "old", "update", data, [100])
        wal.rotate(2)
        written = wal.written_lsn
        claim = {"parts": "old", "part_tensors": [["update", 300]]}
        assert wal.append("update", claim, same_segment_as=first) is None
        assert wal.written_lsn == written  # nothing written
        here = _parts(wal, "new", "update", data, [7, 200])
        claim = {"parts": "new", "part_tensors": [["update", 300]]}
        assert wal.append("update", claim, same_segment_as=here) is not None
    records = _records(tmp_path)
    assert len(records) == 1 and torch.equal(records[0].tensors["update"], data)


@pytest.mark.parametrize(
    ("cuts", "claimed", "what"),
    [
        ([100], 300, "a part missing"),
        ([100], 301, "parts shorter than the record says"),
        ([100, 100], 300, "the same elements twice"),
    ],
)
def test_a_claim_whose_parts_do_not_cover_it_is_refused(
    tmp_path: Path, cuts: list[int], claimed: int, what: str
) -> None:
    data = torch.arange(300, dtype=torch.float32)
    with D.WriteAheadLog(tmp_path, 1) as wal:
        if what == "a part missing":
            part = {"key": "k", "tensor": "update", "start": 0}
            wal.append(D.PART_KIND, part, {"data": data[:100]})
        else:
            _parts(wal, "k", "update", data, [c for c in cuts if c < 300])
            if what == "the same elements twice":
                part = {"key": "k", "tensor": "update", "start": 50}
                wal.append(D.PART_KIND, part, {"data": data[50:60]})
        wal.append("update", {"parts": "k", "part_tensors": [["update", claimed]]})
    with pytest.raises(D.WalDamaged, match="parts"):
        _records(tmp_path)


def test_recovery_refuses_a_log_whose_claimed_parts_are_missing(tmp_path: Path) -> None:
    with D.WriteAheadLog(tmp_path, 1) as wal:
        wal.append("update", {"parts": "gone", "part_tensors": [["update", 3]]})
    with pytest.raises(RecoveryError, match="cannot be replayed.*gone"):
        list(StateStore(tmp_path, durable=True).records(0))


def test_a_torn_tail_through_parts_keeps_the_records_before_it(tmp_path: Path) -> None:
    data = torch.randn(4_001)
    with D.WriteAheadLog(tmp_path, 1) as wal:
        _parts(wal, "a", "update", data, [2_000])
        wal.append("update", {"n": 1, "parts": "a", "part_tensors": [["update", 4_001]]})
        _parts(wal, "b", "update", data, [1_000, 3_000])  # the crash came before its claim
    path = D.segment_path(tmp_path, 1)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1_234)
    records = _records(tmp_path)
    assert [r.meta for r in records] == [{"n": 1}]
    assert torch.equal(records[0].tensors["update"], data)


def _call_log(tmp_path: Path) -> tuple[CallLog, D.WriteAheadLog]:
    call_log = CallLog(FailStop(lambda reason: None), ServerMetrics(CollectorRegistry()))
    wal = D.WriteAheadLog(tmp_path, 1)
    call_log.store = SimpleNamespace(wal=wal)
    return call_log, wal


def _upload(call_log: CallLog, views: dict[str, torch.Tensor], steps: int) -> UploadLog:
    # Parts of an odd size, several per tensor.
    upload = call_log.upload_log(part_bytes=4 * 97, unclaimed_limit=1 << 30)
    assert upload is not None
    for i in range(1, steps + 1):  # the chunks arrive
        upload.progress([(n, v, v.numel() * i // (steps + 1)) for n, v in views.items()])
    upload.finish(views)
    return upload


def _kinds(directory: Path) -> list[tuple[int, str]]:
    """(segment, kind) of every record on disk, part records included."""
    out = []
    for number, path in D.list_segments(directory):
        data, at = path.read_bytes(), 0
        while at < len(data):
            _, length, _ = struct.unpack_from("<4sQI", data, at)
            (meta_len,) = struct.unpack_from("<I", data, at + 16)
            out.append((number, json.loads(data[at + 20 : at + 20 + meta_len])["kind"]))
            at += 16 + length
    return out


def test_the_call_log_claims_an_uploads_parts_in_the_records_segment(tmp_path: Path) -> None:
    views = {"update": torch.randn(1_001), "buffers": torch.randn(31)}
    call_log, wal = _call_log(tmp_path)
    try:
        upload = _upload(call_log, views, steps=3)
        first_parts = len(upload.parts)
        upload.placed()  # the parts are down
        before = wal.written_lsn
        call_log.append_claiming("update", {"n": 1}, upload, views, jobs_issued=0)
        assert wal.written_lsn - before < 400  # the record names the parts: no tensor bytes
        # A checkpoint began a segment between the parts and the record: the parts are written
        # again in the record's segment (the older one goes with the checkpoint).
        upload = _upload(call_log, views, steps=2)
        second_parts = len(upload.parts)
        upload.placed()
        wal.rotate(2)
        call_log.append_claiming("update", {"n": 2}, upload, views, jobs_issued=0)
        asyncio.run(upload.settle())
    finally:
        call_log.shutdown()
        wal.close()
    kinds = _kinds(tmp_path)
    assert first_parts > 4 and second_parts > 4
    assert kinds.count((1, "part")) == first_parts + second_parts
    assert kinds.count((2, "part")) == second_parts
    assert kinds[-1] == (2, "update")
    D.list_segments(tmp_path)[0][1].unlink()  # what a checkpoint lets go
    records = _records(tmp_path)
    assert [r.meta["n"] for r in records] == [2]
    for name, view in views.items():
        assert torch.equal(records[0].tensors[name], view)
    assert call_log.updates_since_checkpoint == 2  # counted once each


def test_settle_drops_the_parts_not_begun_without_waiting_for_the_writers(
    tmp_path: Path,
) -> None:
    """An upload that is done with (refused, its caller gone) frees its slot at once, even when
    every part writer is busy with other uploads: its parts not yet begun are dropped. (A record
    made after that writes them again: the slot is freed only after the call that used it.)"""
    views = {"update": torch.randn(500)}
    call_log, wal = _call_log(tmp_path)
    gate = threading.Event()
    busy = [call_log._part_pool.submit(gate.wait, 30) for _ in range(2)]  # every writer is busy
    try:
        upload = _upload(call_log, views, steps=2)
        t0 = time.monotonic()
        asyncio.run(upload.settle())
        assert time.monotonic() - t0 < 5
        assert all(part.write.cancelled() for part in upload.parts)
        assert upload.unclaimed_bytes() == 0  # nothing was written
        assert all(where == (None, None) for where in upload.placed())
        gate.set()
        call_log.append_claiming("update", {"n": 1}, upload, views, jobs_issued=0)
        for b in busy:
            b.result()
    finally:
        gate.set()
        call_log.shutdown()
        wal.close()
    (record,) = _records(tmp_path)
    assert torch.equal(record.tensors["update"], views["update"])


def test_uploads_nothing_claims_stop_being_logged_ahead_until_the_next_segment(
    tmp_path: Path,
) -> None:
    """A shard of rank >= 1 cannot checkpoint on its own: slices sent to it alone are never
    ordered, and logging them ahead would grow its log without bound. Past the limit of
    unclaimed part bytes in a segment, uploads are not logged ahead (the record of one that is
    applied holds its tensors); a new segment starts the count again."""
    views = {"update": torch.randn(1_000)}  # 4,000 bytes a time
    call_log, wal = _call_log(tmp_path)
    limit = 10_000
    try:
        for _ in range(3):  # 12,000 bytes that no record names
            upload = call_log.upload_log(1024, limit)
            assert upload is not None
            upload.progress([("update", views["update"], 1_000)])
            upload.finish(views)
            upload.placed()
            asyncio.run(upload.settle())
            call_log.settled(upload)
        assert call_log.upload_log(1024, limit) is None
        assert call_log.upload_log(0, 10 * limit) is None  # wal_part_bytes = 0: off
        # An applied upload that was not logged ahead is logged whole.
        call_log.append_claiming("update", {"n": 1}, None, views, jobs_issued=0)
        wal.rotate(2)  # a checkpoint
        upload = call_log.upload_log(1024, limit)
        assert upload is not None
        upload.finish(views)
        call_log.append_claiming("update", {"n": 2}, upload, views, jobs_issued=0)
        asyncio.run(upload.settle())
        call_log.settled(upload)
        assert upload.unclaimed_bytes() == 0  # claimed: it counts for nothing
        assert call_log.upload_log(1024, limit) is not None
    finally:
        call_log.shutdown()
        wal.close()
    records = _records(tmp_path)
    assert [r.meta["n"] for r in records] == [1, 2]
    assert all(torch.equal(r.tensors["update"], views["update"]) for r in records)


def test_a_part_kept_as_wire_bytes_decodes_or_is_refused(tmp_path: Path) -> None:
    """A quantized section logged as it came reads back as the values it decodes to; one whose
    bytes no longer decode (a scale turned NaN) is refused, not read as something else."""
    from aggsrv.transport import Quantization, quantize

    values = torch.randn(300)
    wire, decoded = quantize(values, Quantization.INT4, 64)
    section = {"encoding": "dense", "nnz": 0, "numel": 300, "quantization": "int4",
               "block": 64, "dtype": "float32"}  # fmt: skip
    bad = bytearray(wire)
    bad[0:4] = bytes.fromhex("0000c07f")
    for directory, raw in ((tmp_path / "good", wire), (tmp_path / "bad", bytes(bad))):
        with D.WriteAheadLog(directory, 1) as wal:
            meta = {"key": "k", "tensor": "update", "start": 0, "section": section}
            wire_bytes = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            wal.append(D.PART_KIND, meta, {"wire": wire_bytes})
            wal.append("update", {"parts": "k", "part_tensors": [["update", 300]]})
    (record,) = _records(tmp_path / "good")
    assert torch.equal(record.tensors["update"], decoded)
    with pytest.raises(D.WalDamaged, match="does not decode.*scale of block 0"):
        _records(tmp_path / "bad")
