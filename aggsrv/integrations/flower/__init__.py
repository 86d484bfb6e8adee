"""aggsrv inside Flower (``pip install aggsrv[flower]``, flwr 1.42.0).

- :class:`AggsrvStrategy`: any aggsrv strategy's server side as a Flower ServerApp strategy.
- :func:`run_async`: a ServerApp main loop without rounds for the asynchronous strategies
  (FedAsync, ORTHOFL, FedDGIC, FedHist, ...): every reply is folded in as it arrives and its node
  gets its next job at once.
- :mod:`.arrays`: Flower ``ArrayRecord`` <-> aggsrv's flat layout (zero-copy reads).

Importing this package imports ``flwr``; ``import aggsrv.kernels`` never does.
"""

from aggsrv.integrations.flower.arrays import flat_to_record, layout_of, record_to_flat
from aggsrv.integrations.flower.async_loop import AsyncResult, run_async
from aggsrv.integrations.flower.strategy import AggsrvStrategy

__all__ = [
    "AggsrvStrategy",
    "AsyncResult",
    "flat_to_record",
    "layout_of",
    "record_to_flat",
    "run_async",
]
