"""An aggsrv strategy inside Flower's ServerApp rounds (``flwr.serverapp.strategy.Strategy``).

:class:`AggsrvStrategy` runs the server side of any aggsrv strategy (FedAvg, FedAsync, FedBuff,
Fed-OGD, ORTHOFL, FedHist, FedDGIC, FedEN, ...) with ``aggsrv.kernels``, driven by Flower's
``start()`` loop: ``configure_train`` asks the strategy for each sampled node's job (Flower node
ids are the client ids), ``aggregate_train`` folds the replies in, in the order given, exactly
as our server folds pushes in the order they arrive. So the same updates in the same order give
the same global model as ``aggsrv serve`` (bit for bit: the same strategy code runs).

Flower's rounds wait for every sampled node. For asynchronous aggregation (FedAsync, ORTHOFL,
FedHist, FedDGIC, ...) :func:`aggsrv.integrations.flower.async_loop.run_async` drives the same
object from a ServerApp's own loop through :meth:`AggsrvStrategy.issue_job`,
:meth:`AggsrvStrategy.job_message` and :meth:`AggsrvStrategy.fold_reply`.

Messages carry the job's weights as the "arrays" record (the model's own names and shapes), the
job's recipe and ids in the "config" record (``aggsrv.*`` keys; a ClientApp trains by them with
the helpers of :mod:`aggsrv.integrations.flower.client`), and any further job tensor (Fed-OGD's
basis) as a record of its own, ``aggsrv.<name>``. A reply carries the client's final weights as
"arrays" and its sample count as the "num-examples" metric, as with Flower's own strategies.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy as FlowerStrategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from torch import nn

from aggsrv.integrations.flower.arrays import (
    flat_to_record,
    layout_of,
    record_to_buffers,
    record_to_flat,
)
from aggsrv.layout import ModelLayout
from aggsrv.strategies import (
    Job,
    Outcome,
    Strategy,
    StrategyError,
    Update,
    UpdateKind,
    make_strategy,
    strategy_settings,
)

log = logging.getLogger(__name__)

JOB_ID = "aggsrv.job-id"
BASE_VERSION = "aggsrv.base-version"
RECIPE_PREFIX = "aggsrv.recipe."
# The job's ModelLayout as JSON: which arrays are parameters, float buffers or outside, so a
# ClientApp splits the record exactly as the ServerApp did.
LAYOUT = "aggsrv.layout"


class AggsrvStrategy(FlowerStrategy):
    """Flower strategy that delegates aggregation to the aggsrv strategy ``name``."""

    def __init__(
        self,
        name: str,
        config: Mapping[str, Any] | None = None,
        *,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_available_nodes: int = 1,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        device: str | torch.device = "cpu",
        max_clients: int = 1024,
        clock: Callable[[], float] = time.time,
        seed: int | None = None,
        model: nn.Module | None = None,
    ) -> None:
        """``model`` (optional) fixes which arrays are trained, as ``aggsrv serve`` sees a
        registering model (``ModelLayout.from_module``); without it the initial record decides
        (:func:`~aggsrv.integrations.flower.arrays.layout_of`: float arrays are parameters,
        BatchNorm's running statistics float buffers, integer arrays stay outside)."""
        if not 0.0 <= fraction_train <= 1.0 or not 0.0 <= fraction_evaluate <= 1.0:
            raise ValueError("fraction_train and fraction_evaluate must be in [0, 1]")
        self.name = name
        self.config = dict(config or {})
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.min_available_nodes = min_available_nodes
        self.weighted_by_key = weighted_by_key
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.device = torch.device(device)
        self.max_clients = max_clients
        self.clock = clock
        self._random = random.Random(seed)
        self.strategy: Strategy | None = None
        self.layout: ModelLayout | None = (
            ModelLayout.from_module(model) if model is not None else None
        )
        # Arrays outside the layout (integer buffers: num_batches_tracked), sent back as given
        # in the initial record so a job loads into the model with load_state_dict.
        self._outside: dict[str, Any] = {}
        self._jobs: dict[int, Job] = {}
        self.outcomes: list[tuple[int, str, int]] = []  # (node, status, version) per reply
        # Read once: a bad name or config key fails now, not at the first round.
        self.settings = strategy_settings(name, self.config)

    # ------------------------------------------------------------------ the aggsrv strategy

    def adopt(self, arrays: ArrayRecord) -> None:
        """Create the aggsrv strategy with ``arrays`` as version 0 (first round, or by hand).

        ``arrays`` holds the parameters and, for a model with BatchNorm, its running
        statistics (``ArrayRecord(model.state_dict())``), which the strategy then aggregates
        as ``aggsrv serve`` does (aggsrv/strategies/float_buffers.py)."""
        layout = self.layout or layout_of(arrays)
        initial = record_to_flat(arrays, layout)
        initial_buffers = record_to_buffers(arrays, layout)
        self.strategy = make_strategy(
            self.name,
            layout=layout,
            initial=initial,
            config=self.settings,
            device=self.device,
            max_clients=self.max_clients,
            initial_buffers=initial_buffers,
        )
        self.layout = layout
        self._outside = {n: arrays[n] for n in layout.int_buffer_names if n in arrays}

    def global_arrays(self) -> ArrayRecord:
        """The aggsrv strategy's current global model as a Flower record."""
        assert self.strategy is not None and self.layout is not None
        return flat_to_record(
            self.strategy.global_model(),
            self.layout,
            self.strategy.global_buffers(),
            self._outside,
        )

    def _sample(self, grid: Grid, fraction: float) -> list[int]:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) < self.min_available_nodes:
            log.warning("%d nodes connected, %d wanted", len(nodes), self.min_available_nodes)
        k = max(1, math.ceil(len(nodes) * fraction)) if nodes and fraction > 0 else 0
        return sorted(self._random.sample(nodes, k))

    # ------------------------------------------------------------------ Flower's interface

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.strategy is None:
            self.adopt(arrays)
        # Every connected node registers before any job is asked for, as clients register
        # with `aggsrv serve` on connecting: strategies that wait for min_available clients
        # (Fed-OGD, ORTHOFL) or sample among the registered ones (FedEN) see them all.
        now = self.clock()
        for node in sorted(grid.get_node_ids()):
            self.register(node, now)
        self._fire_due_timer(now)
        messages = []
        for node in self._sample(grid, self.fraction_train):
            if str(node) not in self.strategy.clients:
                continue  # refused at registration (max_clients)
            job = self.issue_job(node, now)
            if job is None:  # e.g. FedHist: this node's last update still waits in the round
                continue
            messages.append(self.job_message(node, job, server_round=server_round, config=config))
        return messages

    def register(self, node: int, now: float | None = None) -> bool:
        """Register ``node`` with the aggsrv strategy on first sight; False (logged) when the
        strategy refuses it (e.g. ``max_clients`` reached)."""
        strategy = self.strategy
        assert strategy is not None, "adopt() the initial arrays first"
        client = str(node)
        if client in strategy.clients:
            return True
        try:
            strategy.on_register(client, self.clock() if now is None else now)
        except StrategyError as exc:
            log.warning("node %s not registered: %s", node, exc)
            return False
        return True

    def issue_job(self, node: int, now: float | None = None) -> Job | None:
        """The node's next job from the aggsrv strategy (registering the node on first sight),
        remembered as its outstanding one; None while the strategy has none for it."""
        strategy = self.strategy
        assert strategy is not None, "adopt() the initial arrays first"
        now = self.clock() if now is None else now
        client = str(node)
        if client not in strategy.clients:
            strategy.on_register(client, now)
        job = strategy.job_for(client, now)
        if job is not None:
            self._jobs[node] = job
        return job

    def job_message(
        self,
        node: int,
        job: Job,
        *,
        server_round: int,
        config: ConfigRecord | None = None,
        ttl: float | None = None,
    ) -> Message:
        """A TRAIN message to ``node`` for ``job``: weights, recipe and ids, further tensors.

        ``config`` adds the ServerApp's own keys; ``ttl`` (seconds) is Flower's message lifetime
        (None: Flower's default)."""
        layout = self.layout
        assert layout is not None
        values: dict[str, Any] = dict(config or {})
        values.update({"server-round": server_round, JOB_ID: job.job_id,
                       BASE_VERSION: job.base_version, LAYOUT: layout.to_json()})  # fmt: skip
        for key, value in job.recipe.to_dict().items():
            if isinstance(value, bool | int | float | str):
                values[RECIPE_PREFIX + key] = value
            elif isinstance(value, Mapping):
                values.update({f"{RECIPE_PREFIX}extra.{k}": float(v) for k, v in value.items()})
        content = RecordDict(
            {
                self.arrayrecord_key: flat_to_record(
                    job.weights, layout, job.tensors.get("buffers"), self._outside
                ),
                self.configrecord_key: ConfigRecord(values),
            }
        )
        for name, tensor in job.tensors.items():
            if name not in ("weights", "buffers") and tensor.numel() == layout.numel:
                content[f"aggsrv.{name}"] = flat_to_record(tensor, layout)
        return Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN, ttl=ttl)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        assert self.strategy is not None and self.layout is not None
        metrics: list[tuple[float, MetricRecord]] = []
        for msg in replies:
            if self.fold_reply(msg) is None:
                continue
            reply_metrics = msg.content.metric_records.get("metrics", MetricRecord())
            metrics.append((float(reply_metrics.get(self.weighted_by_key, 1)), reply_metrics))
        self._fire_due_timer(self.clock())
        return self.global_arrays(), _weighted_mean(metrics, self.weighted_by_key)

    def _fire_due_timer(self, now: float) -> None:
        """Run the aggsrv strategy's timer once its deadline (round, epoch or grouping
        timeout) has passed, as ``aggsrv serve`` does: a round that a node never answers (an
        error reply, a node gone) then closes with the updates it got instead of waiting for
        that node in every later Flower round."""
        assert self.strategy is not None
        deadline = self.strategy.next_deadline()
        if deadline is not None and now >= deadline:
            self.strategy.on_timer(now)

    def fold_reply(
        self, msg: Message, job: Job | None = None, *, now: float | None = None
    ) -> Outcome | None:
        """Fold one TRAIN reply into the aggsrv strategy; its outcome, or None (logged) for an
        error reply, a reply without an outstanding job, or an update the strategy refuses.

        ``job`` is the job the reply answers; without it, the node's outstanding job (one per
        node, as in a synchronous round)."""
        strategy = self.strategy
        assert strategy is not None and self.layout is not None
        node = msg.metadata.src_node_id
        if job is None:
            job = self._jobs.pop(node, None)
        elif self._jobs.get(node) is job:
            del self._jobs[node]
        if msg.has_error() or job is None:
            log.warning("no usable reply from node %s (%s)", node,
                        msg.error.reason if msg.has_error() else "no outstanding job")  # fmt: skip
            return None
        content = msg.content
        reply_metrics = content.metric_records.get("metrics", MetricRecord())
        n = float(reply_metrics.get(self.weighted_by_key, 1))
        try:
            if not (math.isfinite(n) and n >= 0):
                raise ValueError(f"its {self.weighted_by_key!r} is {n}, not a count of examples")
            if self.arrayrecord_key not in content.array_records:
                raise ValueError(f"the reply has no {self.arrayrecord_key!r} record")
            arrays = content.array_records[self.arrayrecord_key]
            tensor = record_to_flat(arrays, self.layout).to(strategy.device)
            buffers = record_to_buffers(arrays, self.layout)
        except ValueError as exc:  # a reply of another model, or without its statistics
            log.warning("reply of node %s refused: %s", node, exc)
            return None
        update = Update(
            client_id=str(node),
            job_id=job.job_id,
            base_version=job.base_version,
            update_id=msg.metadata.message_id or f"{node}-{job.job_id}",
            num_samples=int(n),
            work_done=job.recipe.work_target,
            kind=UpdateKind.WEIGHTS,
            tensor=tensor,
            buffers=None if buffers is None else buffers.to(strategy.device),
        )
        try:
            outcome = strategy.on_update(update, self.clock() if now is None else now)
        except StrategyError as exc:  # e.g. too stale: dropped, as our server refuses it
            log.warning("update of node %s refused: %s", node, exc)
            return None
        self.outcomes.append((node, outcome.status.name, outcome.version))
        return outcome

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.fraction_evaluate == 0.0:
            return []
        values = dict(config)
        values["server-round"] = server_round
        content = RecordDict(
            {self.arrayrecord_key: arrays, self.configrecord_key: ConfigRecord(values)}
        )
        return [
            Message(content=content, dst_node_id=node, message_type=MessageType.EVALUATE)
            for node in self._sample(grid, self.fraction_evaluate)
        ]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        metrics = []
        for msg in replies:
            if msg.has_error():
                continue
            record = msg.content.metric_records.get("metrics", MetricRecord())
            metrics.append((float(record.get(self.weighted_by_key, 1)), record))
        return _weighted_mean(metrics, self.weighted_by_key)

    def summary(self) -> None:
        log.info(
            "AggsrvStrategy: aggsrv %s %s, fraction_train %.2f, fraction_evaluate %.2f",
            self.name, self.config, self.fraction_train, self.fraction_evaluate,
        )  # fmt: skip


def _weighted_mean(
    metrics: list[tuple[float, MetricRecord]], weight_key: str
) -> MetricRecord | None:
    """Sample-weighted mean of every metric (Flower's own aggregation); the weight key itself is
    summed, and a reply without it counts with the weight it was folded in with."""
    if not metrics:
        return None
    records = [
        RecordDict({"metrics": MetricRecord({**dict(r), weight_key: n})}) for n, r in metrics
    ]
    out = aggregate_metricrecords(records, weight_key)
    out[weight_key] = sum(n for n, _ in metrics)
    return out
