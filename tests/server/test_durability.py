"""Tests for aggsrv.server.durability: WAL records, torn tails, group commit, checkpoints, prune.

Oracles: an independent parser of the documented record format (struct, json and a table-driven
CRC-32C written here), file sizes from the OS for LSNs, a recording fdatasync wrapper for what
was really fsynced, and the records a SIGKILLed child reported as synced. Inputs are fresh random
draws; the seed is in every assertion message.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from crc_oracle import crc32c_oracle

from aggsrv.server import durability as D
from aggsrv.server.durability import (
    WAL_MAGIC,
    WalRecord,
    WriteAheadLog,
    checkpoint_path,
    iter_records,
    latest_checkpoint,
    list_checkpoints,
    list_segments,
    load_checkpoint,
    prune,
    scan_segment,
    segment_path,
    write_checkpoint,
)

ROOT = Path(__file__).resolve().parents[2]
KINDS = ["register", "job", "update", "timer"]
SIZES = [1, 7, 1001, 0, 33]

# --------------------------------------------------------------------------------------------
# Oracles and helpers
# --------------------------------------------------------------------------------------------


def oracle_parse(data: bytes) -> list[tuple[int, str, dict, list[tuple[str, bytes]], int]]:
    """Parse a whole intact segment per the module docstring: (offset, kind, meta, tensors, end)."""
    out = []
    pos = 0
    while pos < len(data):
        magic, body_len, crc = struct.unpack_from("<4sQI", data, pos)
        assert magic == b"AWL1"
        body = data[pos + 16 : pos + 16 + body_len]
        assert len(body) == body_len and crc32c_oracle(body) == crc
        (meta_len,) = struct.unpack_from("<I", body, 0)
        assert (4 + meta_len) % 8 == 0  # tensor data starts aligned
        doc = json.loads(body[4 : 4 + meta_len].decode("utf-8"))
        tensors, p = [], 4 + meta_len
        for name, numel in doc["tensors"]:
            tensors.append((name, body[p : p + 4 * numel]))
            p += 4 * numel
        assert p == body_len
        out.append((pos, doc["kind"], doc["meta"], tensors, pos + 16 + body_len))
        pos += 16 + body_len
    return out


@pytest.fixture
def seed() -> int:
    return int(np.random.SeedSequence().entropy % (2**31))


def rand_meta(rng: random.Random, i: int) -> dict[str, Any]:
    return {
        "i": i,
        "sum": 0.1 + 0.2,
        "lr": rng.uniform(-1e-3, 1e3),
        "tiny": rng.random() * 1e-300,
        "neg_zero": -0.0,
        "big": rng.randrange(2**64, 2**90),
        "neg": -rng.randrange(2**40),
        "flag": rng.random() < 0.5,
        "none": None,
        "client": f"client-{rng.randrange(1000)}-ü✓",
        "nested": {"xs": [rng.random() for _ in range(rng.randrange(4))], "d": {"k": [1, [2.5]]}},
    }


def rand_tensors(g: torch.Generator, rng: random.Random, k: int) -> dict[str, torch.Tensor]:
    out = {}
    for j in range(k):
        n = rng.choice(SIZES)
        out[f"t{j}.{rng.randrange(100)}"] = torch.randn(n, generator=g) * 10.0 ** rng.randint(-3, 3)
    return out


def special_values(g: torch.Generator) -> torch.Tensor:
    """Bit patterns a lossy path would change: NaN payloads, -0.0, infinities, subnormals."""
    bits = torch.tensor([0x7FC00001, 0xFFC12345, 0x80000000, 0x7F800000, 0xFF800000, 1, 0x807FFFFF])
    specials = bits.to(torch.int32).view(torch.float32)
    return torch.cat([specials, torch.randn(5, generator=g)])


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor, msg: object) -> None:
    want = want.detach().to(torch.float32).contiguous()
    assert got.dtype == torch.float32 and got.device.type == "cpu", msg
    assert got.shape == want.shape, msg
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), msg
    finite = torch.isfinite(want)
    assert torch.equal(got[finite], want[finite]), msg


def assert_same_record(got: WalRecord, kind: str, meta: dict, tensors: dict, msg: object) -> None:
    assert got.kind == kind, msg
    # repr tells -0.0 from 0.0 and shows every float digit: an exact round-trip check.
    assert repr(got.meta) == repr(meta), msg
    assert list(got.tensors) == list(tensors), msg
    for name, t in tensors.items():
        assert_same_tensor(got.tensors[name], t, (msg, name))


def write_segment(directory: Path, number: int, records: list[tuple[str, dict, dict]]) -> Path:
    with WriteAheadLog(directory, number) as wal:
        for kind, meta, tensors in records:
            wal.append(kind, meta, tensors)
    return segment_path(directory, number)


def make_records(seed: int, n: int, last_size: int | None = None) -> list[tuple[str, dict, dict]]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    recs = []
    for i in range(n):
        tensors = rand_tensors(g, rng, rng.randint(0, 3))
        if last_size is not None and i == n - 1:
            tensors = {"w": torch.randn(last_size, generator=g)}
        recs.append((rng.choice(KINDS), rand_meta(rng, i), tensors))
    return recs


class RecordingSync:
    """Stands in for os.fdatasync: sleeps, syncs for real and records (inode, size at start)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.real = os.fdatasync
        self.lock = threading.Lock()
        self.done: list[tuple[int, int]] = []

    def __call__(self, fd: int) -> None:
        st = os.fstat(fd)
        time.sleep(self.delay)
        self.real(fd)
        with self.lock:
            self.done.append((st.st_ino, st.st_size))

    def covers(self, ino: int, end: int) -> bool:
        with self.lock:
            return any(i == ino and size >= end for i, size in self.done)


# --------------------------------------------------------------------------------------------
# Round trip and LSNs
# --------------------------------------------------------------------------------------------


def test_round_trip_across_rotate(tmp_path, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    expected = []
    with WriteAheadLog(tmp_path, 3) as wal:
        for i in range(40):
            if i == 23:
                wal.rotate(8)
            tensors = rand_tensors(g, rng, rng.randint(0, 3))
            if i == 5:
                tensors["special"] = special_values(g)
            if i == 11:  # converted on the way in: float64 and a strided view
                tensors["f64"] = torch.randn(7, generator=g, dtype=torch.float64)
                tensors["strided"] = torch.randn(2002, generator=g)[::2]
            kind, meta = rng.choice(KINDS), rand_meta(rng, i)
            wal.append(kind, meta, tensors)
            expected.append((3 if i < 23 else 8, kind, meta, tensors))
    assert [n for n, _ in list_segments(tmp_path)] == [3, 8]

    got = list(iter_records(tmp_path, 0))
    assert len(got) == len(expected), seed
    for (seg, rec), (want_seg, kind, meta, tensors) in zip(got, expected, strict=True):
        assert seg == want_seg, seed
        assert_same_record(rec, kind, meta, tensors, (seed, meta["i"]))
    assert [r.meta["i"] for _, r in iter_records(tmp_path, 8)] == list(range(23, 40)), seed

    # The bytes follow the documented format, as read by an independent parser.
    for number, want in ((3, expected[:23]), (8, expected[23:])):
        parsed = oracle_parse(segment_path(tmp_path, number).read_bytes())
        assert len(parsed) == len(want), seed
        for (_, kind, meta, tensors, _), (_, wkind, wmeta, wtensors) in zip(parsed, want, strict=1):
            assert (kind, repr(meta)) == (wkind, repr(wmeta)), seed
            assert [n for n, _ in tensors] == list(wtensors), seed
            for (_, raw), t in zip(tensors, wtensors.values(), strict=True):
                assert raw == t.detach().to(torch.float32).numpy().astype("<f4").tobytes(), seed


def test_lsn_arithmetic(tmp_path, seed):
    recs = make_records(seed, 12)
    wal = WriteAheadLog(tmp_path, 0)
    assert (wal.written_lsn, wal.durable_lsn, wal.fsync_count) == (0, 0, 0)

    def on_disk() -> int:
        return sum(p.stat().st_size for _, p in list_segments(tmp_path))

    lsns = []
    for i, (kind, meta, tensors) in enumerate(recs):
        if i in (4, 9):
            wal.rotate(wal.segment + 1)
            # Rotation fsyncs what the old segment holds.
            assert wal.durable_lsn == wal.written_lsn == lsns[-1], seed
        lsns.append(wal.append(kind, meta, tensors))
        assert lsns[-1] == on_disk() == wal.written_lsn == wal.bytes_written, seed
    assert lsns == sorted(set(lsns)), seed

    assert wal.durable_lsn < lsns[10], seed
    wal.sync(lsns[10])
    assert lsns[10] <= wal.durable_lsn <= wal.written_lsn, seed
    count = wal.fsync_count
    wal.sync(lsns[2])  # already durable: no fsync
    assert wal.fsync_count == count, seed
    with pytest.raises(ValueError, match="only"):
        wal.sync(wal.written_lsn + 1)
    wal.sync_all()
    assert wal.durable_lsn == wal.written_lsn == on_disk(), seed
    assert wal.fsync_seconds > 0.0
    wal.close()
    wal.close()  # idempotent
    assert wal.closed
    with pytest.raises(ValueError, match="closed"):
        wal.append("timer", {"i": 0})
    wal.sync(lsns[-1])  # everything is durable: returns even when closed


def test_append_rejects_bad_input_without_writing(tmp_path):
    wal = WriteAheadLog(tmp_path, 0)
    for meta in ({"x": float("nan")}, {"x": [1.0, float("inf")]}, {"x": -float("inf")}):
        with pytest.raises(ValueError, match="cannot be encoded as JSON"):
            wal.append("update", meta)
    with pytest.raises(ValueError, match="1-D"):
        wal.append("update", {}, {"w": torch.randn(3, 4)})
    with pytest.raises(TypeError):
        wal.append("update", {"x": object()})
    assert wal.written_lsn == 0 and segment_path(tmp_path, 0).stat().st_size == 0
    t = torch.randn(5)
    lsn = wal.append("update", {"ok": True}, {"w": t})
    wal.close()
    [rec] = scan_segment(segment_path(tmp_path, 0)).records
    assert_same_record(rec, "update", {"ok": True}, {"w": t}, lsn)


def test_existing_segment_is_refused(tmp_path, seed):
    write_segment(tmp_path, 3, make_records(seed, 2))
    before = segment_path(tmp_path, 3).read_bytes()
    with pytest.raises(FileExistsError, match="already exists"):
        WriteAheadLog(tmp_path, 3)
    wal = WriteAheadLog(tmp_path, 1)
    lsn = wal.append("job", {"a": 1})
    with pytest.raises(FileExistsError, match="already exists"):
        wal.rotate(3)
    with pytest.raises(ValueError, match="above"):
        wal.rotate(1)
    # Still usable on segment 1 after the refused rotations.
    assert wal.segment == 1
    lsn = wal.append("job", {"a": 2})
    wal.sync(lsn)
    wal.close()
    assert [r.meta["a"] for r in scan_segment(segment_path(tmp_path, 1)).records] == [1, 2]
    assert segment_path(tmp_path, 3).read_bytes() == before


def test_new_directory_is_created(tmp_path):
    d = tmp_path / "a" / "state"
    with WriteAheadLog(d, 0) as wal:
        wal.append("timer", {"t": 1.5})
    assert [n for n, _ in list_segments(d)] == [0]


def test_list_ignores_malformed_names(tmp_path):
    for name in [
        "wal-00000002.log",
        "wal-123456789.log",
        "wal-1.log",
        "wal-000000003.log",  # 9 digits with a leading zero would alias segment 3
        "wal-00000004.log.bak",
        "checkpoint-00000007.pt",
        "checkpoint-7.pt",
        ".tmp-checkpoint-00000009.pt-x1",
        "checkpoint-00000008.pt.tmp",
    ]:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "wal-00000005.log").mkdir()
    assert list_segments(tmp_path) == [
        (2, tmp_path / "wal-00000002.log"),
        (123456789, tmp_path / "wal-123456789.log"),
    ]
    assert list_checkpoints(tmp_path) == [(7, tmp_path / "checkpoint-00000007.pt")]
    assert latest_checkpoint(tmp_path) == (7, tmp_path / "checkpoint-00000007.pt")
    assert list_segments(tmp_path / "missing") == [] and latest_checkpoint(tmp_path / "x") is None


# --------------------------------------------------------------------------------------------
# Torn tails and corruption
# --------------------------------------------------------------------------------------------


def _check_prefix(scan, recs, n: int, msg: object) -> None:
    assert len(scan.records) == n, msg
    for rec, (kind, meta, tensors) in zip(scan.records, recs, strict=False):
        assert_same_record(rec, kind, meta, tensors, msg)


@pytest.mark.parametrize("last_size", [3, 1001])
def test_every_truncation_of_the_last_record(tmp_path, seed, last_size):
    recs = make_records(seed, 5, last_size=last_size)
    data = write_segment(tmp_path, 0, recs).read_bytes()
    last_off = oracle_parse(data)[-1][0]
    last_len = len(data) - last_off
    cuts = range(last_len + 1)
    if last_len > 1000:  # dense sample: every byte of the header and the start of the meta
        cuts = sorted(set(range(120)) | set(range(120, last_len, 13)) | {last_len - 1, last_len})
    path = tmp_path / "cut.log"
    for k in cuts:
        path.write_bytes(data[: last_off + k])
        scan = scan_segment(path)
        msg = (seed, k, scan.reason)
        assert scan.total_bytes == last_off + k, msg
        if k == last_len:
            _check_prefix(scan, recs, 5, msg)
            assert (scan.torn, scan.valid_bytes, scan.reason) == (False, len(data), None), msg
            continue
        _check_prefix(scan, recs, 4, msg)
        assert scan.valid_bytes == last_off, msg
        assert scan.torn == (k > 0), msg
        if k:
            assert f"offset {last_off}" in scan.reason and str(path) in scan.reason, msg


@pytest.mark.parametrize("tail", ["random", "zeros", "huge_length", "bad_crc", "short_header"])
def test_garbage_after_valid_records(tmp_path, seed, tail, caplog):
    recs = make_records(seed, 4)
    data = write_segment(tmp_path, 0, recs).read_bytes()
    rng = np.random.default_rng(seed)
    junk = {
        "random": rng.integers(0, 256, 300, dtype=np.uint8).tobytes(),
        "zeros": bytes(4096),  # what a crash can leave after an extended file size
        "huge_length": WAL_MAGIC + struct.pack("<QI", 2**40, 0) + bytes(64),
        "bad_crc": WAL_MAGIC + struct.pack("<QI", 8, 12345) + struct.pack("<I", 4) + b"{}  ",
        "short_header": WAL_MAGIC + b"\x01\x02",
    }[tail]
    path = segment_path(tmp_path, 0)
    path.write_bytes(data + junk)
    with caplog.at_level(logging.WARNING, logger=D.__name__):
        scan = scan_segment(path)
    msg = (seed, scan.reason)
    _check_prefix(scan, recs, 4, msg)
    assert scan.torn and scan.valid_bytes == len(data), msg
    assert scan.total_bytes == len(data) + len(junk), msg
    assert f"offset {len(data)}" in scan.reason, msg
    want = {
        "random": "magic",
        "zeros": "magic",
        "huge_length": "body length",
        "bad_crc": "CRC",
        "short_header": "header",
    }[tail]
    assert want in scan.reason, msg
    assert any("torn WAL tail" in r.getMessage() for r in caplog.records), msg


def test_corruption_in_a_middle_record(tmp_path, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    recs = [
        (rng.choice(KINDS), rand_meta(rng, i), {"w": torch.randn(101, generator=g)})
        for i in range(7)
    ]
    data = write_segment(tmp_path, 0, recs).read_bytes()
    parsed = oracle_parse(data)
    m = rng.randrange(1, 6)
    off, end = parsed[m][0], parsed[m][4]
    path = tmp_path / "bad.log"
    cases = {
        "tensor bit": end - 4 * 101 + rng.randrange(4 * 101),
        "magic": off + rng.randrange(4),
        "length": off + 4 + rng.randrange(8),
        "crc field": off + 12 + rng.randrange(4),
        "meta": off + 16 + 4 + rng.randrange(10),
    }
    for what, byte in cases.items():
        bad = bytearray(data)
        bad[byte] ^= 1 << rng.randrange(8)
        path.write_bytes(bad)
        magic = bytes(bad[off : off + 4])
        if magic != D.WAL_MAGIC and magic[:3] == D.WAL_MAGIC[:3] and magic[3:].isdigit():
            # The flip made another format's magic: what a newer aggsrv appends reads the same,
            # so the log is refused (nothing dropped), not cut at this record.
            with pytest.raises(D.WalDamaged, match="newer aggsrv"):
                scan_segment(path)
            continue
        scan = scan_segment(path)
        msg = (seed, m, what, scan.reason)
        _check_prefix(scan, recs, m, msg)
        assert scan.torn and scan.valid_bytes == off, msg
        if what == "tensor bit":
            assert "CRC" in scan.reason, msg


def _raw_record(meta_bytes: bytes, data: bytes = b"") -> bytes:
    body = struct.pack("<I", len(meta_bytes)) + meta_bytes + data
    return WAL_MAGIC + struct.pack("<QI", len(body), crc32c_oracle(body)) + body


@pytest.mark.parametrize(
    "meta_bytes,data,reason",
    [
        (b"{not json", b"", "meta does not decode"),
        (b"\xff\xfe{}", b"", "meta does not decode"),
        (b'{"kind": "x", "meta": {}}', b"", "meta does not decode"),
        (b'{"kind": 1, "meta": {}, "tensors": []}', b"", "meta does not decode"),
        (b'{"kind": "x", "meta": {}, "tensors": [["w", -1]]}', b"", "meta does not decode"),
        (b'{"kind": "x", "meta": {}, "tensors": [["w", 2]]}', b"\0" * 4, "tensors need 8 B"),
        (b'{"kind": "x", "meta": {}, "tensors": []}', b"\0" * 4, "tensors need 0 B"),
    ],
)
def test_valid_crc_but_bad_meta(tmp_path, seed, meta_bytes, data, reason):
    recs = make_records(seed, 2)
    good = write_segment(tmp_path, 0, recs).read_bytes()
    path = tmp_path / "x.log"
    path.write_bytes(good + _raw_record(meta_bytes, data) + good)
    scan = scan_segment(path)
    _check_prefix(scan, recs, 2, (seed, scan.reason))
    assert scan.torn and scan.valid_bytes == len(good) and reason in scan.reason, scan.reason


def test_foreign_unaligned_record_is_read(tmp_path, seed):
    # Another writer may skip the padding; the reader copies instead of misreading.
    t = torch.randn(7, generator=torch.Generator().manual_seed(seed))
    meta = json.dumps({"kind": "update", "meta": {"x": 0.5}, "tensors": [["w", 7]]}).encode()
    meta += b" " * ((-len(meta) - 4) % 8 + 1)
    path = tmp_path / "x.log"
    path.write_bytes(_raw_record(meta, t.numpy().astype("<f4").tobytes()))
    [rec] = scan_segment(path).records
    assert_same_record(rec, "update", {"x": 0.5}, {"w": t}, seed)


def test_iter_records_continues_after_torn_tail(tmp_path, seed, caplog):
    per_seg = {n: make_records(seed + n, 3) for n in (0, 1, 2, 3, 4)}
    for n, recs in per_seg.items():
        write_segment(tmp_path, n, recs)
    # Segment 1 loses half of its last record, segment 3 gains junk, 2 and 4 stay intact.
    p1 = segment_path(tmp_path, 1)
    d1 = p1.read_bytes()
    last_off = oracle_parse(d1)[-1][0]
    p1.write_bytes(d1[: (last_off + len(d1)) // 2])
    with open(segment_path(tmp_path, 3), "ab") as f:
        f.write(b"junk" * 10)
    expected = (
        [(1, r) for r in per_seg[1][:2]]
        + [(2, r) for r in per_seg[2]]
        + [(3, r) for r in per_seg[3]]
        + [(4, r) for r in per_seg[4]]
    )
    with caplog.at_level(logging.WARNING, logger=D.__name__):
        got = list(iter_records(tmp_path, 1))
    assert [n for n, _ in got] == [n for n, _ in expected], seed
    for (_, rec), (_, (kind, meta, tensors)) in zip(got, expected, strict=True):
        assert_same_record(rec, kind, meta, tensors, seed)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and "wal-00000001.log" in warned[0] and "00000003" in warned[1]
    assert list(iter_records(tmp_path, 5)) == []


# --------------------------------------------------------------------------------------------
# Group commit and concurrency
# --------------------------------------------------------------------------------------------


def test_group_commit(tmp_path, monkeypatch, seed):
    rec = RecordingSync(delay=0.1)
    monkeypatch.setattr(D.os, "fdatasync", rec)
    wal = WriteAheadLog(tmp_path, 0)
    ino = segment_path(tmp_path, 0).stat().st_ino
    g = torch.Generator().manual_seed(seed)
    payloads = [torch.randn(7, generator=g) for _ in range(16)]
    append_lock = threading.Lock()  # the contract: one appending thread at a time
    barrier = threading.Barrier(16)
    results: list[tuple[int, int, bool]] = []
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            barrier.wait()
            with append_lock:
                lsn = wal.append("update", {"k": k}, {"w": payloads[k]})
            wal.sync(lsn)
            # Returned only once an fsync that started after our bytes were written finished.
            results.append((k, lsn, rec.covers(ino, lsn)))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert len(results) == 16 and all(ok for _, _, ok in results), results
    assert wal.durable_lsn >= max(lsn for _, lsn, _ in results)
    assert wal.fsync_count == len(rec.done)
    assert wal.fsync_count <= 4, f"16 syncs took {wal.fsync_count} fsyncs"
    assert wal.fsync_seconds >= 0.1 * wal.fsync_count * 0.9
    wal.close()
    got = {r.meta["k"]: r for r in scan_segment(segment_path(tmp_path, 0)).records}
    assert sorted(got) == list(range(16))
    for k, t in enumerate(payloads):
        assert_same_tensor(got[k].tensors["w"], t, (seed, k))


def test_sync_under_concurrent_rotate(tmp_path, monkeypatch, seed):
    rec = RecordingSync(delay=0.004)
    monkeypatch.setattr(D.os, "fdatasync", rec)
    wal = WriteAheadLog(tmp_path, 0)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    work: queue.Queue = queue.Queue()
    failures: list[Any] = []
    expected = []

    def writer() -> None:
        try:
            for i in range(80):
                if i % 9 == 8:
                    wal.rotate(wal.segment + rng.choice([1, 3]))
                t = torch.randn(rng.choice(SIZES), generator=g)
                lsn = wal.append("update", {"i": i}, {"w": t})
                path = segment_path(tmp_path, wal.segment)
                st = path.stat()  # single writer: the size right after our append
                expected.append((wal.segment, i, t))
                work.put((lsn, st.st_ino, st.st_size, i))
                if i % 4 == 0:
                    time.sleep(0.001)
        except BaseException as exc:
            failures.append(("writer", exc))
        finally:
            for _ in range(4):
                work.put(None)

    def syncer() -> None:
        while (item := work.get()) is not None:
            lsn, ino, end, i = item
            try:
                wal.sync(lsn)
                if wal.durable_lsn < lsn or not rec.covers(ino, end):
                    failures.append(("not durable", i, lsn, wal.durable_lsn))
            except BaseException as exc:
                failures.append(("sync", i, exc))

    threads = [threading.Thread(target=writer)] + [
        threading.Thread(target=syncer) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), seed
    assert not failures, (seed, failures[:5])
    wal.close()
    assert wal.written_lsn == sum(p.stat().st_size for _, p in list_segments(tmp_path))
    got = list(iter_records(tmp_path, 0))
    assert [(n, r.meta["i"]) for n, r in got] == [(n, i) for n, i, _ in expected], seed
    for (_, r), (_, i, t) in zip(got, expected, strict=True):
        assert_same_tensor(r.tensors["w"], t, (seed, i))


def test_failed_fsync_poisons_the_log(tmp_path, monkeypatch):
    wal = WriteAheadLog(tmp_path, 0)
    lsn = wal.append("update", {"a": 1})

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(D.os, "fdatasync", broken)
    with pytest.raises(OSError, match="Input/output"):
        wal.sync(lsn)
    # After a failed fsync the page cache may have dropped the data: never claim durability.
    monkeypatch.undo()
    with pytest.raises(OSError, match="failed earlier"):
        wal.sync(lsn)
    with pytest.raises(OSError, match="failed earlier"):
        wal.append("update", {"a": 2})
    assert wal.durable_lsn == 0
    wal.close()


# --------------------------------------------------------------------------------------------
# Crash simulation
# --------------------------------------------------------------------------------------------

CHILD = r"""
import sys, torch
from aggsrv.server.durability import WriteAheadLog
wal = WriteAheadLog(sys.argv[1], 0)
i = 0
while True:
    t = torch.randn(1 + (i * 577) % 4099, generator=torch.Generator().manual_seed(i))
    lsn = wal.append("update", {"i": i, "x": i * 0.1}, {"w": t})
    if i % 3 != 1:  # some records are written but never synced
        wal.sync(lsn)
        print(i, lsn, flush=True)
    if i % 50 == 49:
        wal.rotate(wal.segment + 1)
    i += 1
"""


def test_sigkill_loses_no_synced_record(tmp_path, seed):
    rng = random.Random(seed)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=env,
    )
    try:
        first = proc.stdout.readline()  # the child is up and syncing
        assert first, "child exited before syncing anything"
        time.sleep(rng.uniform(0.02, 0.2))
        os.kill(proc.pid, signal.SIGKILL)
        rest = proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    lines = (first + rest).decode().split("\n")[:-1]  # the last piece may be cut mid-line
    synced = [tuple(map(int, line.split())) for line in lines]
    assert synced, seed

    got = list(iter_records(tmp_path, 0))
    last_i, last_lsn = synced[-1]
    assert len(got) > last_i, (seed, len(got), last_i)
    for k, (number, r) in enumerate(got):  # every record present is exactly what was written
        assert number == k // 50, (seed, k)
        t = torch.randn(1 + (k * 577) % 4099, generator=torch.Generator().manual_seed(k))
        assert_same_record(r, "update", {"i": k, "x": k * 0.1}, {"w": t}, (seed, k))
    valid = sum(scan_segment(p).valid_bytes for _, p in list_segments(tmp_path))
    assert valid >= last_lsn, (seed, valid, last_lsn)


# --------------------------------------------------------------------------------------------
# Checkpoints and pruning
# --------------------------------------------------------------------------------------------


def assert_same_payload(got: Any, want: Any, msg: object) -> None:
    assert type(got) is type(want), (msg, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, msg
        assert got.device.type == "cpu", msg
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), msg
    elif isinstance(want, dict):
        assert list(got) == list(want), msg
        for k in want:
            assert_same_payload(got[k], want[k], (msg, k))
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), msg
        for a, b in zip(got, want, strict=True):
            assert_same_payload(a, b, msg)
    else:
        assert repr(got) == repr(want), msg


def test_checkpoint_round_trip(tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    payload = {
        "version": rng.randrange(10**6),
        "weights": torch.randn(1001, generator=g),
        "buffers": [torch.randn(7, generator=g), None, torch.randn(1, generator=g)],
        "moments": {"m": torch.randn(3, 5, generator=g, dtype=torch.float64)},
        "clients": {"c1": {"lease": rng.random() * 1e9, "labels": {"zone": "eu"}}},
        "hist": (0.1 + 0.2, 2**70, -(2**62), True, None, "x"),
        "special": special_values(g),
        "steps": torch.arange(5, dtype=torch.int64),
    }
    path = write_checkpoint(tmp_path, 4, payload)
    assert path == checkpoint_path(tmp_path, 4) == tmp_path / "checkpoint-00000004.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-00000004.pt"]
    assert_same_payload(load_checkpoint(path), payload, seed)
    # Rewriting a number replaces it atomically.
    payload["version"] += 1
    write_checkpoint(tmp_path, 4, payload)
    assert load_checkpoint(path)["version"] == payload["version"]


def test_checkpoint_failures(tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    good = write_checkpoint(tmp_path, 3, {"w": torch.randn(1001, generator=g)})
    data = good.read_bytes()
    # A crash mid-write leaves a temp file only; it is never taken for a checkpoint.
    (tmp_path / ".tmp-checkpoint-00000009.pt-abc").write_bytes(data[: len(data) // 2])
    assert latest_checkpoint(tmp_path) == (3, good)
    # A damaged file under a final name is found by name and refused on load.
    bad = checkpoint_path(tmp_path, 5)
    bad.write_bytes(data[: len(data) - 1 - random.Random(seed).randrange(len(data) // 2)])
    assert latest_checkpoint(tmp_path) == (5, bad)
    with pytest.raises(ValueError, match="checkpoint-00000005.pt"):
        load_checkpoint(bad)
    bad.write_bytes(b"")
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_checkpoint(bad)
    torch.save([1, 2], bad)
    with pytest.raises(ValueError, match="not a dict"):
        load_checkpoint(bad)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(checkpoint_path(tmp_path, 99))
    # A payload that cannot be saved leaves nothing behind.
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(Exception):  # noqa: B017 - pickling errors vary by torch version
        write_checkpoint(tmp_path, 6, {"f": lambda: 0})
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_prune(tmp_path):
    with pytest.raises(ValueError):
        prune(tmp_path, 0)
    for n in range(14):
        segment_path(tmp_path, n).write_bytes(b"x")
    (tmp_path / ".tmp-a").write_bytes(b"")
    assert prune(tmp_path, 1) == [tmp_path / ".tmp-a"]  # no checkpoint: every segment stays
    for n in (2, 5, 9, 12):
        checkpoint_path(tmp_path, n).write_bytes(b"c")
    for name in (".tmp-checkpoint-00000013.pt-k2j", ".tmp-x", "notes.txt"):
        (tmp_path / name).write_bytes(b"")

    deleted = prune(tmp_path, 2)
    assert sorted(p.name for p in deleted) == sorted(
        [".tmp-checkpoint-00000013.pt-k2j", ".tmp-x", "checkpoint-00000002.pt"]
        + ["checkpoint-00000005.pt"]
        + [f"wal-0000000{n}.log" for n in range(9)]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-00000009.pt",
        "checkpoint-00000012.pt",
        "notes.txt",
        "wal-00000009.log",
        "wal-00000010.log",
        "wal-00000011.log",
        "wal-00000012.log",
        "wal-00000013.log",
    ]
    assert prune(tmp_path, 2) == []
    assert prune(tmp_path, 5) == []  # fewer checkpoints than asked: nothing more goes
    assert sorted(p.name for p in prune(tmp_path, 1)) == [
        "checkpoint-00000009.pt",
        "wal-00000009.log",
        "wal-00000010.log",
        "wal-00000011.log",
    ]
    assert [n for n, _ in list_segments(tmp_path)] == [12, 13]
    assert [n for n, _ in list_checkpoints(tmp_path)] == [12]
