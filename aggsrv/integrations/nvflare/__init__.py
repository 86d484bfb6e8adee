"""aggsrv inside NVIDIA FLARE (the ``nvflare`` extra): the fused kernels and robust rules as a
FLARE aggregator (docs/nvflare.md).

* :class:`AggsrvAggregator`: a FLARE ``ModelAggregator`` for the ``FedAvg`` controller, the
  ``FedAvgRecipe`` and ``ScatterAndGather`` jobs: the weighted mean in one float64 pass, or any
  aggsrv robust rule (median, trimmed mean, Krum, Multi-Krum, Bulyan, geometric median,
  centered clipping, a norm bound in front).
* :class:`AsyncAggsrvController`: a FLARE controller that runs any aggsrv strategy (FedAsync,
  FedBuff, ORTHOFL, FedHist, ...) asynchronously: each site's result is folded in as it arrives
  and the site gets its next job at once.
"""

from aggsrv.integrations.nvflare.aggregator import AggsrvAggregator, reply_weight
from aggsrv.integrations.nvflare.async_controller import AsyncAggsrvController, FoldedUpdate
from aggsrv.integrations.nvflare.params import ParamsLayout, ParamsMismatchError

__all__ = [
    "AggsrvAggregator",
    "AsyncAggsrvController",
    "FoldedUpdate",
    "ParamsLayout",
    "ParamsMismatchError",
    "reply_weight",
]
