"""Rows kept as blockwise absmax int8 codes (a compressed [K, D] client cache): the public half,
validated like the rest of `aggsrv.kernels` (re-exported there).

A :class:`QuantizedRows` holds K rows of D values as int8 codes [K, D] and one float32 scale per
block of ``block`` values of a row [K, ceil(D / block)]: value ``(k, i)`` is the binary32 product
``float32(codes[k, i]) * scales[k, i // block]``, the decode of the wire's int8 values
(docs/wire.md), so a row costs D + 4 ceil(D / block) bytes instead of 4 D.

* `quantize_rows` writes rows into that form (round to nearest, ties to even, as the wire's
  deterministic encoder): one pass, the absmax of a block then its codes.
* `quantized_weighted_sum` and `quantized_group_means` read the codes once and never build a
  float32 copy of the rows: each value is decoded where it is added (float64 sums on the CPU).
* `quantized_gram` decodes a few thousand columns at a time into a small float32 buffer and
  multiplies it as `gram_matrix` does float32 rows, the chunks summed in float64.
* `quantized_cosine_matrix` and `quantized_layer_normalized_cosine` (FedDGIC's similarities)
  decode chosen rows a chunk of columns at a time and run `cosine_matrix` /
  `layer_normalized_cosine` on each chunk, their partial sums added over the chunks through the
  kernels' own ``reduce`` protocol (then over the shards, with the caller's ``reduce``).
* `dequantize_rows` decodes chosen rows in full (what a robust rule or a saved state needs).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

from . import (
    _DATA_DTYPES,
    _backend,
    _finite,
    _group_ids,
    _Like,
    _offsets,
    _out,
    _reduce,
    _row_weights,
    cosine_matrix,
    layer_normalized_cosine,
)
from ._partials import Reduce

__all__ = [
    "QuantizedRows",
    "dequantize_rows",
    "quantize_rows",
    "quantized_cosine_matrix",
    "quantized_gram",
    "quantized_layer_normalized_cosine",
    "quantized_group_means",
    "quantized_weighted_sum",
    "quantized_row_bytes",
]

QMAX = 127


class QuantizedRows(NamedTuple):
    """K rows as int8 codes [K, D] and float32 scales [K, ceil(D / block)], both contiguous and
    on one device; row k is :meth:`row`'s view."""

    codes: torch.Tensor
    scales: torch.Tensor
    block: int

    @classmethod
    def empty(cls, rows: int, dim: int, block: int, device: Any = "cpu") -> QuantizedRows:
        """Zeroed rows (every value decodes to 0)."""
        _check_block(block)
        return cls(
            torch.zeros(rows, dim, dtype=torch.int8, device=device),
            torch.zeros(rows, math.ceil(dim / block), dtype=torch.float32, device=device),
            block,
        )

    @property
    def shape(self) -> tuple[int, int]:
        """(K, D)."""
        return (self.codes.shape[0], self.codes.shape[1])

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def row(self, k: int) -> QuantizedRows:
        """Row k alone, as a view."""
        return QuantizedRows(self.codes[k : k + 1], self.scales[k : k + 1], self.block)

    def head(self, n: int) -> QuantizedRows:
        """The first n rows, as a view."""
        return QuantizedRows(self.codes[:n], self.scales[:n], self.block)


def quantized_row_bytes(dim: int, block: int) -> int:
    """The bytes one quantized row of ``dim`` values takes: its codes and its scales."""
    _check_block(block)
    return dim + 4 * math.ceil(dim / block)


def _check_block(block: Any) -> int:
    if isinstance(block, bool) or not isinstance(block, int | np.integer) or block < 1:
        raise ValueError(f"block must be an integer >= 1, got {block!r}")
    return int(block)


def _check_rows(Q: Any, name: str = "Q") -> QuantizedRows:
    if not isinstance(Q, QuantizedRows):
        raise TypeError(f"{name} must be a QuantizedRows, got {type(Q).__name__}")
    block = _check_block(Q.block)
    codes, scales = Q.codes, Q.scales
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.int8 or codes.dim() != 2:
        raise TypeError(f"{name}.codes must be a 2-D int8 tensor")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        raise TypeError(f"{name}.scales must be a float32 tensor")
    K, D = codes.shape
    want = (K, math.ceil(D / block))
    if tuple(scales.shape) != want:
        raise ValueError(
            f"{name}: {K} rows of {D} values in blocks of {block} take scales of shape {want}, "
            f"got {tuple(scales.shape)}"
        )
    if scales.device != codes.device:
        raise ValueError(f"{name}.scales is on {scales.device} but its codes on {codes.device}")
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError(f"{name}'s codes and scales must be contiguous")
    return QuantizedRows(codes, scales, block)


def quantize_rows(
    X: torch.Tensor, block: int, *, out: QuantizedRows | None = None, backend: str = "auto"
) -> QuantizedRows:
    """Rows X ([K, D] or [D], finite, any float dtype) as blockwise absmax int8 codes: per block
    ``scale = float32(max |x|) / 127`` (binary32 division; 0 for an all-zero block) and
    ``code = round(float32(x) / scale)`` (binary32 division, ties to even), the wire's
    deterministic int8 encoder bit for bit. ``out`` (K rows, any block) is written in place.

    A row that is not finite raises ValueError naming it; ``out`` may then be partly written.
    """
    if not isinstance(X, torch.Tensor) or X.dtype not in _DATA_DTYPES:
        raise TypeError("X must be a float torch.Tensor")
    if X.dim() not in (1, 2):
        raise ValueError(f"X must be 1-D or 2-D, got shape {tuple(X.shape)}")
    X2 = X.unsqueeze(0) if X.dim() == 1 else X
    if X2.shape[1] and X2.stride(1) != 1:
        X2 = X2.contiguous()
    K, D = X2.shape
    if out is None:
        out = QuantizedRows.empty(K, D, _check_block(block), X.device)
    else:
        out = _check_rows(out, "out")
        if out.shape != (K, D):
            raise ValueError(f"out holds {out.shape} rows, X has {(K, D)}")
        if out.device != X.device:
            raise ValueError(f"out is on {out.device}, X on {X.device}")
        if out.block != block:
            raise ValueError(f"out has blocks of {out.block}, asked for {block}")
    if K and D:
        _backend(backend, X.device).quantize_rows(X2, out.block, out.codes, out.scales)
        finite = torch.isfinite(out.scales).all(dim=1)
        if not bool(finite.all()):
            bad = int((~finite).nonzero()[0, 0])
            raise ValueError(f"row {bad} is not finite: only finite values can be quantized")
    return out


def _coefficients(
    groups: np.ndarray, coef_of_row: np.ndarray, num_groups: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows ordered by group, each one's coefficient, start of each group [G+1])."""
    included = np.flatnonzero(groups >= 0)
    order = included[np.argsort(groups[included], kind="stable")].astype(np.int64)
    counts = np.bincount(groups[included], minlength=num_groups)
    group_start = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(counts, out=group_start[1:])
    return order, coef_of_row[order].astype(np.float64), group_start


def _result(name: str, out: Any, shape: tuple[int, ...], Q: QuantizedRows) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=Q.device)
    dtype = out.dtype if isinstance(out, torch.Tensor) else torch.float32
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be float32 or float64, got {dtype}")
    _out(name, out, _Like(torch.Size(shape), dtype, Q.device), {})
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return out


def quantized_weighted_sum(
    Q: QuantizedRows,
    weights: Any,
    *,
    out: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """``out = beta*out + alpha * sum_k weights[k] * row_k`` [D], each value decoded as it is
    added (float64 sums on the CPU and in the reference), rounded once to out's dtype (float32
    or float64; a fresh float32 [D] when None). Rows with weight 0 are not read."""
    Q = _check_rows(Q)
    K, D = Q.shape
    w = _row_weights(weights, K)
    alpha, beta = _finite("alpha", alpha), _finite("beta", beta)
    if out is None and beta != 0.0:
        raise ValueError("beta != 0 needs out= (the tensor to scale and add to)")
    out = _result("out", out, (D,), Q)
    wn = w.numpy()
    groups = np.where(wn != 0.0, 0, -1).astype(np.int64)
    rows, coef, start = _coefficients(groups, wn, 1)
    _backend(backend, Q.device).quantized_rows_combination(
        Q.codes, Q.scales, Q.block, rows, coef, start, out.view(1, D), alpha, beta
    )
    return out


def quantized_group_means(
    Q: QuantizedRows,
    groups: Any,
    num_groups: int,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """[G, D] mean of the rows of each group (as `group_means`: rows of group -1 are never
    read, an empty group gives a zero row), decoded as they are added."""
    Q = _check_rows(Q)
    K, D = Q.shape
    gr, num_groups = _group_ids(groups, num_groups, K)
    g = gr.numpy()
    out = _result("out", out, (num_groups, D), Q)
    counts = np.bincount(g[g >= 0], minlength=max(num_groups, 1))
    per_row = np.where(g >= 0, 1.0 / np.maximum(counts[np.maximum(g, 0)], 1), 0.0)
    rows, coef, start = _coefficients(g, per_row, num_groups)
    if num_groups and D:
        _backend(backend, Q.device).quantized_rows_combination(
            Q.codes, Q.scales, Q.block, rows, coef, start, out, 1.0, 0.0
        )
    return out


def quantized_gram(Q: QuantizedRows, *, backend: str = "auto") -> torch.Tensor:
    """[K, K] float32 inner products of the decoded rows, exactly symmetric; chunks of columns
    are decoded into a float32 buffer, multiplied as float32 rows are (`gram_matrix`) and
    summed in float64 (the reference: the decoded rows in float64)."""
    Q = _check_rows(Q)
    return _backend(backend, Q.device).quantized_gram(Q.codes, Q.scales, Q.block)


def dequantize_rows(
    Q: QuantizedRows, rows: Any = None, *, out: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """The decoded values of the chosen rows (all when None) [len(rows), D], each the binary32
    product ``float32(code) * scale`` rounded once to out's dtype (float32 when None)."""
    Q = _check_rows(Q)
    K, D = Q.shape
    idx = list(range(K)) if rows is None else [int(r) for r in rows]
    for r in idx:
        if not 0 <= r < K:
            raise IndexError(f"row {r} is out of range for {K} rows")
    shape = (len(idx), D)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=Q.device)
    else:
        if not isinstance(out, torch.Tensor) or out.dtype not in _DATA_DTYPES:
            raise TypeError("out must be a float torch.Tensor")
        _out("out", out, _Like(torch.Size(shape), out.dtype, Q.device), {})
    impl = _backend(backend, Q.device)
    if D:
        for j, r in enumerate(idx):
            impl.dequantize(Q.codes[r], Q.scales[r], Q.block, 8, out[j])
    return out


# Bytes of float32 the chunked similarities decode at a time.
_SIMILARITY_CHUNK_BYTES = 8 << 20


def _chunked_partials(
    kernel: Any,
    Q: QuantizedRows,
    rows: Any,
    offsets: Any,
    reduce: Reduce | None,
    backend: str,
    **kwargs: Any,
) -> torch.Tensor:
    """``kernel`` (a float kernel that takes ``offsets`` and ``reduce``) on the decoded chosen
    rows, a block-aligned chunk of columns at a time: every chunk's call hands its packed float64
    partial sums to a ``reduce`` that keeps their running total; the last call's gets the total
    (summed over the shards by the caller's ``reduce``), from which the kernel finishes."""
    K, D = Q.shape
    idx = list(range(K)) if rows is None else [int(r) for r in rows]
    for r in idx:
        if not 0 <= r < K:
            raise IndexError(f"row {r} is out of range for {K} rows")
    offs = _offsets(offsets, D)
    red = _reduce(reduce)
    impl = _backend(backend, Q.device)
    k = len(idx)
    cols = Q.block * max(1, _SIMILARITY_CHUNK_BYTES // (4 * max(k, 1) * Q.block))
    starts = list(range(0, D, cols)) or [0]
    buf = torch.empty(k * min(cols, D), dtype=torch.float32, device=Q.device)
    total: list[torch.Tensor | None] = [None]

    def gather(last: bool) -> Reduce:
        def add(partials: torch.Tensor) -> torch.Tensor:
            total[0] = partials.clone() if total[0] is None else total[0].add_(partials)
            if not last:
                return partials
            return total[0] if red is None else red(total[0])

        return add

    out = None
    for n, c0 in enumerate(starts):
        c1 = min(D, c0 + cols)
        chunk = buf[: k * (c1 - c0)].view(k, c1 - c0)
        b0, b1 = c0 // Q.block, -(-c1 // Q.block)
        for j, r in enumerate(idx):
            if c1 > c0:
                impl.dequantize(Q.codes[r, c0:c1], Q.scales[r, b0:b1], Q.block, 8, chunk[j])
        local = (offs.clamp(c0, c1) - c0).contiguous()
        out = kernel(chunk, local, reduce=gather(n == len(starts) - 1), backend=backend, **kwargs)
    assert out is not None
    return out


def quantized_cosine_matrix(
    Q: QuantizedRows,
    offsets: Any = None,
    *,
    rows: Any = None,
    layerwise: bool = False,
    reduce: Reduce | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """`cosine_matrix` (self-similarity) of the decoded rows of Q (the chosen ``rows``, all by
    default, in that order), without decoding them whole: [k, k], or [L, k, k] layerwise."""
    Q = _check_rows(Q)
    if layerwise and offsets is None:
        raise ValueError("layerwise=True needs offsets")
    return _chunked_partials(
        cosine_matrix, Q, rows, offsets, reduce, backend, layerwise=bool(layerwise)
    )


def quantized_layer_normalized_cosine(
    Q: QuantizedRows,
    offsets: Any,
    *,
    rows: Any = None,
    reduce: Reduce | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """`layer_normalized_cosine` of the decoded rows of Q (the chosen ``rows``), without
    decoding them whole: [k, k]."""
    Q = _check_rows(Q)
    if offsets is None:
        raise ValueError("offsets is required (pass the layout's module_offsets)")
    return _chunked_partials(layer_normalized_cosine, Q, rows, offsets, reduce, backend)
