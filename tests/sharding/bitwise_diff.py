"""What a failed bit-for-bit comparison of two models says (tests/ is not a package: import as
`from bitwise_diff import describe_difference`): which elements differ, by how much, and where
they sit against the shard bounds, so an intermittent mismatch reports enough to be traced."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def describe_difference(got: torch.Tensor, want: torch.Tensor, bounds: Sequence[int]) -> str:
    """A short report of where ``got`` and ``want`` differ (empty when they are equal)."""
    differ = torch.nonzero(got != want).flatten().tolist()
    if not differ:
        return ""
    gap = (got.double() - want.double()).abs()
    ulps = (got.view(torch.int32).long() - want.view(torch.int32).long()).abs()
    where = []
    for i in differ[:12]:
        shard = max(r for r in range(len(bounds) - 1) if bounds[r] <= i)
        where.append(
            f"[{i}] shard {shard} +{i - bounds[shard]}: {float(got[i])!r} vs {float(want[i])!r}"
            f" ({int(ulps[i])} ulp)"
        )
    return (
        f"{len(differ)} of {got.numel()} elements differ (max |diff| {float(gap.max()):.3g}, "
        f"shard bounds {list(bounds)}): " + "; ".join(where)
    )
