"""aggsrv.kernels: fused aggregation kernels over flat model vectors.

Functional, torch tensors in and out. Data are [D] or [K, D] rows (rows may be strided) sharing
one dtype among float32, float16, bfloat16 and float64. Every function takes
``backend="auto" | "triton" | "cpu" | "reference"``: ``auto`` picks Triton for CUDA tensors and
the CPU implementation otherwise; ``reference`` is the float64 oracle. This module validates and
normalises every argument, so the backends (see BACKENDS.md) never do.

The kernels that derive values from whole-segment or whole-row sums (`layer_dots`,
`project_out`, `orthogonal_calibrate`, `cosine_matrix`, `layer_normalized_cosine`,
`gram_matrix`, `pairwise_sq_distances`, `nnz_per_layer`, `quantized_cosine_matrix`,
`quantized_layer_normalized_cosine`) take ``reduce=``: a callable that sums
their partial sums over the shards of a sharded server (docs/kernels.md, "Sharded use").

The package imports neither gRPC nor any server code, so other FL stacks can embed it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import torch

# Sums a kernel call's packed float64 partial sums over the shards (a collective, e.g.
# `aggsrv.sharding.Reducer.sum_`): returns its argument summed in place, or a new tensor of the
# same shape, dtype and device.
from ._partials import Reduce

__all__ = [
    "Reduce",
    "layer_dots",
    "project_out",
    "orthogonal_calibrate",
    "cosine_matrix",
    "gram_matrix",
    "pairwise_sq_distances",
    "layer_normalized_cosine",
    "group_means",
    "weighted_sum",
    "nnz_per_layer",
    "sparse_accumulate",
    "accumulate",
    "quantized_accumulate",
    "code_squares",
    "dequantize",
    "average_linkage",
    "similarity_linkage",
    "BACKENDS",
]

BACKENDS = ("auto", "triton", "cpu", "reference")
_DATA_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_BACKEND_MODULES = {"reference": ".reference", "cpu": ".cpu", "triton": ".triton"}


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------


def _backend(backend: str, device: torch.device) -> ModuleType:
    """Resolve `backend=` for tensors on `device` and import that backend lazily."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "cpu"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before import to run "
            "the kernels under the Triton interpreter)"
        )
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"backend='cpu' needs CPU tensors, got tensors on {device}")
    return importlib.import_module(_BACKEND_MODULES[backend], __name__)


def _data(name: str, t: Any, dims: tuple[int, ...] = (1, 2)) -> torch.Tensor:
    """Check one data tensor: a torch tensor of a supported float dtype and rank."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DATA_DTYPES:
        raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")
    if t.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    return t


def _same_kind(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    """All data tensors of a call share one dtype and one device."""
    for name, t in others.items():
        if t is None:
            continue
        if t.dtype != ref.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View as [K, D] with unit element stride; strided rows are kept, odd layouts copied."""
    t2 = t.unsqueeze(0) if t.dim() == 1 else t
    if t2.shape[1] > 0 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    if t2.shape[0] > 1 and t2.stride(0) < t2.shape[1]:
        t2 = t2.contiguous()
    return t2


def _offsets(offsets: Any, D: int, name: str = "offsets") -> torch.Tensor:
    """Validate an offset table and return it as a CPU int64 tensor [L+1]."""
    if offsets is None:
        return torch.tensor([0, D], dtype=torch.int64)
    if isinstance(offsets, torch.Tensor):
        if (
            offsets.dtype.is_floating_point
            or offsets.dtype.is_complex
            or offsets.dtype == torch.bool
        ):
            raise TypeError(f"{name} must be an integer tensor, got {offsets.dtype}")
        offs = offsets.detach().to("cpu", torch.int64)
    else:
        arr = np.asarray(offsets)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got {arr.dtype}")
        offs = torch.from_numpy(arr.astype(np.int64, copy=True))
    if offs.dim() != 1 or offs.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D with at least 2 entries, got shape {tuple(offs.shape)}"
        )
    # numpy on the (small) table: a torch op costs microseconds each, which matters for the
    # per-step calls on small models.
    o = offs.numpy()
    if o[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(o[0])}")
    if o[-1] != D:
        raise ValueError(f"{name}[-1] must equal the data length D={D}, got {int(o[-1])}")
    if (o[1:] < o[:-1]).any():
        raise ValueError(f"{name} must be non-decreasing")
    return offs.contiguous()


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1
    return (t.data_ptr(), t.data_ptr() + extent * t.element_size())


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    return a0 < b1 and b0 < a1


def _is_alias(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exactly the same memory with the same geometry: the one overlap we allow (out=g)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


class _Like(NamedTuple):
    """What an `out=` tensor must look like, when no input tensor has that shape."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


def _out(
    name: str,
    out: Any,
    like: torch.Tensor | _Like,
    inputs: dict[str, torch.Tensor],
    alias: str | None = None,
) -> torch.Tensor:
    """Check an `out=` tensor: exact shape/dtype/device, unit inner stride, no illegal overlap."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != like.shape:
        raise ValueError(f"{name} must have shape {tuple(like.shape)}, got {tuple(out.shape)}")
    if out.dtype != like.dtype:
        raise TypeError(f"{name} must have dtype {like.dtype}, got {out.dtype}")
    if out.device != like.device:
        raise ValueError(f"{name} must be on {like.device}, got {out.device}")
    if out.numel() > 0 and out.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension")
    if out.dim() == 2 and out.shape[0] > 1 and out.stride(0) < out.shape[1]:
        raise ValueError(f"{name} rows must not overlap each other")
    for in_name, t in inputs.items():
        if in_name == alias and _is_alias(out, t):
            continue
        if _overlaps(out, t):
            allowed = f" (only {name}={alias} exactly is allowed)" if alias else ""
            raise ValueError(f"{name} overlaps {in_name} in memory{allowed}")
    return out


def _row_pair(X: Any, other: Any) -> None:
    """Check the rows of a Gram-type call: X [K, D] and optionally other [M, D], one kind."""
    _data("X", X, dims=(2,))
    if other is not None:
        _data("other", other, dims=(2,))
        _same_kind("X", X, other=other)
        if other.shape[1] != X.shape[1]:
            raise ValueError(f"other has rows of length {other.shape[1]} but X has {X.shape[1]}")


def _row_pair_pass(kernel: str, X: Any, other: Any, reduce: Any, backend: str) -> torch.Tensor:
    """The backend's Gram-type `kernel` (gram_matrix, pairwise_sq_distances) on checked rows,
    in the accumulation dtype of X."""
    _row_pair(X, other)
    red = _reduce(reduce)
    impl = _backend(backend, X.device)
    Y = None if other is None else _rows(other)
    return getattr(impl, kernel)(_rows(X), Y, reduce=red).to(_acc_dtype(X))


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _row_weights(weights: Any, K: int) -> torch.Tensor:
    """One finite real weight per row as a float64 CPU tensor [K]; a list of Python floats keeps
    their precision (torch.as_tensor would round it to float32)."""
    if isinstance(weights, torch.Tensor):
        w = weights.detach().to("cpu")
    else:
        w = torch.as_tensor(np.asarray(weights))
    if not (w.dtype.is_floating_point or w.dtype in (torch.int32, torch.int64)):
        raise TypeError(f"weights must be real numbers, got {w.dtype}")
    w = w.to(torch.float64)
    if w.shape != (K,):
        raise ValueError(f"weights must have shape ({K},) (one per row), got {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weights must be finite")
    return w


def _group_ids(groups: Any, num_groups: Any, K: int) -> tuple[torch.Tensor, int]:
    """(a group id per row in [-1, num_groups) as a CPU int64 tensor [K], num_groups)."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int | np.integer):
        raise TypeError(f"num_groups must be an int, got {type(num_groups).__name__}")
    num_groups = int(num_groups)
    if num_groups < 0:
        raise ValueError(f"num_groups must be >= 0, got {num_groups}")
    gr = torch.as_tensor(groups).detach().to("cpu")
    if gr.dtype.is_floating_point or gr.dtype == torch.bool or gr.dtype.is_complex:
        raise TypeError(f"groups must be an integer tensor, got {gr.dtype}")
    gr = gr.to(torch.int64)
    if gr.shape != (K,):
        raise ValueError(f"groups must have shape ({K},) (one id per row), got {tuple(gr.shape)}")
    if gr.numel() and (int(gr.min()) < -1 or int(gr.max()) >= num_groups):
        raise ValueError(
            f"groups must lie in [-1, {num_groups}), got [{int(gr.min())}, {int(gr.max())}]"
        )
    return gr.contiguous(), num_groups


def _finite(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    if not np.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def _eps(eps: Any) -> float:
    v = _finite("eps", eps)
    if v < 0:
        raise ValueError(f"eps must be >= 0, got {v}")
    return v


def _reduce(reduce: Any) -> Reduce | None:
    """Check `reduce=` and wrap it so the backends get back a tensor like the one they passed
    (same shape, dtype float64, device; made contiguous), or an error naming the argument."""
    if reduce is None:
        return None
    if not callable(reduce):
        raise TypeError(f"reduce must be callable (tensor -> tensor) or None, got {reduce!r}")

    def checked(partials: torch.Tensor) -> torch.Tensor:
        res = reduce(partials)
        if not isinstance(res, torch.Tensor):
            raise TypeError(f"reduce must return a torch.Tensor, got {type(res).__name__}")
        if res.dtype != partials.dtype:
            raise TypeError(f"reduce returned dtype {res.dtype}, expected {partials.dtype}")
        if res.shape != partials.shape or res.device != partials.device:
            raise ValueError(
                f"reduce returned shape {tuple(res.shape)} on {res.device}, expected "
                f"{tuple(partials.shape)} on {partials.device}"
            )
        return res.contiguous()

    return checked


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def layer_dots(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: Any = None,
    *,
    reduce: Reduce | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Inner products of paired rows per segment of `offsets` (whole vector when None).

    `a` [D] or [K, D]; `b` [D] (broadcast over rows) or [K, D]. Returns [L] / [K, L], or a
    scalar / [K] without offsets; float32 (float64 for float64 inputs). `reduce` gets the
    float64 [K, L] dots of this slice (K = 1 for a [D] input) and returns their sum over the
    shards, which the call returns.
    """
    _data("a", a)
    _data("b", b)
    _same_kind("a", a, b=b)
    if b.dim() == 2 and (a.dim() != 2 or b.shape[0] != a.shape[0]):
        raise ValueError(
            f"b must be [D] or have as many rows as a: a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"a and b lengths differ: {a.shape[-1]} vs {b.shape[-1]}")
    D = a.shape[-1]
    offs = _offsets(offsets, D)
    red = _reduce(reduce)
    impl = _backend(backend, a.device)
    res = impl.layer_dots(_rows(a), _rows(b), offs, reduce=red).to(_acc_dtype(a))
    if offsets is None:
        res = res[:, 0]
    return res[0] if a.dim() == 1 else res


def project_out(
    g: torch.Tensor,
    b: torch.Tensor,
    offsets: Any = None,
    *,
    only_conflicting: bool = False,
    eps: float = 0.0,
    out: torch.Tensor | None = None,
    reduce: Reduce | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """`g - c * b` per segment with c = <g,b>/<b,b> (0 where <b,b> <= eps).

    With `only_conflicting=True`, c = min(c, 0): only the component that conflicts with `b` is
    removed (Fed-OGD). A segment whose coefficient is 0 is a bitwise copy of `g`. `out=g` is
    safe. `reduce` gets the float64 [K+1, L] partial sums (rows 0..K-1: <g_k, b>, row K:
    <b, b>; K = 1 for a [D] g) and returns their sum over the shards, from which c is formed.
    """
    _data("g", g)
    _data("b", b, dims=(1,))
    _same_kind("g", g, b=b)
    if g.shape[-1] != b.shape[0]:
        raise ValueError(f"g and b lengths differ: {g.shape[-1]} vs {b.shape[0]}")
    eps = _eps(eps)
    offs = _offsets(offsets, b.shape[0])
    red = _reduce(reduce)
    impl = _backend(backend, g.device)
    if out is None:
        out = torch.empty_like(g, memory_format=torch.contiguous_format)
    else:
        _out("out", out, g, {"g": g, "b": b}, alias="g")
    g2 = _rows(g)
    out2 = _rows(out)
    if out2.data_ptr() != out.data_ptr() or (out.dim() == 2 and out2.stride() != out.stride()):
        raise ValueError("out must have unit stride in its last dimension")
    impl.project_out(g2, _rows(b), offs, bool(only_conflicting), eps, out2, reduce=red)
    return out


def orthogonal_calibrate(
    x: torch.Tensor,
    sent: torch.Tensor,
    w: torch.Tensor,
    snap: torch.Tensor,
    offsets: Any,
    beta: float,
    *,
    calibrate: Any = None,
    ma: torch.Tensor | None = None,
    eps: float = 0.0,
    out_y: torch.Tensor | None = None,
    out_ma: torch.Tensor | None = None,
    return_coeffs: bool = False,
    reduce: Reduce | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, ...]:
    """ORTHOFL's per-arrival update in two fused passes over [D] vectors.

    dm = x - sent, dg = w - snap; per segment c = <dg,dm>/<dm,dm> (0 where <dm,dm> <= eps) and
    y = x + (dg - c*dm), y = x on segments where `calibrate` is False; ma_new = (1-beta)*ma +
    beta*x with `ma` defaulting to `w`. Returns (y, ma_new) or (y, ma_new, c).
    `out_y` may alias `x` and `out_ma` may alias `ma` (or `w` when ma is None). `reduce` gets
    the float64 [2, L] partial sums (<dg, dm>, <dm, dm> per segment; may be 0 where calibrate
    is False) and returns their sum over the shards, from which c is formed.
    """
    for name, t in (("x", x), ("sent", sent), ("w", w), ("snap", snap)):
        _data(name, t, dims=(1,))
    if ma is not None:
        _data("ma", ma, dims=(1,))
    _same_kind("x", x, sent=sent, w=w, snap=snap, ma=ma)
    D = x.shape[0]
    for name, t in (("sent", sent), ("w", w), ("snap", snap), ("ma", ma)):
        if t is not None and t.shape[0] != D:
            raise ValueError(f"{name} has length {t.shape[0]} but x has {D}")
    offs = _offsets(offsets, D)
    L = offs.numel() - 1
    beta = _finite("beta", beta)
    eps = _eps(eps)
    if calibrate is None:
        mask = torch.ones(L, dtype=torch.bool)
    else:
        mask = torch.as_tensor(calibrate).detach().to("cpu")
        if mask.dtype != torch.bool:
            raise TypeError(f"calibrate must be a bool mask, got {mask.dtype}")
        if mask.shape != (L,):
            raise ValueError(
                f"calibrate must have shape ({L},) (one flag per segment), got {tuple(mask.shape)}"
            )
    ma_in = w if ma is None else ma
    ma_name = "w" if ma is None else "ma"
    inputs = {"x": x, "sent": sent, "w": w, "snap": snap}
    if ma is not None:
        inputs["ma"] = ma
    if out_y is None:
        out_y = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        _out("out_y", out_y, x, inputs, alias="x")
    if out_ma is None:
        out_ma = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        _out("out_ma", out_ma, x, inputs, alias=ma_name)
    if _overlaps(out_y, out_ma):
        raise ValueError("out_y and out_ma overlap in memory")
    red = _reduce(reduce)
    impl = _backend(backend, x.device)
    r = _rows
    coeffs = impl.orthogonal_calibrate(
        r(x), r(sent), r(w), r(snap), r(ma_in), offs, beta, mask, eps, r(out_y), r(out_ma),
        reduce=red,
    ).to(_acc_dtype(x))  # fmt: skip
    if return_coeffs:
        return out_y, out_ma, coeffs
    return out_y, out_ma


def cosine_matrix(
    X: torch.Tensor,
    offsets: Any = None,
    *,
    other: torch.Tensor | None = None,
    layerwise: bool = False,
    reduce: Reduce | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Cosine similarities of the rows of X: [K, K], or [K, M] against the rows of `other`.

    With `layerwise=True`, one matrix per segment of `offsets`: [L, K, K] / [L, K, M].
    Self-similarity matrices are exactly symmetric with 1 on the diagonal of non-zero rows.
    `reduce` gets the float64 partial sums, per segment (L' = L) or of the whole rows (L' = 1):
    the symmetric Gram [L', K, K] (squared norms on its diagonal), or with `other`
    [L', K*M + K + M] (the Gram X Y^T flattened, then the squared norms of X's and Y's rows);
    the cosines are formed from their sum over the shards.
    """
    _row_pair(X, other)
    if layerwise and offsets is None:
        raise ValueError("layerwise=True needs offsets")
    offs = _offsets(offsets, X.shape[1])
    red = _reduce(reduce)
    impl = _backend(backend, X.device)
    return impl.cosine_matrix(
        _rows(X), offs, None if other is None else _rows(other), bool(layerwise), reduce=red
    ).to(_acc_dtype(X))


def gram_matrix(
    X: torch.Tensor,
    *,
    other: torch.Tensor | None = None,
    reduce: Reduce | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Inner products of the rows of X: G = X X^T [K, K], or X Y^T [K, M] against `other`.

    float32 (float64 for float64 inputs). The self Gram is exactly symmetric (one triangle
    computed and mirrored); its diagonal holds the squared row norms. The same Gram pass as
    `cosine_matrix`, without the normalisation. `reduce` gets this slice's float64 Gram
    ([K, K] symmetric, or [K, M]) and returns its sum over the shards, which the call returns.
    """
    return _row_pair_pass("gram_matrix", X, other, reduce, backend)


def pairwise_sq_distances(
    X: torch.Tensor,
    *,
    other: torch.Tensor | None = None,
    reduce: Reduce | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Squared Euclidean distances |x_i - y_j|^2 of the rows of X to themselves [K, K] or to
    the rows of `other` [K, M], from one Gram pass: max(|x_i|^2 + |y_j|^2 - 2 <x_i, y_j>, 0).

    float32 (float64 for float64 inputs). Without `other` the matrix is exactly symmetric with
    an exactly zero diagonal, the squared norms coming from the Gram diagonal (Krum, Multi-Krum,
    Bulyan). The error is relative to |x_i|^2 + |y_j|^2, not to the distance: for rows much
    closer to each other than to 0, subtract a common point first (the global model, as deltas).
    `reduce` gets the float64 partial sums, the symmetric Gram [K, K] (norms on its diagonal)
    or with `other` [K*M + K + M] (Gram, squared norms of X's rows, of Y's rows), and the
    distances are formed from their sum over the shards.
    """
    return _row_pair_pass("pairwise_sq_distances", X, other, reduce, backend)


def layer_normalized_cosine(
    X: torch.Tensor, offsets: Any, *, reduce: Reduce | None = None, backend: str = "auto"
) -> torch.Tensor:
    """[K, K] mean over non-empty segments of the per-segment cosine matrices (FedDGIC).

    Equal to the plain cosine of rows whose segments were each scaled to unit norm, so no
    single large layer dominates the similarity. A row that is zero on a segment contributes 0
    there, so its diagonal entry is the fraction of non-empty segments where it is non-zero.
    `reduce` gets the float64 [L, K*K + 1] partial sums (per segment: the symmetric Gram
    flattened, then the segment's length in this slice); a segment is non-empty when its summed
    length is > 0.
    """
    _data("X", X, dims=(2,))
    if offsets is None:
        raise ValueError("offsets is required (pass the layout's module_offsets)")
    offs = _offsets(offsets, X.shape[1])
    red = _reduce(reduce)
    impl = _backend(backend, X.device)
    return impl.layer_normalized_cosine(_rows(X), offs, reduce=red).to(_acc_dtype(X))


def group_means(
    X: torch.Tensor,
    groups: Any,
    num_groups: int,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """[G, D] mean of the rows of each group; rows with group -1 are never read (they may hold
    anything, NaN included); an empty group gives a zero row.

    Pass a contiguous `out=` [G, D] buffer when calling repeatedly (Fed-OGD's bases): a fresh
    buffer of tens of MB costs more in page faults than the means themselves.
    """
    _data("X", X, dims=(2,))
    gr, num_groups = _group_ids(groups, num_groups, X.shape[0])
    shape = (num_groups, X.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=X.dtype, device=X.device)
    else:
        _out("out", out, _Like(torch.Size(shape), X.dtype, X.device), {"X": X})
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    impl = _backend(backend, X.device)
    impl.group_means(_rows(X), gr, num_groups, out)
    return out


def weighted_sum(
    X: torch.Tensor,
    weights: Any,
    *,
    out: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """out = beta*out + alpha * sum_k weights[k] * X[k], returned as a [D] tensor.

    With beta == 0 the old content of `out` is ignored (it may be uninitialised).
    """
    _data("X", X, dims=(2,))
    w = _row_weights(weights, X.shape[0])
    alpha, beta = _finite("alpha", alpha), _finite("beta", beta)
    like = X[0] if X.shape[0] else X.new_empty(X.shape[1])
    if out is None:
        if beta != 0.0:
            raise ValueError("beta != 0 needs out= (the tensor to scale and add to)")
        out = torch.empty(X.shape[1], dtype=X.dtype, device=X.device)
    else:
        _out("out", out, like, {"X": X})
    impl = _backend(backend, X.device)
    impl.weighted_sum(_rows(X), w.contiguous(), out, alpha, beta)
    return out


def nnz_per_layer(
    X: torch.Tensor, offsets: Any = None, *, reduce: Reduce | None = None, backend: str = "auto"
) -> torch.Tensor:
    """Non-zero elements per segment: int64 [L] for a [D] input, [K, L] for [K, D].

    NaN counts as non-zero and -0.0 as zero. With ``offsets=None`` the whole vector is one
    segment. Tells whether an update is worth a sparse encoding, layer by layer. `reduce` gets
    the counts of this slice as float64 [K, L] (exact) and returns their sum over the shards.
    """
    _data("X", X)
    offs = _offsets(offsets, X.shape[-1])
    red = _reduce(reduce)
    impl = _backend(backend, X.device)
    res = impl.nnz_per_layer(_rows(X), offs, reduce=red)
    return res[0] if X.dim() == 1 else res


def sparse_accumulate(
    out: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
    weight: float = 1.0,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``out[indices] += weight * values`` in place, without densifying the update; returns out.

    ``out`` is a [D] row (e.g. a row of the [K, D] cache); ``indices`` are strictly increasing
    int32/int64 positions in [0, D) on out's device (what the sparse wire encodings decode to);
    ``values`` has one entry per index in out's dtype. Each touched element is computed in the
    accumulation dtype (float64 on the CPU and in the reference) and rounded once.
    """
    _data("out", out, dims=(1,))
    if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
        got = indices.dtype if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise TypeError(f"indices must be an int32 or int64 tensor, got {got}")
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    _data("values", values, dims=(1,))
    _same_kind("out", out, values=values)
    if indices.device != out.device:
        raise ValueError(f"indices must be on {out.device}, got {indices.device}")
    if values.shape != indices.shape:
        raise ValueError(
            f"values must have one entry per index: {tuple(values.shape)} vs {tuple(indices.shape)}"
        )
    n, D = indices.numel(), out.shape[0]
    if n:
        lo, hi = int(indices[0]), int(indices[-1])
        if lo < 0 or hi >= D:
            raise IndexError(f"indices must lie in [0, {D}), got range [{lo}, {hi}]")
        if n > 1 and not bool((indices[1:] > indices[:-1]).all()):
            raise ValueError("indices must be strictly increasing (sorted, no repeats)")
    if out.numel() and out.stride(0) != 1:
        raise ValueError("out must have unit stride")
    if _overlaps(out, values):
        raise ValueError("out overlaps values in memory")
    w = _finite("weight", weight)
    impl = _backend(backend, out.device)
    impl.sparse_accumulate(out, indices.contiguous(), values.contiguous(), w)
    return out


def accumulate(
    acc: torch.Tensor, x: torch.Tensor, weight: float = 1.0, *, backend: str = "auto"
) -> torch.Tensor:
    """``acc += weight * x`` in place, in one pass over both; returns acc.

    ``acc`` is a [n] float64 (or float32) row with unit stride, typically a running sum of
    contributions; ``x`` a [n] row of any float dtype on acc's device, not overlapping acc. Each
    element is computed in float64 and rounded once to acc's dtype (the product and the sum each
    rounded in float64, as ``sparse_accumulate``: the reference's bits). torch's own
    ``acc.add_(x, alpha=weight)`` with a float32 ``x`` into a float64 ``acc`` runs about 14x
    slower on the CPU (docs/kernels.md) and may fuse the multiply-add (other bits).
    """
    _data("acc", acc, dims=(1,))
    _data("x", x, dims=(1,))
    if acc.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"acc must be float64 or float32, got {acc.dtype}")
    if x.device != acc.device:
        raise ValueError(f"x is on {x.device} but acc is on {acc.device}")
    if x.shape != acc.shape:
        raise ValueError(f"x must have acc's shape {tuple(acc.shape)}, got {tuple(x.shape)}")
    if acc.numel() and acc.stride(0) != 1:
        raise ValueError("acc must have unit stride")
    if _overlaps(acc, x):
        raise ValueError("acc overlaps x in memory")
    w = _finite("weight", weight)
    if acc.numel():
        impl = _backend(backend, acc.device)
        impl.accumulate(acc, x.contiguous(), w)
    return acc


def quantized_accumulate(
    out: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    weight: float = 1.0,
    *,
    bits: int = 8,
    base: torch.Tensor | None = None,
    squares: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``out += weight * values`` in place, the values read from blockwise absmax codes (the
    wire's quantized values, docs/wire.md) in the same pass: value i is the binary32 product
    ``float32(code_i) * scales[i // block]``, exactly as a receiver decodes it, then each element
    is computed in the accumulation dtype (float64 on the CPU and in the reference) and rounded
    once; returns out.

    ``out`` is a [n] float row; ``codes`` the int8 codes [n] (``bits=8``) or the uint8 bytes of
    packed 4-bit codes [ceil(n / 2)] (``bits=4``: value 2j in the low nibble of byte j); ``scales``
    float32 [ceil(n / block)]; all on out's device. The codes are taken as they are (the wire's
    checks of codes and scales are the decoder's).

    With ``base`` (a [n] row like out, not overlapping it unless it is out itself), ``out = base
    + weight * values`` in the same pass, out's old content never read: the same bits as adding
    into a copy of base (FedAsync's ``x + a * delta`` written into the next version).

    With ``squares`` (a float64 [1] tensor on out's device), it receives ``sum_b scales[b]^2 *
    sum_{i in b} code_i^2``, the values' squared L2 norm taken from their codes (exact products
    ``code * scale``, before each value's rounding to binary32), in the same read of the codes on
    the CPU (a separate pass elsewhere).
    """
    _quantized_args(out, codes, scales, block, bits)
    if base is not None:
        _data("base", base, dims=(1,))
        _same_kind("out", out, base=base)
        if base.shape != out.shape:
            raise ValueError(f"base must have shape {tuple(out.shape)}, got {tuple(base.shape)}")
        if not _is_alias(out, base) and _overlaps(out, base):
            raise ValueError("out overlaps base in memory (only base=out exactly is allowed)")
        if base.numel() and base.stride(0) != 1:
            base = base.contiguous()
    if squares is not None:
        got = (
            (squares.dtype, tuple(squares.shape)) if isinstance(squares, torch.Tensor) else squares
        )
        if got != (torch.float64, (1,)):
            raise TypeError(f"squares must be a float64 tensor of shape (1,), got {got!r}")
        if squares.device != out.device:
            raise ValueError(f"squares is on {squares.device}, out on {out.device}")
    n = out.shape[0]
    w = _finite("weight", weight)
    if n:
        impl = _backend(backend, out.device)
        impl.quantized_accumulate(
            out, codes.contiguous(), scales.contiguous(), block, w, bits,
            out if base is None else base, squares,
        )  # fmt: skip
    elif squares is not None:
        squares.zero_()
    return out


def _quantized_args(out: torch.Tensor, codes: Any, scales: Any, block: Any, bits: Any) -> None:
    """Check the arguments of a kernel that reads blockwise codes into ``out`` [n]."""
    _data("out", out, dims=(1,))
    _code_args(out.shape[0], out.device, codes, scales, block, bits, where="out")
    if out.numel() and out.stride(0) != 1:
        raise ValueError("out must have unit stride")


def _code_args(
    n: int, device: torch.device, codes: Any, scales: Any, block: Any, bits: Any, where: str
) -> None:
    """Check ``n`` values' blockwise codes and scales, on ``device`` (``where``'s)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an integer >= 1, got {block!r}")
    want = (torch.int8, n) if bits == 8 else (torch.uint8, (n + 1) // 2)
    if not isinstance(codes, torch.Tensor) or codes.dtype != want[0] or codes.dim() != 1:
        got = (codes.dtype, tuple(codes.shape)) if isinstance(codes, torch.Tensor) else codes
        raise TypeError(f"codes must be a 1-D {want[0]} tensor for bits={bits}, got {got}")
    if codes.numel() != want[1]:
        raise ValueError(
            f"{bits}-bit codes of {n} values take {want[1]} entries, got {codes.numel()}"
        )
    nblocks = -(-n // block)
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        raise TypeError("scales must be a float32 tensor")
    if scales.shape != (nblocks,):
        raise ValueError(
            f"{n} values in blocks of {block} take {nblocks} scales, got {tuple(scales.shape)}"
        )
    for name, t in (("codes", codes), ("scales", scales)):
        if t.device != device:
            raise ValueError(f"{name} must be on {device} ({where}'s), got {t.device}")


def code_squares(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    n: int,
    *,
    bits: int = 8,
    backend: str = "auto",
) -> float:
    """``sum_b scales[b]^2 * sum_{i in b} code_i^2`` in float64: the squared L2 norm of ``n``
    values given as blockwise codes (arguments as :func:`quantized_accumulate`), from the exact
    products ``code * scale`` before each value's rounding to binary32, in one read of the codes.
    The CPU backend runs on the calling thread alone (it may be called beside other kernels)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    device = codes.device if isinstance(codes, torch.Tensor) else torch.device("cpu")
    _code_args(n, device, codes, scales, block, bits, where="codes")
    if not n:
        return 0.0
    impl = _backend(backend, device)
    return float(impl.code_squares(codes.contiguous(), scales.contiguous(), block, bits, n))


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int,
    *,
    bits: int = 8,
    out: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """The values of blockwise absmax codes written into ``out`` [n] (float32, or any float
    dtype: each binary32 value rounded once to it): ``out[i] = float32(code_i) *
    scales[i // block]``, the binary32 product as the wire format decodes it (docs/wire.md),
    bit for bit (signed zeros included). Arguments as :func:`quantized_accumulate`; returns out.
    """
    _quantized_args(out, codes, scales, block, bits)
    if out.shape[0]:
        impl = _backend(backend, out.device)
        impl.dequantize(codes.contiguous(), scales.contiguous(), block, bits, out)
    return out


def average_linkage(dist: Any, *, backend: str = "auto") -> Any:
    """UPGMA linkage in scipy's `Z` format ([n-1, 4] float64) from distances.

    `dist` is condensed (length n(n-1)/2) or a square symmetric matrix with a zero diagonal,
    read as distances (scipy would read a square array as observations). Returns a numpy array
    for numpy input, a CPU float64 tensor for torch input. Equal to
    `scipy.cluster.hierarchy.linkage(condensed, method="average")`: same merges, heights within
    1e-9 relative. Ties between equal distances resolve toward the smaller cluster index.
    Linkage is sequential, so `triton` runs the CPU implementation.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    as_torch = isinstance(dist, torch.Tensor)
    arr = _host_float64("dist", dist)
    Z = None
    if backend != "reference" and arr.ndim in (1, 2) and arr.size > 1:
        # One pass checks the distances while it builds the working matrix; input that fails
        # goes through _condensed below for the precise error.
        from .linkage import linkage_from_condensed, linkage_from_square

        if arr.ndim == 2 and arr.shape[0] == arr.shape[1]:
            Z = linkage_from_square(arr)
        elif arr.ndim == 1 and _is_condensed_length(arr.size):
            Z = linkage_from_condensed(arr)
    if Z is None:
        condensed, n = _condensed(arr)
        if n < 2:
            Z = np.zeros((0, 4), dtype=np.float64)
        else:
            impl = importlib.import_module(
                ".reference" if backend == "reference" else ".cpu", __name__
            )
            Z = impl.average_linkage(condensed)
    return torch.from_numpy(Z) if as_torch else Z


def similarity_linkage(similarity: Any, *, backend: str = "auto") -> Any:
    """UPGMA linkage (as `average_linkage`) of n points from their [n, n] similarities.

    The distances are ``max(1 - (S + S^T) / 2, 0)`` with a zero diagonal: the similarities are
    symmetrised, the diagonal's values do not matter but must be finite, and a similarity a
    rounding above 1 gives distance 0. The result equals `average_linkage` of those distances
    bit for bit. The `cpu` backend makes them in its pass that fills the linkage's working
    matrix, where numpy makes four [n, n] temporaries (bench/test_bench_linkage.py, n = 4096:
    88 ms, against 243-258 ms for numpy's distances and `average_linkage`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    as_torch = isinstance(similarity, torch.Tensor)
    s = _host_float64("similarity", similarity)
    if s.ndim != 2 or s.shape[0] != s.shape[1] or s.shape[0] == 0:
        raise ValueError(f"similarity must be a square [n, n] matrix, got shape {s.shape}")
    Z = None
    if backend != "reference" and s.shape[0] >= 2:
        from .linkage import linkage_from_similarity

        Z = linkage_from_similarity(s)
    if Z is None:  # not finite (said here), a finite sum that overflowed, or n = 1
        if not np.all(np.isfinite(s)):
            raise ValueError("similarity must be finite")
        with np.errstate(over="ignore"):
            d = 1.0 - (s + s.T) / 2.0
        np.fill_diagonal(d, 0.0)
        # A sum past float64's range upwards is a distance of 0 (clamped below); downwards, an
        # infinite distance, which no linkage takes.
        if np.any(d == np.inf):
            raise ValueError(
                "similarity: S[i, j] + S[j, i] overflows float64 towards -inf for some pair"
            )
        Z = average_linkage(np.maximum(d, 0.0), backend=backend)
    return torch.from_numpy(Z) if as_torch else Z


def _host_float64(name: str, x: Any) -> np.ndarray:
    """A numpy float64 array of a numpy array, a sequence or a tensor on any device."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    if isinstance(x, np.ndarray | Sequence) or hasattr(x, "__array__"):
        return np.asarray(x, dtype=np.float64)
    raise TypeError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")


def _is_condensed_length(m: int) -> bool:
    """m = n(n-1)/2 for an integer n >= 2."""
    n = int(round((1 + np.sqrt(1 + 8 * m)) / 2))
    return n >= 2 and n * (n - 1) // 2 == m


def _condensed(arr: np.ndarray) -> tuple[np.ndarray, int]:
    """Validate distances; return (condensed float64 with tiny negatives set to 0, n)."""
    if arr.ndim == 2:
        n = arr.shape[0]
        if arr.shape != (n, n):
            raise ValueError(f"dist must be condensed (1-D) or square, got shape {arr.shape}")
        if not np.all(np.isfinite(arr)):
            raise ValueError("dist must be finite")
        if not np.array_equal(arr, arr.T):
            raise ValueError("square dist must be symmetric")
        if np.any(np.diag(arr) != 0):
            raise ValueError("square dist must have a zero diagonal")
        iu = np.triu_indices(n, k=1)
        condensed = arr[iu]
    elif arr.ndim == 1:
        m = arr.size
        n = int(round((1 + np.sqrt(1 + 8 * m)) / 2))
        if n * (n - 1) // 2 != m:
            raise ValueError(f"condensed dist length {m} is not n(n-1)/2 for any integer n")
        condensed = arr
        if not np.all(np.isfinite(condensed)):
            raise ValueError("dist must be finite")
    else:
        raise ValueError(f"dist must be condensed (1-D) or square, got {arr.ndim}-D")
    if condensed.size and condensed.min() < -1e-12:
        raise ValueError(
            f"dist must be >= 0 (tiny negatives down to -1e-12 are clamped), got {condensed.min()}"
        )
    return np.ascontiguousarray(np.maximum(condensed, 0.0), dtype=np.float64), n


# The robust aggregation kernels live in their own module; it imports the helpers above, so it
# is imported last. Its `__all__` is the one list of what it adds to this package's.
from .quantized_rows import *  # noqa: E402, F403
from .quantized_rows import __all__ as _quantized_rows_names  # noqa: E402
from .robust import *  # noqa: E402, F403
from .robust import __all__ as _robust_names  # noqa: E402

__all__ += _robust_names + _quantized_rows_names
