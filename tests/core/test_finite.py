"""count_non_finite / sum_is_finite against numpy's element-wise count, on every path: CPU
float32/float64 (summed by numpy on the calling thread), half types and large tensors (torch),
strided views, and finite values whose sum overflows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aggsrv import finite
from aggsrv.finite import count_non_finite, sum_is_finite


def _oracle(t: torch.Tensor) -> int:
    return int((~np.isfinite(t.detach().to(torch.float64).numpy())).sum())


def _poison(t: torch.Tensor, rng: np.random.Generator, k: int) -> torch.Tensor:
    t = t.clone()
    idx = rng.choice(t.numel(), size=k, replace=False)
    vals = rng.choice([np.nan, np.inf, -np.inf], size=k)
    t.view(-1)[torch.as_tensor(idx)] = torch.as_tensor(vals, dtype=t.dtype)
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 32_769, 100_003])
def test_count_matches_numpy_elementwise(dtype: torch.dtype, n: int) -> None:
    rng = np.random.default_rng()
    t = torch.as_tensor(rng.standard_normal(n)).to(dtype)
    assert count_non_finite(t) == 0 and sum_is_finite(t)
    for k in sorted({1, min(3, n), min(n, 1 + n // 10)}):
        bad = _poison(t, rng, k)
        assert count_non_finite(bad) == _oracle(bad) == k
        assert not sum_is_finite(bad)


def test_strided_and_noncontiguous_views_are_read_correctly() -> None:
    rng = np.random.default_rng()
    base = torch.as_tensor(rng.standard_normal((301, 257)), dtype=torch.float32)
    base[16, 3] = float("nan")  # view[3, 8] below; column 3 is outside base[:, ::2]
    view = base.t()[:, ::2]  # view[i, j] = base[2 j, i]
    assert not view.is_contiguous()
    assert count_non_finite(view) == _oracle(view) == 1
    assert count_non_finite(base[:, ::2]) == _oracle(base[:, ::2]) == 0


def test_finite_values_whose_sum_overflows_count_zero() -> None:
    t = torch.full((1001,), 3.0e38, dtype=torch.float32)  # every element finite, the sum is not
    assert not sum_is_finite(t)
    assert count_non_finite(t) == 0


def test_empty_integer_and_grad_tensors() -> None:
    assert count_non_finite(torch.empty(0)) == 0
    assert count_non_finite(torch.arange(10)) == 0
    w = torch.randn(33, requires_grad=True)
    assert count_non_finite(w) == 0
    w2 = w.detach().clone()
    w2[5] = float("inf")
    assert count_non_finite(w2.requires_grad_()) == 1


def test_above_the_single_thread_size_torch_counts_the_same(monkeypatch) -> None:
    monkeypatch.setattr(finite, "SINGLE_THREAD_NUMEL", 1000)
    rng = np.random.default_rng()
    t = _poison(torch.as_tensor(rng.standard_normal(4099), dtype=torch.float32), rng, 5)
    assert count_non_finite(t) == _oracle(t) == 5
    assert count_non_finite(t[:999].clone().nan_to_num_()) == 0


def test_overflow_and_inf_minus_inf_raise_no_warning() -> None:
    # The server's log would otherwise carry numpy's RuntimeWarning for a refused update.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert count_non_finite(torch.full((33,), 3.0e38)) == 0
        assert count_non_finite(torch.tensor([float("inf"), -float("inf"), 1.0])) == 2


@pytest.mark.parametrize("n", [1, 7, 1013, 100_003])
def test_the_squared_norm_pass_proves_finite_and_gives_the_norm(n: int) -> None:
    from aggsrv.finite import squared_norm, squared_norm_if_finite

    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3.0
    want = float((x.double() ** 2).sum())
    got = squared_norm_if_finite(x)
    assert got is not None and abs(got - want) <= 1e-5 * want
    assert squared_norm_if_finite(x.double()) == pytest.approx(want, rel=1e-12)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[n // 2] = bad
        assert squared_norm_if_finite(y) is None
    big = x.clone()
    big[0] = 3e19  # finite, but its square overflows float32
    assert squared_norm_if_finite(big) is None and count_non_finite(big) == 0
    assert squared_norm(big) == pytest.approx(float((big.double() ** 2).sum()), rel=1e-12)
    strided = torch.randn(2 * n, generator=g)[::2]
    assert squared_norm_if_finite(strided) == pytest.approx(
        float((strided.double() ** 2).sum()), rel=1e-5
    )


def test_the_squared_norm_of_a_large_tensor_goes_through_torch_without_float64_copies(
    monkeypatch,
) -> None:
    """Above SINGLE_THREAD_NUMEL (here lowered to 1000) the pass is torch's dot, same answers."""
    from aggsrv.finite import squared_norm, squared_norm_if_finite

    monkeypatch.setattr(finite, "SINGLE_THREAD_NUMEL", 1000)
    monkeypatch.setattr(finite, "SQUARES_CHUNK", 777)
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(2))
    want = float((x.double() ** 2).sum())
    assert squared_norm_if_finite(x) == pytest.approx(want, rel=1e-5)
    y = x.clone()
    y[9_999] = float("nan")
    assert squared_norm_if_finite(y) is None
    y[9_999] = 3e19
    assert squared_norm_if_finite(y) is None
    assert squared_norm(y) == pytest.approx(float((y.double() ** 2).sum()), rel=1e-12)
