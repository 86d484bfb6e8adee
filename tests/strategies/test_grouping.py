"""FedDGIC's grouping (docs/algorithms/feddgic.md 1.4.3-1.4.4): the spec's test vector by hand,
scipy's fcluster as the oracle for the cut, planted clusters recovered, degenerate cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

from aggsrv.strategies.grouping import cut_tree, dynamic_groups, group_count, similarity_rounds


def _same_partition(labels, other) -> bool:
    """Equal up to renaming the groups."""
    pairs = set(zip(labels, other, strict=True))
    return len(pairs) == len(set(labels)) == len(set(other))


def test_spec_test_vector_heights_ratios_and_groups() -> None:
    """Spec 1.4.4: n = 6; heights .10 .12 .175 .24 .888889; ratios 0.1014 0.2789 0.3296
    3.2901; m* = 5, k = 2, groups {0,1,2} and {3,4,5}."""
    d = np.full((6, 6), 0.9)
    for (i, j), v in {(0, 1): .10, (0, 2): .20, (1, 2): .15, (3, 4): .12, (3, 5): .18,
                      (4, 5): .30, (2, 3): .80}.items():  # fmt: skip
        d[i, j] = d[j, i] = v
    np.fill_diagonal(d, 0.0)
    g = dynamic_groups(1.0 - d)
    np.testing.assert_allclose(g.heights, [0.10, 0.12, 0.175, 0.24, 0.8 + 0.8 / 9], atol=1e-12)
    np.testing.assert_allclose(g.ratios, [0.1014, 0.2789, 0.3296, 3.2901], atol=5e-5)
    assert g.k == 2 and g.groups() == [[0, 1, 2], [3, 4, 5]]
    assert g.labels == (0, 0, 0, 1, 1, 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n", [3, 7, 20, 41])
def test_cut_matches_scipy_fcluster_for_every_k(seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5))
    d = squareform(np.linalg.norm(x[:, None] - x[None], axis=-1), checks=False)
    Z = linkage(d, method="average")
    for k in range(1, n + 1):
        ours = cut_tree(Z, k)
        theirs = fcluster(Z, k, criterion="maxclust")
        assert len(set(ours)) == k and _same_partition(ours, theirs), k


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_planted_clusters_are_recovered_from_cosine_similarities(seed: int) -> None:
    """Clients whose updates are noisy copies of one of 3 random directions (sizes 5, 4, 2):
    the rule finds k = 3 and exactly the planted groups."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(3, 300, generator=g)
    planted = [0] * 5 + [1] * 4 + [2] * 2
    order = torch.randperm(len(planted), generator=g).tolist()
    labels = [planted[i] for i in order]
    rows = torch.stack([centres[c] + 0.3 * torch.randn(300, generator=g) for c in labels])
    rows = rows / rows.norm(dim=1, keepdim=True)
    result = dynamic_groups(rows @ rows.T)
    assert result.k == 3 and _same_partition(result.labels, labels)


def test_degenerate_cases_give_one_group() -> None:
    assert group_count([]) == (1, [])  # n = 1
    assert group_count([0.4]) == (1, [])  # n = 2: Eq. 5 undefined
    assert group_count([0.3, 0.3, 0.3]) == (1, [])  # no spread
    # Uniform spacing: every normalised gap is 1 > 0.8, so the first one stops: k = n - 1.
    assert group_count([0.125, 0.25, 0.375, 0.5])[0] == 4
    # p >= 1 where no gap exceeds it (exact binary heights): nothing stops the merging.
    assert group_count([0.125, 0.25, 0.375, 0.5], p=1.0) == (1, [1.0, 1.0, 1.0])
    one = dynamic_groups(torch.ones(1, 1))
    assert one.k == 1 and one.labels == (0,) and one.heights == ()
    two = dynamic_groups(torch.tensor([[1.0, 0.2], [0.2, 1.0]]))
    assert two.k == 1 and two.labels == (0, 0)


def test_ties_still_give_a_valid_partition_and_k() -> None:
    """Two identical pairs at equal distance from everything: the ratios see equal heights."""
    s = np.full((4, 4), 0.0)
    s[0, 1] = s[1, 0] = s[2, 3] = s[3, 2] = 0.9
    np.fill_diagonal(s, 1.0)
    g = dynamic_groups(s)
    assert g.heights[0] == g.heights[1]  # the tied merges
    assert g.k == 2 and g.groups() == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((np.ones((2, 3)),), "square"),
        ((np.array([[1.0, np.nan], [np.nan, 1.0]]),), "finite"),
    ],
)
def test_bad_inputs_are_refused(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        dynamic_groups(*args)
    with pytest.raises(ValueError, match="non-decreasing"):
        group_count([0.3, 0.2, 0.4])
    with pytest.raises(ValueError, match="p must be"):
        group_count([0.1, 0.2, 0.3], p=0.0)
    with pytest.raises(ValueError, match="k must be"):
        cut_tree(np.zeros((2, 4)), 4)


def test_similarity_rounds_follow_eq6() -> None:
    """Spec 1.4.1: 2 up to 8 clients, then floor(log2 n) - 1 (n = 20: 3; n = 1000: 8)."""
    expected = {1: 2, 8: 2, 9: 2, 15: 2, 16: 3, 20: 3, 31: 3, 32: 4, 63: 4, 64: 5, 127: 5,
                1000: 8, 1024: 9}  # fmt: skip
    assert {n: similarity_rounds(n) for n in expected} == expected
    for n in range(9, 5000):
        assert similarity_rounds(n) == int(np.floor(np.log2(n))) - 1, n
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="int >= 1"):
            similarity_rounds(bad)
