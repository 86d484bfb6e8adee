"""FedHist (Jiang et al., arXiv:2312.10425): K-async aggregation with history-enhanced gradients.

Spec: docs/algorithms/fedhist.md (section 1.4 is the round this module runs, section 5 the gaps).
The server aggregates after every K accepted updates (``buffer_size``; K is the buffer, not the
number of clients). Each update is turned into a gradient ``g = -DELTA / (lr * steps)`` with the
learning rate of its job's recipe and the steps it reports (docs/design.md; with an epoch recipe,
``steps = work_done * ceil(num_samples / batch_size)``), stored in the round's [K, D] buffer with
its float64 norm. Round ``r = version + 1`` then runs, in the paper's order:

1. ``tau_i = r - v_i = s_i + 1`` (docs/design.md: FedHist's staleness is ``s + 1``, fresh = 1);
2. EGS: each g_i is fused with the cached global gradient of least cosine similarity,
   ``g~_i = g_i + alpha * G_j*`` (ties: the most recent row; a zero g_i is not fused);
3. HAA: ``p_i ∝ max((e/2)^-tau_i + lam * Ubar[c_i], 0)`` in float64, with the staleness-only
   fallback when every weight clamps (spec 5 A2; both are counted and logged);
4. INA: ``g_glob = a * mean_i ||g~_i|| / ||a||`` with ``a = sum_i p_i g~_i``;
5. ``w <- w - server_lr * g_glob`` and ``g_glob`` enters the history G (the last h rounds);
6. hindsight (rounds r > h): round ``q = r - h`` is evaluated against the mean of the set S of
   raw local gradients of rounds q..r (q..r-1 without ``include_current_round``) that started
   from version ``q - 1``; each of round q's clients gets ``Util = (s - sim_T) * p_his * |S|``
   (Eqs. 11-12) folded into its EMA ``Ubar`` (Eq. 13, only evaluated clients change).

:func:`aggsrv.strategies.fedhist_ops.aggregate_round` does steps 2-4 without materialising the
fused rows (spec section 4). The raw local gradients of the last h + 1 rounds (the L cache) are
kept only when ``lam != 0``, the global history only when ``alpha != 0``: TWAFL (``twafl``,
below) is FedHist with alpha = 0, lam = 0 and no rescaling and keeps neither.

Decisions beyond the spec's defaults:

* ``buffer_size`` K = 5 and ``learning_rate`` (the server step, ``server_lr`` None) = 0.1, not
  the spec's K = 10 and eta = 0.01 (``preset = "paper"``): a job is one mini-batch step, and
  with K >= N every round waits for the slowest client, so a short run makes a dozen steps of
  0.01 and stays near chance. K = 5 (CA2FL's buffer) keeps a small federation asynchronous and
  eta = 0.1 is the top of the spec's sweep {0.01, 0.02, 0.05, 0.1} (docs/strategies.md,
  "Defaults that learn").
* ``history`` None means the spec's ``ceil(N / (2K))`` with N the clients registered at the
  first aggregation (at least 1); it is logged and fixed from then on.
* ``server_lr`` None means the clients' ``learning_rate``: with K = 1, a fresh update and no
  fusion, the server step then reproduces the client's own step.
* A client whose update waits in the buffer gets no new job until the buffer is aggregated (the
  paper: "only the K participants receive the new global model"), so a round never holds two
  updates of one client (spec 5 A23). With fewer than K registered clients a round aggregates
  once every registered client is in it (with a warning), rather than waiting forever.
* Float buffers (BatchNorm statistics) are averaged with the round's HAA weights.

``aggregator`` (docs/robust.md; default ``mean``, the weighted sum above, unchanged): any other
rule combines the round's fused rows ``g~_i`` (built in a [K, D] buffer when EGS fused some:
the rule compares them) with the HAA weights ``p_i`` where the rule is weighted, and
``a = sum_i p_i g~_i`` becomes ``(sum_i p_i) * rule(g~, p)``; INA rescales to the *median* of
the norms rather than their mean (a mean would let one huge row set the step's length: the
rule would pick the direction, the attacker the size); the step, the history and hindsight
are as before. Centered clipping's centre is the previous round's rule aggregate
(before INA). The rows are the round buffer FedHist keeps anyway, so a round saved with one
aggregator resumes with any other.

Outcomes: BUFFERED(current version) for the first K - 1 updates of a round, APPLIED(new version)
for the K-th.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from aggsrv import kernels
from aggsrv.aggregators import AGGREGATOR_HELP, AggregateInfo
from aggsrv.config_check import Count
from aggsrv.strategies.base import Strategy
from aggsrv.strategies.config import StrategyConfig
from aggsrv.strategies.errors import InvalidUpdate, NonFiniteResult
from aggsrv.strategies.fedhist_ops import (
    RoundInputs,
    aggregate_round,
    hindsight_utility,
    robust_round,
    utility_ema,
)
from aggsrv.strategies.finite_results import FLOAT32_SAFE_MAX
from aggsrv.strategies.job import Job
from aggsrv.strategies.robust import check_aggregator
from aggsrv.values import Outcome, PendingReason, Status, Update, UpdateKind

__all__ = ["TWAFL", "FedHist", "FedHistConfig", "TWAFLConfig"]

logger = logging.getLogger(__name__)


@dataclass
class FedHistConfig(StrategyConfig):
    """FedHist settings; defaults are docs/algorithms/fedhist.md section 2's except K and eta
    (see the module doc; ``preset = "paper"`` gives those).

    With neither ``local_epochs`` nor ``local_steps`` set a job is one mini-batch step (spec 5
    A13: the paper's client uploads one stochastic gradient).
    """

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "paper": {
            "buffer_size": 10,
            "learning_rate": 0.01,
            "alpha": 0.1,
            "lam": 0.1,
            "gamma": 0.2,
            "sim_threshold": 0.3,
            "rescale": True,
        },
    }
    PRESET_NOTES: ClassVar[Mapping[str, str]] = {
        "paper": "the spec's K 10, eta 0.01, one step per job: needs thousands of rounds "
        "(default scenario: 0.25-0.39)",
    }

    HELP: ClassVar[Mapping[str, str]] = {
        "local_steps": "local mini-batch steps per job; unset = 1 step unless local_epochs is set",
        "buffer_size": "updates per round (K)",
        "history": "rounds of global gradients kept (h); unset = ceil(N / (2K))",
        "alpha": "EGS: weight of the least similar cached global gradient (0: off)",
        "lam": "HAA: weight of the hindsight utility (0: staleness only)",
        "gamma": "EMA factor of the hindsight utility, in (0, 1]",
        "sim_threshold": "hindsight similarity threshold in [-1, 1]",
        "server_lr": "server learning rate; unset = learning_rate",
        "rescale": "INA: rescale the aggregate to the mean norm of the updates",
        "ina_norms": "INA's mean norm over the fused or the raw gradients",
        "include_current_round": "the hindsight set includes the current round's gradients",
        "aggregator": AGGREGATOR_HELP,
    }

    learning_rate: float = 0.1
    buffer_size: Count = 5
    history: Count | None = None
    alpha: float = 0.1
    lam: float = 0.1
    gamma: float = 0.2
    sim_threshold: float = 0.3
    server_lr: float | None = None
    rescale: bool = True
    ina_norms: str = "fused"
    include_current_round: bool = True
    aggregator: str = "mean"

    def __post_init__(self) -> None:
        """Default to one local step, then check ranges."""
        if self.local_epochs is None and self.local_steps is None:
            self.local_steps = 1
        super().__post_init__()
        if self.alpha < 0 or self.lam < 0:
            raise ValueError(f"alpha and lam must be >= 0, got {self.alpha} and {self.lam}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")
        if not -1.0 <= self.sim_threshold <= 1.0:
            raise ValueError(f"sim_threshold must be in [-1, 1], got {self.sim_threshold}")
        if self.server_lr is not None and not self.server_lr > 0:
            raise ValueError(f"server_lr must be > 0 or None, got {self.server_lr}")
        if self.ina_norms not in ("fused", "raw"):
            raise ValueError(f"ina_norms must be 'fused' or 'raw', got {self.ina_norms!r}")
        check_aggregator(self.aggregator, self.buffer_size, "buffer_size")

    @property
    def effective_server_lr(self) -> float:
        """``server_lr``, or ``learning_rate`` when it is None."""
        return self.learning_rate if self.server_lr is None else self.server_lr


@dataclass
class _Round:
    """One aggregated round kept for the hindsight step (the L cache)."""

    round: int
    buffer: torch.Tensor  # [K, D]; its first len(clients) rows are the raw local gradients
    clients: list[str]
    versions: list[int]  # base version of each update
    taus: list[int]

    @property
    def grads(self) -> torch.Tensor:
        return self.buffer[: len(self.clients)]


# FedHist's config, or the config of a strategy that extends it (TWAFL).
HistConfig = TypeVar("HistConfig", bound=FedHistConfig)


class FedHist(Strategy[HistConfig], name="fedhist"):
    """FedHist: K-async rounds of EGS, HAA, INA, a global step and hindsight utilities."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Allocate the round buffer; the history and L caches come with the first round."""
        super().__init__(*args, **kwargs)
        k = self.config.buffer_size
        self._cur = torch.zeros(k, self.dim, dtype=torch.float32, device=self.device)
        self._cur_norms = torch.zeros(k, dtype=torch.float64)
        self._cur_meta: list[tuple[str, int]] = []  # (client, base version) per buffered row
        b = self.float_buffers.numel
        self._cur_buffers = torch.zeros(k, b, dtype=torch.float32, device=self.device)
        self.history: int | None = self.config.history  # h, fixed at the first aggregation
        # G ring: h + 1 slots so the new global gradient never overwrites a row in use.
        self._g = torch.zeros(0, self.dim, dtype=torch.float32, device=self.device)
        self._g_norms = torch.zeros(0, dtype=torch.float64)
        self._g_order: list[int] = []  # valid slots, oldest first
        self._g_used = 0  # slots ever written (rows 0.._g_used-1 hold data)
        self._rounds: deque[_Round] = deque()
        self._spare: list[torch.Tensor] = []  # [K, D] buffers of evicted rounds, for reuse
        self._pred = torch.zeros(0, dtype=torch.float32, device=self.device)
        self._scratch = torch.zeros(0, dtype=torch.float32, device=self.device)  # g_glob, unchecked
        self.ubar: dict[str, float] = {}
        self.clamped_weights = 0
        self.fallback_rounds = 0
        self.evaluations = 0
        self._warned_small = False
        self._fused: torch.Tensor | None = None  # [K, D] fused rows (robust rules, EGS on)
        self._robust_agg = torch.zeros(0, dtype=torch.float32, device=self.device)
        self._robust_info: Any = None

    # --------------------------------------------------------------------------- protocol

    @property
    def buffered(self) -> int:
        """Updates waiting in the current round."""
        return len(self._cur_meta)

    def job_for(self, client_id: str, now: float) -> Job | None:
        """A job from the current version, except while the client's update waits in the round."""
        self._require_registered(client_id)
        if any(c == client_id for c, _ in self._cur_meta):
            return self._no_job(PendingReason.UPDATE_BUFFERED)
        return self._issue_job(client_id, deadline=None, now=now)

    def steps_of(self, update: Update, job: Job) -> float:
        """The local SGD steps behind an update (the divisor of its gradient)."""
        recipe = job.recipe
        if recipe.local_steps is not None:
            return float(update.work_done)
        batches = math.ceil(update.num_samples / recipe.batch_size)
        return float(update.work_done) * batches

    def _check(self, update: Update, job: Job, staleness: int, now: float) -> None:
        if not self.steps_of(update, job) > 0:
            raise InvalidUpdate(
                f"FedHist derives a gradient as -DELTA / (lr * steps): the update reports "
                f"work_done={update.work_done} and num_samples={update.num_samples}, i.e. no "
                "local step"
            )

    def _apply(self, update: Update, job: Job, staleness: int, now: float) -> Outcome:
        # Rows at and past len(_cur_meta) hold nothing of the state: row i may be written
        # before the checks, and the state changes when the row is counted (_cur_meta).
        i = len(self._cur_meta)
        row = self._cur[i]
        scale = job.recipe.learning_rate * self.steps_of(update, job)
        if update.kind is UpdateKind.DELTA:
            torch.div(update.tensor, -scale, out=row)
        else:
            torch.sub(job.weights, update.tensor, out=row).div_(scale)
        self._require_finite(row, "the update's gradient -DELTA / (lr * steps)")
        self._cur_norms[i] = self.whole_norm(row)
        k = i + 1
        if k < self.config.buffer_size and k < len(self._clients):
            self._check_round_bound(k)
            self._cur_meta.append((update.client_id, job.base_version))
            if update.buffers is not None:
                self._cur_buffers[i].copy_(update.buffers)
            return Outcome(Status.BUFFERED, self.version)
        self._cur_meta.append((update.client_id, job.base_version))
        if update.buffers is not None:
            self._cur_buffers[i].copy_(update.buffers)
        try:
            step = self._round_step()
        except NonFiniteResult:
            self._cur_meta.pop()
            raise
        if k < self.config.buffer_size and not self._warned_small:
            # Every registered client waits in the round: waiting for K would never end.
            self._warned_small = True
            logger.warning(
                "%s: buffer_size K = %d but only %d clients are registered: a round aggregates "
                "once every registered client has an update in it",
                self.name, self.config.buffer_size, len(self._clients),
            )  # fmt: skip
        return Outcome(Status.APPLIED, self._aggregate(*step))

    def _check_round_bound(self, k: int) -> None:
        """Refuse a buffered update unless the round it joins can only aggregate to a finite
        model: the global gradient's norm is at most the largest fused row norm
        ``max ||g_i|| + alpha max ||G_j||`` (the HAA weights sum to 1; INA rescales to the
        mean of those norms), so ``max |x| + server_lr * that`` bounds every element of the
        next model. Only updates near the float32 limit can fail it."""
        bound = float(self._cur_norms[:k].max())
        if self._keeps_history() and self._g_order:
            bound += self.config.alpha * max(float(self._g_norms[j]) for j in self._g_order)
        if self._robust is not None:
            # A rule's aggregate lies in the hull of the fused rows (whose max |x| is at most
            # their norm) and of its centre; INA then rescales to the mean norm as before.
            bound = self._robust.bound(bound)
        reach = self.model_absmax() + self.config.effective_server_lr * bound
        if not reach < FLOAT32_SAFE_MAX:
            raise NonFiniteResult(
                f"the round this update joins could aggregate to values up to {reach:.3g}, past "
                "float32's range; it was refused and nothing changed. Send a smaller update."
            )

    # --------------------------------------------------------------------------- rounds

    def _resolve_history(self) -> int:
        if self.history is None:
            n = len(self._clients)
            self.history = max(1, math.ceil(n / (2 * self.config.buffer_size)))
            logger.info(
                "%s: history h = ceil(N / 2K) = %d (N = %d registered clients, K = %d)",
                self.name, self.history, n, self.config.buffer_size,
            )  # fmt: skip
        return self.history

    def _keeps_history(self) -> bool:
        return self.config.alpha != 0

    def _keeps_rounds(self) -> bool:
        return self.config.lam != 0

    def _round_step(self) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Steps 2-5 for the round in the buffer, computed and checked before anything
        changes: (EGS/HAA/INA result, global gradient in a scratch row, next model)."""
        cfg = self.config
        r = self.version + 1
        taus = [r - v for _, v in self._cur_meta]
        utilities = [self.ubar.get(c, 0.0) for c, _ in self._cur_meta]
        if self._scratch.numel() != self.dim:
            self._scratch = torch.empty(self.dim, dtype=torch.float32, device=self.device)
        inputs = self._round_inputs(taus, utilities)
        info = None
        if self._robust is None:
            result = aggregate_round(inputs, out=self._scratch)
        else:
            result, info = self._robust_round(inputs)
        self._require_finite(self._scratch, "the round's global gradient")
        new = self._new_model_buffer()
        torch.add(self._model, self._scratch, alpha=-cfg.effective_server_lr, out=new)
        self._check_version(new)
        self._robust_info = info
        return result, self._scratch, new

    def _round_inputs(self, taus: list[int], utilities: list[float]) -> RoundInputs:
        """The buffered round's rows (K, or fewer when fewer clients are registered), the
        history ring and the settings."""
        cfg = self.config
        n = len(taus)
        return RoundInputs(
            self._cur[:n], self._cur_norms[:n], self._g[: self._g_used] if self._g_order else None,
            self._g_norms, self._g_order, taus, utilities, alpha=cfg.alpha, lam=cfg.lam,
            rescale=cfg.rescale, raw_norms=cfg.ina_norms == "raw", reduce=self.reduce,
        )  # fmt: skip

    def _robust_round(self, inputs: RoundInputs) -> tuple[Any, AggregateInfo]:
        """The round's global gradient into the scratch row with the robust rule (module
        docstring): (EGS/HAA/INA result, what the rule's aggregation did)."""
        assert self._robust is not None
        if inputs.history is not None and self.config.alpha != 0 and self._fused is None:
            self._fused = torch.empty_like(self._cur)
        if self._robust_agg.numel() != self.dim:
            self._robust_agg = torch.empty(self.dim, dtype=torch.float32, device=self.device)
        infos = []

        def combine(rows: torch.Tensor, weights: list[float], into: torch.Tensor) -> None:
            assert self._robust is not None
            infos.append(self._robust.combine(rows, weights, reduce=self.reduce, out=into))

        result = robust_round(
            inputs,
            combine=combine,
            fused=self._fused,
            aggregate=self._robust_agg,
            out=self._scratch,
        )
        self._require_finite(self._robust_agg, f"the round's {self._robust.aggregator.rule} rows")
        return result, infos[0]

    def _aggregate(self, result: Any, gradient: torch.Tensor, new: torch.Tensor) -> int:
        """Commit a round computed by :meth:`_round_step`: history, buffers, hindsight, publish."""
        if self._robust is not None and self._robust_info is not None:
            self._robust.commit(
                self._robust_agg, self._robust_info,
                lambda t: self._checked_absmax(t, "the robust aggregate"),
            )  # fmt: skip
            self._robust_info = None
        h = self._resolve_history()
        r = self.version + 1
        clients = [c for c, _ in self._cur_meta]
        versions = [v for _, v in self._cur_meta]
        taus = [r - v for v in versions]
        if self._g.shape[0] == 0:
            self._g = torch.zeros(
                h + 1 if self._keeps_history() else 1, self.dim, device=self.device
            )
            self._g_norms = torch.zeros(self._g.shape[0], dtype=torch.float64)
        slot = next(j for j in range(self._g.shape[0]) if j not in self._g_order)
        g_glob = self._g[slot].copy_(gradient)
        self.clamped_weights += result.clamped
        self.fallback_rounds += int(result.fallback)
        if result.clamped:
            logger.info(
                "%s: round %d clamped %d negative weights%s (in all: %d weights, %d fallbacks)",
                self.name, r, result.clamped, ", staleness-only fallback" if result.fallback
                else "", self.clamped_weights, self.fallback_rounds,
            )  # fmt: skip
        if self._keeps_history():
            self._g_norms[slot] = self.whole_norm(g_glob)
            self._g_order.append(slot)
            self._g_used = max(self._g_used, slot + 1)
            if len(self._g_order) > h:
                self._g_order.pop(0)
        if self.float_buffers.enabled:
            for i, p in enumerate(result.weights.tolist()):
                self.float_buffers.add(self._cur_buffers[i], p)
        if self._keeps_rounds():
            self._rounds.append(_Round(r, self._cur, clients, versions, taus))
            self._cur = self._spare.pop() if self._spare else torch.zeros_like(self._cur)
            self._hindsight(r, h)
        self._cur_meta = []
        version = self._publish(new)
        logger.debug(
            "%s: round %d taus %s weights %s -> v%d",
            self.name, r, taus, [round(p, 4) for p in result.weights.tolist()], version,
        )  # fmt: skip
        return version

    def relatively_fresh(self, r: int, h: int) -> list[tuple[int, list[int]]]:
        """The set S of round r's hindsight step as (round, rows) pairs (spec 5 A3)."""
        q = r - h
        last = r if self.config.include_current_round else r - 1
        out = []
        for rec in self._rounds:
            if q <= rec.round <= last:
                rows = [i for i, v in enumerate(rec.versions) if v == q - 1]
                if rows:
                    out.append((rec.round, rows))
        return out

    def _hindsight(self, r: int, h: int) -> None:
        """Evaluate round q = r - h against the predicted unbiased gradient; evict it."""
        q = r - h
        if q < 1:
            return
        his = self._rounds[0]
        assert his.round == q, (his.round, q)
        members = self.relatively_fresh(r, h)
        size = sum(len(rows) for _, rows in members)
        if size:
            if self._pred.numel() != self.dim:
                self._pred = torch.zeros(self.dim, dtype=torch.float32, device=self.device)
            by_round = {rec.round: rec for rec in self._rounds}
            first = True
            for rnd, rows in members:
                grads = by_round[rnd].grads
                for i in rows:
                    kernels.weighted_sum(
                        grads[i : i + 1], [1.0 / size], out=self._pred, beta=0.0 if first else 1.0
                    )
                    first = False
            sims = kernels.cosine_matrix(
                his.grads, other=self._pred.unsqueeze(0), reduce=self.reduce
            )[:, 0]
            for client, tau, s in zip(his.clients, his.taus, sims.tolist(), strict=True):
                util = hindsight_utility(s, tau, self.config.sim_threshold, size)
                self.ubar[client] = utility_ema(self.ubar.get(client, 0.0), util, self.config.gamma)
            self.evaluations += 1
            logger.debug(
                "%s: hindsight of round %d: |S| = %d, similarities %s",
                self.name, q, size, [round(s, 3) for s in sims.tolist()],
            )  # fmt: skip
        self._spare.append(self._rounds.popleft().buffer)

    # --------------------------------------------------------------------------- state

    def _extra_state(self) -> dict[str, Any]:
        n = len(self._cur_meta)
        return {
            "history": self.history,
            "cur": self._cur[:n],
            "cur_norms": self._cur_norms[:n],
            "cur_meta": [list(m) for m in self._cur_meta],
            "cur_buffers": self._cur_buffers[:n],
            "g": self._g[: self._g_used],
            "g_rows": self._g.shape[0],
            "g_norms": self._g_norms,
            "g_order": list(self._g_order),
            "rounds": [
                {
                    "round": rec.round,
                    "grads": rec.grads,
                    "clients": list(rec.clients),
                    "versions": list(rec.versions),
                    "taus": list(rec.taus),
                }
                for rec in self._rounds
            ],
            "ubar": dict(self.ubar),
            "counters": [self.clamped_weights, self.fallback_rounds, self.evaluations],
            "robust": None if self._robust is None else self._robust.state(),
        }

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        k = self.config.buffer_size

        meta = [(str(c), int(v)) for c, v in state["cur_meta"]]
        if len(meta) >= k:
            raise ValueError(f"saved round holds {len(meta)} updates; buffer_size={k} would "
                             "have aggregated them")  # fmt: skip
        for key in ("cur", "g"):
            if state[key].numel() and state[key].shape[1] != self.dim:
                raise ValueError(
                    f"saved {key} rows have length {state[key].shape[1]}, D={self.dim}"
                )
        self.history = None if state["history"] is None else int(state["history"])
        n = len(meta)
        self._cur.zero_()
        self._cur[:n].copy_(state["cur"])
        self._cur_norms.zero_()
        self._cur_norms[:n] = state["cur_norms"].to(torch.float64)
        self._cur_meta = meta
        if self.float_buffers.enabled:
            self._cur_buffers[:n].copy_(state["cur_buffers"])
        rows = int(state["g_rows"])
        self._g = torch.zeros(rows, self.dim, dtype=torch.float32, device=self.device)
        used = state["g"].shape[0]
        self._g[:used].copy_(state["g"])
        self._g_used = used
        self._g_norms = state["g_norms"].to(torch.float64).clone()
        self._g_order = [int(j) for j in state["g_order"]]
        self._rounds = deque()
        for rec in state["rounds"]:
            clients = [str(c) for c in rec["clients"]]
            grads = rec["grads"]
            if tuple(grads.shape) != (len(clients), self.dim) or len(clients) > k:
                raise ValueError(f"saved round {rec['round']} has gradients {tuple(grads.shape)}")
            buffer = torch.zeros(k, self.dim, dtype=torch.float32, device=self.device)
            buffer[: len(clients)].copy_(grads)
            self._rounds.append(
                _Round(int(rec["round"]), buffer, clients, [int(v) for v in rec["versions"]],
                       [int(t) for t in rec["taus"]])
            )  # fmt: skip
        self._spare = []
        self.ubar = {str(c): float(u) for c, u in state["ubar"].items()}
        self.clamped_weights, self.fallback_rounds, self.evaluations = map(int, state["counters"])
        if self._robust is not None:
            self._robust.load(
                state.get("robust"), lambda t: self._restore(t, shared=False),
                lambda t: self._checked_absmax(t, "the saved centre"),
            )  # fmt: skip


@dataclass
class TWAFLConfig(FedHistConfig):
    """TWAFL: FedHist's K-async rounds with ``(e/2)^-tau`` weights only (spec 3.5); FedHist's
    defaults, and its paper preset's K and eta."""

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "paper": {"buffer_size": 10, "learning_rate": 0.01},
    }
    PRESET_NOTES: ClassVar[Mapping[str, str]] = {
        "paper": "FedHist's K 10, eta 0.01, one step per job: needs thousands of rounds "
        "(default scenario: 0.18-0.30)",
    }

    alpha: float = 0.0
    lam: float = 0.0
    rescale: bool = False

    def __post_init__(self) -> None:
        """Refuse the FedHist mechanisms TWAFL does not have."""
        super().__post_init__()
        if self.alpha != 0 or self.lam != 0 or self.rescale:
            raise ValueError(
                "twafl is FedHist with alpha = 0, lam = 0 and rescale = false; use strategy "
                "'fedhist' to turn on EGS, HAA's utility term or INA"
            )


class TWAFL(FedHist[TWAFLConfig], name="twafl"):
    """TWAFL (the FedHist paper's baseline [17]): ``w <- w - eta * sum_i p_i g_i`` every K
    arrivals with ``p_i ∝ (e/2)^-tau_i``; no history is kept."""
