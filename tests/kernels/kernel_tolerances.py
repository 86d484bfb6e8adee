"""The kernel conventions' accuracy rules (docs/design.md "Wire and numeric conventions") as test
helpers shared by the kernel test modules (tests/ is not a package: import as
`from kernel_tolerances import ...`)."""

from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)


def vec_tol(dtype: torch.dtype) -> float:
    """Norm-wise relative tolerance of a vector result."""
    return 2e-2 if dtype in HALF else (1e-12 if dtype == torch.float64 else 1e-5)


def cos_tol(dtype: torch.dtype) -> float:
    """Absolute tolerance of cosines."""
    return 2e-2 if dtype in HALF else (1e-12 if dtype == torch.float64 else 1e-5)


def assert_close_normwise(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """|got - want| <= tol |want| (2-norms over the whole tensor, float64)."""
    got64, want64 = got.double().cpu(), want.double().cpu()
    assert got64.shape == want64.shape, f"shape {tuple(got64.shape)} vs {tuple(want64.shape)}"
    err = (got64 - want64).norm().item()
    scale = max(want64.norm().item(), 1e-30)
    assert err <= tol * scale, f"relative error {err / scale:.3g} > {tol}"
