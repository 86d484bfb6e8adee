"""Decoder: chunks -> a preallocated float32 staging slot, checked chunk by chunk and at the end.

A `StagingSlot` is allocated once and reused for every upload (large fresh buffers are page-fault
bound, docs/design.md "Measured platform facts"). A `Decoder` checks each chunk before touching the
slot, writes its values straight into place (float32: one memcpy; half types: one conversion pass),
and `finish` checks completeness, the trailer's CRC-32C and finiteness, in that order. A failed
decode leaves garbage in the slot: the server applies nothing from it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from aggsrv.finite import squared_norm, squared_norm_if_finite
from aggsrv.values import QuantizedValues

from . import dtypes as _dtypes
from .crc import BytesLike, Crc32c
from .dtypes import WireDtype, from_wire
from .errors import (
    BadChunk,
    ChecksumMismatch,
    ChunkTooLarge,
    CodecError,
    NonFinite,
    Truncated,
    WrongLength,
)
from .quantized import Quantization, quantized_values
from .sparse import Encoding, decode_sparse, encoded_nbytes

__all__ = ["Decoder", "StagingSlot", "device_event"]

logger = logging.getLogger(__name__)


class StagingSlot:
    """A reusable float32 landing area: `flat` [numel] plus optional named `extras` buffers."""

    def __init__(
        self, numel: int, extras: Mapping[str, int] | None = None, *, pin_memory: bool = False
    ) -> None:
        if pin_memory and not torch.cuda.is_available():
            raise ValueError(
                "pin_memory=True needs CUDA (pinned memory only speeds up host-to-GPU copies); "
                "pass pin_memory=False when the server cache is on the CPU"
            )
        sizes = {"flat": numel, **(extras or {})}
        for name, n in sizes.items():
            if n < 0:
                raise ValueError(f"staging buffer {name!r} has negative size {n}")
        self.pin_memory = pin_memory
        self.flat = torch.empty(numel, dtype=torch.float32, pin_memory=pin_memory)
        self.extras: dict[str, torch.Tensor] = {
            name: torch.empty(n, dtype=torch.float32, pin_memory=pin_memory)
            for name, n in (extras or {}).items()
        }
        # Touch every page now, so the first upload does not pay the page faults.
        self.flat.zero_()
        for buf in self.extras.values():
            buf.zero_()
        self._fence: Any = None  # an event after the last device copy out of the slot

    def fence(self, device: torch.device) -> None:
        """Mark the slot busy until the device copies queued out of it so far (on this thread's
        current stream) are done: a ``non_blocking`` copy from pinned memory to a GPU still
        reads its source after it returns, so the next upload must not land here before."""
        self._fence = device_event(device)

    def fence_with(self, event: Any) -> None:
        """Mark the slot busy until ``event`` (recorded after copies out of it on a stream of
        their own, aggsrv.transport.crossing) has passed."""
        self._fence = event

    def idle(self) -> bool:
        """Whether no device copy still reads the slot (the next upload may overwrite it)."""
        if self._fence is not None and not self._fence.query():
            return False
        self._fence = None
        return True

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers of the slot."""
        return 4 * (self.flat.numel() + sum(b.numel() for b in self.extras.values()))


def device_event(device: torch.device) -> Any:
    """An event recorded on ``device``'s current stream: its ``query()`` turns True once the work
    queued there before it (a copy) is done. None for the CPU, where copies are synchronous."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@dataclass
class _Target:
    """Where one named tensor lands and how much of it has arrived."""

    name: str
    view: torch.Tensor  # float32 [numel], a view into the slot
    nbytes: int  # expected wire bytes
    received: int = 0  # wire bytes received so far == next expected offset
    # The view's bytes when the wire bytes are its bytes (native float32 on the CPU): chunks
    # then land with one memcpy under the GIL instead of a torch op, which costs more than the
    # copy itself for 1 MiB chunks while a client competes for the cores.
    raw: memoryview | None = None
    # A section decoded whole by finish() (its bytes land in `raw`, a buffer of its own): a
    # sparse one (transport/sparse.py), (encoding, nnz), or quantized values (DENSE, numel).
    sparse: tuple[Encoding, int] | None = None
    # Quantized values (transport/quantized.py): (quantization, block size).
    quantized: tuple[Quantization, int] | None = None


class Decoder:
    """Decodes one upload at a time into `slot`; call `reset()` (or make a new one) per upload.

    `layout` maps each tensor name to its element count, in upload order. Names that are keys of
    `slot.extras` land in that buffer; all others are packed in order into `slot.flat`. Chunks of
    one tensor must arrive in ascending, contiguous byte offsets; tensors may interleave, and the
    CRC-32C covers the payload bytes in arrival order.
    """

    def __init__(
        self,
        slot: StagingSlot,
        layout: Mapping[str, int],
        wire_dtype: WireDtype | str | torch.dtype,
        max_chunk_bytes: int,
        sparse: Mapping[str, tuple[Encoding, int]] | None = None,
        reference: Any = None,
        exact_norm: bool = False,
        refuse_non_finite: bool = True,
        quantized: Mapping[str, tuple[Quantization, int]] | None = None,
        keep_quantized: bool = False,
    ) -> None:
        """``sparse`` names the tensors sent in a sparse encoding with their (encoding, nnz);
        a sparse section that is not smaller than the dense bytes is refused (WrongLength).
        ``quantized`` names the tensors whose values are quantized, with (quantization, block
        size) (transport/quantized.py); they are decoded whole by :meth:`finish`.
        ``reference``: where to find a CPU float32 direction the size of the main buffer, to
        which the finished upload's :attr:`cosine` is taken in the same pass as its check: an
        object with ``current`` ((direction, its norm) or None) and ``generation`` (odd while
        the direction is written; a cosine computed across a change is dropped), read when the
        upload finishes (``aggsrv.server.update_health.RecentChange``). ``exact_norm``: the
        main buffer's :attr:`norm` is accumulated in float64 (clipping under differential
        privacy needs it exact; the health metrics do with float32's partial sums).
        ``refuse_non_finite`` False: NaN/Inf in the main buffer are not refused but reported
        (:attr:`non_finite`, and no :attr:`norm`), for differential privacy, which takes such
        an update as clipped to zero (a refusal would tell everyone that its values were
        not finite); the other buffers' are refused all the same. ``keep_quantized``: a main
        buffer sent as dense quantized values is checked but not decoded: :attr:`quantized`
        holds its codes (its view in the slot is left as it was), there is no :attr:`norm`
        (``QuantizedValues.norm`` has it, from the codes) and no cosine (unless a scale is too
        large to prove the values finite without decoding them: that one is decoded and checked
        as usual)."""
        self.slot = slot
        self.reference = reference
        self.exact_norm = exact_norm
        self.refuse_non_finite = refuse_non_finite
        self.keep_quantized = keep_quantized
        # The main buffer's values as codes, by tensor name (keep_quantized), once finished.
        self.quantized: dict[str, QuantizedValues] = {}
        self.wire_dtype = WireDtype.parse(wire_dtype)
        if max_chunk_bytes < self.wire_dtype.itemsize:
            raise ValueError(
                f"max_chunk_bytes={max_chunk_bytes} is smaller than one "
                f"{self.wire_dtype.wire_name} element"
            )
        self.max_chunk_bytes = max_chunk_bytes
        self._targets: dict[str, _Target] = {}
        packed = 0
        itemsize = self.wire_dtype.itemsize
        for name, numel in layout.items():
            numel = int(numel)
            if numel < 0:
                raise ValueError(f"tensor {name!r} has negative size {numel}")
            if name in slot.extras:
                buf = slot.extras[name]
                if numel > buf.numel():
                    raise ValueError(
                        f"tensor {name!r} has {numel} elements but its staging buffer only "
                        f"{buf.numel()}"
                    )
                view = buf[:numel]
            else:
                if packed + numel > slot.flat.numel():
                    raise ValueError(
                        f"layout needs more than the slot's {slot.flat.numel()} elements "
                        f"(at tensor {name!r})"
                    )
                view = slot.flat[packed : packed + numel]
                packed += numel
            raw = None
            # The wire is little-endian; read the host's order where from_wire reads it.
            native = _dtypes._NATIVE_LITTLE and self.wire_dtype.torch_dtype == view.dtype
            if native and view.device.type == "cpu" and view.is_contiguous():
                raw = memoryview(view.numpy()).cast("B")
            spec = (sparse or {}).get(name)
            quant = (quantized or {}).get(name)
            if quant is not None or (spec is not None and spec[0] is not Encoding.DENSE):
                encoding, nnz = spec if spec is not None else (Encoding.DENSE, numel)
                dense = encoded_nbytes(Encoding.DENSE, numel, numel, self.wire_dtype, quant)
                nbytes = encoded_nbytes(encoding, numel, nnz, self.wire_dtype, quant)
                if encoding is not Encoding.DENSE and (not 0 <= nnz <= numel or nbytes >= dense):
                    raise WrongLength(
                        f"tensor {name!r}: {encoding.value} encoding with nnz={nnz} of {numel} "
                        f"elements ({nbytes} bytes) is not smaller than dense "
                        f"({dense} bytes): send it dense",
                        tensor=name,
                    )
                raw = memoryview(bytearray(nbytes))
                self._targets[name] = _Target(
                    name, view, nbytes, raw=raw, sparse=(encoding, nnz), quantized=quant
                )
                continue
            self._targets[name] = _Target(name, view, numel * itemsize, raw=raw)
        self.flat = slot.flat[:packed]
        self._crc = Crc32c()
        self._state = "open"
        self.norm: float | None = None  # the L2 norm of the main buffer, once finished
        self.norm_exact = False  # whether norm was accumulated in float64
        self.cosine: float | None = None  # its cosine to ``reference``, when one was given
        self.non_finite = False  # the main buffer holds NaN/Inf (refuse_non_finite False)

    def reset(self) -> None:
        """Forget the previous upload (successful or not) and accept a new one into the slot."""
        for t in self._targets.values():
            t.received = 0
            if self.quantized and t.name in self.quantized and t.raw is not None:
                t.raw = memoryview(bytearray(t.nbytes))  # the codes handed out keep theirs
        self._crc.reset()
        self._state = "open"
        self.norm = self.cosine = None
        self.norm_exact = self.non_finite = False
        self.quantized = {}

    @property
    def bytes_received(self) -> int:
        """Payload bytes accepted so far."""
        return self._crc.nbytes

    def decoded(self) -> list[tuple[str, torch.Tensor, int]]:
        """(name, its view in the slot, elements decoded so far) of each tensor: the first
        elements of a dense tensor are final as its chunks arrive; a sparse one is decoded
        whole by :meth:`finish` (0 until then)."""
        itemsize = self.wire_dtype.itemsize
        return [
            (t.name, t.view, 0 if t.sparse is not None else t.received // itemsize)
            for t in self._targets.values()
        ]

    def sections(self) -> dict[str, tuple[memoryview, dict[str, Any]]]:
        """(after :meth:`finish`) The tensors that came as a section of their own format
        (sparse or quantized): their wire bytes and how to decode them again
        (:func:`decode_sparse`'s arguments: encoding, nnz, quantization, block, numel, dtype)."""
        out = {}
        for t in self._targets.values():
            if t.sparse is None or t.raw is None:
                continue
            encoding, nnz = t.sparse
            q, block = t.quantized if t.quantized is not None else (None, 0)
            out[t.name] = (t.raw, {
                "encoding": encoding.value, "nnz": nnz, "numel": t.view.numel(),
                "quantization": q.value if q is not None else None, "block": block,
                "dtype": self.wire_dtype.wire_name,
            })  # fmt: skip
        return out

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(
                f"decoder is {self._state}: call reset() before decoding another upload"
            )

    def _fail(self, exc: Exception) -> Exception:
        self._state = "failed"
        return exc

    def feed(self, name: str, byte_offset: int, data: BytesLike) -> None:
        """Check one chunk, add it to the CRC and decode it into the slot."""
        self._check_open()
        wd = self.wire_dtype
        target = self._targets.get(name)
        if target is None:
            known = ", ".join(repr(n) for n in list(self._targets)[:5])
            more = ", ..." if len(self._targets) > 5 else ""
            raise self._fail(
                BadChunk(
                    f"unknown tensor {name!r} at byte offset {byte_offset}: the layout has "
                    f"{len(self._targets)} tensors ({known}{more})",
                    tensor=name,
                )
            )
        mv = memoryview(data)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")  # protobuf gives bytes; other callers may pass typed views
        n = mv.nbytes
        if n == 0:
            raise self._fail(
                BadChunk(
                    f"chunk of tensor {name!r} at byte offset {byte_offset} is empty: every "
                    "chunk carries data (tensor.proto: never empty)",
                    tensor=name,
                )
            )
        if n > self.max_chunk_bytes:
            raise self._fail(
                ChunkTooLarge(
                    f"chunk of tensor {name!r} at byte offset {byte_offset} has {n} bytes, more "
                    f"than the negotiated chunk size of {self.max_chunk_bytes} bytes",
                    tensor=name,
                )
            )
        if target.sparse is None and byte_offset % wd.itemsize:
            raise self._fail(
                BadChunk(
                    f"chunk of tensor {name!r} starts at byte offset {byte_offset}, not a multiple "
                    f"of the {wd.wire_name} element size {wd.itemsize}",
                    tensor=name,
                )
            )
        if target.sparse is None and n % wd.itemsize:
            raise self._fail(
                BadChunk(
                    f"chunk of tensor {name!r} at byte offset {byte_offset} has {n} bytes: "
                    f"a partial {wd.wire_name} element (chunks hold whole {wd.itemsize}-byte "
                    f"elements)",
                    tensor=name,
                )
            )
        if byte_offset != target.received:
            what = "a gap" if byte_offset > target.received else "an overlap or replay"
            raise self._fail(
                BadChunk(
                    f"chunk of tensor {name!r} at byte offset {byte_offset} leaves {what}: "
                    f"expected byte offset {target.received} (chunks of a tensor arrive in order)",
                    tensor=name,
                )
            )
        end = byte_offset + n
        if end > target.nbytes:
            raise self._fail(
                WrongLength(
                    f"chunk of tensor {name!r} covers bytes [{byte_offset}, {end}) but the tensor "
                    f"has {target.nbytes} bytes ({target.nbytes // wd.itemsize} {wd.wire_name} "
                    f"elements): wrong length",
                    tensor=name,
                )
            )
        self._crc.update(mv)
        # Straight from the message's buffer into the slot: a memcpy for native float32, one
        # conversion pass for half types (torch's copy_ beats numpy's there: it uses every core).
        if target.raw is not None:
            target.raw[byte_offset:end] = mv
        else:
            a, b = byte_offset // wd.itemsize, end // wd.itemsize
            target.view[a:b].copy_(from_wire(mv, wd))
        target.received = end

    def finish(
        self, expected_crc32c: int, payload_bytes: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Check the trailer's length (if given), completeness, the CRC-32C and finiteness.

        Returns the filled views of the slot by name.
        """
        self._check_open()
        wd = self.wire_dtype
        if payload_bytes is not None and payload_bytes != self._crc.nbytes:
            raise self._fail(
                Truncated(
                    f"trailer says {payload_bytes} payload bytes were sent, {self._crc.nbytes} "
                    "arrived (bytes lost or added on the way)"
                )
            )
        missing = [t for t in self._targets.values() if t.received != t.nbytes]
        if missing:
            t = missing[0]
            elements = (
                ""
                if t.sparse is not None  # a section of its own format: bytes say it all
                else f" ({t.received // wd.itemsize} of {t.nbytes // wd.itemsize} "
                f"{wd.wire_name} elements)"
            )
            raise self._fail(
                Truncated(
                    f"upload truncated: tensor {t.name!r} has {t.received} of {t.nbytes} "
                    f"bytes{elements}; {len(missing)} of {len(self._targets)} tensors "
                    "incomplete",
                    tensor=t.name,
                )
            )
        got = self._crc.value
        if got != expected_crc32c:
            expected = (
                f"0x{expected_crc32c:08x}"
                if isinstance(expected_crc32c, int)
                else repr(expected_crc32c)
            )
            raise self._fail(
                ChecksumMismatch(
                    f"CRC-32C mismatch over {self._crc.nbytes} payload bytes: trailer says "
                    f"{expected}, payload gives 0x{got:08x} (data corrupted or misordered)"
                )
            )
        for t in self._targets.values():
            if t.sparse is not None:
                try:
                    encoding, nnz = t.sparse
                    if self._keeps(t):
                        assert t.raw is not None and t.quantized is not None
                        q, block = t.quantized
                        kept = quantized_values(t.raw, q, t.view.numel(), block, t.name)
                        if kept is not None:
                            self.quantized[t.name] = kept
                            continue
                    decode_sparse(
                        t.raw, encoding, t.view.numel(), nnz, wd, t.view, t.name, t.quantized
                    )
                except CodecError as exc:
                    raise self._fail(exc) from None
        self._check_finite()
        self._state = "finished"
        return {t.name: t.view for t in self._targets.values()}

    def _keeps(self, t: _Target) -> bool:
        """Whether ``t`` stays as codes: dense quantized values filling the main buffer."""
        return (
            self.keep_quantized
            and t.quantized is not None
            and t.sparse is not None
            and t.sparse[0] is Encoding.DENSE
            and t.name not in self.slot.extras
            and t.view.numel() == self.flat.numel()
        )

    def _check_finite(self) -> None:
        """NonFinite naming the first NaN/Inf; one read-only pass over the decoded values, which
        also gives the main buffer's norm (:attr:`norm`). Values kept as codes are finite by
        their scales (QuantizedValues), and not read here."""
        buffers = [self.flat] + [
            t.view for t in self._targets.values() if t.name in self.slot.extras
        ]
        for i, buf in enumerate(buffers):
            if i == 0 and self.quantized:
                continue
            if i == 0:
                uu = self._float64_check(buf)
                if uu is not None and math.isfinite(uu):
                    continue
                if uu is not None:  # a float64 sum of squares does not overflow: NaN/Inf
                    self._non_finite_main(buf)
                    continue
            # A finite sum of squares proves every element finite (aggsrv.finite); an overflow
            # of finite values only sends us to the exact (slow, rare) check below.
            sq = squared_norm_if_finite(buf) if buf.numel() else 0.0
            if sq is None:
                bad = (~torch.isfinite(buf)).nonzero()
                if bad.numel():
                    if i == 0:
                        self._non_finite_main(buf)
                        continue
                    self._raise_non_finite(buf, int(bad[0]), bad.numel())
                sq = squared_norm(buf)  # the squares overflowed in float32
            if i == 0:
                self.norm = math.sqrt(sq)

    def _non_finite_main(self, buf: torch.Tensor) -> None:
        """The main buffer holds NaN/Inf: refused (NonFinite), or with ``refuse_non_finite``
        False reported, with no norm or cosine."""
        if not self.refuse_non_finite:
            self.non_finite = True
            self.norm = self.cosine = None
            self.norm_exact = False
            return
        bad = (~torch.isfinite(buf)).nonzero()
        self._raise_non_finite(buf, int(bad[0]), bad.numel())

    def _float64_check(self, buf: torch.Tensor) -> float | None:
        """The main buffer's ``u . u`` in float64, in one pass over a CPU float32 buffer: with
        a reference direction that fits, its dot product too (the cosine), else with
        ``exact_norm`` the squares alone; None when neither applies (the float32 check then
        runs). A finite sum proves every value finite and sets :attr:`norm`; float64 squares
        cannot overflow, so a non-finite one means NaN/Inf."""
        if buf.dtype != torch.float32 or not buf.is_cpu or buf.numel() == 0:
            return None
        source = self.reference
        current = generation = None
        if source is not None:
            generation, current = source.generation, source.current
            if current is not None and (generation % 2 or current[0].numel() != buf.numel()):
                current = None
        flat = buf.reshape(-1).numpy()
        # numba: a server's, never a client's
        from aggsrv.fused_dots import squares, squares_and_dot

        if current is not None:
            direction, direction_norm = current
            uu, ur = squares_and_dot(flat, direction.reshape(-1).numpy())
        elif self.exact_norm:
            uu, ur = squares(flat), None
        else:
            return None
        if not math.isfinite(uu):
            return uu
        self.norm = math.sqrt(uu)
        self.norm_exact = True
        # A cosine taken across a change of direction (the generation moved) is dropped.
        changed = source is None or source.generation != generation
        if ur is not None and self.norm > 0 and direction_norm > 0 and not changed:
            self.cosine = max(-1.0, min(1.0, ur / (self.norm * direction_norm)))
        return uu

    def _raise_non_finite(self, buf: torch.Tensor, index: int, count: int) -> None:
        for t in self._targets.values():
            v = t.view
            if v.numel() and v.data_ptr() <= buf[index].data_ptr() < v.data_ptr() + v.nbytes:
                elem = (buf[index].data_ptr() - v.data_ptr()) // 4
                raise self._fail(
                    NonFinite(
                        f"tensor {t.name!r} holds {float(buf[index])} at element {elem} (byte "
                        f"offset {elem * self.wire_dtype.itemsize}); {count} non-finite values "
                        f"in the upload's buffer: NaN/Inf updates are rejected",
                        tensor=t.name,
                    )
                )
        raise self._fail(NonFinite(f"{count} non-finite values in the upload"))  # unreachable
