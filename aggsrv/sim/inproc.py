"""The `inproc` transport: an event-driven virtual clock driving the strategy in this process.

The strategy object is the one the gRPC server builds (``make_strategy``) and is called exactly
as the server's aggregation loop calls it (``on_register``, ``job_for``, ``on_update`` with the
update validated by the strategy, ``next_deadline``/``on_timer``), with virtual time as ``now``.
Clients train their job the moment they get it (the result depends only on the job's weights
and on (seed, client, round)); the update then *arrives* ``plan.duration`` virtual seconds
later, as the profile says. Events at equal times are ordered by a sequence number, so a run is
a pure function of its config: two runs give identical metrics except the wall-clock fields.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aggsrv.client.clipping import clip_update
from aggsrv.client.compression import Compressor, Section
from aggsrv.server.trace import TraceWriter
from aggsrv.sim.config import Budget
from aggsrv.sim.progress import Progress
from aggsrv.sim.setup import RunSetup, client_id
from aggsrv.strategies import Job, Status, StrategyError, Update, UpdateKind, make_strategy
from aggsrv.trace_format import FOLDED_IN
from aggsrv.transport import Encoding, WireDtype, quantized_values
from aggsrv.values import QuantizedValues

__all__ = ["InprocRun", "is_round_based"]

log = logging.getLogger(__name__)

# Event kinds, in the order they are handled when they fall on the same virtual time.
ARRIVE, TIMER, READY, EVAL = 0, 1, 2, 3
# A run ends as stalled after this many arrivals in a row without an accepted update (and at
# least STALL_ROUNDS per client): no budget in rounds or versions can be reached then.
STALL_ARRIVALS = 200
STALL_ROUNDS = 20


def is_round_based(strategy_config) -> bool:
    """Round-based strategies make one version per round (FedAvg/FedProx in sync mode)."""
    return getattr(strategy_config, "mode", None) == "sync"


@dataclass
class _InFlight:
    job: Job
    result: Any  # TrainResult
    started: float
    round_: int


@dataclass
class Counters:
    applied: int = 0  # accepted updates (APPLIED or BUFFERED)
    rejected: int = 0
    filtered: int = 0  # left out by the strategy's update filter (FILTERED): not in `applied`
    lost: int = 0  # updates of clients that dropped out mid-job
    bytes_received: int = 0
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    rejected_by: dict[str, int] = field(default_factory=dict)
    # Updates of attackers (the config's `attack`) per client id: sent, and accepted by the
    # server (APPLIED or BUFFERED).
    crafted_sent: dict[str, int] = field(default_factory=dict)
    crafted_accepted: dict[str, int] = field(default_factory=dict)

    def count_crafted(self, cid: str, accepted: bool) -> None:
        self.crafted_sent[cid] = self.crafted_sent.get(cid, 0) + 1
        if accepted:
            self.crafted_accepted[cid] = self.crafted_accepted.get(cid, 0) + 1

    def metric_row(
        self, version: int, virtual_time: float, wall_time: float, accuracy: float, loss: float,
        rounds: float, epsilon: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """One metrics.jsonl line (both transports write the same fields; ``epsilon`` only
        under differential privacy)."""
        privacy = {} if epsilon is None else {"epsilon": epsilon}
        return {
            **privacy,
            "version": version,
            "virtual_time": virtual_time,
            "wall_time": wall_time,
            "test_accuracy": accuracy,
            "test_loss": loss,
            "updates_applied": self.applied,
            "updates_rejected": self.rejected,
            "updates_filtered": self.filtered,
            "bytes_received": self.bytes_received,
            "rounds": rounds,
        }


class InprocRun:
    """One simulation on the virtual clock; :meth:`run` returns the metric rows."""

    def __init__(
        self,
        setup: RunSetup,
        on_metric,
        progress: Progress | None = None,
        on_event=None,
        trace: Path | None = None,
    ) -> None:
        cfg = setup.config
        self.setup = setup
        self.cfg = cfg
        self.n = cfg.clients
        self.strategy = make_strategy(
            cfg.strategy,
            layout=setup.layout,
            initial=setup.initial,
            initial_buffers=setup.initial_buffers,
            config=cfg.strategy_settings,
            device="cpu",
            max_clients=max(cfg.clients, 1),
        )
        self.strategy.event_sink = on_event
        self.profile = setup.profile
        self.trainer = setup.trainer()
        self.evaluate = setup.evaluator()
        self.on_metric = on_metric
        self.progress = progress
        self.budget: Budget = cfg.budget_spec()
        self.every: Budget = cfg.eval_spec()
        self.round_based = is_round_based(self.strategy.config)
        self.counters = Counters()
        self._events: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._inflight: dict[int, _InFlight] = {}
        # Each client's compression and residual (docs/compression.md), when the run has one.
        spec = cfg.compression_spec()
        self._compressors = (
            [Compressor(spec, setup.layout.numel, seed=cfg.seed * 100_003 + c)
             for c in range(self.n)]
            if spec is not None else None
        )  # fmt: skip
        self._rounds = [0] * self.n  # jobs received per client
        self._sent = [0] * self.n  # updates sent per client (dropouts "after N updates")
        self._waiting: set[int] = set()
        self._ready_pending: set[int] = set()
        self._timer_at: float | None = None
        self._next_eval = 0.0  # in the eval unit
        self.now = 0.0
        self.wall0 = time.perf_counter()
        self.metrics: list[dict[str, Any]] = []
        self.stalled = False
        self.privacy_spent = False  # dp_target_epsilon ended the run
        self._refused_in_a_row = 0  # arrivals since the last accepted update
        # The run's arrivals in the format of `aggsrv serve --trace` (virtual seconds), so a
        # simulated run and a served one are read, compared and replayed alike.
        self.trace = None
        if trace is not None:
            self.trace = TraceWriter(
                str(trace), strategy=cfg.strategy, version=lambda: self.strategy.version,
                clock=lambda: self.now, max_bytes=1 << 40, backups=1,
            )  # fmt: skip
        self._asked: dict[int, float] = {}  # when a waiting client first asked for its job

    # ------------------------------------------------------------------ event queue

    def _push(self, t: float, kind: int, client: int = -1) -> None:
        heapq.heappush(self._events, (t, kind, self._seq, client))
        self._seq += 1

    def _ready(self, t: float, client: int) -> None:
        if client not in self._ready_pending:
            self._ready_pending.add(client)
            self._push(t, READY, client)

    def _after_state_change(self, t: float) -> None:
        """Wake clients waiting for a job and re-arm the strategy's timer."""
        for c in sorted(self._waiting):
            self._ready(t, c)
        self._waiting.clear()
        deadline = self.strategy.next_deadline()
        if deadline is not None and deadline != self._timer_at:
            self._timer_at = deadline
            self._push(max(deadline, t), TIMER)

    # ------------------------------------------------------------------ progress measures

    def rounds_done(self) -> float:
        if self.round_based:
            return float(self.strategy.version)
        return self.counters.applied / self.n

    def _position(self, unit: str) -> float:
        if unit == "seconds":
            return self.now
        if unit == "versions":
            return float(self.strategy.version)
        return self.rounds_done()

    def _budget_reached(self) -> bool:
        b = self.budget
        return b.unit != "seconds" and self._position(b.unit) >= b.amount

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self) -> None:
        t0 = time.perf_counter()
        acc, loss = self.evaluate(self.strategy.global_model(), self.strategy.global_buffers())
        self.counters.eval_seconds += time.perf_counter() - t0
        privacy = self.strategy.privacy
        row = self.counters.metric_row(
            self.strategy.version, round(self.now, 9), time.perf_counter() - self.wall0, acc, loss,
            self.rounds_done(), privacy.accountant.epsilon() if privacy is not None else None,
        )  # fmt: skip
        self.metrics.append(row)
        self.on_metric(row)
        if self.progress is not None:
            self.progress.update(self._position(self.budget.unit), row)

    def _maybe_evaluate_by_count(self) -> None:
        unit = self.every.unit
        if unit == "seconds":
            return
        while self._position(unit) >= self._next_eval:
            self._evaluate()
            self._next_eval += self.every.amount

    # ------------------------------------------------------------------ handlers

    def _on_ready(self, t: float, c: int) -> None:
        self._ready_pending.discard(c)
        if not self.profile.online(c, t, self._sent[c]):
            back = self.profile.next_change(c, t, self._sent[c])
            if back is not None:
                self._ready(back, c)
            return
        cid = client_id(c)
        try:
            job = self.strategy.job_for(cid, t)
        except StrategyError as exc:
            log.debug("job_for(%s) refused: %s", cid, exc)
            job = None
        if job is None:
            self._waiting.add(c)
            self._asked.setdefault(c, t)
            return
        if self.trace is not None:
            nbytes = sum(v.numel() for v in job.tensors.values()) * 4
            self.trace.job(cid, job.job_id, job.base_version, self._asked.pop(c, t), nbytes)
        self._after_state_change(t)  # issuing a job may open a round or set a deadline
        r = self._rounds[c]
        self._rounds[c] += 1
        plan = self.profile.plan(c, r)
        t0 = time.perf_counter()
        result = self.trainer.run(c, r, job.weights, job.recipe, plan.work_fraction,
                                  basis=job.tensors.get("basis"),
                                  buffers=job.tensors.get("buffers"))  # fmt: skip
        self.counters.train_seconds += time.perf_counter() - t0
        self._inflight[c] = _InFlight(job, result, t, r)
        self._push(t + plan.duration, ARRIVE, c)

    def _codes(self, section: Section) -> QuantizedValues | None:
        """A dense quantized section as the codes the server folds in, where a server would
        (``Federation.folds_quantized``): the strategy then repeats a server's arithmetic."""
        strategy = self.strategy
        if (
            section.quantization is None
            or section.encoding is not Encoding.DENSE
            or strategy.device.type != "cpu"
            or not strategy.folds_quantized_updates(UpdateKind.DELTA)
        ):
            return None
        return quantized_values(
            section.payload, section.quantization, section.numel, section.block, "update"
        )

    def _on_arrive(self, t: float, c: int) -> None:
        flight = self._inflight.pop(c)
        start_sent = self._sent[c]
        away = self.profile.next_change(c, flight.started, start_sent)
        if away is not None and away <= t or not self.profile.online(c, t, start_sent):
            # The client left while training: its update never arrives (FedDGIC's dropouts).
            self.counters.lost += 1
            self._ready(t, c)
            return
        job, result = flight.job, flight.result
        delta = result.delta
        payload_bytes = result.payload_bytes
        compressor = None
        codes = None
        if job.recipe.clip_norm is not None:  # the client clips, as the client library does
            delta = clip_update(delta, UpdateKind.DELTA, job.weights, job.recipe.clip_norm)
        elif self._compressors is not None:  # and compresses, as the client library does
            compressor = self._compressors[c]
            sections = compressor.compress(
                delta, [0, delta.numel()], ("int8", "int4"), 0, WireDtype.FLOAT32
            )
            assert sections is not None and compressor.sent is not None
            delta = compressor.sent
            buffer_bytes = 0 if result.buffers is None else 4 * result.buffers.numel()
            payload_bytes = sum(s.payload.nbytes for s in sections) + buffer_bytes
            codes = self._codes(sections[0])
        update = Update(
            client_id=client_id(c),
            job_id=job.job_id,
            base_version=job.base_version,
            update_id=f"{client_id(c)}-{flight.round_}",
            num_samples=self.trainer.num_samples(c),
            work_done=result.work_done(job.recipe),
            kind=UpdateKind.DELTA,
            tensor=delta,
            buffers=result.buffers,
            quantized=codes,
        )
        self._sent[c] += 1
        accepted = False
        at_apply = self.strategy.version - job.base_version
        try:
            outcome = self.strategy.on_update(update, t)
            if compressor is not None:
                compressor.commit()
            self._trace_update(update, t, outcome.version, outcome.status.name,
                               outcome.staleness if outcome.staleness is not None else at_apply,
                               payload_bytes)  # fmt: skip
            self.counters.bytes_received += payload_bytes
            if outcome.status is Status.FILTERED:
                self.counters.filtered += 1
            else:
                self.counters.applied += 1
                accepted = True
                self._refused_in_a_row = 0
        except StrategyError as exc:
            if compressor is not None:
                compressor.discard()
            self._trace_update(update, t, self.strategy.version, exc.code, None,
                               payload_bytes)  # fmt: skip
            self.counters.rejected += 1
            name = type(exc).__name__
            self.counters.rejected_by[name] = self.counters.rejected_by.get(name, 0) + 1
        if not accepted:
            self._refused_in_a_row += 1
        if self.setup.attack is not None and self.setup.attack.is_attacker(c):
            self.counters.count_crafted(client_id(c), accepted)
        self._after_state_change(t)
        self._ready(t, c)

    def _trace_update(
        self, update: Update, t: float, version: int, outcome: str, staleness: int | None,
        nbytes: int,
    ) -> None:  # fmt: skip
        if self.trace is None:
            return
        folded = outcome.lower() in FOLDED_IN
        self.trace.update(
            update.client_id, update.job_id, update.base_version, t, t, version,
            max(0, staleness) if folded and staleness is not None else None, nbytes, outcome,
        )  # fmt: skip

    def privacy_now(self) -> dict[str, Any] | None:
        privacy = self.strategy.privacy
        return privacy.snapshot() if privacy is not None else None

    def _on_timer(self, t: float) -> None:
        if self._timer_at is None or t < self._timer_at:
            return  # superseded by a later deadline
        self._timer_at = None
        self.strategy.on_timer(t)
        self._after_state_change(t)

    # ------------------------------------------------------------------ main loop

    def run(self) -> list[dict[str, Any]]:
        try:
            return self._run()
        finally:
            if self.trace is not None:
                self.trace.close()

    def _run(self) -> list[dict[str, Any]]:
        for c in range(self.n):
            self.strategy.on_register(client_id(c), 0.0)
        for c in range(self.n):
            self._ready(0.0, c)
        self._after_state_change(0.0)
        if self.every.unit == "seconds":
            self._push(0.0, EVAL)
        else:
            self._maybe_evaluate_by_count()
        horizon = self.budget.amount if self.budget.unit == "seconds" else float("inf")
        while self._events:
            t, kind, _, c = heapq.heappop(self._events)
            if t > horizon:
                break
            self.now = t
            if kind == ARRIVE:
                self._on_arrive(t, c)
            elif kind == READY:
                self._on_ready(t, c)
            elif kind == TIMER:
                self._on_timer(t)
            else:
                self._evaluate()
                nxt = t + self.every.amount
                if nxt <= horizon + 1e-9:
                    self._push(nxt, EVAL)
                continue
            self._maybe_evaluate_by_count()
            if self._budget_reached():
                break
            if self.strategy.privacy is not None and self.strategy.privacy.exhausted:
                self.privacy_spent = True
                log.info(
                    "the privacy budget is spent at virtual time %.3f (epsilon %.4g after %d "
                    "releases): the run ends",
                    self.now, self.strategy.privacy.accountant.epsilon(),
                    self.strategy.privacy.accountant.releases,
                )  # fmt: skip
                break
            if self._refused_in_a_row >= max(STALL_ARRIVALS, STALL_ROUNDS * self.n):
                # A budget in rounds or versions counts accepted updates: when none is
                # accepted any more (a diverged model whose updates overflow, a bound no
                # update meets) it is never reached.
                self.stalled = True
                log.warning(
                    "the run stalled at virtual time %.3f: every update of the last %d "
                    "arrivals was refused or filtered",
                    self.now, self._refused_in_a_row,
                )  # fmt: skip
                break
        else:
            self.stalled = self.budget.unit != "seconds" and not self._budget_reached()
            if self.stalled:
                log.warning(
                    "the run stalled at virtual time %.3f: no client can make progress "
                    "(all dropped out, or the strategy waits for clients that never come)",
                    self.now,
                )
        if self.budget.unit == "seconds":
            ended_early = self.stalled or self.privacy_spent
            self.now = max(self.now, horizon) if not ended_early else self.now
        if not self.metrics or self.metrics[-1]["virtual_time"] != round(self.now, 9):
            self._evaluate()
        return self.metrics
