"""Compressed updates with error feedback (docs/compression.md): a client sends the largest
``top_k`` share of its delta's entries and/or their values quantized to INT8/INT4 in blocks
(docs/wire.md "Quantized values"), and keeps what it did not send (the residual) to add to its
next delta, so nothing is lost, only delayed. The residual survives a restart when it is given
a ``state_path``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from aggsrv.transport import (
    DEFAULT_BLOCK,
    Encoding,
    Quantization,
    WireDtype,
    check_block,
    encoded_nbytes,
    from_wire,
    index_section,
    quantize,
    to_wire,
    wire_view,
)

__all__ = ["Compression", "Compressor", "Section"]


@dataclass(frozen=True)
class Compression:
    """How a client compresses its DELTA updates.

    ``quantization``: "int8", "int4" or None (values in the upload dtype); used only when the
    job's recipe offers it (else the update goes uncompressed and the residual waits).
    ``top_k``: the share of entries sent, (0, 1] (the largest in magnitude); None: all.
    ``block``: values per scale; None: the recipe's suggestion (128 without one).
    ``stochastic``: stochastic rounding of the codes (unbiased; nearest when False).
    ``error_feedback``: keep the residual and add it to the next delta.
    ``state_path``: a file the residual is kept in across restarts (written after each push).
    """

    quantization: str | None = "int8"
    top_k: float | None = None
    block: int | None = None
    stochastic: bool = False
    error_feedback: bool = True
    state_path: str | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None:
            q = Quantization.parse(self.quantization)
            object.__setattr__(self, "quantization", None if q is Quantization.NONE else q.value)
        if self.top_k is not None and not 0 < self.top_k <= 1:
            raise ValueError(f"top_k must be in (0, 1], got {self.top_k}")
        if self.block is not None:
            check_block(self.block)


@dataclass
class Section:
    """One tensor's compressed wire bytes and how its TensorInfo describes them."""

    payload: memoryview
    numel: int
    encoding: Encoding
    nnz: int
    quantization: Quantization | None
    block: int


class Compressor:
    """A client's compression state: the residual of what it has not sent yet."""

    def __init__(self, spec: Compression, numel: int, seed: int | None = None) -> None:
        self.spec = spec
        self.numel = numel
        self._generator = torch.Generator()
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()
        self.residual = torch.zeros(numel, dtype=torch.float32)
        self._pending: torch.Tensor | None = None
        self.sent: torch.Tensor | None = None  # what the last compress() sends, decoded
        path = spec.state_path
        if path and os.path.exists(path):
            saved = torch.load(path, weights_only=True)
            if not isinstance(saved, torch.Tensor) or saved.shape != (numel,):
                raise ValueError(
                    f"{path} holds no residual of {numel} elements (another model's?): remove "
                    "it to start without one"
                )
            self.residual = saved.to(torch.float32)

    def compress(
        self,
        delta: torch.Tensor,
        bounds: list[int],
        offered: tuple[str, ...],
        suggested_block: int,
        wire_dtype: WireDtype,
    ) -> list[Section] | None:
        """The sections of ``delta`` (flat, float) cut at ``bounds`` (the shards' slices; [0, D]
        for one server), or None when the job offers nothing this compression uses (the update
        is then sent as it is, and the residual kept for later). The residual of this update
        is kept aside until :meth:`commit`."""
        spec = self.spec
        quant = None
        if spec.quantization is not None:
            if spec.quantization not in offered:
                return None
            quant = Quantization.parse(spec.quantization)
        block = spec.block or suggested_block or DEFAULT_BLOCK
        target = delta.detach().reshape(-1).to(torch.float32).cpu()
        if spec.error_feedback:
            target = target + self.residual
        keep = None
        if spec.top_k is not None and spec.top_k < 1 and target.numel():
            k = max(1, int(round(spec.top_k * target.numel())))
            keep = torch.zeros(target.numel(), dtype=torch.bool)
            keep[torch.topk(target.abs(), k, sorted=False).indices] = True
        sent = torch.zeros_like(target)
        sections = []
        for a, b in zip(bounds, bounds[1:], strict=False):
            part = target[a:b]
            kept = keep[a:b] if keep is not None else None
            section, decoded = self._section(part, kept, quant, block, wire_dtype)
            sent[a:b] = decoded
            sections.append(section)
        self._pending = target - sent if spec.error_feedback else None
        self.sent = sent
        return sections

    def _section(
        self,
        part: torch.Tensor,
        kept: torch.Tensor | None,
        quant: Quantization | None,
        block: int,
        wire_dtype: WireDtype,
    ) -> tuple[Section, torch.Tensor]:
        numel = part.numel()
        generator = self._generator if self.spec.stochastic else None
        q = (quant, block) if quant is not None else None
        encoding = Encoding.DENSE
        if kept is not None:
            nnz = int(kept.sum())
            sizes = {e: encoded_nbytes(e, numel, nnz, wire_dtype, q) for e in Encoding}
            encoding = min((Encoding.COO, Encoding.BITMAP), key=sizes.__getitem__)
            if sizes[encoding] >= sizes[Encoding.DENSE]:
                # Dense is no bigger: every entry goes, the dropped ones as zeros.
                part, kept, encoding = torch.where(kept, part, 0.0), None, Encoding.DENSE
        values = part if kept is None else part[kept]
        if quant is not None:
            value_bytes, decoded = quantize(values, quant, block, generator)
        else:
            value_bytes = bytes(wire_view(to_wire(values, wire_dtype)))
            decoded = from_wire(memoryview(value_bytes), wire_dtype).to(torch.float32)
        if kept is None:
            return Section(memoryview(value_bytes), numel, encoding, 0, quant, block), decoded
        sent = torch.zeros(numel, dtype=torch.float32)
        sent[kept] = decoded
        payload = memoryview(index_section(kept, encoding) + value_bytes)
        return Section(payload, numel, encoding, values.numel(), quant, block), sent

    def commit(self) -> None:
        """The update was taken: what it did not send becomes the residual (and is saved)."""
        if self._pending is None:
            return
        self.residual, self._pending = self._pending, None
        path = self.spec.state_path
        if path:
            _save_atomically(self.residual, Path(path))

    def discard(self) -> None:
        """The update was not taken: the residual stays what it was."""
        self._pending = None


def _save_atomically(tensor: torch.Tensor, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(tensor, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
