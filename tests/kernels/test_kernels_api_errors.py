"""Argument validation of the public `aggsrv.kernels` API: the right exception type, and a
message that names the offending argument."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from aggsrv import kernels  # noqa: E402

BACKENDS = ["reference", "cpu"]
D = 37
K = 3
ROOT = Path(__file__).resolve().parents[2]
SHAPE_ERR = (ValueError, TypeError)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def named(*names: str) -> str:
    """Regex matching any of the names as a whole word."""
    return "|".join(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])" for n in names)


def rows(k=K, d=D, dtype=torch.float32):
    return torch.randn(k, d, dtype=dtype)


def vec(d=D, dtype=torch.float32):
    return torch.randn(d, dtype=dtype)


OFFS = torch.tensor([0, 10, 10, 30, D])

BAD_OFFSETS = {
    "first_not_zero": torch.tensor([1, 10, D]),
    "last_not_D": torch.tensor([0, 10, D - 1]),
    "last_past_D": torch.tensor([0, 10, D + 1]),
    "decreasing": torch.tensor([0, 20, 10, D]),
    "two_dim": torch.tensor([[0, 10], [20, D]]),
    "float": torch.tensor([0.0, 10.0, float(D)]),
    "single": torch.tensor([0]),
}


# --------------------------------------------------------------------------------------------
# offsets, shared by every function that takes them


def _offset_calls(offs, backend):
    x, s, w, sn = vec(), vec(), vec(), vec()
    return {
        "layer_dots": lambda: kernels.layer_dots(rows(), vec(), offs, backend=backend),
        "project_out": lambda: kernels.project_out(rows(), vec(), offs, backend=backend),
        "orthogonal_calibrate": lambda: kernels.orthogonal_calibrate(
            x, s, w, sn, offs, 0.5, backend=backend
        ),
        "cosine_matrix": lambda: kernels.cosine_matrix(
            rows(), offs, layerwise=True, backend=backend
        ),
        "layer_normalized_cosine": lambda: kernels.layer_normalized_cosine(
            rows(), offs, backend=backend
        ),
    }


@pytest.mark.parametrize("bad", list(BAD_OFFSETS), ids=list(BAD_OFFSETS))
def test_bad_offsets(backend, bad):
    for name, call in _offset_calls(BAD_OFFSETS[bad], backend).items():
        exc = (ValueError, TypeError) if bad == "float" else ValueError
        with pytest.raises(exc, match="offsets") as info:
            call()
        assert info is not None, name


def test_good_offsets_accepted(backend):
    for call in _offset_calls(OFFS, backend).values():
        call()


def test_layerwise_needs_offsets(backend):
    with pytest.raises(ValueError, match=named("offsets", "layerwise")):
        kernels.cosine_matrix(rows(), layerwise=True, backend=backend)


def test_layer_normalized_cosine_needs_offsets(backend):
    with pytest.raises((ValueError, TypeError), match="offsets"):
        kernels.layer_normalized_cosine(rows(), None, backend=backend)


# --------------------------------------------------------------------------------------------
# backend name, dtypes


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        kernels.layer_dots(vec(), vec(), backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        kernels.weighted_sum(rows(), torch.ones(K), backend="numpy")
    with pytest.raises(ValueError, match="backend"):
        kernels.average_linkage(np.array([1.0, 2.0, 3.0]), backend="scipy")


@pytest.mark.parametrize("idt", [torch.int32, torch.int64, torch.bool])
def test_integer_data_rejected(backend, idt):
    Xi = torch.ones(K, D, dtype=idt)
    vi = torch.ones(D, dtype=idt)
    with pytest.raises(SHAPE_ERR, match=named("a")):
        kernels.layer_dots(vi, vi, backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("g")):
        kernels.project_out(Xi, vi, backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("X")):
        kernels.cosine_matrix(Xi, backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("X")):
        kernels.group_means(Xi, torch.zeros(K, dtype=torch.int64), 1, backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("X")):
        kernels.weighted_sum(Xi, torch.ones(K), backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("X")):
        kernels.layer_normalized_cosine(Xi, OFFS, backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("x")):
        kernels.orthogonal_calibrate(vi, vi, vi, vi, OFFS, 0.5, backend=backend)


def test_mixed_dtypes(backend):
    f64 = torch.float64
    with pytest.raises(SHAPE_ERR, match=named("b")):
        kernels.layer_dots(rows(), vec(dtype=f64), backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("b")):
        kernels.project_out(rows(), vec(dtype=torch.float16), backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("other")):
        kernels.cosine_matrix(rows(), other=rows(dtype=f64), backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("snap")):
        kernels.orthogonal_calibrate(
            vec(), vec(), vec(), vec(dtype=f64), OFFS, 0.5, backend=backend
        )
    with pytest.raises(SHAPE_ERR, match=named("ma")):
        kernels.orthogonal_calibrate(
            vec(), vec(), vec(), vec(), OFFS, 0.5, ma=vec(dtype=torch.bfloat16), backend=backend
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_mixed_devices():
    with pytest.raises(ValueError, match=named("b")):
        kernels.layer_dots(rows().cuda(), vec(), backend="auto")


# --------------------------------------------------------------------------------------------
# shapes


def test_layer_dots_shapes(backend):
    with pytest.raises(SHAPE_ERR, match=named("a", "b")):
        kernels.layer_dots(rows(), vec(D + 1), backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("a", "b")):
        kernels.layer_dots(rows(), rows(K + 1), backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("a", "b")):
        kernels.layer_dots(rows(), rows(d=D + 2), backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("a")):
        kernels.layer_dots(torch.randn(2, K, D), vec(), backend=backend)


def test_project_out_shapes(backend):
    with pytest.raises(SHAPE_ERR, match=named("g", "b")):
        kernels.project_out(rows(), vec(D + 1), backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("b")):
        kernels.project_out(rows(), rows(), backend=backend)


def test_orthogonal_calibrate_shapes(backend):
    x = vec()
    with pytest.raises(SHAPE_ERR, match=named("sent")):
        kernels.orthogonal_calibrate(x, vec(D + 1), vec(), vec(), OFFS, 0.5, backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("w")):
        kernels.orthogonal_calibrate(x, vec(), vec(D - 1), vec(), OFFS, 0.5, backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("ma")):
        kernels.orthogonal_calibrate(
            x, vec(), vec(), vec(), OFFS, 0.5, ma=vec(D + 3), backend=backend
        )
    L = len(OFFS) - 1
    for bad in (torch.ones(L + 1, dtype=torch.bool), torch.ones(L - 1, dtype=torch.bool)):
        with pytest.raises(ValueError, match="calibrate"):
            kernels.orthogonal_calibrate(
                x, vec(), vec(), vec(), OFFS, 0.5, calibrate=bad, backend=backend
            )


def test_cosine_matrix_shapes(backend):
    with pytest.raises(SHAPE_ERR, match=named("other")):
        kernels.cosine_matrix(rows(), other=rows(d=D + 1), backend=backend)


def test_group_means_errors(backend):
    X = rows(4)
    for bad in ([0, 1, 2, 3], [0, -2, 1, 0]):
        with pytest.raises(ValueError, match="groups"):
            kernels.group_means(X, torch.tensor(bad), 3, backend=backend)
    with pytest.raises(ValueError, match="groups"):
        kernels.group_means(X, torch.tensor([0, 1, 0]), 3, backend=backend)
    with pytest.raises((ValueError, TypeError), match="groups"):
        kernels.group_means(X, torch.tensor([0.0, 1.0, 0.0, 1.0]), 3, backend=backend)


def test_weighted_sum_errors(backend):
    X = rows(4)
    for bad in (torch.ones(3), torch.ones(5), torch.ones(4, 1)):
        with pytest.raises(ValueError, match="weights"):
            kernels.weighted_sum(X, bad, backend=backend)


# --------------------------------------------------------------------------------------------
# out= tensors: shape, dtype, illegal overlaps


def test_project_out_out_errors(backend):
    g, b = rows(), vec()
    with pytest.raises(ValueError, match=named("out")):
        kernels.project_out(g, b, out=torch.empty(K, D + 1), backend=backend)
    with pytest.raises(ValueError, match=named("out")):
        kernels.project_out(g, b, out=torch.empty(K * D), backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("out")):
        kernels.project_out(g, b, out=torch.empty(K, D, dtype=torch.float64), backend=backend)
    # overlap with the basis
    bb = vec()
    with pytest.raises(ValueError, match=named("out")):
        kernels.project_out(vec(), bb, out=bb, backend=backend)
    # partial overlap with g (not the documented alias out=g)
    big = torch.randn(K, D + 1)
    with pytest.raises(ValueError, match=named("out")):
        kernels.project_out(big[:, :D], b, out=big[:, 1:], backend=backend)
    # out=g is allowed
    g2 = rows()
    kernels.project_out(g2, b, out=g2, backend=backend)


def test_orthogonal_calibrate_out_errors(backend):
    x, sent, w, snap, ma = vec(), vec(), vec(), vec(), vec()

    def call(**kw):
        return kernels.orthogonal_calibrate(
            x, sent, w, snap, OFFS, 0.5, ma=ma, backend=backend, **kw
        )

    with pytest.raises(ValueError, match="out_y"):
        call(out_y=torch.empty(D + 1))
    with pytest.raises(SHAPE_ERR, match="out_y"):
        call(out_y=torch.empty(D, dtype=torch.float16))
    with pytest.raises(ValueError, match="out_ma"):
        call(out_ma=torch.empty(1, D))
    with pytest.raises(SHAPE_ERR, match="out_ma"):
        call(out_ma=torch.empty(D, dtype=torch.float64))
    for illegal in ("sent", "w", "snap", "ma"):
        t = {"sent": sent, "w": w, "snap": snap, "ma": ma}[illegal]
        with pytest.raises(ValueError, match="out_y"):
            call(out_y=t)
    for illegal in ("x", "sent", "w", "snap"):
        t = {"x": x, "sent": sent, "w": w, "snap": snap}[illegal]
        with pytest.raises(ValueError, match="out_ma"):
            call(out_ma=t)
    with pytest.raises(ValueError, match=named("out_y", "out_ma")):
        o = torch.empty(D)
        call(out_y=o, out_ma=o)
    # documented aliases are fine
    call(out_y=x, out_ma=ma)


def test_weighted_sum_out_errors(backend):
    X = rows(4)
    w = torch.ones(4)
    with pytest.raises(ValueError, match=named("out")):
        kernels.weighted_sum(X, w, out=torch.empty(D + 1), backend=backend)
    with pytest.raises(ValueError, match=named("out")):
        kernels.weighted_sum(X, w, out=torch.empty(1, D), backend=backend)
    with pytest.raises(SHAPE_ERR, match=named("out")):
        kernels.weighted_sum(X, w, out=torch.empty(D, dtype=torch.float64), backend=backend)
    with pytest.raises(ValueError, match=named("out")):
        kernels.weighted_sum(X, w, out=X[1], backend=backend)


# --------------------------------------------------------------------------------------------
# average_linkage


@pytest.mark.parametrize(
    "bad",
    [
        np.array([1.0, 2.0]),  # not n(n-1)/2
        np.zeros((2, 3)),  # 2-D but not square
        np.zeros((2, 2, 2)),  # 3-D
        np.array([1.0, -2.0, 3.0]),  # negative
        np.array([1.0, np.nan, 3.0]),  # not finite
        np.array([1.0, np.inf, 3.0]),
    ],
    ids=["length", "not_square", "3d", "negative", "nan", "inf"],
)
def test_average_linkage_errors(bad):
    with pytest.raises(ValueError, match="dist"):
        kernels.average_linkage(bad)


# --------------------------------------------------------------------------------------------
# import isolation


def test_import_does_not_pull_grpc_or_flwr():
    code = (
        "import aggsrv.kernels, sys; "
        "print(sorted(m for m in ('grpc', 'flwr', 'google.protobuf') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"import aggsrv.kernels imported {out.stdout.strip()}"
