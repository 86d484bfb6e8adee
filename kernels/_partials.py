"""Partial sums and `reduce=` (docs/kernels.md "Sharded use"), shared by every backend.

A sharded server's shards sum each kernel call's partial sums with one collective, so the
packing of those sums is a contract between shards: it is defined here once, for all backends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Sums a call's packed float64 partial sums over the shards; returns a tensor like its argument.
Reduce = Callable[[torch.Tensor], torch.Tensor]


def summed(reduce: Reduce | None, partials: torch.Tensor) -> torch.Tensor:
    """The partial sums summed over the shards: one `reduce` call, or the partials as they are
    for a single server."""
    return partials if reduce is None else reduce(partials.contiguous())


def mirror_upper(G: torch.Tensor) -> torch.Tensor:
    """[..., K, K] with the upper triangle (diagonal included) copied onto the lower one: exactly
    symmetric, and the lower triangle is never read (a self Gram kernel may leave it unset)."""
    upper = torch.ones(G.shape[-2:], dtype=torch.bool, device=G.device).triu()
    return torch.where(upper, G, G.transpose(-1, -2))


def summed_grams(
    reduce: Reduce,
    grams: torch.Tensor,
    sq_x: torch.Tensor | None = None,
    sq_y: torch.Tensor | None = None,
    *,
    self_gram: bool,
    squeeze: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One `reduce` of a Gram pass's partial sums [L, K, M], packed in float64 as docs/kernels.md
    fixes it, and the sums unpacked: (Grams [L, K, M], squared norms [L, K] and [L, M] or None).

    A self Gram goes as the mirrored [L, K, K] (its diagonal holds the squared norms); against
    another matrix as [L, K*M + K + M]: the Grams flattened, then ``sq_x`` and ``sq_y``.
    ``squeeze`` leaves out the segment dimension (L = 1), as `pairwise_sq_distances` packs."""
    f64 = torch.float64
    L, K, M = grams.shape
    if self_gram:
        packed = mirror_upper(grams).to(f64)
        return reduce((packed[0] if squeeze else packed).contiguous()).reshape(L, K, K), None, None
    if sq_x is None or sq_y is None:
        raise ValueError("a Gram against another matrix is reduced with both sides' norms")
    packed = torch.cat([grams.reshape(L, K * M), sq_x, sq_y], dim=1).to(f64)
    sums = reduce((packed[0] if squeeze else packed).contiguous()).reshape(L, -1)
    return sums[:, : K * M].reshape(L, K, M), sums[:, K * M : K * M + K], sums[:, K * M + K :]
