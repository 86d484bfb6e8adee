"""FedDGIC's dynamic grouping (docs/algorithms/feddgic.md 1.4.3-1.4.4): average linkage on the
cosine distance ``1 - S``, the number of groups from the gap rule (Eq. 5), and the cut.

The linkage is :func:`aggsrv.kernels.average_linkage` (float64, scipy's ``Z`` format, merges
sorted by height); everything after it is here and is O(n log n):

* Eq. 5 with the spec's indexing: the n - 1 merge heights ``h_1 <= ... <= h_{n-1}``, the mean
  gap ``(h_{n-1} - h_1) / (n - 2)``, ``ratio_m = (h_m - h_{m-1}) / mean_gap`` for m = 2..n-1;
  ``m*`` is the first m with ``ratio_m > p``, merge ``m*`` is not performed, so
  ``k = n - m* + 1`` groups (the Fig. 1 caption's reading, spec 1.4.4 step 3).
* Degenerate cases (spec gap 7): n <= 2, or no spread in the heights, give one group; so does
  p >= 1 when no gap exceeds it (with p < 1 some gap always does: the normalised gaps average
  exactly 1).
* The cut is a union-find over the first ``n - k`` merges; groups are numbered by their
  smallest member, so labels do not depend on the linkage's cluster ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aggsrv import kernels

__all__ = ["Grouping", "cut_tree", "dynamic_groups", "group_count", "similarity_rounds"]


def similarity_rounds(n: int) -> int:
    """n_cal of Eq. 6: 2 for n <= 8, else floor(log2 n) - 1, in integers (no rounding error at
    powers of two): n = 20 gives 3, n = 1000 gives 8."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of clients must be an int >= 1, got {n!r}")
    return 2 if n <= 8 else n.bit_length() - 2


@dataclass(frozen=True)
class Grouping:
    """The result of one grouping: ``labels[i]`` is client i's group (0..k-1, numbered by the
    smallest member), plus what a user wants to see of the dendrogram."""

    labels: tuple[int, ...]
    k: int
    heights: tuple[float, ...]  # the n - 1 merge heights, non-decreasing
    ratios: tuple[float, ...]  # Eq. 5's ratio_m for m = 2..n-1 (empty when undefined)
    linkage: np.ndarray  # scipy Z, [n - 1, 4] float64

    def groups(self) -> list[list[int]]:
        """Members of each group, in group order."""
        out: list[list[int]] = [[] for _ in range(self.k)]
        for i, g in enumerate(self.labels):
            out[g].append(i)
        return out


def group_count(heights: np.ndarray | list[float], p: float = 0.8) -> tuple[int, list[float]]:
    """(k, ratios) from the sorted merge heights of n = len(heights) + 1 clients (Eq. 5)."""
    if not p > 0:
        raise ValueError(f"p must be > 0, got {p}")
    h = np.asarray(heights, dtype=np.float64)
    if h.ndim != 1:
        raise ValueError(f"heights must be 1-D, got shape {h.shape}")
    if np.any(np.diff(h) < 0):
        raise ValueError("heights must be non-decreasing (sorted merges)")
    n = h.size + 1
    if n <= 2 or h[-1] == h[0]:
        return 1, []
    mean_gap = (h[-1] - h[0]) / (n - 2)
    ratios = [float((h[m] - h[m - 1]) / mean_gap) for m in range(1, n - 1)]
    for idx, ratio in enumerate(ratios):
        if ratio > p:
            m_star = idx + 2  # ratios[0] is ratio_2
            return n - m_star + 1, ratios
    return 1, ratios


def cut_tree(Z: np.ndarray, k: int) -> tuple[int, ...]:
    """Labels of the n clients after the first ``n - k`` merges of ``Z`` (sorted by height)."""
    n = Z.shape[0] + 1
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..{n}, got {k}")
    parent = list(range(2 * n - 1))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for step in range(n - k):
        a, b = int(Z[step, 0]), int(Z[step, 1])
        parent[find(a)] = n + step
        parent[find(b)] = n + step
    roots = [find(i) for i in range(n)]
    number: dict[int, int] = {}
    return tuple(number.setdefault(r, len(number)) for r in roots)


def dynamic_groups(
    similarity: torch.Tensor | np.ndarray, p: float = 0.8, k: int | None = None
) -> Grouping:
    """Group n clients from their averaged [n, n] cosine similarities (Algorithm 1, lines 7-9).

    The distance is ``1 - S``, symmetrised with a zero diagonal (spec 1.4.3: the paper calls
    the similarity a distance; merging the *smallest* distance needs ``1 - S``). ``k`` fixes
    the number of groups instead of Eq. 5 (FedFG; capped at n); the ratios are still computed.
    """
    Z = kernels.similarity_linkage(similarity)  # raises for a matrix not square or not finite
    Z = Z.numpy() if isinstance(Z, torch.Tensor) else Z
    n = Z.shape[0] + 1
    # UPGMA never inverts, but the Lance-Williams update can put a near-tie a rounding below
    # the merge before it; Eq. 5 wants the sorted sequence.
    heights = np.maximum.accumulate(Z[:, 2])
    k_rule, ratios = group_count(heights, p)
    if k is None:
        k = k_rule
    elif k < 1:
        raise ValueError(f"a fixed number of groups must be >= 1, got {k}")
    k = min(k, n)
    return Grouping(cut_tree(Z, k), k, tuple(map(float, heights)), tuple(ratios), Z)
