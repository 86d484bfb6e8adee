"""Triton backend of `aggsrv.kernels` (CUDA; on a CPU it runs under TRITON_INTERPRET=1).

Functions follow kernels/BACKENDS.md: arguments arrive validated and normalised, so nothing is
re-checked here.
"""

from __future__ import annotations

import numpy as np

from .distance import clip_rows, sq_distances_to
from .gram import cosine_matrix, gram_matrix, layer_normalized_cosine, pairwise_sq_distances
from .order import coordinate_median, mean_around_median, trimmed_mean
from .quantized import code_squares, dequantize, quantized_accumulate
from .quantized_rows import quantize_rows, quantized_gram, quantized_rows_combination
from .rows import group_means, weighted_sum
from .segmented import layer_dots, orthogonal_calibrate, project_out
from .sparse import accumulate, nnz_per_layer, sparse_accumulate

__all__ = [
    "accumulate",
    "average_linkage",
    "clip_rows",
    "coordinate_median",
    "cosine_matrix",
    "dequantize",
    "gram_matrix",
    "group_means",
    "layer_dots",
    "layer_normalized_cosine",
    "mean_around_median",
    "nnz_per_layer",
    "orthogonal_calibrate",
    "pairwise_sq_distances",
    "project_out",
    "quantize_rows",
    "quantized_accumulate",
    "code_squares",
    "quantized_gram",
    "quantized_rows_combination",
    "sparse_accumulate",
    "sq_distances_to",
    "trimmed_mean",
    "weighted_sum",
]


def average_linkage(condensed: np.ndarray) -> np.ndarray:
    """UPGMA linkage (scipy Z): merges are sequential, so there is no GPU kernel; CPU code."""
    # Imported lazily so this backend imports even where the CPU linkage module is absent.
    from ..linkage import average_linkage_cpu

    return average_linkage_cpu(condensed)
