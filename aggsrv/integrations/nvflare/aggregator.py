"""An NVIDIA FLARE aggregator that combines the clients' models with aggsrv's kernels.

:class:`AggsrvAggregator` is a FLARE ``ModelAggregator``: pass it as ``aggregator=`` to FLARE's
``FedAvg`` controller (or a ``FedAvgRecipe``), or name it as the aggregator component of a
``ScatterAndGather`` job. Every reply's floating-point parameters are read as one flat row (the
first reply of the run fixes the layout, :mod:`.params`), and the round's rows are combined by
an aggsrv aggregator spec (docs/robust.md): ``"mean"`` (FLARE's weighted FedAvg), or a robust
rule such as ``"median"``, ``"trimmed_mean:trim=0.1"``, ``"krum:f=1"``, ``"multi_krum:f=2"``,
``"bulyan:f=1"``, ``"geometric_median"``, ``"centered_clipping"``, each optionally behind
``"norm_bound:max=M > ..."``.

Weights follow FLARE's FedAvg: the reply's ``NUM_STEPS_CURRENT_ROUND`` (1 when missing, not
finite or not positive) times ``aggregation_weights[client]`` (1 when not given). Rows and
weights reach :func:`aggsrv.aggregators.combine` unchanged, so the rules weigh as they do in
``aggsrv serve`` (the order statistics and Krum are unweighted). Centered clipping's centre is
the previous round's aggregate; the first round, without one, starts from the coordinate-wise
median of the replies.

Memory: ``"mean"`` folds each reply into one float64 sum of D values as it arrives (FLARE's
in-time aggregation, one pass over the reply); the other rules need every row at once and keep
a [K, D] float32 buffer, reused from round to round. The aggregate is float32.

A reply that cannot be aggregated (another model's names or shapes, NaN or Inf, no parameters,
a params_type other than the round's) is refused: an error naming the client and the reason is
logged, the reply counts for nothing, and :attr:`AggsrvAggregator.refused` lists it until the
next round. A round in which every reply was refused returns an empty DIFF, which leaves FLARE's
global model as it was.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from nvflare.apis.fl_constant import FLMetaKey, ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.aggregators.model_aggregator import ModelAggregator
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from aggsrv import kernels
from aggsrv.aggregators import AggregateInfo, Aggregator, warm_up
from aggsrv.finite import count_non_finite
from aggsrv.integrations.nvflare.params import ParamsLayout, ParamsMismatchError

__all__ = ["AggsrvAggregator", "reply_weight"]

UNKNOWN_CLIENT = "?"


def client_name(model: FLModel) -> str:
    """The sending site's name as FLARE's FedAvg reads it from the reply's meta."""
    name = (model.meta or {}).get("client_name")
    return name if isinstance(name, str) and name else UNKNOWN_CLIENT


def reply_weight(model: FLModel, aggregation_weights: Mapping[str, float]) -> float:
    """FLARE's FedAvg weight of a reply: its NUM_STEPS_CURRENT_ROUND (1 when missing, not a
    finite positive number) times the site's aggregation weight (1 when not given)."""
    steps = (model.meta or {}).get(FLMetaKey.NUM_STEPS_CURRENT_ROUND)
    try:
        w = float(steps) if steps is not None and not isinstance(steps, bool) else 1.0
    except (TypeError, ValueError, OverflowError):
        w = 1.0
    if not (math.isfinite(w) and w > 0):
        w = 1.0
    return w * float(aggregation_weights.get(client_name(model), 1.0))


# Elements divided at a time: the float64 quotient stays in cache, no [D] float64 temporary.
_CHUNK = 1 << 16


def _divided(total: torch.Tensor, divisor: float) -> torch.Tensor:
    """float32(total / divisor), element by element rounded once, on this thread (numpy)."""
    out = np.empty(total.numel(), dtype=np.float32)
    src = total.numpy()
    quotient = np.empty(min(_CHUNK, src.size), dtype=np.float64)
    for start in range(0, src.size, _CHUNK):
        end = min(start + _CHUNK, src.size)
        q = quotient[: end - start]
        np.divide(src[start:end], divisor, out=q)
        out[start:end] = q
    return torch.from_numpy(out)


class AggsrvAggregator(ModelAggregator):
    """FLARE's ``ModelAggregator`` on aggsrv's flat rows and kernels (module docstring).

    ``aggregator``: an aggsrv aggregator spec (``"mean"``, ``"krum:f=1"``, ...);
    ``aggregation_weights``: a weight per site name (FLARE's FedAvg argument of the same name);
    ``expected_clients``: replies per round to size the row buffer for (it grows when more
    come). Every argument is plain JSON, so FLARE job configurations can name the class.
    """

    def __init__(
        self,
        aggregator: str = "mean",
        aggregation_weights: Mapping[str, float] | None = None,
        expected_clients: int = 8,
    ) -> None:
        super().__init__()
        # FLARE's job API writes a component's config from the attributes named as its
        # constructor's arguments: keep each one as given.
        self.aggregator = aggregator
        self.spec = Aggregator.parse(aggregator)
        weights = dict(aggregation_weights or {})
        for site, w in weights.items():
            if isinstance(w, bool) or not (
                isinstance(w, numbers.Real) and math.isfinite(w) and w >= 0
            ):
                raise ValueError(f"aggregation_weights[{site!r}] must be a finite number >= 0")
        self.aggregation_weights = weights
        if not (isinstance(expected_clients, int) and expected_clients >= 1):
            raise ValueError(f"expected_clients must be an integer >= 1, got {expected_clients!r}")
        self.expected_clients = expected_clients
        self.layout: ParamsLayout | None = None
        self.refused: list[tuple[str, str]] = []  # (site, reason), this round
        self.last_info: AggregateInfo | None = None  # what the rule did last round
        self._lock = threading.Lock()
        self._rows = torch.empty(0, 0)
        self._capacity = expected_clients
        self._sum: torch.Tensor | None = None  # the mean's float64 running sum
        self._centre: torch.Tensor | None = None  # centered clipping's: the last aggregate
        warm_up(self.spec, "cpu")  # the kernels compile now, not inside the first round
        self.reset_stats()

    @property
    def streams(self) -> bool:
        """True when the rule folds each reply in as it comes (no [K, D] buffer)."""
        return self.spec.rule == "mean" and self.spec.norm_bound is None

    def reset_stats(self) -> None:
        """Forget the round's replies (FLARE calls this before each round)."""
        with self._lock:
            self._weights: list[float] = []
            self._sites: list[str] = []
            self._params_type: ParamsType | None = None
            self._kept: dict[str, Any] = {}
            self._metrics: list[tuple[float, Mapping[str, Any]]] = []
            self.refused = []
            self._mismatched = 0  # replies refused for another model's names or shapes
            if self._sum is not None:
                self._sum.zero_()

    def accept(self, shareable: Shareable, fl_ctx: FLContext) -> bool:
        """ScatterAndGather's entry: the reply as an FLModel; False when it was refused."""
        self.fl_ctx = fl_ctx
        # ScatterAndGather names the site in the reply's peer identity (FLARE's, not the
        # site's own word in its meta, which could borrow another site's weight).
        peer = shareable.get_peer_prop(ReservedKey.IDENTITY_NAME, None)
        site = peer if isinstance(peer, str) and peer else UNKNOWN_CLIENT
        # A reply to an earlier round's task (ScatterAndGather passes late ones on) is not this
        # round's, as FLARE's own aggregators hold.
        contribution = shareable.get_cookie(AppConstants.CONTRIBUTION_ROUND)
        current = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        if contribution is not None and current is not None and contribution != current:
            return self._refuse(site, f"a reply to round {contribution} in round {current}")
        try:
            model = FLModelUtils.from_shareable(shareable, fl_ctx)
        except (ValueError, TypeError, KeyError) as e:
            return self._refuse(site, f"not a model: {e}")
        if site != UNKNOWN_CLIENT:
            model.meta = {**(model.meta or {}), "client_name": site}
        return self.accept_model(model)

    def _refuse(self, site: str, reason: str) -> bool:
        with self._lock:
            self.refused.append((site, reason))
        self.error(f"refused the reply of {site}: {reason}")
        return False

    def accept_model(self, model: FLModel) -> bool:
        """Fold one reply into the round; False (and an error in the log) when refused."""
        site = client_name(model)
        with self._lock:
            try:
                self._accept(model, site)
            except (ParamsMismatchError, ValueError) as e:
                self.refused.append((site, str(e)))
                if isinstance(e, ParamsMismatchError):
                    self._mismatched += 1
                self.error(f"refused the reply of {site}: {e}")
                return False
        return True

    def _accept(self, model: FLModel, site: str) -> None:
        params_type = model.params_type or ParamsType.FULL
        if params_type not in (ParamsType.FULL, ParamsType.DIFF):
            raise ValueError(f"params_type {params_type} cannot be aggregated (FULL or DIFF)")
        if self._params_type is not None and params_type != self._params_type:
            raise ValueError(f"params_type {params_type} in a round of {self._params_type} replies")
        if self.spec.norm_bound is not None and params_type != ParamsType.DIFF:
            # The bound is on an update's norm: on FULL weights it would shrink the model.
            raise ValueError(
                "norm_bound bounds updates: send DIFF replies (params_transfer_type DIFF)"
            )
        if site != UNKNOWN_CLIENT and site in self._sites:
            raise ValueError("a second reply from this site in the round")
        if self.layout is None:
            self.layout = ParamsLayout.of(model.params)
        layout = self.layout
        weight = reply_weight(model, self.aggregation_weights)
        k = len(self._weights)
        if self.streams:
            if self._sum is None:
                self._sum = torch.zeros(layout.numel, dtype=torch.float64)
            self._fold(model.params, weight)
        else:
            rows = self._row_buffer(k + 1, layout.numel)
            self._copy_row(model.params, rows[k])
        if not self._weights:
            self._params_type = params_type
            self._kept = {name: model.params[name] for name in layout.kept}
        self._weights.append(weight)
        self._sites.append(site)
        if model.metrics:
            self._metrics.append((weight, model.metrics))

    def _fold(self, params: Mapping[str, Any], weight: float) -> None:
        """Add weight * reply into the float64 sum, every value checked finite first (in cache,
        array by array); a refused reply leaves the sum as it was."""
        assert self.layout is not None and self._sum is not None
        checked = []
        for e, t in self.layout.tensors(params):
            if count_non_finite(t):  # one-read sum, the exact count if it overflows
                raise ValueError(f"parameter {e.name!r} holds NaN or Inf")
            checked.append((e, t))
        for e, t in checked:
            kernels.accumulate(self._sum[e.offset : e.offset + e.numel], t.reshape(-1), weight)

    def _copy_row(self, params: Mapping[str, Any], row: torch.Tensor) -> None:
        assert self.layout is not None
        for e, t in self.layout.tensors(params):
            part = row[e.offset : e.offset + e.numel]
            part.copy_(t.reshape(-1))
            if count_non_finite(part):
                raise ValueError(f"parameter {e.name!r} holds NaN or Inf")

    def _row_buffer(self, K: int, D: int) -> torch.Tensor:
        """The round's [K, D] rows, kept across rounds; grown (doubling) when a round has more
        replies than the buffer holds, the rows so far copied over."""
        if self._rows.shape[1] != D or self._rows.shape[0] < K:
            capacity = max(K, self._capacity, 2 * self._rows.shape[0])
            grown = torch.empty(capacity, D, dtype=torch.float32)
            if self._rows.shape[1] == D:
                grown[: K - 1].copy_(self._rows[: K - 1])
            self._rows, self._capacity = grown, capacity
        return self._rows

    def aggregate_model(self) -> FLModel:
        """The round's aggregate as an FLModel of the replies' params_type (float32 arrays of
        the replies' kind), with the replies' metrics averaged by the same weights."""
        with self._lock:
            K = len(self._weights)
            if self._mismatched > K:
                # The run's layout came from its first reply; when most replies disagree with
                # it, that reply was the odd one (a Byzantine site can send first): drop the
                # round rather than aggregate the minority, and learn the layout again.
                self.error(
                    f"{self._mismatched} replies this round did not match the model the first "
                    f"reply of the run set, {K} did: the round is dropped and the next round's "
                    "first reply sets the model"
                )
                self.layout, self._sum, self._rows = None, None, torch.empty(0, 0)
                self._centre = None
                return FLModel(params_type=ParamsType.DIFF, params={})
            if K == 0:
                why = "; ".join(f"{s}: {r}" for s, r in self.refused) or "no replies"
                self.error(f"no reply to aggregate this round ({why}): the model stays as it was")
                return FLModel(params_type=ParamsType.DIFF, params={})
            assert self.layout is not None
            weights = torch.tensor(self._weights, dtype=torch.float64)
            if not float(weights.sum()) > 0:
                self.error(
                    "the replies' weights sum to 0 (aggregation_weights all 0?): the model "
                    "stays as it was"
                )
                return FLModel(params_type=ParamsType.DIFF, params={})
            if self.streams:
                assert self._sum is not None
                total = float(weights.sum())
                aggregate = _divided(self._sum, total)
                self.last_info = AggregateInfo("mean", K)
            else:
                aggregate = torch.empty(self.layout.numel, dtype=torch.float32)
                rows = self._rows[:K]
                centred = self.spec.rule == "centered_clipping"
                if centred and self._centre is None:
                    self._centre = kernels.coordinate_median(rows)
                _, self.last_info = self.spec.combine(
                    rows, weights, center=self._centre, out=aggregate
                )
                if centred:
                    self._centre = aggregate.clone()
            meta = {"aggsrv": self.last_info.as_dict(), "sites": list(self._sites)}
            if self.refused:
                meta["refused"] = [list(r) for r in self.refused]
            return FLModel(
                params_type=self._params_type,
                params=self.layout.to_params(aggregate, self._kept),
                metrics=self._mean_metrics(),
                meta=meta,
            )

    def _mean_metrics(self) -> dict[str, float] | None:
        """The weighted mean of every numeric metric all accepted replies report."""
        if not self._metrics or len(self._metrics) != len(self._weights):
            return None
        keys = set.intersection(*(set(m) for _, m in self._metrics))
        out: dict[str, float] = {}
        for key in sorted(keys):
            values = [(w, m[key]) for w, m in self._metrics]
            if all(isinstance(v, numbers.Real) and not isinstance(v, bool | np.bool_)
                   for _, v in values):  # fmt: skip
                total = sum(w for w, _ in values)
                if total > 0:
                    out[key] = sum(w * float(v) for w, v in values) / total
        return out or None
