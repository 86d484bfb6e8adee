"""Asynchronous aggregation inside a Flower ServerApp: no rounds, nobody waits for the slowest.

Flower's ``Strategy.start()`` runs synchronous rounds: every sampled node must answer (or time
out) before the next round starts. Asynchronous strategies (FedAsync, ORTHOFL, FedHist, FedDGIC,
...) fold each update in the moment it arrives and hand its sender the next job at once. Flower's
route for that is a ServerApp main loop of its own that pushes and pulls messages; :func:`run_async`
is that loop for an :class:`~aggsrv.integrations.flower.AggsrvStrategy`, driving the aggsrv
strategy as ``aggsrv serve`` does (``aggsrv.server.federation``):

* every connected node has one job outstanding; a reply is folded in (in the order the Grid
  returns replies) and its node gets its next job in the next pass, without sleeping;
* a node whose ``job_for`` answers None (FedHist: its update still waits in the round) is asked
  again after the next state change (an accepted update, a timer, a registration);
* ``on_timer(now)`` runs once ``next_deadline()`` has passed;
* nodes appearing in ``grid.get_node_ids()`` join; a job whose reply does not come within
  ``job_timeout`` is given up and the node gets a fresh one (which supersedes the old job in the
  aggsrv strategy once the model moved on; the message's Flower TTL is ``job_timeout`` too, so
  the SuperLink drops it as well).

Usage in a ServerApp::

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = AggsrvStrategy("fedasync", {"alpha": 0.6})
        result = run_async(grid, strategy, ArrayRecord(model.state_dict()), max_updates=500)

Messages are the same TRAIN messages as in rounds (a ClientApp cannot tell the difference); their
"server-round" config value is the job's base version + 1, the round number a synchronous
strategy would give a job starting from that model.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from aggsrv.integrations.flower.strategy import AggsrvStrategy
from aggsrv.strategies import Job, Status, Strategy

__all__ = ["AsyncResult", "UpdateRecord", "run_async"]

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 10.0  # an INFO progress line at most this often (on the loop's clock)
REFUSED = "REFUSED"


@dataclass(frozen=True)
class UpdateRecord:
    """One reply folded in (or refused), in arrival order.

    ``status`` is the outcome's status name (APPLIED, BUFFERED, DUPLICATE) or REFUSED; ``version``
    the outcome's version (for REFUSED: the version it was refused at); ``staleness`` the
    version at arrival minus the job's base version; ``time`` seconds since the loop started.
    """

    node: int
    job_id: int
    status: str
    version: int
    staleness: int
    time: float


@dataclass
class AsyncResult:
    """What :func:`run_async` reached: the final model, counts, per-update outcomes, evaluations.

    ``updates_applied`` counts accepted updates (APPLIED or BUFFERED), ``updates_filtered`` the
    ones the strategy's update filter left out (FILTERED); ``jobs_failed`` counts error
    replies and messages the Grid did not take, ``jobs_timed_out`` jobs given up after
    ``job_timeout``; ``outstanding`` the messages still unanswered when the loop stopped.
    """

    arrays: ArrayRecord
    version: int
    start_version: int
    updates_applied: int = 0
    updates_refused: int = 0
    updates_filtered: int = 0
    jobs_sent: int = 0
    jobs_failed: int = 0
    jobs_timed_out: int = 0
    outstanding: int = 0
    outcomes: list[UpdateRecord] = field(default_factory=list)
    evaluations: dict[int, MetricRecord] = field(default_factory=dict)
    elapsed: float = 0.0
    stop_reason: str = ""

    @property
    def new_versions(self) -> int:
        """Versions made during this run."""
        return self.version - self.start_version


@dataclass(frozen=True)
class _Sent:
    node: int
    job: Job
    sent_at: float


def run_async(
    grid: Grid,
    strategy: AggsrvStrategy,
    initial_arrays: ArrayRecord,
    *,
    max_updates: int | None = None,
    max_versions: int | None = None,
    duration: float | None = None,
    job_timeout: float | None = None,
    poll_interval: float = 0.05,
    train_config: ConfigRecord | None = None,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    evaluate_every: int = 0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> AsyncResult:
    """Run ``strategy``'s aggsrv strategy asynchronously over ``grid`` until a stop condition.

    Stops after ``max_updates`` accepted updates, ``max_versions`` new versions or ``duration``
    seconds on ``clock``, whichever comes first (at least one is required). ``initial_arrays``
    is version 0 unless the strategy already holds a model (then it continues from that).
    ``evaluate_fn(version, arrays)`` runs at the start, whenever the version passes a multiple of
    ``evaluate_every`` (0: never in between) and at the end. ``clock`` and ``sleep`` are
    injectable so tests can run on a virtual clock; the aggsrv strategy's ``now`` is ``clock()``.
    """
    if max_updates is None and max_versions is None and duration is None:
        raise ValueError("set at least one of max_updates, max_versions and duration")
    for name, value in (("max_updates", max_updates), ("max_versions", max_versions)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    for name, value in (("duration", duration), ("job_timeout", job_timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if not poll_interval > 0:
        raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
    if evaluate_every < 0:
        raise ValueError(f"evaluate_every must be >= 0, got {evaluate_every}")
    if strategy.strategy is None:
        strategy.adopt(initial_arrays)
    else:
        log.info("continuing the aggsrv strategy at version %d", strategy.strategy.version)
    loop = _AsyncLoop(
        grid, strategy, max_updates=max_updates, max_versions=max_versions, duration=duration,
        job_timeout=job_timeout, poll_interval=poll_interval, train_config=train_config,
        evaluate_fn=evaluate_fn, evaluate_every=evaluate_every, clock=clock, sleep=sleep,
    )  # fmt: skip
    return loop.run()


class _AsyncLoop:
    """The state of one :func:`run_async` call (kept apart so the function stays readable)."""

    def __init__(
        self,
        grid: Grid,
        adapter: AggsrvStrategy,
        *,
        max_updates: int | None,
        max_versions: int | None,
        duration: float | None,
        job_timeout: float | None,
        poll_interval: float,
        train_config: ConfigRecord | None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
        evaluate_every: int,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> None:
        assert adapter.strategy is not None
        self.grid = grid
        self.adapter = adapter
        self.strategy: Strategy = adapter.strategy
        self.max_updates = max_updates
        self.max_versions = max_versions
        self.duration = duration
        self.job_timeout = job_timeout
        self.poll_interval = poll_interval
        self.train_config = train_config
        self.evaluate_fn = evaluate_fn
        self.evaluate_every = evaluate_every
        self.clock = clock
        self.sleep = sleep
        self.sent: dict[str, _Sent] = {}  # message id -> its job, while its reply is awaited
        self.busy: dict[int, str] = {}  # node -> the message id it works on
        self.waiting: set[int] = set()  # job_for said None: ask again after a state change
        self.excluded: set[int] = set()  # the strategy refused to register these
        self.start = clock()
        self.last_progress = self.start
        self.evaluated_version = -1
        self.result = AsyncResult(
            arrays=adapter.global_arrays(),
            version=self.strategy.version,
            start_version=self.strategy.version,
        )

    # ------------------------------------------------------------------ the loop

    def run(self) -> AsyncResult:
        log.info(
            "async %s from version %d: max_updates=%s max_versions=%s duration=%s job_timeout=%s",
            self.adapter.name, self.strategy.version, self.max_updates, self.max_versions,
            self.duration, self.job_timeout,
        )  # fmt: skip
        self._evaluate()
        reason = None
        while reason is None:
            now = self.clock()
            reason = self._stop_reason(now) or self._fire_timer(now)
            if reason is not None:
                break
            self._expire(now)
            self._dispatch(now)
            replies = list(self.grid.pull_messages(list(self.sent))) if self.sent else []
            reason = self._fold(replies)
            if not replies and reason is None:
                self.sleep(self._pause(self.clock()))
        return self._finish(reason)

    def _stop_reason(self, now: float) -> str | None:
        r = self.result
        if self.max_updates is not None and r.updates_applied >= self.max_updates:
            return f"max_updates={self.max_updates}"
        if self.max_versions is not None and self.strategy.version - r.start_version >= (
            self.max_versions
        ):
            return f"max_versions={self.max_versions}"
        if self.duration is not None and now - self.start >= self.duration:
            return f"duration={self.duration}"
        return None

    def _fire_timer(self, now: float) -> str | None:
        deadline = self.strategy.next_deadline()
        if deadline is None or now < deadline:
            return None
        before = self.strategy.version
        self.strategy.on_timer(now)
        self.waiting.clear()  # a timer may open or close a round: ask the waiting nodes again
        log.debug("timer at %.3f (deadline %.3f): version %d -> %d", now, deadline, before,
                  self.strategy.version)  # fmt: skip
        self._version_moved(before)
        return self._stop_reason(now)

    def _expire(self, now: float) -> None:
        """Give up jobs older than ``job_timeout``; their nodes get fresh ones in this pass."""
        if self.job_timeout is None:
            return
        for message_id, sent in list(self.sent.items()):
            if now - sent.sent_at >= self.job_timeout:
                del self.sent[message_id]
                self.busy.pop(sent.node, None)
                self.result.jobs_timed_out += 1
                log.warning("node %d: no reply to job %d within %.3gs; issuing a fresh job",
                            sent.node, sent.job.job_id, self.job_timeout)  # fmt: skip

    def _dispatch(self, now: float) -> None:
        """Register new nodes, then push a job to every connected node without one."""
        nodes = sorted(set(self.grid.get_node_ids()))
        joined = False
        for node in nodes:
            client = str(node)
            if node in self.excluded or client in self.strategy.clients:
                continue
            if not self.adapter.register(node, now):  # e.g. max_clients: leave the node idle
                self.excluded.add(node)
                continue
            joined = True
            log.info("node %d joined (%d registered)", node, len(self.strategy.clients))
        if joined:
            self.waiting.clear()  # a registration can open a round (FedDGIC's grouping)
        messages: list[Message] = []
        jobs: list[tuple[int, Job]] = []
        for node in nodes:
            if node in self.busy or node in self.waiting or node in self.excluded:
                continue
            job = self.adapter.issue_job(node, now)
            if job is None:
                self.waiting.add(node)
                continue
            messages.append(
                self.adapter.job_message(
                    node,
                    job,
                    server_round=job.base_version + 1,
                    config=self.train_config,
                    ttl=self.job_timeout,
                )  # fmt: skip
            )
            jobs.append((node, job))
        if messages:
            self._push(messages, jobs, now)

    def _push(self, messages: list[Message], jobs: list[tuple[int, Job]], now: float) -> None:
        ids = list(self.grid.push_messages(messages))
        taken = {i for i in ids if i}
        for k, (msg, (node, job)) in enumerate(zip(messages, jobs, strict=True)):
            # Flower's grids write the id into the message; the returned list may skip failures.
            message_id = msg.metadata.message_id or (ids[k] if len(ids) == len(messages) else "")
            if not message_id or message_id not in taken:
                self.result.jobs_failed += 1
                log.warning("node %d: the grid did not take job %d; retrying", node, job.job_id)
                continue
            self.sent[message_id] = _Sent(node, job, now)
            self.busy[node] = message_id
            self.result.jobs_sent += 1
            log.debug("node %d: job %d from version %d", node, job.job_id, job.base_version)

    def _fold(self, replies: list[Message]) -> str | None:
        """Fold replies in as returned; stop at once when a stop condition is met."""
        for k, msg in enumerate(replies):
            sent = self.sent.pop(msg.metadata.reply_to_message_id, None)
            if sent is None:  # given up after job_timeout, or not ours
                log.debug("reply to unknown message %s ignored", msg.metadata.reply_to_message_id)
                continue
            if self.busy.get(sent.node) == msg.metadata.reply_to_message_id:
                del self.busy[sent.node]
            if msg.has_error():
                self.result.jobs_failed += 1
                log.warning("node %d: error reply to job %d: %s", sent.node, sent.job.job_id,
                            msg.error.reason)  # fmt: skip
                continue
            now = self.clock()
            before = self.strategy.version
            staleness = before - sent.job.base_version
            outcome = self.adapter.fold_reply(msg, sent.job, now=now)
            if outcome is None:
                self.result.updates_refused += 1
                status, version = REFUSED, before
            else:
                status, version = outcome.status.name, outcome.version
                if outcome.status in (Status.APPLIED, Status.BUFFERED):
                    self.result.updates_applied += 1
                    self.waiting.clear()
                elif outcome.status is Status.FILTERED:
                    self.result.updates_filtered += 1
            self.result.outcomes.append(
                UpdateRecord(
                    sent.node, sent.job.job_id, status, version, staleness, now - self.start
                )  # fmt: skip
            )
            log.debug("node %d: job %d %s v%d s=%d", sent.node, sent.job.job_id, status,
                      version, staleness)  # fmt: skip
            self._version_moved(before)
            reason = self._stop_reason(now)
            if reason is not None:
                if k + 1 < len(replies):
                    log.info("stopping: %d replies pulled but not folded in", len(replies) - k - 1)
                return reason
        return None

    def _pause(self, now: float) -> float:
        """Sleep until the next poll, timer, job timeout or the end, whichever is first."""
        due = [now + self.poll_interval]
        deadline = self.strategy.next_deadline()
        if deadline is not None:
            due.append(deadline)
        if self.job_timeout is not None and self.sent:
            due.append(min(s.sent_at for s in self.sent.values()) + self.job_timeout)
        if self.duration is not None:
            due.append(self.start + self.duration)
        return max(0.0, min(due) - now)

    # ------------------------------------------------------------------ progress and the end

    def _version_moved(self, before: int) -> None:
        version = self.strategy.version
        if version == before:
            return
        every = self.evaluate_every
        if every and version // every > max(self.evaluated_version, 0) // every:
            self._evaluate()
        now = self.clock()
        if now - self.last_progress >= PROGRESS_SECONDS:
            self.last_progress = now
            r = self.result
            log.info("version %d after %.1fs: %d updates applied, %d refused, %d nodes busy",
                     version, now - self.start, r.updates_applied, r.updates_refused,
                     len(self.busy))  # fmt: skip

    def _evaluate(self) -> None:
        version = self.strategy.version
        if self.evaluate_fn is None or version == self.evaluated_version:
            return
        self.evaluated_version = version
        metrics = self.evaluate_fn(version, self.adapter.global_arrays())
        if metrics is not None:
            self.result.evaluations[version] = metrics
            log.info("version %d: global evaluation %s", version, metrics)

    def _finish(self, reason: str) -> AsyncResult:
        self._evaluate()
        r = self.result
        r.arrays = self.adapter.global_arrays()
        r.version = self.strategy.version
        r.outstanding = len(self.sent)
        r.elapsed = self.clock() - self.start
        r.stop_reason = reason
        staleness = [o.staleness for o in r.outcomes if o.status != REFUSED]
        mean_s = sum(staleness) / len(staleness) if staleness else math.nan
        log.info(
            "async %s stopped (%s) at version %d after %.1fs: %d updates applied, %d refused, "
            "%d filtered, %d jobs sent, %d failed, %d timed out, %d unanswered; mean staleness "
            "%.2f",
            self.adapter.name, reason, r.version, r.elapsed, r.updates_applied,
            r.updates_refused, r.updates_filtered, r.jobs_sent, r.jobs_failed, r.jobs_timed_out,
            r.outstanding, mean_s,
        )  # fmt: skip
        return r
