"""FedAvg (McMahan et al. 2017) in sync rounds or K-async, with an optional FedAdam server step.

Every accepted update contributes its delta (client weights minus its job's start weights) with
weight ``num_samples`` to a running [D] sum; an aggregation turns it into the sample-weighted
mean delta ``d = sum_i n_i delta_i / sum_i n_i`` and takes a server step:

* ``server_opt = "sgd"``: ``x <- x + server_lr * d`` (``server_lr = 1``: plain FedAvg, the
  sample-weighted mean of the client weights when they all started from ``x``);
* ``server_opt = "adam"`` (FedAdam, Reddi et al. 2021, Algorithm 2, no bias correction):
  ``m <- beta1 m + (1 - beta1) d``, ``v <- beta2 v + (1 - beta2) d^2`` with ``m_0 = 0`` and
  ``v_0 = tau^2``, ``x <- x + server_lr * m / (sqrt(v) + tau)``.

An aggregation with no contribution (or zero samples in all) keeps the weights but still makes a
new version, so in sync mode ``version`` counts closed rounds.

``mode = "sync"``: a round opens as soon as ``max(min_available, min_clients)`` clients are
registered (and again right after the previous round closed). ``sampling = "fixed"`` samples
``participation`` of them (a float in (0, 1]: that fraction of the registered clients, rounded
down; an int: that many), at least ``min_clients`` and at most all. ``sampling = "poisson"``
includes each registered client independently with probability ``q = participation`` (a
fraction), so a round has Binomial(n, q) clients, possibly none. The draws come from the
strategy's seeded RNG (``sampling_source = "seed"``: reproducible, and as public as the seed)
or from a 252-bit key drawn from the operating system (``"os"``: BLAKE2b keyed by it, per draw
and client; the key is in the strategy's state, so a replayed log samples alike, like the log's
own record of who got a job). ``job_for`` gives sampled clients that have not reported a job
whose deadline is ``round start + round_timeout``; everyone else gets None until the next
round. The round closes when every sampled client reported, or at the deadline (``on_timer``)
if at least ``min_clients`` updates were accepted into it; otherwise the deadline moves
``round_timeout`` on. Then the next round opens at once. A Poisson round is never redrawn nor
extended for lack of updates (that would condition the sample on its size, and the inclusion
probability would no longer be q): at its deadline it closes with what it has, even nothing, so
``round_timeout`` is required and ``min_clients`` only gates the first round.

**Amplification by sampling** (docs/privacy.md): with the dp_ keys, ``sampling = "poisson"``,
``sampling_source = "os"``, ``dp_accountant`` ``pld`` or ``rdp`` and ``dp_neighbour =
"zero_out"``, each round charges every registered client (sampled or not) one
``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` instead of charging the sampled ones a Gaussian
mechanism. For that the published model must not tell who was sampled: such a round closes
only at its deadline (an early close would time the slowest sampled client), the mean divides
the noised sum by the expected size ``q n`` (n: the clients registered when it opened; the
fixed-denominator estimator of McMahan et al. 2018) instead of the count, a round with no
contribution still publishes its noise, and ``late = "drop"`` is required (a late update would
land in a round that did not sample its client). A public seed, fixed-size sampling or the
``gdp`` accountant claim no amplification: the sampled clients are charged as always.

``partial_work``: an update whose ``work_done`` is below its recipe's epochs (or steps) is
``drop``-ped (accepted, answered BUFFERED, but not aggregated; the client still counts as
reported) or ``include``-d like a full one. ``late``: when a round closes, the jobs of sampled
clients that did not report are ``drop``-ped (their updates are refused with JobSuperseded,
ABORTED) or kept, and their update counts in the round open when it arrives (``next_round``).

``mode = "k_async"``: every registered client always gets a job from the current version; every
``k`` accepted contributions are aggregated (partial work dropped does not count).

``aggregator`` (docs/robust.md; default ``mean``, the running sum above, unchanged): any other
rule keeps the contributions' deltas as rows of a [capacity, D] float32 buffer with their
weights (``num_samples``; FedEN's ``p_i``) and at the aggregation the rule's aggregate replaces
the mean delta ``d``, then the same server step (sgd or FedAdam). Centered clipping's centre is
the previous aggregate (zero before the first). Partial work dropped is not a row; float
buffers keep the weighted mean.

Outcomes: BUFFERED(current version) for an update waiting for its aggregation, APPLIED(new
version) for the one that triggered it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from aggsrv.aggregators import AGGREGATOR_HELP, RowBuffer
from aggsrv.config_check import Count
from aggsrv.strategies.base import Strategy
from aggsrv.strategies.config import StrategyConfig
from aggsrv.strategies.dp_accounting import AMPLIFYING_KINDS
from aggsrv.strategies.finite_results import require_reach
from aggsrv.strategies.job import Job, round_job
from aggsrv.strategies.privacy import PrivacyBudgetSpent, PrivacyConfig
from aggsrv.strategies.robust import (
    check_aggregator,
    check_pending_rows,
    load_kept_rows,
)
from aggsrv.values import Outcome, Status, Update

__all__ = ["FedAvg", "FedAvgConfig"]

logger = logging.getLogger(__name__)

SAMPLINGS = ("fixed", "poisson")
SAMPLING_SOURCES = ("seed", "os")
_KEY_WORDS = 4  # the "os" sampling key: 4 words of 63 random bits


@dataclass
class FedAvgConfig(StrategyConfig, PrivacyConfig):
    """FedAvg settings (see the module docstring for the meaning of each).

    ``learning_rate`` defaults to 0.05, not the shared 0.01: a sync round waits for its slowest
    client, so a run makes few steps (docs/strategies.md, "Defaults that learn").
    """

    HELP: ClassVar[Mapping[str, str]] = {
        "mode": "sync (rounds) or k_async (aggregate every k updates)",
        "participation": "clients sampled per round: a fraction in (0, 1] or a count",
        "sampling": "sync: fixed (participation's share, exactly) or poisson (each client with "
        "probability participation)",
        "sampling_source": "sync sampling's draws: seed (public, reproducible) or os (secret: "
        "DP amplification, pld/rdp)",
        "min_clients": "a round samples and closes with at least this many clients",
        "min_available": "registered clients needed before the first round opens",
        "round_timeout": "seconds before a round closes without its stragglers; unset = never",
        "partial_work": "an update with less work than its recipe: drop or include",
        "late": "updates of clients that missed their round: drop or next_round",
        "k": "k_async: accepted updates per aggregation",
        "server_opt": "server step: sgd or adam (FedAdam)",
        "server_lr": "server learning rate; unset = 1.0 for sgd, 0.01 for adam",
        "beta1": "FedAdam first-moment decay",
        "beta2": "FedAdam second-moment decay",
        "tau": "FedAdam adaptivity (added to sqrt(v); v starts at tau^2)",
        "aggregator": AGGREGATOR_HELP,
    }

    learning_rate: float = 0.05
    mode: str = "sync"
    participation: float | int = 1.0
    sampling: str = "fixed"
    sampling_source: str = "seed"
    min_clients: Count = 1
    min_available: Count = 1
    round_timeout: float | None = 60.0
    partial_work: str = "drop"
    late: str = "drop"
    k: Count = 10
    server_opt: str = "sgd"
    server_lr: float | None = None  # None: 1.0 for sgd (plain FedAvg), 0.01 for adam
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    aggregator: str = "mean"

    def __post_init__(self) -> None:
        """Check choices and ranges."""
        super().__post_init__()
        for key, choices in (
            ("mode", ("sync", "k_async")),
            ("partial_work", ("drop", "include")),
            ("late", ("drop", "next_round")),
            ("server_opt", ("sgd", "adam")),
            ("sampling", SAMPLINGS),
            ("sampling_source", SAMPLING_SOURCES),
        ):
            if getattr(self, key) not in choices:
                raise ValueError(f"{key} must be one of {choices}, got {getattr(self, key)!r}")
        p = self.participation
        if isinstance(p, bool) or not isinstance(p, int | float):
            raise ValueError(f"participation must be a fraction or a count, got {p!r}")
        if isinstance(p, int) and p < 1:
            raise ValueError(f"participation as a count must be >= 1, got {p}")
        if isinstance(p, float) and not 0.0 < p <= 1.0:
            raise ValueError(f"participation as a fraction must be in (0, 1], got {p}")
        if self.round_timeout is not None and not self.round_timeout > 0:
            raise ValueError(f"round_timeout must be > 0 or None, got {self.round_timeout}")
        self._check_sampling()
        if self.server_lr is not None and not self.server_lr > 0:
            raise ValueError(f"server_lr must be > 0, got {self.server_lr}")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0 and self.tau > 0):
            raise ValueError("FedAdam needs 0 <= beta1, beta2 < 1 and tau > 0")
        # k_async aggregates k rows (fewer only when some weigh 0); a sync round's count varies.
        k_async = self.mode == "k_async"
        check_aggregator(self.aggregator, self.k if k_async else None, "k")
        self.check_privacy(self.aggregator)

    def _check_sampling(self) -> None:
        """``sampling`` and ``sampling_source`` against the mode, participation and late."""
        if self.mode != "sync" and (self.sampling, self.sampling_source) != ("fixed", "seed"):
            raise ValueError(
                "sampling and sampling_source choose a sync round's clients; k_async samples "
                "no one (every client always has a job)"
            )
        if self.sampling != "poisson":
            return
        if not isinstance(self.participation, float):
            raise ValueError(
                "sampling = 'poisson' includes each client with probability participation: give "
                f"it as a fraction in (0, 1], got the count {self.participation!r}"
            )
        if self.round_timeout is None:
            raise ValueError(
                "sampling = 'poisson' closes a round at its deadline with whatever it drew (a "
                "round is never redrawn, and it may have sampled no one): set round_timeout"
            )
        if self.amplified and self.dp_adaptive_quantile is not None:
            raise ValueError(
                "amplification by sampling (sampling = 'poisson', sampling_source = 'os' with "
                "the dp_ keys) cannot be used with adaptive clipping (dp_adaptive_quantile): its "
                "noise split and its move of C depend on how many sampled clients reported, "
                "which the sampled Gaussian mechanism the accountant charges keeps secret"
            )
        if self.amplified and self.late != "drop":
            raise ValueError(
                "amplification by sampling (sampling = 'poisson', sampling_source = 'os' with "
                "the dp_ keys) needs late = 'drop': a late update would count in a round that "
                "did not sample its client"
            )

    @property
    def amplified(self) -> bool:
        """Whether differential privacy charges each round as a Poisson-sampled Gaussian
        mechanism for every client (module docstring, "Amplification by sampling")."""
        return (
            self.private
            and self.mode == "sync"
            and self.sampling == "poisson"
            and self.sampling_source == "os"
            and self.dp_accountant in AMPLIFYING_KINDS
            and self.dp_neighbour == "zero_out"
        )

    @property
    def effective_server_lr(self) -> float:
        """``server_lr`` with its optimizer-dependent default filled in."""
        if self.server_lr is not None:
            return self.server_lr
        return 1.0 if self.server_opt == "sgd" else 0.01


# FedAvg's config, or the config of a strategy that extends it (FedEN, FedProx).
AvgConfig = TypeVar("AvgConfig", bound=FedAvgConfig)


class FedAvg(Strategy[AvgConfig], name="fedavg"):
    """FedAvg / FedAdam: sample-weighted mean of client deltas, in sync rounds or every k."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Allocate the running delta sum (and the FedAdam moments on first use)."""
        super().__init__(*args, **kwargs)
        self._acc = self._running_sum(torch.float32)  # a robust rule keeps rows instead
        self._spare: torch.Tensor | None = None  # the next running sum, before it is checked
        # The delta of a WEIGHTS update (mean), or the robust aggregate.
        self._scratch = torch.empty(self.dim, dtype=torch.float32, device=self.device)
        self._acc_weight = 0.0  # sum of num_samples folded into _acc
        self._acc_count = 0  # contributions folded into _acc
        self._m: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        # Sync round: sampled clients in join order -> reported yet.
        self._round_open = False
        self._participants: dict[str, bool] = {}
        self._deadline: float | None = None
        # Sampling: draws made (a counter the "os" key hashes with), that key, and an
        # amplified round's expected size q n (its mean's denominator).
        self._draws = 0
        self._sampling_key: bytes | None = None
        if self.config.sampling_source == "os":
            # Drawn now, not at the first round: the first checkpoint (at adoption, before any
            # round) must hold it, or a recovery from it would draw other samples than the log's.
            self._secret_key()
        self._amplified = self.privacy is not None and self.config.amplified
        self._expected = 0.0
        # With a robust rule: the contributions' deltas as rows, each row's max |x| (derived
        # from the rows, not saved) and FedAdam's moments' bounds.
        self._rows = RowBuffer(self.dim, self.device) if self._robust is not None else None
        self._row_absmax: list[float] = []
        self._moment_absmax: tuple[int, float, float] | None = None  # (version, |m|, |v|)
        self._robust_info: Any = None  # what the pending step's aggregation did

    # --------------------------------------------------------------------------- protocol

    @property
    def participants(self) -> tuple[str, ...]:
        """The clients sampled for the open round (empty when none is open or in k_async)."""
        return tuple(self._participants)

    def on_register(self, client_id: str, now: float) -> None:
        """Register; in sync mode a round opens once enough clients are registered."""
        super().on_register(client_id, now)
        self._maybe_open_round(now)

    def job_for(self, client_id: str, now: float) -> Job | None:
        """k_async: always a job. sync: a job for a sampled client that has not reported yet."""
        self._require_registered(client_id)
        self._require_privacy_budget()  # every client hears it, sampled or not
        if self.config.mode == "k_async":
            return self._issue_job(client_id, deadline=None, now=now)
        return round_job(self, client_id, now)

    def _next_deadline(self) -> float | None:
        """The open round's deadline (sync mode; none once the privacy budget is spent)."""
        if self.privacy is not None and self.privacy.exhausted:
            return None
        return self._deadline if self._round_open else None

    def _on_timer(self, now: float) -> None:
        """At the deadline close the round if ``min_clients`` contributed, else extend it."""
        if self.config.mode != "sync":
            return
        if self._round_open and self._deadline is not None and now >= self._deadline:
            # A Poisson round closes with what it has: waiting for more would condition it.
            if self._acc_count >= self.config.min_clients or self.config.sampling == "poisson":
                if self.privacy is not None:
                    try:
                        self.privacy.require_budget()
                    except PrivacyBudgetSpent as exc:
                        logger.warning("%s: round %d not published: %s", self.name,
                                       self.version, exc)  # fmt: skip
                        return
                self._close_round(now)
            else:
                timeout = self.config.round_timeout
                assert timeout is not None  # a deadline exists only with a timeout
                self._deadline = now + timeout
                logger.info(
                    "%s: round %d has %d of min_clients=%d updates at its deadline; "
                    "extended to %.3f",
                    self.name,
                    self.version,
                    self._acc_count,
                    self.config.min_clients,
                    self._deadline,
                )
        self._maybe_open_round(now)

    # --------------------------------------------------------------------------- updates

    def _apply(self, update: Update, job: Job, staleness: int, now: float) -> Outcome:
        cfg = self.config
        partial = update.work_done < job.recipe.work_target
        # A job at the current version comes from the open round (a close bumps the version).
        in_round = cfg.mode == "sync" and job.base_version == self.version and self._round_open
        if cfg.mode == "k_async":
            closes = self._acc_count + 1 >= cfg.k
        else:
            closes = (
                in_round
                and not self._amplified  # at its deadline only: the time would tell who
                and all(r for c, r in self._participants.items() if c != update.client_id)
            )
        step = None
        contributes = not (partial and cfg.partial_work == "drop")
        if not contributes:
            closes = closes and cfg.mode == "sync"  # k_async counts contributions only
        if closes and self.privacy is not None:
            self.privacy.require_budget(update.client_id, 1.0 if contributes else 0.0)
        if not contributes:
            logger.debug("%s: dropped partial work of %s", self.name, update.client_id)
        elif self._rows is not None:
            # The robust path: the delta is a row (counted last), checked like the sum below.
            weight = self._weight_of(update)
            absmax = self._stage_row(update, job)
            if closes:
                step = self._robust_step(weight)
            else:
                self._check_robust_reach(absmax)
            self._commit_row(update, weight, absmax)
        else:
            # Everything is computed and checked before the first change of state.
            weight = self._weight_of(update)
            acc, clip = self._summed(update, job, weight)
            if closes:
                with self._noise_for_release(extra=1) as noise:
                    # The sum is emptied by the step: the noise may go into it in place.
                    noised = acc if noise is None else acc.add_(noise)
                    step = self._checked_step(
                        self._server_step(noised, self._denominator(self._acc_weight + weight))
                    )
            else:
                self._check_aggregate(acc, self._denominator(self._acc_weight + weight))
            self._commit_sum(update, acc, weight, clip)
        if closes and cfg.mode == "k_async":
            assert step is not None
            return Outcome(Status.APPLIED, self._commit_step(step))
        if closes:
            return Outcome(Status.APPLIED, self._close_round(now, step))
        if in_round:
            self._participants[update.client_id] = True
        return Outcome(Status.BUFFERED, self.version)

    def _weight_of(self, update: Update) -> float:
        """How much the update's delta counts in the mean: its ``num_samples``; 1 for every
        update under differential privacy (a weight is a sensitivity there)."""
        return 1.0 if self.privacy is not None else float(update.num_samples)

    def _summed(self, update: Update, job: Job, weight: float) -> tuple[torch.Tensor, float]:
        """The running sum with ``weight * clip * delta`` added, in a spare buffer (checked
        finite; the sum itself is untouched until :meth:`_commit_sum`), and ``clip``:
        differential privacy's clip factor of the delta (1 without DP; the mean divides by the
        unclipped weights)."""
        delta = self.client_delta(update, job, out=self._scratch)
        if delta is self._scratch:
            self._require_finite(delta, "the client's delta (its weights minus the job's)")
        clip = 1.0 if self.privacy is None else self.privacy.clip_factor_of(update, job, delta)
        if self._spare is None:
            self._spare = torch.empty_like(self._acc)
        if self._acc_count:
            torch.add(self._acc, delta, alpha=weight * clip, out=self._spare)
        else:  # the first contribution overwrites old content
            torch.mul(delta, weight * clip, out=self._spare)
        self._require_finite(self._spare, "the running sum of the deltas")
        return self._spare, clip

    def _commit_sum(
        self, update: Update, acc: torch.Tensor, weight: float, clip: float = 1.0
    ) -> None:
        """Make ``acc`` (from :meth:`_summed`) the running sum and count the contribution
        (``clip``: differential privacy's clip factor of it)."""
        self._acc, self._spare = acc, self._acc
        self._acc_weight += weight
        self._acc_count += 1
        if self.privacy is not None:
            self.privacy.contribute(update.client_id, weight, clip)
        if update.buffers is not None:
            self.float_buffers.add(update.buffers, weight)

    # --------------------------------------------------------------------------- robust rows

    def _stage_row(self, update: Update, job: Job) -> float:
        """Write the client's delta into the row buffer's slot (not counted yet); its max |x|
        (NonFiniteResult when it is not finite)."""
        assert self._rows is not None
        row = self.client_delta(update, job, out=self._rows.slot())
        return self._checked_absmax(row, "the client's delta (its weights minus the job's)")

    def _commit_row(self, update: Update, weight: float, absmax: float) -> None:
        """Count the staged row and the contribution."""
        assert self._rows is not None
        self._rows.commit(weight)
        self._row_absmax.append(absmax)
        self._acc_weight += weight
        self._acc_count += 1
        if update.buffers is not None:
            self.float_buffers.add(update.buffers, weight)

    def _moments_absmax(self) -> tuple[float, float]:
        """max |m| and max v of FedAdam's moments (their starting values before the first
        step), cached per version (they change only when a version is made)."""
        cached = self._moment_absmax
        if cached is not None and cached[0] == self.version:
            return cached[1], cached[2]
        m = 0.0 if self._m is None else self._checked_absmax(self._m, "FedAdam's first moment")
        v = self.config.tau**2
        if self._v is not None:
            v = self._checked_absmax(self._v, "FedAdam's second moment")
        self._moment_absmax = (self.version, m, v)
        return m, v

    def _aggregate_absmax(self, t: torch.Tensor) -> float:
        return self._checked_absmax(t, "the robust aggregate")

    def _check_robust_reach(self, absmax: float) -> None:
        """Refuse unless the aggregation, were it to run now, stays in float32's range, by the
        bound every rule meets (aggsrv/strategies/robust.py): ``|d| <= B``, the largest max |x|
        of the rows with this one (and of the centre). sgd: ``|x| + lr B``; FedAdam:
        ``|m'| <= max(|m|, B)``, ``v' <= max(v, B^2)`` and ``|step| <= |m'| / tau``."""
        assert self._robust is not None
        bound = self._robust.bound(max([absmax, *self._row_absmax]))
        cfg = self.config
        lr = cfg.effective_server_lr
        what = "the model the round would publish"
        if cfg.server_opt == "sgd":
            require_reach(self.model_absmax() + lr * bound, what)
            return
        m, v = self._moments_absmax()
        require_reach(max(v, bound * bound), "FedAdam's second moment")
        require_reach(self.model_absmax() + lr * max(m, bound) / cfg.tau, what)

    def _robust_step(
        self, staged: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The checked server step (:meth:`_checked_step`) with the rule's aggregate of the
        rows (and the staged row of weight ``staged`` when given) as the mean delta; the
        aggregate is kept in the scratch row for :meth:`_commit_step`. Changes nothing."""
        assert self._rows is not None and self._robust is not None
        if staged is None:
            rows, weights = self._rows.rows, list(self._rows.weights)
        else:
            rows, weights = self._rows.with_slot(staged)
        self._robust_info = None
        if not sum(weights) > 0:  # nothing to combine: same weights, next version
            return self._checked_step(self._server_step(self._acc, 0.0))
        info = self._robust.combine(rows, weights, reduce=self.reduce, out=self._scratch)
        self._require_finite(self._scratch, f"the round's {self._robust.aggregator.rule} aggregate")
        step = self._checked_step(self._server_step(self._scratch, 1.0))
        self._robust_info = info
        return step

    # --------------------------------------------------------------------------- server step

    def _server_step(
        self, acc: torch.Tensor, weight: float, part: slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The next model (and FedAdam's next moments) from the running sum ``acc`` of total
        ``weight``: the elements ``part`` of them when given (a candidate checked chunk by
        chunk), else the whole [D] vectors, the model in a fresh version buffer. Changes
        nothing else."""
        cfg = self.config
        lr = cfg.effective_server_lr
        s = slice(None) if part is None else part
        model = self._model[s]
        if weight == 0:  # nothing to average: same weights, next version
            return (self._model if part is None else model), None, None
        out = self._new_model_buffer() if part is None else None
        if cfg.server_opt == "sgd":
            return torch.add(model, acc[s], alpha=lr / weight, out=out), None, None
        d = acc[s] * (1.0 / weight)
        m = self._m[s] if self._m is not None else torch.zeros_like(model)
        v = self._v[s] if self._v is not None else torch.full_like(model, cfg.tau**2)
        m = torch.add(m * cfg.beta1, d, alpha=1.0 - cfg.beta1)
        v = torch.addcmul(v * cfg.beta2, d, d, value=1.0 - cfg.beta2)
        step = torch.div(m, torch.sqrt(v).add_(cfg.tau))
        return torch.add(model, step, alpha=lr, out=out), m, v

    def _check_aggregate(self, acc: torch.Tensor, weight: float) -> None:
        """Refuse unless the aggregation, were it to run now on ``acc``, is finite, so the
        aggregation that a later update or the round's deadline triggers is a checked one."""
        if self.config.server_opt == "sgd":
            self._require_finite_chunks(
                lambda s: self._server_step(acc, weight, s)[0], "the model the round would publish"
            )
            return

        def worst(s: slice) -> torch.Tensor:
            new, m, v = self._server_step(acc, weight, s)
            return new if m is None or v is None else new + m + v  # non-finite if any is

        self._require_finite_chunks(worst, "the model or moments the round would publish")

    def _checked_step(
        self, step: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A server step from :meth:`_server_step` with its model in a version buffer, every
        part checked finite (NonFiniteResult otherwise); nothing changes."""
        new, m, v = step
        for t, what in ((m, "FedAdam's first moment"), (v, "FedAdam's second moment")):
            if t is not None:
                self._require_finite(t, what)
        if new is not self._model:
            self._check_version(new)
        return new, m, v

    def _commit_step(
        self, step: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
    ) -> int:
        """Publish a checked server step (:meth:`_checked_step`) and empty the running sum."""
        new, m, v = step
        if m is not None:
            self._m, self._v = m, v
        if self._rows is not None:
            assert self._robust is not None
            if self._robust_info is not None:
                self._robust.commit(self._scratch, self._robust_info, self._aggregate_absmax)
            self._robust_info = None
            self._rows.clear()
            self._row_absmax = []
        self._acc_count = 0
        self._acc_weight = 0.0
        version = self._publish(new)
        self._released()
        logger.debug("%s: aggregated -> v%d", self.name, version)
        return version

    def _aggregate(self) -> int:
        """Server step with the mean delta of the running sum; publishes and returns a version."""
        if self._rows is not None:
            return self._commit_step(self._robust_step())
        weight = self._acc_weight if self._acc_count else 0.0
        # An empty round releases nothing: no noise drawn; but an amplified round publishes its
        # noise whatever it drew (an unchanged model would tell that nobody was sampled).
        amplified = self._amplified and self._round_open
        releases = bool(weight) or amplified
        with self._noise_for_release() if releases else contextlib.nullcontext() as noise:
            acc = self._acc
            if amplified and not self._acc_count:
                acc = self._spare_sum().zero_()  # the sum holds an older round's values
            if noise is not None:
                # Beside the sum, not in it: a refused step must find the sum as it was.
                acc = torch.add(acc, noise, out=self._spare_sum())
            step = self._checked_step(self._server_step(acc, self._denominator(weight)))
        return self._commit_step(step)

    def _spare_sum(self) -> torch.Tensor:
        if self._spare is None:
            self._spare = torch.empty_like(self._acc)
        return self._spare

    def _denominator(self, weight: float) -> float:
        """What the mean divides the (noised) sum by: the contributions' weight, or an
        amplified round's expected size ``q n``, which does not tell how many were sampled."""
        if self._amplified and self._round_open:
            return self._expected
        return weight

    # --------------------------------------------------------------------------- rounds

    def _sample_size(self, n: int) -> int:
        p = self.config.participation
        m = p if isinstance(p, int) else math.floor(p * n + 1e-9)
        return min(n, max(m, self.config.min_clients, 1))

    def _secret_key(self) -> bytes:
        """The "os" sampling key: 252 random bits from the operating system (``secrets``),
        made when the strategy is; on shards, rank 0's, so every shard samples alike."""
        if self._sampling_key is None:
            words = torch.zeros(_KEY_WORDS, dtype=torch.int64, device=self.device)
            if self.reducer.rank == 0:
                fresh = [secrets.randbits(63) for _ in range(_KEY_WORDS)]
                words.copy_(torch.tensor(fresh, dtype=torch.int64))
            if self.reduce is not None:
                words = self.reduce(words)
            self._sampling_key = b"".join(int(w).to_bytes(8, "big") for w in words.tolist())
        return self._sampling_key

    def _secret_draws(self, registered: list[str]) -> list[int]:
        """Per registered client a uniform 64-bit number, BLAKE2b keyed by the secret key of
        this draw's count and the client's id: independent over clients and draws, and
        unpredictable without the key (an observer of some clients' inclusions learns nothing
        of the others')."""
        key = self._secret_key()
        prefix = self._draws.to_bytes(8, "big")
        return [
            int.from_bytes(
                hashlib.blake2b(prefix + c.encode(), digest_size=8, key=key,
                                person=b"aggsrv.sampling").digest(), "big"
            )
            for c in registered
        ]  # fmt: skip

    def _sample(self, registered: list[str]) -> list[str]:
        """The clients of the round about to open, in join order (module docstring)."""
        cfg = self.config
        n = len(registered)
        if cfg.sampling == "poisson":
            q = float(cfg.participation)
            if cfg.sampling_source == "os":
                bound = math.ldexp(q, 64)  # P(u < q 2^64) = q for a uniform 64-bit u
                return [c for c, u in zip(registered, self._secret_draws(registered),
                                          strict=True) if u < bound]  # fmt: skip
            u = torch.rand(n, generator=self._rng, dtype=torch.float64).tolist()
            return [c for c, x in zip(registered, u, strict=True) if x < q]
        m = self._sample_size(n)
        if cfg.sampling_source == "os":  # the m smallest draws: a uniform m-subset
            draws = self._secret_draws(registered)
            picked = sorted(sorted(range(n), key=draws.__getitem__)[:m])
        else:
            picked = sorted(torch.randperm(n, generator=self._rng)[:m].tolist())
        return [registered[i] for i in picked]

    def _maybe_open_round(self, now: float) -> None:
        """Open a sync round (sample its participants) if none is open and enough clients are."""
        if self.config.mode != "sync" or self._round_open:
            return
        n = len(self._clients)
        if n < max(self.config.min_clients, self.config.min_available):
            return
        self._participants = dict.fromkeys(self._sample(list(self._clients)), False)
        m = len(self._participants)
        self._draws += 1
        if self._amplified:
            assert self.privacy is not None
            q = float(self.config.participation)
            self._expected = q * n
            self.privacy.accountant.open_round(q)
        self._round_open = True
        self._note_side_effect()  # reachable from job_for: the server must log that call
        timeout = self.config.round_timeout
        self._deadline = None if timeout is None else now + timeout
        logger.debug("%s: round %d opens with %d of %d clients", self.name, self.version, m, n)

    def _close_round(self, now: float, step: Any = None) -> int:
        """Aggregate the round (with ``step`` when the caller checked it already), drop (or
        keep) the jobs of the missing clients, open the next round."""
        late = []
        if self.config.late == "drop":
            for client, reported in self._participants.items():
                job = self.outstanding_job(client)
                if not reported and job is not None and job.base_version == self.version:
                    late.append(job)
        # First: a refusal there must find the round as it was.
        version = self._aggregate() if step is None else self._commit_step(step)
        for job in late:
            self.jobs.retire(job)
        self._round_open = False
        self._participants = {}
        self._deadline = None
        self._maybe_open_round(now)
        return version

    # --------------------------------------------------------------------------- state

    def _extra_state(self) -> dict[str, Any]:
        robust = None
        if self._rows is not None:
            assert self._robust is not None
            robust = {**self._robust.state(), **self._rows.state()}
        return {
            "acc": self._acc if self._acc_count and self._rows is None else None,
            "acc_weight": self._acc_weight,
            "acc_count": self._acc_count,
            "m": self._m,
            "v": self._v,
            "round_open": self._round_open,
            "participants": dict(self._participants),
            "deadline": self._deadline,
            "robust": robust,
            "draws": self._draws,
            "expected": self._expected,
            # The "os" sampling key (its draws are in the log's record of jobs anyway).
            "sampling_key": None if self._sampling_key is None else self._sampling_key.hex(),
        }

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        robust = state.get("robust")
        check_pending_rows(self, robust, int(state["acc_count"]))
        if self._rows is not None:
            assert self._robust is not None
            self._row_absmax = load_kept_rows(self, self._rows, self._robust, robust)
            self._moment_absmax = None
        if state["acc"] is not None:
            self._acc.copy_(state["acc"])
        self._acc_weight = float(state["acc_weight"])
        self._acc_count = int(state["acc_count"])

        self._m = self._restore(state["m"], shared=False)
        self._v = self._restore(state["v"], shared=False)
        self._round_open = bool(state["round_open"])
        self._participants = {str(c): bool(r) for c, r in state["participants"].items()}
        self._deadline = state["deadline"]
        # States saved before Poisson sampling: no draw counted, no key, no amplified round.
        self._draws = int(state.get("draws", 0))
        self._expected = float(state.get("expected", 0.0))
        key = state.get("sampling_key")
        self._sampling_key = None if key is None else bytes.fromhex(key)
