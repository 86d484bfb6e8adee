"""Storage layer for durable server state: numbered checkpoints plus a write-ahead log (WAL).

A state directory holds ``checkpoint-<N>.pt`` files and ``wal-<N>.log`` segments (N printed with
at least 8 digits). Checkpoint N covers everything logged in segments numbered below N, so
recovery loads the newest complete checkpoint N and replays segments numbered >= N in order.
An update is acknowledged only after its WAL record is fsynced (`WriteAheadLog.sync`), so a
SIGKILL or power loss at any moment loses no acknowledged update.

Record encoding (all integers little-endian)::

    record = MAGIC (4 bytes, b"AWL1") | body_length u64 | crc32c(body) u32 | body
    body   = meta_length u32 | meta | tensor data
    meta   = UTF-8 JSON {"kind": str, "meta": {...}, "tensors": [[name, numel], ...]},
             followed by 0-7 ASCII spaces so that the tensor data starts 8-byte aligned in body
    tensor data = each tensor's float32 values, in the order of "tensors", back to back (an
             entry [name, nbytes, "u8"] is raw bytes instead)

A record's tensors may be written ahead of it, in parts (a server logs an upload's decoded bytes
while the rest of it is still arriving): each part is a record of kind "part" with meta
{"key", "tensor", "start"} and one tensor "data", the elements [start, start + numel) of that
tensor; the record they belong to comes after them in the same segment, with no tensors and
meta "parts" (the key) and "part_tensors" ([[name, numel], ...]). A part may instead hold an
upload's section as it came on the wire (quantized or sparse: "wire" bytes, and meta "section"
saying how to decode it), so the log keeps the compressed bytes. Readers give that record its
tensors made whole from the parts, and never yield part records; parts that no record claims
(an upload that was refused or cut off) are skipped. A writer appends the claiming record only
while its parts are in the current segment (`WriteAheadLog.append`, ``same_segment_as``), so a
record never depends on a segment that a checkpoint let go.

The CRC-32C (Castagnoli) covers the whole body. A reader stops at the first record that is cut
short, lacks the magic, claims more bytes than the file has left, fails its CRC or has meta that
does not decode; everything from there on is a torn tail and is dropped, never misread. Records
past a torn one in the same segment are unreachable, which is why a restarted server always
opens a fresh segment instead of appending to an old one.

Meta is plain JSON: floats round-trip exactly (``repr``), non-finite floats are refused, tuples
come back as lists and non-string dict keys as strings.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import torch

from aggsrv.transport import (
    CodecError,
    Encoding,
    Quantization,
    WireDtype,
    decode_sparse,
    quantized_values,
)
from aggsrv.values import QuantizedValues

__all__ = [
    "PART_KIND",
    "WAL_MAGIC",
    "SegmentScan",
    "WalDamaged",
    "WalRecord",
    "WriteAheadLog",
    "checkpoint_path",
    "iter_records",
    "latest_checkpoint",
    "list_checkpoints",
    "list_segments",
    "load_checkpoint",
    "prune",
    "scan_segment",
    "segment_path",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

WAL_MAGIC: bytes = b"AWL1"
PART_KIND = "part"  # a piece of a later record's tensor (the module's docstring)

_HEADER = struct.Struct("<4sQI")  # magic, body_length, crc32c(body)
_META_LEN = struct.Struct("<I")
_ALIGN = 8
_FLOAT_LE = np.dtype("<f4")
_SEGMENT_RE = re.compile(r"wal-(\d{8,})\.log")
_CHECKPOINT_RE = re.compile(r"checkpoint-(\d{8,})\.pt")
_TMP_PREFIX = ".tmp-"
# Linux refuses writev with more buffers than IOV_MAX (1024 everywhere we run).
_IOV_MAX = 1024


@dataclass
class WalRecord:
    """One decoded WAL record: its kind, JSON meta and float32 1-D CPU tensors (in order)."""

    kind: str
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # The tensors of an update folded from its codes (meta "codes"), logged as the wire's dense
    # quantized values: also as those codes (aggsrv.transport.quantized_values).
    quantized: dict[str, QuantizedValues] = field(default_factory=dict)


@dataclass
class SegmentScan:
    """What `scan_segment` found: the intact records and, when the tail is torn, where and why."""

    records: list[WalRecord]
    valid_bytes: int
    total_bytes: int
    torn: bool
    reason: str | None


# --------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------


def segment_path(directory: str | os.PathLike[str], number: int) -> Path:
    """Path of WAL segment `number` in `directory`."""
    return Path(directory) / f"wal-{number:08d}.log"


def checkpoint_path(directory: str | os.PathLike[str], number: int) -> Path:
    """Path of checkpoint `number` in `directory`."""
    return Path(directory) / f"checkpoint-{number:08d}.pt"


def _list_numbered(
    directory: str | os.PathLike[str], pattern: re.Pattern[str]
) -> list[tuple[int, Path]]:
    base = Path(directory)
    if not base.is_dir():
        return []
    found = []
    for entry in base.iterdir():
        m = pattern.fullmatch(entry.name)
        # The canonical spelling check rejects e.g. 9-digit names with a leading zero, which
        # would otherwise alias another number.
        if m and entry.is_file() and f"{int(m.group(1)):08d}" == m.group(1):
            found.append((int(m.group(1)), entry))
    found.sort(key=lambda item: item[0])
    return found


def list_segments(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """WAL segments in `directory` as (number, path), ascending; odd names are ignored."""
    return _list_numbered(directory, _SEGMENT_RE)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints (renamed into place, so not temporary files), ascending."""
    return _list_numbered(directory, _CHECKPOINT_RE)


def latest_checkpoint(directory: str | os.PathLike[str]) -> tuple[int, Path] | None:
    """The newest checkpoint as (number, path), or None when there is none.

    Goes by name only; a checkpoint damaged on disk shows up when `load_checkpoint` fails.
    """
    found = list_checkpoints(directory)
    return found[-1] if found else None


def _fsync_dir(directory: Path) -> None:
    """Make renames, creations and deletions in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _start_writeback_fn() -> Any:
    """Linux's sync_file_range(2), which starts writing dirty pages to disk without waiting
    (not a durability point: the fsync that follows has less left to do); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - every Linux libc has it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _start_writeback_fn()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` of ``fd`` (best effort)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _datasync(fd: int) -> None:
    """fdatasync where the OS has it (skips timestamps, still flushes the file size)."""
    # Looked up per call so tests can slow it down by patching the os module.
    sync = getattr(os, "fdatasync", None) or os.fsync
    sync(fd)


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


def _tensor_buffer(name: str, tensor: torch.Tensor) -> memoryview:
    """A byte view of `tensor` as little-endian float32, copying only when it must convert."""
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be str, got {type(name).__name__}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.dtype == torch.uint8 and tensor.dim() == 1:  # bytes, logged as they are
        return memoryview(tensor.detach().cpu().contiguous().numpy()).cast("B")
    if tensor.dim() != 1:
        # The record keeps numel only; a silent reshape would come back wrong on replay.
        raise ValueError(f"tensor {name!r} must be 1-D, got shape {tuple(tensor.shape)}")
    t = tensor.detach()
    if t.device.type != "cpu" or t.dtype != torch.float32:
        t = t.to(device="cpu", dtype=torch.float32)
    t = t.resolve_conj().resolve_neg().contiguous()
    arr = t.numpy()
    if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in use
        arr = arr.astype(_FLOAT_LE)
    return memoryview(arr).cast("B")


def _encode(
    kind: str, meta: dict[str, Any], tensors: Mapping[str, torch.Tensor] | None
) -> list[memoryview | bytes]:
    """The record as a list of buffers for writev: header and meta in one piece, then tensors."""
    if not isinstance(kind, str):
        raise TypeError(f"record kind must be str, got {type(kind).__name__}")
    if not isinstance(meta, dict):
        raise TypeError(f"record meta must be a dict, got {type(meta).__name__}")
    bufs = [_tensor_buffer(name, t) for name, t in (tensors or {}).items()]
    names = list((tensors or {}).keys())
    doc = {
        "kind": kind,
        "meta": meta,
        "tensors": [
            [n, b.nbytes, "u8"] if t.dtype == torch.uint8 else [n, b.nbytes // 4]
            for n, b, t in zip(names, bufs, (tensors or {}).values(), strict=True)
        ],
    }
    try:
        text = json.dumps(doc, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except ValueError as exc:
        # Non-finite floats land here too: NaN/Infinity are not JSON and the server never logs them.
        raise ValueError(f"{kind!r} record meta cannot be encoded as JSON: {exc}") from exc
    meta_bytes = text.encode("utf-8")
    pad = -(_META_LEN.size + len(meta_bytes)) % _ALIGN
    meta_bytes += b" " * pad
    prefix = _META_LEN.pack(len(meta_bytes)) + meta_bytes
    body_length = len(prefix) + sum(b.nbytes for b in bufs)
    crc = crc32c.crc32c(prefix)
    for b in bufs:
        crc = crc32c.crc32c(b, crc)
    head = _HEADER.pack(WAL_MAGIC, body_length, crc) + prefix
    return [head, *(b for b in bufs if b.nbytes)]


def _write_all(fd: int, bufs: list[memoryview | bytes]) -> int:
    """writev every byte of `bufs` to `fd`, resuming after short writes; returns the total."""
    views = [memoryview(b).cast("B") if not isinstance(b, memoryview) else b for b in bufs]
    total = 0
    while views:
        n = os.writev(fd, views[:_IOV_MAX])
        total += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return total


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------


def _open_segment(directory: Path, number: int) -> int:
    """Create segment `number` (never reusing an existing file) and make its name durable."""
    path = segment_path(directory, number)
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError as exc:
        raise FileExistsError(
            exc.errno,
            f"WAL segment {path} already exists; a new log must start a segment number above "
            f"every existing one (see list_segments) so no logged record is overwritten",
            str(path),
        ) from None
    try:
        _fsync_dir(directory)
    except BaseException:
        os.close(fd)
        raise
    return fd


class WriteAheadLog:
    """Append-only segments wal-<NNNNNNNN>.log in `directory`; group-commit fsync.

    One writer thread appends (and rotates); any number of threads may `sync` concurrently, and
    one fsync then serves every waiter whose bytes were written before it started. After an
    I/O error the log refuses further use: following a failed fsync the kernel may have dropped
    dirty pages, so the only safe continuation is a restart that recovers from disk.
    """

    def __init__(self, directory: str | os.PathLike[str], segment: int) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            self.directory.mkdir(parents=True, exist_ok=True)
            # The new directory's own entry must survive a crash too.
            _fsync_dir(self.directory.parent)
        self._fd: int | None = _open_segment(self.directory, segment)
        self.segment = segment
        # Serialises writers against rotate/close; held for whole writes.
        self._write_lock = threading.Lock()
        # Guards the counters below; never held across I/O.
        self._cond = threading.Condition(threading.Lock())
        self._written = 0
        self._durable = 0
        self._segment_start = 0  # the LSN at which the current segment began
        self._syncing = False  # an fsync (or rotate/close) runs on the current fd
        self._failed: BaseException | None = None
        self.fsync_count = 0
        self.fsync_seconds = 0.0

    # -- properties --------------------------------------------------------------------------

    @property
    def written_lsn(self) -> int:
        """Bytes handed to the OS so far, over all segments of this object."""
        with self._cond:
            return self._written

    @property
    def durable_lsn(self) -> int:
        """Bytes known to be fsynced so far."""
        with self._cond:
            return self._durable

    @property
    def segment_start(self) -> int:
        """The LSN at which the current segment began (it changes when the log rotates)."""
        with self._cond:
            return self._segment_start

    @property
    def bytes_written(self) -> int:
        """Total bytes written (equal to `written_lsn`; kept as a separate name for metrics)."""
        return self.written_lsn

    @property
    def closed(self) -> bool:
        """True once `close` has run."""
        return self._fd is None

    # -- writing -----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise OSError(
                f"write-ahead log in {self.directory} failed earlier ({self._failed!r}); "
                "restart and recover from disk"
            ) from self._failed
        if self._fd is None:
            raise ValueError(f"write-ahead log in {self.directory} is closed")

    def append(
        self,
        kind: str,
        meta: dict[str, Any],
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        same_segment_as: int | None = None,
        writeback: bool = False,
    ) -> int | None:
        """Write one record to the OS (no fsync) and return its LSN, the log's byte count after it.

        Pass the LSN to `sync` before acknowledging anything that depends on the record.
        ``same_segment_as``: the LSN of an earlier record (a part of this one); the record is
        written only while that one is in the current segment, else None is returned and
        nothing written. ``writeback``: start writing the record to disk now (the fsync that
        makes it durable later then waits for less).
        """
        bufs = _encode(kind, meta, tensors)
        with self._write_lock:
            with self._cond:
                self._check_usable()
                fd, start = self._fd, self._written
                if same_segment_as is not None and same_segment_as <= self._segment_start:
                    return None
            assert fd is not None
            try:
                n = _write_all(fd, bufs)
            except BaseException as exc:
                # A partial record would hide every later record of this segment from readers.
                with self._cond:
                    self._failed = exc
                    self._cond.notify_all()
                raise
            if writeback:
                _start_writeback(fd, start - self._segment_start, n)
            with self._cond:
                self._written += n
                return self._written

    def sync(self, lsn: int) -> None:
        """Block until every byte up to `lsn` is on stable storage (group commit)."""
        with self._cond:
            if lsn > self._written:
                raise ValueError(
                    f"cannot sync to LSN {lsn}: only {self._written} bytes were written"
                )
            while self._durable < lsn:
                self._check_usable()
                if self._syncing:
                    # Another fsync is running; it may already cover us, else we lead the next.
                    self._cond.wait()
                    continue
                self._fsync_current()

    def _fsync_current(self) -> None:
        """Fsync the current fd with `_cond` held on entry and exit; released during the I/O."""
        self._syncing = True
        target, fd = self._written, self._fd
        assert fd is not None
        try:
            self._cond.release()
            try:
                start = time.perf_counter()
                _datasync(fd)
                elapsed = time.perf_counter() - start
            finally:
                self._cond.acquire()
        except BaseException as exc:
            self._failed = exc
            raise
        else:
            self.fsync_count += 1
            self.fsync_seconds += elapsed
            # Only bytes written before the fsync started are covered by it.
            self._durable = max(self._durable, target)
        finally:
            self._syncing = False
            self._cond.notify_all()

    def sync_all(self) -> None:
        """Fsync everything written so far."""
        self.sync(self.written_lsn)

    def _quiesce(self) -> None:
        """With `_write_lock` held: wait out a running fsync, then fsync the rest (if any)."""
        with self._cond:
            while self._syncing:
                self._cond.wait()
            self._check_usable()
            if self._durable < self._written:
                self._fsync_current()

    def rotate(self, new_segment: int) -> None:
        """Fsync and close the current segment and continue in `new_segment`; LSNs keep counting.

        The new number must exceed the current one, since recovery replays segments in number
        order. If the new segment cannot be created the log stays on the current one.
        """
        if new_segment <= self.segment:
            raise ValueError(
                f"new segment {new_segment} must be above the current segment {self.segment}"
            )
        with self._write_lock:
            self._quiesce()
            with self._cond:
                # Keep concurrent syncs off the old fd while it is swapped out.
                self._syncing = True
            try:
                new_fd = _open_segment(self.directory, new_segment)
                with self._cond:
                    old_fd, self._fd = self._fd, new_fd
                    self.segment = new_segment
                    self._segment_start = self._written
            finally:
                with self._cond:
                    self._syncing = False
                    self._cond.notify_all()
            assert old_fd is not None
            os.close(old_fd)
            log.debug("WAL rotated to %s", segment_path(self.directory, new_segment))

    def close(self) -> None:
        """Fsync and close the current segment; closing twice is a no-op."""
        with self._write_lock:
            if self._fd is None:
                return
            try:
                if self._failed is None:
                    self._quiesce()
            finally:
                with self._cond:
                    while self._syncing:
                        self._cond.wait()
                    fd, self._fd = self._fd, None
                    self._cond.notify_all()
                if fd is not None:
                    os.close(fd)

    def __enter__(self) -> WriteAheadLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------


class WalDamaged(ValueError):
    """A record that is intact but cannot be read whole: its parts are missing or overlap.
    The writer never leaves a log like that (a crash tears only the tail), so recovery stops
    instead of dropping a record that may have been acknowledged."""


class _Torn(Exception):
    """Raised inside the reader for the first bad record; carries the human-readable reason."""


def _decode_body(body: bytearray, offset: int) -> WalRecord:
    (meta_len,) = _META_LEN.unpack_from(body, 0)
    data_start = _META_LEN.size + meta_len
    if data_start > len(body):
        raise _Torn(
            f"record at offset {offset}: meta length {meta_len} exceeds the body ({len(body)} B)"
        )
    try:
        doc = json.loads(body[_META_LEN.size : data_start].decode("utf-8"))
        kind, meta, specs = doc["kind"], doc["meta"], doc["tensors"]
        if not (isinstance(kind, str) and isinstance(meta, dict) and isinstance(specs, list)):
            raise TypeError("kind/meta/tensors have the wrong types")
        shapes = []
        for spec in specs:
            name, numel, *element = spec
            if not (isinstance(name, str) and type(numel) is int and numel >= 0):
                raise TypeError(f"bad tensor entry {spec!r}")
            if element not in ([], ["u8"]):
                raise TypeError(f"bad tensor entry {spec!r}")
            shapes.append((name, numel, 1 if element else 4))
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise _Torn(f"record at offset {offset}: meta does not decode ({exc})") from None
    data_bytes = sum(n * size for _, n, size in shapes)
    if data_start + data_bytes != len(body):
        raise _Torn(
            f"record at offset {offset}: tensors need {data_bytes} B but the body holds "
            f"{len(body) - data_start} B after the meta"
        )
    tensors: dict[str, torch.Tensor] = {}
    pos = data_start
    for name, numel, size in shapes:
        if size == 1:
            tensors[name] = torch.from_numpy(np.frombuffer(body, np.uint8, numel, pos).copy())
            pos += numel
            continue
        arr = np.frombuffer(body, dtype=_FLOAT_LE, count=numel, offset=pos)
        if not arr.flags.aligned or sys.byteorder != "little":
            # Records from this writer are aligned; anything else gets its own copy.
            arr = arr.astype(np.float32)
        tensors[name] = torch.from_numpy(arr)
        pos += 4 * numel
    return WalRecord(kind=kind, meta=meta, tensors=tensors)


def _part_codes(part: WalRecord, numel: int) -> QuantizedValues | None:
    """A part's codes when it holds a whole tensor of ``numel`` as dense quantized values (its
    wire bytes, already checked by :func:`_part_data`), else None."""
    section = part.meta.get("section")
    if section is None or not section.get("quantization") or part.meta.get("start") != 0:
        return None
    if Encoding.parse(section["encoding"]) is not Encoding.DENSE or int(section["numel"]) != numel:
        return None
    raw = memoryview(part.tensors["wire"].numpy()).cast("B")
    quantization = Quantization.parse(section["quantization"])
    return quantized_values(raw, quantization, numel, int(section["block"]), "update")


def _part_data(part: WalRecord, path: Path, at: int) -> torch.Tensor:
    """A part's float32 values: its "data", or its "wire" bytes (a section as it came on the
    wire, described by meta "section") decoded."""
    section = part.meta.get("section")
    if section is None:
        return part.tensors["data"]
    try:
        numel = int(section["numel"])
        quant = section.get("quantization")
        quantized = (Quantization.parse(quant), int(section["block"])) if quant else None
        out = torch.empty(numel, dtype=torch.float32)
        raw = memoryview(part.tensors["wire"].numpy()).cast("B")
        decode_sparse(
            raw, Encoding.parse(section["encoding"]), numel, int(section["nnz"]),
            WireDtype.parse(section["dtype"]), out, str(part.meta.get("tensor")), quantized,
        )  # fmt: skip
    except (CodecError, KeyError, ValueError, TypeError) as exc:
        raise WalDamaged(f"{path}: the part at offset {at} does not decode: {exc}") from exc
    return out


class _SegmentReader:
    """Iterates a segment's intact records; afterwards `valid_bytes`, `torn`, `reason` are set."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.valid_bytes = 0
        self.total_bytes = 0
        self.torn = False
        self.reason: str | None = None

    def __iter__(self) -> Iterator[WalRecord]:
        with open(self.path, "rb") as f:
            self.total_bytes = os.fstat(f.fileno()).st_size
            offset = 0
            # Where the parts of records still to come are, by key: (offset, its "data" size).
            parts: dict[str, list[int]] = {}
            try:
                while offset < self.total_bytes:
                    record, size = self._read_one(f, offset)
                    if record.kind == PART_KIND:
                        parts.setdefault(str(record.meta.get("key")), []).append(offset)
                    elif "parts" in record.meta:
                        record = self._join(f, offset, record, parts.pop(record.meta["parts"], []))
                    offset += size
                    self.valid_bytes = offset
                    if record.kind != PART_KIND:
                        yield record
            except _Torn as exc:
                self.torn = True
                self.reason = (
                    f"{self.path}: {exc}; dropping {self.total_bytes - offset} of "
                    f"{self.total_bytes} bytes from offset {offset}"
                )

    def _join(self, f: Any, offset: int, record: WalRecord, part_offsets: list[int]) -> WalRecord:
        """``record`` (at ``offset``) with its tensors made whole from its parts, read again
        from their offsets (parts are not kept in memory: an upload that was refused leaves
        parts no record claims)."""
        meta = dict(record.meta)
        key = meta.pop("parts")
        sizes = {str(name): int(numel) for name, numel in meta.pop("part_tensors", [])}
        tensors = {name: torch.empty(numel, dtype=torch.float32) for name, numel in sizes.items()}
        spans: dict[str, list[tuple[int, int]]] = {name: [] for name in sizes}
        codes: dict[str, QuantizedValues] = {}
        back = f.tell()
        for at in part_offsets:
            f.seek(at)
            part, _ = self._read_one(f, at)
            name, start = part.meta.get("tensor"), part.meta.get("start")
            data = _part_data(part, self.path, at)
            if (
                name not in tensors
                or type(start) is not int
                or not (start >= 0 and start + data.numel() <= sizes[name])
            ):
                raise WalDamaged(
                    f"{self.path}: the part at offset {at} of the record at offset {offset} "
                    f"({name!r} from element {start!r}, {data.numel()} elements) lies outside "
                    f"the record's tensors {sizes}"
                )
            tensors[name][start : start + data.numel()] = data
            spans[name].append((start, start + data.numel()))
            if meta.get("codes"):  # the live server folded them: replay folds them again
                kept = _part_codes(part, sizes[name])
                if kept is not None:
                    codes[name] = kept
        f.seek(back)
        for name, numel in sizes.items():
            ends = [0]
            for start, end in sorted(spans[name]):
                if start != ends[-1]:
                    break
                ends.append(end)
            if ends[-1] != numel or len(ends) != len(spans[name]) + 1:
                raise WalDamaged(
                    f"{self.path}: the {record.kind!r} record at offset {offset} was written "
                    f"after its parts (key {key!r}), but its parts of {name!r} here are "
                    f"{sorted(spans[name])[:8]}, not [0, {numel}) once"
                )
        return WalRecord(kind=record.kind, meta=meta, tensors=tensors, quantized=codes)

    def _read_one(self, f: Any, offset: int) -> tuple[WalRecord, int]:
        remaining = self.total_bytes - offset
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise _Torn(
                f"record at offset {offset}: truncated header ({len(head)} of {_HEADER.size} bytes)"
            )
        magic, body_length, crc = _HEADER.unpack(head)
        if magic != WAL_MAGIC and magic[:3] == WAL_MAGIC[:3] and magic[3:].isdigit():
            # Another version's log, not a torn write: dropping it would lose acknowledged calls.
            raise WalDamaged(
                f"{self.path}: the record at offset {offset} is of log format "
                f"{magic.decode()}, and this aggsrv reads {WAL_MAGIC.decode()}: a newer aggsrv "
                "wrote it; resume it with that version (docs/compatibility.md)"
            )
        if magic != WAL_MAGIC:
            raise _Torn(f"record at offset {offset}: bad magic {magic!r} (expected {WAL_MAGIC!r})")
        if body_length > remaining - _HEADER.size:
            raise _Torn(
                f"record at offset {offset}: body length {body_length} but only "
                f"{remaining - _HEADER.size} bytes follow the header (truncated or corrupt length)"
            )
        if body_length < _META_LEN.size:
            raise _Torn(f"record at offset {offset}: body length {body_length} is too short")
        body = bytearray(body_length)
        got = f.readinto(body)
        if got != body_length:
            raise _Torn(f"record at offset {offset}: file shrank while reading ({got} B read)")
        actual = crc32c.crc32c(body)
        if actual != crc:
            raise _Torn(
                f"record at offset {offset}: CRC-32C mismatch "
                f"(stored {crc:#010x}, computed {actual:#010x})"
            )
        return _decode_body(body, offset), _HEADER.size + body_length


def scan_segment(path: str | os.PathLike[str]) -> SegmentScan:
    """Read a segment's records up to the first damaged one (logged); raises only OSError."""
    reader = _SegmentReader(path)
    records = list(reader)
    if reader.torn:
        log.warning("torn WAL tail: %s", reader.reason)
    return SegmentScan(
        records=records,
        valid_bytes=reader.valid_bytes,
        total_bytes=reader.total_bytes,
        torn=reader.torn,
        reason=reader.reason,
    )


def iter_records(
    directory: str | os.PathLike[str], first_segment: int
) -> Iterator[tuple[int, WalRecord]]:
    """Stream (segment number, record) for every segment numbered >= `first_segment`, in order.

    A torn tail ends its segment (with a warning) and reading goes on with the next segment:
    a crash tears at most the segment it was writing, and the restarted server opened a new one.
    """
    for number, path in list_segments(directory):
        if number < first_segment:
            continue
        reader = _SegmentReader(path)
        for record in reader:
            yield number, record
        if reader.torn:
            log.warning("torn WAL tail, continuing with the next segment: %s", reader.reason)


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def write_checkpoint(
    directory: str | os.PathLike[str], number: int, payload: dict[str, Any]
) -> Path:
    """Atomically write checkpoint `number`: temp file, fsync, rename, fsync the directory.

    A crash leaves either the old state or the complete new file, plus at most a ``.tmp-`` file
    that `prune` removes.
    """
    base = Path(directory)
    base.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(base, number)
    fd, tmp_name = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{final.name}-", dir=base)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_dir(base)
    return final


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a checkpoint on the CPU (weights_only); ValueError if the file is damaged or foreign.

    A missing or unreadable file raises the OSError as is.
    """
    with open(path, "rb"):  # a missing or unreadable file: its OSError as is
        pass
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's zip reader reports some truncations as OSError (EINVAL)
        raise ValueError(
            f"checkpoint {path} cannot be loaded (corrupt or truncated?): {exc}"
        ) from exc
    if not isinstance(payload, dict):
        raise ValueError(f"checkpoint {path} holds a {type(payload).__name__}, not a dict")
    return payload


def prune(directory: str | os.PathLike[str], keep: int) -> list[Path]:
    """Keep the newest `keep` checkpoints and the segments they need; delete the rest.

    Also deletes every ``.tmp-*`` file, so call it only while no checkpoint is being written.
    Returns the deleted paths.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    base = Path(directory)
    checkpoints = list_checkpoints(base)
    doomed: list[Path] = []
    if len(checkpoints) > keep:
        doomed += [p for _, p in checkpoints[:-keep]]
    if checkpoints:
        # With fewer than `keep` checkpoints the oldest still bounds what replay can need.
        oldest_kept = checkpoints[-keep:][0][0]
        doomed += [p for n, p in list_segments(base) if n < oldest_kept]
    if base.is_dir():
        doomed += sorted(
            p for p in base.iterdir() if p.name.startswith(_TMP_PREFIX) and p.is_file()
        )
    deleted = []
    for p in doomed:
        try:
            p.unlink()
        except FileNotFoundError:
            continue
        deleted.append(p)
    if deleted:
        _fsync_dir(base)
        log.info("pruned %d files from %s", len(deleted), base)
    return deleted
