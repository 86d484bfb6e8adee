"""aggsrv inside Flower (``pip install aggsrv[flower]``, flwr 1.41.0).

- :class:`AggsrvStrategy`: any aggsrv strategy's server side as a Flower ServerApp strategy.
- :mod:`.arrays`: Flower ``ArrayRecord`` <-> aggsrv's flat layout (zero-copy reads).

Importing this package imports ``flwr``; ``import aggsrv.kernels`` never does.
"""

from aggsrv.integrations.flower.arrays import flat_to_record, layout_of, record_to_flat
from aggsrv.integrations.flower.strategy import AggsrvStrategy

__all__ = ["AggsrvStrategy", "flat_to_record", "layout_of", "record_to_flat"]
