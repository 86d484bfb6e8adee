"""UPGMA linkage backends against scipy.cluster.hierarchy.linkage(method="average")."""

from __future__ import annotations

import secrets
from collections.abc import Callable

import numpy as np
import pytest
import torch
from aggsrv.kernels.linkage import average_linkage_cpu, average_linkage_reference  # noqa: E402
from scipy.cluster import hierarchy
from scipy.spatial import distance

BACKENDS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "reference": average_linkage_reference,
    "cpu": average_linkage_cpu,
}
SIZES = [2, 3, 17, 64, 257]


def _euclidean(n: int, rng: np.random.Generator) -> np.ndarray:
    """Condensed Euclidean distances of random points: generic, tie-free input."""
    return distance.pdist(rng.standard_normal((n, 6)))


def _cosine(n: int, rng: np.random.Generator) -> np.ndarray:
    """Condensed 1 - cosine of random vectors, the distance FedDGIC clusters on."""
    x = rng.standard_normal((n, 32))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    sim = np.clip(x @ x.T, -1.0, 1.0)
    iu = np.triu_indices(n, k=1)
    return np.maximum(1.0 - sim[iu], 0.0)


def _scipy(condensed: np.ndarray) -> np.ndarray:
    """The oracle."""
    return hierarchy.linkage(condensed, method="average")


def _assert_same(z: np.ndarray, ref: np.ndarray) -> None:
    """Same merges and sizes exactly, heights within 1e-9 relative."""
    assert z.shape == ref.shape
    assert z.dtype == np.float64
    np.testing.assert_array_equal(z[:, [0, 1, 3]], ref[:, [0, 1, 3]])
    np.testing.assert_allclose(z[:, 2], ref[:, 2], rtol=1e-9, atol=0.0)


def _assert_valid(z: np.ndarray, n: int) -> None:
    """A well-formed dendrogram: scipy's checks, ordered ids, consistent sizes, monotone heights."""
    assert z.shape == (n - 1, 4)
    assert hierarchy.is_valid_linkage(z)
    assert np.all(z[:, 0] < z[:, 1])
    assert np.all(np.diff(z[:, 2]) >= 0)
    sizes = np.concatenate([np.ones(n), z[:, 3]])
    np.testing.assert_array_equal(z[:, 3], sizes[z[:, 0].astype(int)] + sizes[z[:, 1].astype(int)])
    assert z[-1, 3] == n


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("make", [_euclidean, _cosine], ids=["euclidean", "cosine"])
def test_matches_scipy(name: str, n: int, make: Callable) -> None:
    """Generic inputs: identical merges and heights to scipy."""
    rng = np.random.default_rng([n, 11])
    condensed = make(n, rng)
    z = BACKENDS[name](condensed.copy())
    _assert_same(z, _scipy(condensed))
    _assert_valid(z, n)


@pytest.mark.parametrize("n", SIZES)
def test_cpu_bitwise_equals_scipy(n: int) -> None:
    """The CPU path replays scipy's nn_chain operation for operation, so it matches bitwise."""
    condensed = _cosine(n, np.random.default_rng([n, 5]))
    np.testing.assert_array_equal(average_linkage_cpu(condensed), _scipy(condensed))


def test_cpu_does_not_modify_input() -> None:
    """The chain works on its own copy."""
    condensed = _euclidean(40, np.random.default_rng(3))
    before = condensed.copy()
    average_linkage_cpu(condensed)
    average_linkage_reference(condensed)
    np.testing.assert_array_equal(condensed, before)


def _tied_inputs() -> list[tuple[str, np.ndarray]]:
    """Distances with many exact ties."""
    rng = np.random.default_rng(7)
    cases = []
    for n in (2, 3, 17, 64, 257):
        m = n * (n - 1) // 2
        cases.append((f"int3-n{n}", rng.integers(1, 4, m).astype(np.float64)))
        cases.append((f"equal-n{n}", np.full(m, 0.5)))
    cases.append(("zeros-n30", np.zeros(30 * 29 // 2)))
    # Duplicated points: blocks of zero distance plus equal between-block distances.
    pts = np.repeat(rng.integers(0, 3, (12, 2)).astype(np.float64), 3, axis=0)
    cases.append(("duplicates-n36", distance.pdist(pts, "cityblock")))
    return cases


def _assert_upgma(z: np.ndarray, condensed: np.ndarray) -> None:
    """Each merge joins a pair at minimal mean member-to-member distance, at that height.

    Checked from sums of the original distances (not Lance-Williams means), so it holds for any
    tie rule and is independent of both backends.
    """
    n = distance.num_obs_y(condensed)
    sums = np.full((2 * n - 1, 2 * n - 1), np.nan)
    sums[:n, :n] = distance.squareform(condensed)
    sizes = np.concatenate([np.ones(n), np.zeros(n - 1)])
    active = np.zeros(2 * n - 1, dtype=bool)
    active[:n] = True
    for k, (a, b, height, _) in enumerate(z):
        a, b, new = int(a), int(b), n + k
        assert active[a] and active[b]
        ids = np.flatnonzero(active)
        means = sums[np.ix_(ids, ids)] / np.outer(sizes[ids], sizes[ids])
        np.fill_diagonal(means, np.inf)
        np.testing.assert_allclose(height, sums[a, b] / (sizes[a] * sizes[b]), rtol=1e-9)
        assert height <= means.min() * (1 + 1e-9)
        sums[new, :] = sums[a, :] + sums[b, :]
        sums[:, new] = sums[new, :]
        sizes[new] = sizes[a] + sizes[b]
        active[[a, b]] = False
        active[new] = True


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize(("case", "condensed"), _tied_inputs(), ids=[c for c, _ in _tied_inputs()])
def test_ties(name: str, case: str, condensed: np.ndarray) -> None:
    """Tied inputs: a valid UPGMA dendrogram, and the same result on every call."""
    n = distance.num_obs_y(condensed)
    fn = BACKENDS[name]
    z = fn(condensed.copy())
    _assert_valid(z, n)
    _assert_upgma(z, condensed)
    np.testing.assert_array_equal(fn(condensed.copy()), z)
    # A different tie choice can change later heights (UPGMA is not unique under ties), so
    # only the CPU path, which follows scipy's chain, or tie-invariant inputs match scipy here.
    if name == "cpu" or case.startswith(("equal", "zeros")):
        np.testing.assert_allclose(np.sort(z[:, 2]), np.sort(_scipy(condensed)[:, 2]), rtol=1e-9)


@pytest.mark.parametrize(("case", "condensed"), _tied_inputs(), ids=[c for c, _ in _tied_inputs()])
def test_cpu_ties_follow_scipy(case: str, condensed: np.ndarray) -> None:
    """With ties the CPU path still follows scipy's chain, so even the tie-breaking agrees."""
    np.testing.assert_array_equal(average_linkage_cpu(condensed), _scipy(condensed))


def test_reference_tie_rule() -> None:
    """All-equal distances: the reference merges the smallest id pair first, as documented."""
    z = average_linkage_reference(np.full(6, 1.0))  # n = 4
    np.testing.assert_array_equal(z[:, [0, 1]], [[0, 1], [2, 3], [4, 5]])


@pytest.mark.parametrize("n", SIZES)
def test_reference_agrees_with_cpu(n: int) -> None:
    """The two backends agree on generic inputs."""
    condensed = _euclidean(n, np.random.default_rng([n, 9]))
    _assert_same(average_linkage_reference(condensed), average_linkage_cpu(condensed))


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _public() -> Callable:
    """The public function."""
    from aggsrv import kernels

    return kernels.average_linkage


@pytest.mark.parametrize("backend", ["reference", "cpu", "auto"])
@pytest.mark.parametrize("square", [False, True], ids=["condensed", "square"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("n", [2, 17, 64])
def test_public_average_linkage(backend: str, square: bool, kind: str, n: int) -> None:
    """Condensed or square, numpy or torch in; the same kind out, equal to scipy."""
    fn = _public()
    condensed = _cosine(n, np.random.default_rng([n, 13]))
    dist = distance.squareform(condensed) if square else condensed
    if kind == "torch":
        import torch

        out = fn(torch.from_numpy(dist.copy()), backend=backend)
        assert isinstance(out, torch.Tensor)
        assert out.dtype == torch.float64 and out.device.type == "cpu"
        z = out.numpy()
    else:
        z = fn(dist.copy(), backend=backend)
        assert isinstance(z, np.ndarray)
    _assert_same(z, _scipy(condensed))


@pytest.mark.parametrize("square", [False, True], ids=["condensed", "square"])
def test_public_linkage_equals_scipy_bitwise_on_calls_that_reuse_the_working_matrix(
    square: bool,
) -> None:
    """Consecutive calls of the same n (FedDGIC every grouping round) share one working
    matrix: each still equals scipy bit for bit, whatever the call before left in it."""
    fn = _public()
    rng = np.random.default_rng()
    n = int(rng.integers(70, 140))
    for make in (_cosine, _euclidean, _cosine):
        condensed = make(n, rng)
        dist = distance.squareform(condensed) if square else condensed
        before = dist.copy()
        np.testing.assert_array_equal(fn(dist), _scipy(condensed))
        np.testing.assert_array_equal(dist, before)  # the input is never written


@pytest.mark.parametrize("square", [False, True], ids=["condensed", "square"])
def test_public_linkage_clamps_rounding_negatives_and_refuses_real_ones(square: bool) -> None:
    fn = _public()
    rng = np.random.default_rng()
    condensed = _cosine(int(rng.integers(9, 30)), rng)
    condensed[3] = -1e-13  # a rounding of 1 - cos: read as 0
    clamped = np.maximum(condensed, 0.0)
    dist = distance.squareform(condensed, checks=False) if square else condensed
    np.testing.assert_array_equal(fn(dist), _scipy(clamped))
    condensed[3] = -1e-6
    dist = distance.squareform(condensed, checks=False) if square else condensed
    with pytest.raises(ValueError, match=">= 0"):
        fn(dist)


@pytest.mark.parametrize(
    ("defect", "message"),
    [("nan", "finite"), ("inf", "finite"), ("asymmetric", "symmetric"), ("diagonal", "diagonal")],
)
def test_public_linkage_names_what_is_wrong_with_a_square_matrix(defect: str, message: str) -> None:
    fn = _public()
    rng = np.random.default_rng()
    n = int(rng.integers(5, 90))
    dist = distance.squareform(_cosine(n, rng))
    i, j = sorted(rng.choice(n, size=2, replace=False))
    if defect in ("nan", "inf"):
        dist[i, j] = dist[j, i] = float(defect)
    elif defect == "asymmetric":
        dist[i, j] = np.nextafter(dist[i, j], 2.0)
    else:
        dist[i, i] = 1e-300
    with pytest.raises(ValueError, match=message):
        fn(dist)


# --------------------------------------------------------------------------------------------
# similarity_linkage: FedDGIC's distances 1 - (S + S^T) / 2 made in the linkage's own pass
# --------------------------------------------------------------------------------------------


def _similarities(n: int, rng: np.random.Generator) -> np.ndarray:
    """Averaged cosine similarities as FedDGIC keeps them: not exactly symmetric (each entry
    averaged over its own rounds), some a rounding above 1, any diagonal."""
    x = rng.standard_normal((n, 16))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    s = x @ x.T + rng.normal(0.0, 1e-3, (n, n))
    s[rng.random((n, n)) < 0.05] = 1.0 + 1e-15  # distance 0 after the clamp
    s[0, 1] = s[1, 0] = 1.0 + 2e-16
    np.fill_diagonal(s, rng.uniform(-2.0, 2.0, n))  # never read
    return s


def _distances_of(s: np.ndarray) -> np.ndarray:
    """The oracle's distances, in numpy, condensed for scipy."""
    d = 1.0 - (s + s.T) / 2.0
    np.fill_diagonal(d, 0.0)
    return distance.squareform(np.maximum(d, 0.0), checks=False)


@pytest.mark.parametrize("backend", ["reference", "cpu", "auto"])
@pytest.mark.parametrize("kind", ["numpy64", "numpy32", "torch32"])
@pytest.mark.parametrize("n", [2, 3, 17, 65, 130])
def test_similarity_linkage_equals_scipy_on_the_distances_numpy_would_make(
    backend: str, kind: str, n: int
) -> None:
    """Same merges and heights bit for bit as scipy's linkage of ``max(1 - (S + S^T)/2, 0)``
    made by numpy (the reference backend: as the reference's linkage of them), for asymmetric
    S with entries a rounding above 1, in every input kind; the input is not written. n = 65
    and 130 cross the fast path's 64-wide tiles."""
    from aggsrv import kernels

    seed = secrets.randbits(32)
    s = _similarities(n, np.random.default_rng(seed))
    if kind == "numpy32":
        s = s.astype(np.float32)
    given = torch.from_numpy(s.astype(np.float32)) if kind == "torch32" else s.copy()
    before = given.clone() if kind == "torch32" else given.copy()
    z = kernels.similarity_linkage(given, backend=backend)
    if kind == "torch32":
        assert isinstance(z, torch.Tensor) and z.dtype == torch.float64
        assert torch.equal(given, before)
        z = z.numpy()
    else:
        np.testing.assert_array_equal(given, before)
    condensed = _distances_of(np.asarray(before, dtype=np.float64))
    # Ties (the distances clamped to 0) break the reference's own way, documented above.
    oracle = average_linkage_reference(condensed) if backend == "reference" else _scipy(condensed)
    np.testing.assert_array_equal(z, oracle, err_msg=f"seed {seed}")


def test_similarity_linkage_makes_the_distances_in_its_own_pass() -> None:
    """The fast path is taken for finite similarities (not the numpy fallback), and the
    distances it makes are numpy's bit for bit (+inf on the diagonal, as the square path's)."""
    from aggsrv.kernels import linkage

    seed = secrets.randbits(32)
    for n in (2, 64, 65, 131):
        s = _similarities(n, np.random.default_rng([seed, n]))
        square = distance.squareform(_distances_of(s))
        z = linkage.linkage_from_similarity(s)
        assert z is not None, f"n {n} seed {seed}"
        np.testing.assert_array_equal(z, linkage.linkage_from_square(square), f"seed {seed}")
        ours, numpys = np.empty((n, n + 8)), np.empty((n, n + 8))
        assert linkage._checked_into_work(s, n, ours, True)
        assert linkage._checked_into_work(square, n, numpys, False)
        np.testing.assert_array_equal(ours[:, :n], numpys[:, :n], f"seed {seed}")


def test_similarity_linkage_reuses_its_working_matrix_across_sizes_bit_for_bit() -> None:
    """Calls of alternating n, the same n twice: each equals scipy's (nothing left over)."""
    from aggsrv import kernels

    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    for n in (40, 40, 7, 129, 40):
        s = _similarities(n, rng)
        np.testing.assert_array_equal(
            kernels.similarity_linkage(s), _scipy(_distances_of(s)), f"seed {seed}"
        )


def test_similarity_linkage_of_one_point_and_of_sums_that_overflow() -> None:
    """n = 1 has no merges; similarities whose finite sum overflows (distance -inf, clamped
    to 0 by numpy) take the numpy path and give its result, not an error."""
    from aggsrv import kernels

    assert kernels.similarity_linkage(np.array([[0.3]])).shape == (0, 4)
    s = _similarities(9, np.random.default_rng(9))
    s[2, 5] = s[5, 2] = 1.5e308  # the sum is inf; each value is finite
    with np.errstate(over="ignore"):
        oracle = _scipy(_distances_of(s))
    np.testing.assert_array_equal(kernels.similarity_linkage(s), oracle)
    s[2, 5] = s[5, 2] = -1.5e308  # the sum is -inf: an infinite distance, named as such
    with pytest.raises(ValueError, match="overflows float64"):
        kernels.similarity_linkage(s)


@pytest.mark.parametrize("where", ["off", "diagonal"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_similarity_linkage_refuses_a_similarity_that_is_not_finite(where: str, value) -> None:
    from aggsrv import kernels

    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 80))
    s = _similarities(n, rng)
    i, j = sorted(rng.choice(n, size=2, replace=False))
    if where == "off":
        s[j, i] = value  # one side only: its mirror is finite
    else:
        s[i, i] = value
    with pytest.raises(ValueError, match="similarity must be finite"):
        kernels.similarity_linkage(s)


@pytest.mark.parametrize("shape", [(3, 4), (0, 0), (5,), (2, 2, 2)])
def test_similarity_linkage_refuses_a_matrix_that_is_not_square(shape) -> None:
    from aggsrv import kernels

    with pytest.raises(ValueError, match="square"):
        kernels.similarity_linkage(np.zeros(shape))
