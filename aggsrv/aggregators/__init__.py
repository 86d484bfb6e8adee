"""Robust aggregation rules between the kernels and the strategies (docs/robust.md).

:class:`Aggregator` is a parsed, validated spec (``Aggregator.parse("norm_bound:max=10 >
multi_krum:f=2,m=5")``); its :meth:`~Aggregator.combine` turns [K, D] rows and their weights
into one [D] aggregate with the :mod:`aggsrv.kernels` robust kernels. :class:`RowBuffer` holds
the rows a strategy keeps between aggregations. Imports the kernels and the spec parser only
(tests/project/test_layers.py checks it).
"""

from __future__ import annotations

from aggsrv.aggregators.combine import AggregateInfo, combine
from aggsrv.aggregators.rows import RowBuffer
from aggsrv.aggregators.spec import NORM_BOUND, RULES, WEIGHTED, Aggregator, parse_aggregator
from aggsrv.aggregators.warm import warm_up

__all__ = [
    "AGGREGATOR_HELP",
    "NORM_BOUND",
    "RULES",
    "WEIGHTED",
    "AggregateInfo",
    "Aggregator",
    "RowBuffer",
    "combine",
    "parse_aggregator",
    "warm_up",
]

# The HELP line of every strategy config that takes the key.
AGGREGATOR_HELP = (
    "mean, median, trimmed_mean, krum, multi_krum, bulyan, geometric_median, centered_clipping "
    "(docs/robust.md)"
)
