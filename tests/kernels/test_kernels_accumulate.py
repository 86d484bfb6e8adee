"""kernels.accumulate (acc += weight * x, the running float64 sum of a buffered strategy or an
in-time aggregator) against the float64 reference, on every backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aggsrv import kernels

BACKENDS = ["reference", "cpu", "triton"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _backend_ok(backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
        import os

        if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("acc_dtype", [torch.float64, torch.float32], ids=str)
def test_accumulate_rounds_each_element_once_from_float64(backend, x_dtype, acc_dtype) -> None:
    _backend_ok(backend)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng()
    n = int(rng.integers(1, 3000)) * 2 + 1  # odd, across several blocks
    acc0 = torch.from_numpy(rng.standard_normal(n) * 10).to(acc_dtype)
    x = torch.from_numpy(rng.standard_normal(n)).to(x_dtype)
    w = float(rng.uniform(-3, 3))
    want = (acc0.to(torch.float64) + w * x.to(torch.float64)).to(acc_dtype)  # numpy's order
    acc = acc0.clone().to(device)
    out = kernels.accumulate(acc, x.to(device), w, backend=backend)
    assert out is acc
    assert torch.equal(acc.cpu(), want)


def test_accumulate_leaves_x_and_an_empty_row_alone() -> None:
    x = torch.randn(37)
    before = x.clone()
    acc = torch.zeros(37, dtype=torch.float64)
    kernels.accumulate(acc, x, 2.0)
    assert torch.equal(x, before)
    empty = torch.zeros(0, dtype=torch.float64)
    assert kernels.accumulate(empty, torch.zeros(0), 1.0) is empty


@pytest.mark.parametrize(
    ("acc", "x", "weight", "error", "match"),
    [
        (torch.zeros(4, dtype=torch.float16), torch.zeros(4), 1.0, TypeError, "float64 or float32"),
        (torch.zeros(4, dtype=torch.float64), torch.zeros(5), 1.0, ValueError, "shape"),
        (torch.zeros(4, dtype=torch.float64), torch.zeros(2, 2), 1.0, ValueError, "1-D"),
        (torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.int32), 1.0, TypeError,
         "float32"),
        (torch.zeros(4, dtype=torch.float64), torch.zeros(4), float("nan"), ValueError, "finite"),
        (torch.zeros(8, dtype=torch.float64)[::2], torch.zeros(4), 1.0, ValueError, "stride"),
    ],
)  # fmt: skip
def test_accumulate_refuses_bad_arguments(acc, x, weight, error, match) -> None:
    with pytest.raises(error, match=match):
        kernels.accumulate(acc, x, weight)


def test_accumulate_refuses_x_overlapping_acc() -> None:
    acc = torch.zeros(8, dtype=torch.float32)
    with pytest.raises(ValueError, match="overlaps"):
        kernels.accumulate(acc[:4], acc[2:6], 1.0)
