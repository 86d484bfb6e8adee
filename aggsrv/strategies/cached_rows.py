"""The per-client row cache of the strategies that keep every client's latest update (MIFA,
Fed-OGD, CA2FL) or a similarity row per client (FedDGIC, FedFG), stored in ``cache_dtype``:

* ``float32``: the rows as they are (the default; results unchanged bit for bit);
* ``bfloat16``: half the bytes; each value rounded once to bfloat16 (8 significant bits);
* ``int8``: blockwise absmax codes with a float32 scale per block of ``CACHE_BLOCK`` values
  (`aggsrv.kernels.QuantizedRows`, the wire's int8 format): about a quarter of the bytes.

The kernels read the stored rows directly (`quantized_group_means` and friends decode each value
where they add it), so a compressed cache never has a float32 copy of its K rows; only a robust
rule, which needs the values themselves, decodes the rows it combines (K x D float32 while it
runs), and bfloat16 rows reach the kernels as float32 a few MB of columns at a time (or, for
FedDGIC's similarities, the rows of a round whole). Rows grow as clients join
(:mod:`aggsrv.strategies.row_cache`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch

from aggsrv import kernels
from aggsrv.kernels import QuantizedRows
from aggsrv.strategies.row_cache import capacity_after, with_room

__all__ = [
    "CACHE_BLOCK",
    "CACHE_DTYPES",
    "CACHE_DTYPE_HELP",
    "CachedRows",
    "RowCacheInfo",
    "check_cache_dtype",
]

CACHE_DTYPES = ("float32", "bfloat16", "int8")
# The wire's default block: 4 bytes of scale per 128 values (3 % over the codes).
CACHE_BLOCK = 128
CACHE_DTYPE_HELP = (
    "how per-client rows are stored: float32 (exact), bfloat16 (half the bytes) or int8 "
    "(about 0.26x)"
)

# How much larger than the row it was given a stored row's max |x| may be: half a unit in
# the last place of what the dtype rounds to (int8: the binary32 scale and its product).
# Bytes of float32 a bfloat16 cache is converted to at a time (on the way to a kernel).
_FLOAT_CHUNK_BYTES = 16 << 20
_ROUNDING_GROWTH = {"float32": 0.0, "bfloat16": 2.0**-8, "int8": 2.0**-22}


class RowCacheInfo(NamedTuple):
    """What a status report says of a row cache."""

    dtype: str
    rows: int  # in use (one per client that has one)
    bytes_per_row: int  # scales included


def check_cache_dtype(value: str) -> str:
    """``value`` if it names a cache dtype, else a ValueError listing them."""
    if value not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {', '.join(CACHE_DTYPES)}, got {value!r}")
    return value


class CachedRows:
    """[capacity, D] rows in one of :data:`CACHE_DTYPES`; row r is written whole and read by
    the kernels in place."""

    def __init__(self, dim: int, dtype: str, device: torch.device) -> None:
        """An empty cache (no rows yet)."""
        self.dim = dim
        self.dtype = check_cache_dtype(dtype)
        self.device = device
        self._rows: torch.Tensor | QuantizedRows = self._zeros(0)

    def _zeros(self, rows: int) -> torch.Tensor | QuantizedRows:
        if self.dtype == "int8":
            return QuantizedRows.empty(rows, self.dim, CACHE_BLOCK, self.device)
        torch_dtype = torch.float32 if self.dtype == "float32" else torch.bfloat16
        return torch.zeros(rows, self.dim, dtype=torch_dtype, device=self.device)

    # --------------------------------------------------------------------------- size

    @property
    def capacity(self) -> int:
        """Rows allocated."""
        return self._rows.shape[0]

    @property
    def bytes_per_row(self) -> int:
        """What one row takes in memory (its scales included)."""
        if self.dtype == "int8":
            return kernels.quantized_row_bytes(self.dim, CACHE_BLOCK)
        return self.dim * (4 if self.dtype == "float32" else 2)

    def info(self, rows: int) -> RowCacheInfo:
        """The status report of a cache with ``rows`` rows in use."""
        return RowCacheInfo(self.dtype, rows, self.bytes_per_row)

    @property
    def nbytes(self) -> int:
        """What the allocated rows take."""
        return self.capacity * self.bytes_per_row

    def ensure(self, used: int, needed: int, max_clients: int) -> None:
        """Room for ``needed`` rows, keeping the first ``used`` (blocks that double)."""
        if needed <= self.capacity:
            return
        if isinstance(self._rows, QuantizedRows):
            codes = with_room(self._rows.codes, used, needed, max_clients)
            scales = with_room(self._rows.scales, used, needed, max_clients)
            self._rows = QuantizedRows(codes, scales, CACHE_BLOCK)
        else:
            self._rows = with_room(self._rows, used, needed, max_clients)

    # --------------------------------------------------------------------------- rows

    def bound(self, absmax: float) -> float:
        """A bound on max |x| of a row stored from values with max |x| = ``absmax`` (the
        absolute term covers subnormal values and scales, whose relative error is larger)."""
        if self.dtype == "float32":
            return absmax
        return absmax * (1.0 + _ROUNDING_GROWTH[self.dtype]) + 2.0**-126

    def write(self, row: int, values: torch.Tensor) -> None:
        """Store ``values`` [D] (finite) as row ``row``."""
        if isinstance(self._rows, QuantizedRows):
            kernels.quantize_rows(values, CACHE_BLOCK, out=self._rows.row(row))
        else:
            self._rows[row].copy_(values)

    def read(self, row: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Row ``row``'s values as float32 [D] (a view when stored as float32 and no ``out``)."""
        if isinstance(self._rows, QuantizedRows):
            if out is None:
                out = torch.empty(self.dim, dtype=torch.float32, device=self.device)
            return kernels.dequantize_rows(self._rows.row(row), out=out.view(1, -1))[0]
        if out is None:
            return self._rows[row] if self.dtype == "float32" else self._rows[row].float()
        return out.copy_(self._rows[row])

    def cosines(
        self, rows: list[int], layer_norm: str, offsets: torch.Tensor, reduce: Any
    ) -> torch.Tensor:
        """FedDGIC's similarity of the listed rows: ``layer_normalized_cosine``
        (``per_layer_mean``), the plain cosine (``none``), or the per-layer cosines [L, k, k]
        (``param_weighted``, weighed by the caller); int8 rows are decoded a chunk at a time."""
        if isinstance(self._rows, QuantizedRows):
            if layer_norm == "per_layer_mean":
                return kernels.quantized_layer_normalized_cosine(
                    self._rows, offsets, rows=rows, reduce=reduce
                )
            if layer_norm == "none":
                return kernels.quantized_cosine_matrix(self._rows, rows=rows, reduce=reduce)
            return kernels.quantized_cosine_matrix(
                self._rows, offsets, rows=rows, layerwise=True, reduce=reduce
            )
        x = self._rows.index_select(0, torch.as_tensor(rows, device=self.device))
        if layer_norm == "per_layer_mean":
            return kernels.layer_normalized_cosine(x, offsets, reduce=reduce)
        if layer_norm == "none":
            return kernels.cosine_matrix(x, reduce=reduce)
        return kernels.cosine_matrix(x, offsets, layerwise=True, reduce=reduce)

    def decoded(self, n: int, rows: list[int] | None = None) -> torch.Tensor:
        """Rows (the first ``n``, or those listed) as float32 [k, D]; a view of the cache when
        it is float32 and no list is given."""
        if isinstance(self._rows, QuantizedRows):
            return kernels.dequantize_rows(self._rows.head(n), rows)
        x = self._rows[:n]
        if rows is not None:
            x = x.index_select(0, torch.tensor(rows, dtype=torch.int64, device=self.device))
        return x if x.dtype == torch.float32 else x.float()

    def group_means(
        self, n: int, groups: torch.Tensor, num_groups: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`kernels.group_means` of the first ``n`` rows, as float32 [G, D]."""
        if isinstance(self._rows, QuantizedRows):
            return kernels.quantized_group_means(self._rows.head(n), groups, num_groups, out=out)
        if self.dtype == "float32":
            return kernels.group_means(self._rows[:n], groups, num_groups, out=out)
        if out is None:
            out = torch.empty(num_groups, self.dim, dtype=torch.float32, device=self.device)
        for cols, rows in self._float_columns(n):
            out[:, cols].copy_(kernels.group_means(rows, groups, num_groups))
        return out

    def sum_into(self, n: int, out: torch.Tensor) -> torch.Tensor:
        """``out`` [D] (float64) = the sum of the first ``n`` rows."""
        if isinstance(self._rows, QuantizedRows):
            return kernels.quantized_weighted_sum(self._rows.head(n), [1.0] * n, out=out)
        if self.dtype == "float32":
            return torch.sum(self._rows[:n], dim=0, dtype=out.dtype, out=out)
        for cols, rows in self._float_columns(n):
            torch.sum(rows, dim=0, dtype=out.dtype, out=out[cols])
        return out

    def _float_columns(self, n: int) -> Iterator[tuple[slice, torch.Tensor]]:
        """The first ``n`` bfloat16 rows as float32, a few MB of columns at a time: the kernels'
        CPU code converts half types to float32 first, which must not cost a float32 copy of
        the whole cache."""
        assert isinstance(self._rows, torch.Tensor)
        step = max(1, _FLOAT_CHUNK_BYTES // (4 * max(n, 1)))
        for c0 in range(0, self.dim, step):
            cols = slice(c0, min(self.dim, c0 + step))
            yield cols, self._rows[:n, cols].float()

    # --------------------------------------------------------------------------- state

    def state(self, n: int, key: str = "cache") -> dict[str, Any]:
        """The first ``n`` rows as saved: ``key`` (float32/bfloat16 rows, or int8 codes) and,
        for int8, ``key``_scales and ``key``_block."""
        if isinstance(self._rows, QuantizedRows):
            head = self._rows.head(n)
            return {key: head.codes, f"{key}_scales": head.scales, f"{key}_block": CACHE_BLOCK}
        return {key: self._rows[:n]}

    def load(self, state: Mapping[str, Any], n: int, max_clients: int, key: str = "cache") -> None:
        """Rows from :meth:`state` of any cache dtype (converted to this one), with the
        capacity they grew to live."""
        saved = state[key]
        if tuple(saved.shape) != (n, self.dim):
            raise ValueError(f"saved cache has shape {tuple(saved.shape)}, expected ({n}, D)")
        self._rows = self._zeros(capacity_after(n, max_clients) if n else 0)
        if not n:
            return
        scales = state.get(f"{key}_scales")
        if scales is not None:
            block = int(state[f"{key}_block"])
            source = QuantizedRows(saved.detach().contiguous(), scales.detach().contiguous(), block)
            if isinstance(self._rows, QuantizedRows) and source.block == CACHE_BLOCK:
                self._rows.codes[:n].copy_(source.codes)
                self._rows.scales[:n].copy_(source.scales)
                return
            for r in range(n):
                self.write(r, kernels.dequantize_rows(source.row(r))[0].to(self.device))
            return
        for r in range(n):
            self.write(r, saved[r].to(device=self.device, dtype=torch.float32))
