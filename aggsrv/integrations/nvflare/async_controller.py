"""Asynchronous aggregation inside NVIDIA FLARE: an aggsrv strategy drives the sites, no rounds.

FLARE's ``FedAvg`` waits for every sampled site each round. FLARE's ``ModelController`` also
sends a task to a single site without blocking and calls back when that site's result arrives
(``send_model(targets=[site], callback=...)``), and that is all asynchronous aggregation needs.
:class:`AsyncAggsrvController` is such a controller: it runs any aggsrv strategy (FedAsync,
FedBuff, ORTHOFL, FedHist, FedDGIC, FedEN, ...; docs/algorithms) as ``aggsrv serve`` runs it:

* every site gets a job from the strategy (its model version, sent as a FULL FLModel whose
  ``current_round`` is the job's base version); its result is folded in the moment it arrives
  (in arrival order, one at a time on the controller's thread) and the site gets its next job
  at once, from the newest model;
* a site the strategy has no job for yet (FedHist: its update still waits in the round) is asked
  again after the next change (an update folded in, a timer);
* the strategy's timer (round, epoch or grouping deadline) runs once its deadline has passed;
* a result that fails on the site, a reply whose parameters do not match the model, or one the
  strategy refuses (too stale, NaN) is logged with the site's name and counts for nothing; the
  site gets a fresh job. A task that gets no result within ``job_timeout`` seconds is given up
  (FLARE's task timeout) and the site gets a fresh job too;
* after ``max_updates`` results (or an abort) the outstanding tasks are cancelled and the final
  model is saved with the job's persistor.

Replies may be FULL weights or DIFF updates (FLARE's ``params_transfer_type``); the client
scripts are FLARE's usual ones (``flare.receive()`` ... ``flare.send()``), so a FedAvg job's
client runs unchanged. ``NUM_STEPS_CURRENT_ROUND`` in the reply's meta is its sample weight.
"""

from __future__ import annotations

import math
import numbers
import queue
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from nvflare.apis.client import Client
from nvflare.apis.controller_spec import ClientTask
from nvflare.apis.fl_constant import FLMetaKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.workflows.model_controller import ModelController

from aggsrv.finite import count_non_finite
from aggsrv.integrations.nvflare.params import ParamsLayout, ParamsMismatchError
from aggsrv.layout import ModelLayout
from aggsrv.strategies import (
    Job,
    Strategy,
    StrategyError,
    Update,
    UpdateKind,
    make_strategy,
    strategy_settings,
)
from aggsrv.strategies.privacy import PrivacyBudgetSpent

__all__ = ["AsyncAggsrvController", "FoldedUpdate"]

JOB_ID = "aggsrv_job_id"
DISPATCH = "aggsrv_dispatch"  # which sending of a job a task is (a job can be sent again)
BASE_VERSION = "aggsrv_base_version"
RECIPE = "aggsrv_recipe"
POLL_SECONDS = 0.2


@dataclass(frozen=True)
class FoldedUpdate:
    """One result, in arrival order: the site, the outcome's status name (APPLIED, BUFFERED,
    DUPLICATE, or REFUSED), the model version after it, and its staleness (versions)."""

    site: str
    status: str
    version: int
    staleness: int


@dataclass
class _Outstanding:
    job: Job
    sent: float
    dispatch: int
    answered: bool = field(default=False)


class AsyncAggsrvController(ModelController):
    """A FLARE controller that runs the aggsrv strategy ``strategy`` asynchronously.

    ``config``: the strategy's keys (as in ``aggsrv serve --config``, e.g.
    ``{"alpha": 0.6}`` for FedAsync, ``{"buffer_size": 4}`` for FedBuff); ``num_clients``: the
    sites to train (all connected ones when 0); ``max_updates``: results to fold in before the
    run ends; ``job_timeout``: seconds a site may take for one job (0: no limit); ``task_name``:
    the task the sites' executors handle; ``persistor_id``: the job's model persistor, which
    gives the initial model and keeps the final one. Every argument is plain JSON, so FLARE job
    configurations can name the class.
    """

    def __init__(
        self,
        *,
        strategy: str = "fedasync",
        config: Mapping[str, Any] | None = None,
        num_clients: int = 0,
        max_updates: int = 100,
        job_timeout: int = 0,
        task_name: str = "train",
        persistor_id: str = "persistor",
    ) -> None:
        # A failed site task is this controller's to handle (a fresh job): FLARE's default
        # would end the run, since every task here has one target and needs its one result.
        super().__init__(persistor_id=persistor_id, ignore_result_error=True)
        # FLARE's job API writes a component's config from the attributes named as its
        # constructor's arguments: keep each one as given.
        self.strategy = strategy
        self.config = dict(config or {})
        self.settings = strategy_settings(strategy, self.config)  # a bad key fails now
        for name, value, least in (("num_clients", num_clients, 0),
                                   ("max_updates", max_updates, 1),
                                   ("job_timeout", job_timeout, 0)):  # fmt: skip
            if isinstance(value, bool) or not (isinstance(value, int) and value >= least):
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.num_clients = num_clients
        self.max_updates = max_updates
        self.job_timeout = job_timeout
        self.task_name = task_name
        self.folded: list[FoldedUpdate] = []
        self.aggregation: Strategy | None = None
        self.layout: ParamsLayout | None = None
        self._kept: dict[str, Any] = {}
        self._results: queue.Queue[tuple[str, int, Job, FLModel | None]] = queue.Queue()
        self._stopping = False  # the strategy can hand out no more jobs (privacy budget spent)
        self._outstanding: dict[str, _Outstanding] = {}
        self._waiting: set[str] = set()
        self._dispatches = 0  # one update id per job sent: each is a fresh training run

    # ------------------------------------------------------------------------- the run

    def run(self) -> None:
        model = self.load_model()
        if model is None or not model.params:
            self.panic("the job's persistor gave no initial model to start from")
            return
        self.layout = ParamsLayout.of(model.params)
        self._kept = {name: model.params[name] for name in self.layout.kept}
        self.aggregation = self._make_strategy(model.params)
        sites = self.sample_clients(self.num_clients or None)
        now = time.time()
        for site in sites:
            try:
                self.aggregation.on_register(site, now)
            except StrategyError as e:
                self.warning(f"site {site} not registered: {e}")
        for site in sites:
            if site in self.aggregation.clients:
                self._dispatch(site)
        self.info(f"asynchronous {self.strategy} on {len(sites)} sites: {self.max_updates} updates")
        try:
            while (
                len(self.folded) < self.max_updates
                and not self.abort_signal.triggered
                and not (self._stopping and not self._outstanding)
            ):
                self._step()
            self._drain()
        finally:
            self.cancel_all_tasks(fl_ctx=self.fl_ctx)
        self.save_model(self.global_model())
        counts: dict[str, int] = {}
        for f in self.folded:
            counts[f.status] = counts.get(f.status, 0) + 1
        stalest = max((f.staleness for f in self.folded), default=0)
        self.info(
            f"asynchronous {self.strategy} done: version {self.aggregation.version}, {counts}, "
            f"staleness at most {stalest}"
        )

    def _drain(self) -> None:
        """Let the sites finish the jobs they hold (their results are not folded in), so their
        scripts end with the job instead of being aborted mid-training; at most
        ``job_timeout`` seconds when one is set."""
        give_up = time.time() + self.job_timeout if self.job_timeout else math.inf
        while self.get_num_standing_tasks() and not self.abort_signal.triggered:
            if time.time() > give_up:
                self.warning("sites still training at the end: their tasks are cancelled")
                return
            time.sleep(POLL_SECONDS)

    def _make_strategy(self, params: Mapping[str, Any]) -> Strategy:
        assert self.layout is not None
        layout = ModelLayout.from_named_shapes([(e.name, e.shape) for e in self.layout.entries])
        initial = self.layout.to_flat(params)
        if count_non_finite(initial):
            raise ValueError("the initial model holds NaN or Inf")
        return make_strategy(
            self.strategy, layout=layout, initial=initial, config=self.settings,
            device="cpu", max_clients=max(len(self.engine.get_clients()), 1),
        )  # fmt: skip

    def global_model(self) -> FLModel:
        """The strategy's current model as a FULL FLModel of the initial model's names."""
        assert self.aggregation is not None and self.layout is not None
        params = self.layout.to_params(self.aggregation.global_model(), self._kept)
        return FLModel(
            params_type=ParamsType.FULL,
            params=params,
            current_round=self.aggregation.version,
            meta={"aggsrv_strategy": self.strategy, "aggsrv_version": self.aggregation.version},
        )

    def _step(self) -> None:
        """Fold the next result in (or wait a little for one), then run what came due."""
        assert self.aggregation is not None
        try:
            site, dispatch, job, result = self._results.get(timeout=POLL_SECONDS)
        except queue.Empty:
            changed = False
        else:
            out = self._outstanding.get(site)
            if out is None or out.dispatch != dispatch:
                return  # a task given up on (timed out) answered after all: not folded
            del self._outstanding[site]
            self._fold(site, dispatch, job, result)
            self._dispatch(site)
            changed = True
        now = time.time()
        deadline = self.aggregation.next_deadline()
        if deadline is not None and now >= deadline:
            try:
                self.aggregation.on_timer(now)
            except StrategyError as e:
                self.error(f"the strategy's timer failed: {e}")
            changed = True
        if self.job_timeout:
            for site, out in list(self._outstanding.items()):
                if not out.answered and now - out.sent > self.job_timeout + 5 * POLL_SECONDS:
                    self.warning(f"site {site} gave no result within {self.job_timeout} s")
                    del self._outstanding[site]
                    self._dispatch(site)
        if changed:
            for site in sorted(self._waiting):
                self._dispatch(site)

    def _dispatch(self, site: str) -> None:
        """Send ``site`` its next job, or remember to ask again after the next change."""
        assert self.aggregation is not None and self.layout is not None
        if site in self._outstanding or len(self.folded) >= self.max_updates or self._stopping:
            return
        try:
            job = self.aggregation.job_for(site, time.time())
        except PrivacyBudgetSpent as e:
            self.info(f"no more jobs: {e}")
            self._stopping = True
            return
        except StrategyError as e:
            self.warning(f"no job for site {site} now ({e}): asked again after the next change")
            job = None
        if job is None:
            self._waiting.add(site)
            return
        self._waiting.discard(site)
        self._dispatches += 1
        out = _Outstanding(job, time.time(), self._dispatches)
        self._outstanding[site] = out
        data = FLModel(
            params_type=ParamsType.FULL,
            # A copy: FLARE serializes the task when the site asks for it, by which time the
            # version's buffer may have gone back to the strategy's pool.
            params=self.layout.to_params(job.weights.clone(), self._kept),
            current_round=job.base_version,
            meta={
                JOB_ID: job.job_id,
                BASE_VERSION: job.base_version,
                DISPATCH: out.dispatch,
                RECIPE: _plain(job.recipe.to_dict()),
            },  # fmt: skip
        )

        def arrived(result: FLModel, site: str = site, out: _Outstanding = out) -> bool:
            out.answered = True
            self._results.put((site, out.dispatch, out.job, result))
            return True

        self.send_model(
            task_name=self.task_name, data=data, targets=[site], timeout=self.job_timeout,
            callback=arrived,
        )  # fmt: skip

    def _process_result(self, client_task: ClientTask, fl_ctx: FLContext) -> None:
        """FLARE's result handling, then: a result FLARE rejected (the site's task failed) never
        reaches the callback, so the site is queued with no result to get a fresh job."""
        super()._process_result(client_task, fl_ctx)
        client: Client = client_task.client
        meta = client_task.task.props.get(AppConstants.META_DATA) or {}
        out = self._outstanding.get(client.name)
        # The callback may have run, and the site got its next task, before this line: only
        # the sending this task carried can be the one that failed.
        if out is not None and out.dispatch == meta.get(DISPATCH) and not out.answered:
            out.answered = True
            self._results.put((client.name, out.dispatch, out.job, None))

    def _fold(self, site: str, dispatch: int, job: Job, result: FLModel | None) -> None:
        assert self.aggregation is not None and self.layout is not None
        version = self.aggregation.version
        staleness = version - job.base_version
        try:
            if result is None:
                raise ValueError("the site's task failed")
            update = self._update(site, job, result, f"{site}-{job.job_id}-{dispatch}")
            outcome = self.aggregation.on_update(update, time.time())
        except (ValueError, ParamsMismatchError, StrategyError) as e:
            self.warning(f"result of {site} refused: {e}")
            self.folded.append(FoldedUpdate(site, "REFUSED", version, staleness))
            return
        self.folded.append(FoldedUpdate(site, outcome.status.name, outcome.version, staleness))

    def _update(self, site: str, job: Job, result: FLModel, update_id: str) -> Update:
        assert self.layout is not None
        kind = {ParamsType.FULL: UpdateKind.WEIGHTS, ParamsType.DIFF: UpdateKind.DELTA}.get(
            result.params_type or ParamsType.FULL
        )
        if kind is None:
            raise ValueError(f"params_type {result.params_type} is neither FULL nor DIFF")
        flat = self.layout.to_flat(result.params or {})
        steps = (result.meta or {}).get(FLMetaKey.NUM_STEPS_CURRENT_ROUND)
        samples = 1
        whole = (
            isinstance(steps, numbers.Real)
            and not isinstance(steps, bool | np.bool_)
            and math.isfinite(steps)
            and steps >= 0
            and float(steps).is_integer()
        )
        if whole:
            samples = int(steps)
        return Update(
            client_id=site,
            job_id=job.job_id,
            base_version=job.base_version,
            update_id=update_id,
            num_samples=max(samples, 0),
            work_done=job.recipe.work_target,
            kind=kind,
            tensor=flat,
        )


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's values FLARE can carry in meta: numbers, strings, flags, their dicts."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out[key] = _plain(value)
        elif isinstance(value, bool | int | str) or (
            isinstance(value, float) and math.isfinite(value)
        ):
            out[key] = value
    return out
