"""FedDGIC (Xie et al.): dynamic grouping of clients, then asynchronous aggregation with
gradient compensation for the groups that lost members to dropouts.

Spec: docs/algorithms/feddgic.md. Two phases:

**Grouping (Algorithm 1, spec 1.4.5 "sync_rounds").** ``n_cal`` barrier rounds (Eq. 6 from the
number n of clients in the first round, or ``similarity_rounds``). A round opens once
``min_available`` clients are registered and takes every registered client; each gets a job
whose deadline is ``round start + grouping_round_timeout``. The round closes when all reported,
or at the deadline if at least one did (else the deadline moves on); jobs of clients that did
not report are retired (their late updates are refused, ABORTED). At the close:

* the similarity ``S_r`` of the reporters' updates ``u_i = W_new - W_base`` (``sim_input =
  "update"``; ``"weights"`` is the literal reading) with the layer scale removed
  (``layer_norm = "per_layer_mean"``: the mean over modules of per-module cosines,
  ``kernels.layer_normalized_cosine`` over ``module_offsets``; ``"none"``: the plain cosine;
  ``"param_weighted"``: per-module cosines weighted by module size), summed per pair with a
  per-pair count, so a client missing from a round is averaged over the rounds it was in;
* the global model becomes the sample-weighted mean of the reporters' weights (FedAvg), a new
  version.

After round n_cal: ``S_avg``, average linkage on ``1 - S_avg`` and the Eq. 5 cut with ``p``
(:func:`aggsrv.strategies.grouping.dynamic_groups`; ``fixed_groups`` cuts at a fixed k instead:
FedFG). A pair never seen together counts as similarity 0. The grouping is logged and emitted as
a ``"grouping"`` event (clients, labels, k, the dendrogram's heights, Eq. 5 ratios and linkage),
which the simulator writes to ``events.jsonl`` and ``aggsrv report`` draws.

**Asynchronous (Algorithm 2, spec 1.5.6).** Every client always gets a job from the current
version; each accepted update runs lines 7-14 (:class:`GroupCompensation`): the group model
takes the client's weights with Eq. 8's staleness-controlled ratio, the version counters move,
the group's dropouts are detected by ``V_g - V_j >= T`` (``t_mode``), and the global model takes
the group model with ``alpha_comp`` (Eq. 9; 1 - r_c = 0 with ``compensate = false``: FedFG).
Algorithm 2 starts from the global model of the grouping phase (spec 1.4.5). A change of a
client's dropout flag is logged and emitted as a ``"dropout"`` event.

Decisions beyond the spec: a client that registers after the grouping joins as a group of its
own (it can never be compensated for), unless ``regroup_on_join``. Regrouping (off by default,
as in the paper) uses one similarity round over every client's latest update, which the strategy
then keeps ([n, D], only when a regroup option is on): ``regroup_every = R`` regroups every R
versions of the asynchronous phase, ``regroup_on_join`` when a late client's first update
arrives. A regroup restarts Algorithm 2's counters and group models from the current global
model (spec 1.4.5: N_g changes, so V_g and V_i restart at 0).

Float buffers (BatchNorm statistics) follow the weights: the sample-weighted mean in the grouping
rounds, then the same two moving averages (group, then global) with the same ratios.

Outcomes: grouping rounds answer BUFFERED(current version) until the update that closes the
round (APPLIED(new version)); every BUFFERED update is in the round's average. An update whose
job is not part of the open round is refused (ABORTED) and changes nothing. The asynchronous
phase answers APPLIED(new version) every time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from aggsrv import kernels
from aggsrv.config_check import Count
from aggsrv.strategies.base import Strategy
from aggsrv.strategies.cached_rows import (
    CACHE_DTYPE_HELP,
    CachedRows,
    RowCacheInfo,
    check_cache_dtype,
)
from aggsrv.strategies.compensation import GroupCompensation
from aggsrv.strategies.errors import JobSuperseded
from aggsrv.strategies.finite_results import require_reach
from aggsrv.strategies.grouping import Grouping, dynamic_groups, similarity_rounds
from aggsrv.strategies.job import Job, round_job
from aggsrv.strategies.update_filters import FilteredConfig
from aggsrv.values import Outcome, Status, Update, UpdateKind

__all__ = ["FedDGIC", "FedDGICConfig", "FedFG", "FedFGConfig"]

logger = logging.getLogger(__name__)

LAYER_NORMS = ("per_layer_mean", "none", "param_weighted")


@dataclass
class FedDGICConfig(FilteredConfig):
    """FedDGIC settings; defaults are docs/algorithms/feddgic.md section 2.1 (module docstring).

    ``preset = "paper"`` spells those defaults out. The regime map (issue 20) found no cell where
    another choice of FedDGIC's keys wins (a fixed k = 5 did not), so there is no other preset.
    """

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "paper": {
            "alpha_global": 0.5, "alpha_max": 0.8, "beta": 1.0, "p": 0.8,
            "t_mode": "per_group_multiple", "t_factor": 2, "compensate": True,
        },
    }  # fmt: skip

    HELP: ClassVar[Mapping[str, str]] = {
        "alpha_global": "Eq. 9: weight of the group model in the global model, in [0, 1)",
        "alpha_max": "Eq. 8: largest weight of a client in its group model, in (0, 1]",
        "beta": "Eq. 8: staleness decay of a client's weight (>= 0)",
        "p": "Eq. 5: the dendrogram cut's ratio threshold (> 0)",
        "t_mode": "dropout timeout T: per_group_multiple (t_factor x group size) or constant",
        "t_factor": "T = t_factor x the group's size (at least 2) in per_group_multiple",
        "t_constant": "T in versions for t_mode = constant; unset = not constant",
        "compensate": "compensate groups for their dropped members (Eq. 9)",
        "fixed_groups": "cut the dendrogram at this many groups (FedFG); unset = Eq. 5's cut",
        "similarity_rounds": "grouping rounds (n_cal); unset = Eq. 6 from the first round",
        "layer_norm": "layer scale removal: per_layer_mean, none or param_weighted",
        "layer_unit": "a layer for layer_norm: module or tensor",
        "sim_input": "similarity of the updates or of the weights",
        "min_available": "registered clients needed before the first grouping round",
        "grouping_round_timeout": "seconds a grouping round waits for all; unset = forever",
        "regroup_every": "regroup every this many versions; unset = never",
        "regroup_on_join": "regroup when a late client's first update arrives",
        "cache_dtype": CACHE_DTYPE_HELP,
    }

    alpha_global: float = 0.5
    alpha_max: float = 0.8
    beta: float = 1.0
    p: float = 0.8
    t_mode: str = "per_group_multiple"
    t_factor: Count = 2
    t_constant: Count | None = None
    compensate: bool = True
    fixed_groups: Count | None = None
    similarity_rounds: Count | None = None
    layer_norm: str = "per_layer_mean"
    layer_unit: str = "module"
    sim_input: str = "update"
    min_available: Count = 1
    grouping_round_timeout: float | None = 60.0
    regroup_every: Count | None = None
    regroup_on_join: bool = False
    cache_dtype: str = "float32"

    def __post_init__(self) -> None:
        """Check choices and ranges."""
        super().__post_init__()
        check_cache_dtype(self.cache_dtype)
        for key, choices in (
            ("t_mode", ("per_group_multiple", "constant")),
            ("layer_norm", LAYER_NORMS),
            ("layer_unit", ("module", "tensor")),
            ("sim_input", ("update", "weights")),
        ):
            if getattr(self, key) not in choices:
                raise ValueError(f"{key} must be one of {choices}, got {getattr(self, key)!r}")
        if not 0.0 <= self.alpha_global < 1.0:
            raise ValueError(f"alpha_global must be in [0, 1), got {self.alpha_global}")
        if not 0.0 < self.alpha_max <= 1.0:
            raise ValueError(f"alpha_max must be in (0, 1], got {self.alpha_max}")
        if self.beta < 0 or not self.p > 0:
            raise ValueError(f"need beta >= 0 and p > 0, got {self.beta} and {self.p}")
        if self.t_mode == "constant" and self.t_constant is None:
            raise ValueError("t_mode = 'constant' needs t_constant (the timeout in versions)")
        if self.grouping_round_timeout is not None and not self.grouping_round_timeout > 0:
            raise ValueError(
                f"grouping_round_timeout must be > 0 or None, got {self.grouping_round_timeout}"
            )


# FedDGIC's config, or the config of a strategy that extends it (FedFG).
DGICConfig = TypeVar("DGICConfig", bound=FedDGICConfig)


class FedDGIC(Strategy[DGICConfig], name="feddgic"):
    """FedDGIC: n_cal synchronous similarity rounds, a grouping, then Algorithm 2."""

    buffer_rule = "own"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Start in the grouping phase with no round open."""
        super().__init__(*args, **kwargs)
        cfg = self.config
        offsets = self.layout.module_offsets if cfg.layer_unit == "module" else self.layout.offsets
        self._offsets = offsets.to(torch.int64)
        # "param_weighted" weighs layers by their whole size (a shard holds slices of them).
        whole = self.layout.whole
        whole_offsets = whole.module_offsets if cfg.layer_unit == "module" else whole.offsets
        self._layer_sizes = (whole_offsets[1:] - whole_offsets[:-1]).to(torch.float64)
        self.phase = "grouping"
        self.grouping: Grouping | None = None
        self.n_cal: int | None = None
        self.rounds_done = 0  # grouping rounds closed
        self._ids: list[str] = []  # clients seen in the grouping / the compensation, by index
        self._index: dict[str, int] = {}
        self._rows = self._empty_rows()
        self._has_row: list[bool] = []
        self._s_sum = np.zeros((0, 0))
        self._s_count = np.zeros((0, 0), dtype=np.int64)
        # Open grouping round: client -> reported; running sample-weighted sum of weights.
        self._round_open = False
        self._participants: dict[str, bool] = {}
        self._deadline: float | None = None
        self._acc = torch.zeros(self.dim, dtype=torch.float64, device=self.device)
        self._acc_weight = 0.0
        self._acc_buffers: torch.Tensor | None = None
        self._comp: GroupCompensation | None = None
        self._group_buffers: list[torch.Tensor] = []
        self._scratch = torch.zeros(0, dtype=torch.float32, device=self.device)  # a row, unchecked
        self._async_versions = 0  # versions made in the asynchronous phase (regroup_every)

    # --------------------------------------------------------------------------- views

    def group_of(self, client_id: str) -> int | None:
        """The client's group in the asynchronous phase (None before the grouping)."""
        if self._comp is None or client_id not in self._index:
            return None
        return self._comp.labels[self._index[client_id]]

    def dropped(self) -> list[str]:
        """Clients currently flagged as dropped."""
        if self._comp is None:
            return []
        return [c for c, d in zip(self._ids, self._comp.dropped, strict=False) if d]

    def _empty_rows(self) -> CachedRows:
        return CachedRows(self.dim, self.config.cache_dtype, self.device)

    def row_cache(self) -> RowCacheInfo | None:
        return self._rows.info(sum(self._has_row)) if self._keeps_rows() else None

    def _keeps_rows(self) -> bool:
        return self.phase == "grouping" or self._regrouping()

    def _regrouping(self) -> bool:
        return self.config.regroup_every is not None or self.config.regroup_on_join

    # --------------------------------------------------------------------------- protocol

    def on_register(self, client_id: str, now: float) -> None:
        """Register; the first grouping round opens once ``min_available`` clients are."""
        super().on_register(client_id, now)
        self._maybe_open_round(now)

    def job_for(self, client_id: str, now: float) -> Job | None:
        """Grouping: a job for a round participant that has not reported. Async: always."""
        self._require_registered(client_id)
        if self.phase == "async":
            return self._issue_job(client_id, deadline=None, now=now)
        return round_job(self, client_id, now)

    def _next_deadline(self) -> float | None:
        """The open grouping round's deadline."""
        return self._deadline if self._round_open else None

    def _on_timer(self, now: float) -> None:
        """At a grouping round's deadline close it if anyone reported, else extend it."""
        if not self._round_open or self._deadline is None or now < self._deadline:
            return
        if any(self._participants.values()):
            self._close_round(now)
        else:
            timeout = self.config.grouping_round_timeout
            assert timeout is not None
            self._deadline = now + timeout
            logger.info(
                "%s: grouping round %d has no update at its deadline; extended to %.3f",
                self.name, self.rounds_done + 1, self._deadline,
            )  # fmt: skip

    # --------------------------------------------------------------------------- updates

    def _check(self, update: Update, job: Job, staleness: int, now: float) -> None:
        # A grouping round averages only its own jobs' updates (spec 1.4.5: u_i = W_new,i -
        # W_global^r); one from outside it is refused here, before any state changes, rather
        # than answered BUFFERED and left out. A closed round retires its jobs, so this is a
        # guard for states the API does not make.
        if self.phase == "grouping" and not (
            self._round_open
            and update.client_id in self._participants
            and job.base_version == self.version
        ):
            raise JobSuperseded(
                f"job {job.job_id} of client {update.client_id!r} (from version "
                f"{job.base_version}) is not part of the open grouping round (round "
                f"{self.rounds_done + 1}, version {self.version}); discard this update and ask "
                "for a new job"
            )

    def _apply(self, update: Update, job: Job, staleness: int, now: float) -> Outcome:
        if self.phase == "grouping":
            return self._apply_grouping(update, job, now)
        return self._apply_async(update, job, now)

    def _row_of(self, client_id: str) -> int:
        """The client's index (rows, similarity matrix, compensation), added on first use."""
        i = self._index.get(client_id)
        if i is not None:
            return i
        i = len(self._ids)
        self._ids.append(client_id)
        self._index[client_id] = i
        self._has_row.append(False)
        if self._keeps_rows():
            self._rows.ensure(i, i + 1, self.max_clients)
        return i

    def _prepare_row(self, update: Update, job: Job) -> torch.Tensor:
        """The client's next similarity row (its update or its weights, by ``sim_input``) in a
        scratch row, checked finite; not yet stored."""
        if self._scratch.numel() != self.dim:
            self._scratch = torch.empty(self.dim, dtype=torch.float32, device=self.device)
        if self.config.sim_input == "update":
            self.client_delta(update, job, out=self._scratch)
        else:
            self.client_weights(update, job, out=self._scratch)
        absmax = self._checked_absmax(self._scratch, "the client's similarity row")
        # The cosines between rows sum products in float32: |sum x_i y_i| <= D max|x| max|y|,
        # so a row with larger values could make the similarity matrix NaN.
        require_reach(absmax * absmax * self.layout.whole.numel, "a dot product of similarity rows")
        return self._scratch

    def _store_row(self, i: int, row: torch.Tensor) -> None:
        self._rows.write(i, row)
        self._has_row[i] = True

    def _apply_grouping(self, update: Update, job: Job, now: float) -> Outcome:
        cid = update.client_id  # _check refused any update outside the open round
        n = float(update.num_samples) or 1.0  # a client without samples counts once
        row = self._prepare_row(update, job)
        base = job.weights if update.kind is UpdateKind.DELTA else None
        total = self._acc_weight + n

        def mean_after(s: slice) -> torch.Tensor:
            acc = torch.add(self._acc[s], update.tensor[s], alpha=n)
            if base is not None:
                acc.add_(base[s], alpha=n)
            return acc.div_(total).float()

        # The round's mean if it closed now: its close (this update's or the deadline's)
        # publishes a checked value.
        self._require_finite_chunks(mean_after, "the model the grouping round would publish")
        i = self._row_of(cid)
        self._store_row(i, row)
        # n * (client weights) into the float64 sum, without a [D] temporary (kernels.accumulate:
        # float32 into float64 costs torch's add_ ~14x more).
        kernels.accumulate(self._acc, update.tensor, n)
        if update.kind is UpdateKind.DELTA:
            kernels.accumulate(self._acc, job.weights, n)
        self._acc_weight += n
        if update.buffers is not None:
            b = update.buffers.to(torch.float64) * n
            self._acc_buffers = b if self._acc_buffers is None else self._acc_buffers.add_(b)
        self._participants[cid] = True
        if all(self._participants.values()):
            return Outcome(Status.APPLIED, self._close_round(now))
        return Outcome(Status.BUFFERED, self.version)

    def _apply_async(self, update: Update, job: Job, now: float) -> Outcome:
        comp = self._comp
        assert comp is not None
        cid = update.client_id
        joined = cid not in self._index
        i = self._index.get(cid, len(self._ids))
        new_group = i >= len(comp.labels)
        assert i <= len(comp.labels), "every client with an index is in the compensation"
        # Everything is computed and checked first (a joining client's group too), then kept.
        new = self._new_model_buffer()
        weights = self.client_weights(update, job)
        plan = comp.plan(i, weights, out=new, joining=new_group)
        self._require_finite(plan.group_model, "the client's group model")
        self._check_version(new)
        group_buffers = None
        if update.buffers is not None:
            current = self.float_buffers.current
            assert current is not None
            gb = current if new_group else self._group_buffers[plan.step.group]
            gb = torch.lerp(gb, update.buffers, plan.step.alpha_group)
            group_buffers = (gb, torch.lerp(current, gb, plan.step.alpha_comp))
        self._require_finite_buffers(
            group_buffers[1] if group_buffers is not None else None, "the next float buffers"
        )
        row = self._prepare_row(update, job) if self._regrouping() else None
        i = self._row_of(cid)
        if new_group:
            if self.float_buffers.enabled:
                assert self.float_buffers.current is not None
                self._group_buffers.append(self.float_buffers.current.clone())
            logger.info("%s: %s joined after the grouping: a group of its own", self.name, cid)
        if row is not None:
            self._store_row(i, row)
        before = list(comp.dropped) + [False] * new_group
        step = comp.commit(plan)
        if group_buffers is not None:
            self._group_buffers[step.group] = group_buffers[0]
            self.float_buffers.set(group_buffers[1])
        for j, (was, now_dropped) in enumerate(zip(before, comp.dropped, strict=True)):
            if was != now_dropped:
                self._emit_dropout(j, now_dropped, now)
        version = self._publish(new)
        self._async_versions += 1
        cfg = self.config
        if (cfg.regroup_on_join and joined) or (
            cfg.regroup_every is not None and self._async_versions % cfg.regroup_every == 0
        ):
            self._regroup(now, "join" if joined else "schedule")
        logger.debug(
            "%s: %s group %d staleness %d a_grp %.4g D_g %d a_comp %.4g -> v%d",
            self.name, cid, step.group, step.staleness, step.alpha_group, step.dropped,
            step.alpha_comp, version,
        )  # fmt: skip
        return Outcome(Status.APPLIED, version)

    # --------------------------------------------------------------------------- grouping

    def _maybe_open_round(self, now: float) -> None:
        if self.phase != "grouping" or self._round_open:
            return
        n = len(self._clients)
        if n < self.config.min_available:
            return
        if self.n_cal is None:
            self.n_cal = self.config.similarity_rounds or similarity_rounds(n)
            logger.info(
                "%s: grouping phase: %d similarity rounds over %d clients", self.name,
                self.n_cal, n,
            )  # fmt: skip
        self._participants = dict.fromkeys(self._clients, False)
        self._round_open = True
        self._note_side_effect()  # reachable from job_for: the server must log that call
        timeout = self.config.grouping_round_timeout
        self._deadline = None if timeout is None else now + timeout

    def _close_round(self, now: float) -> int:
        reporters = [self._index[c] for c, done in self._participants.items() if done]
        for client, reported in self._participants.items():
            job = self.outstanding_job(client)
            if not reported and job is not None and job.base_version == self.version:
                self.jobs.retire(job)
        self._add_similarity(reporters)
        new = self._new_model_buffer()
        new.copy_(self._acc / self._acc_weight)  # the mean in float64, rounded once
        if self._acc_buffers is not None:
            self.float_buffers.set((self._acc_buffers / self._acc_weight).to(torch.float32))
        self._acc.zero_()
        self._acc_weight = 0.0
        self._acc_buffers = None
        self._round_open = False
        self._participants = {}
        self._deadline = None
        self.rounds_done += 1
        version = self._publish(new)
        assert self.n_cal is not None
        if self.rounds_done >= self.n_cal:
            self._form_groups(now)
        else:
            self._maybe_open_round(now)
        return version

    def _similarity(self, members: list[int]) -> torch.Tensor:
        """[m, m] similarity of the rows of ``members`` under ``layer_norm``."""
        mode = self.config.layer_norm
        sims = self._rows.cosines(members, mode, self._offsets, self.reduce)
        if mode != "param_weighted":
            return sims
        per_layer = sims
        sizes = self._layer_sizes.to(per_layer.dtype)
        return torch.einsum("l,lij->ij", sizes / sizes.sum(), per_layer)

    def _add_similarity(self, members: list[int]) -> None:
        n = len(self._ids)
        if self._s_sum.shape[0] < n:
            grown = np.zeros((n, n))
            grown[: self._s_sum.shape[0], : self._s_sum.shape[0]] = self._s_sum
            count = np.zeros((n, n), dtype=np.int64)
            count[: self._s_count.shape[0], : self._s_count.shape[0]] = self._s_count
            self._s_sum, self._s_count = grown, count
        if not members:
            return
        s = self._similarity(members).to("cpu", torch.float64).numpy()
        ix = np.ix_(members, members)
        self._s_sum[ix] += s
        self._s_count[ix] += 1

    def _averaged_similarity(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            s = np.where(self._s_count > 0, self._s_sum / np.maximum(self._s_count, 1), 0.0)
        np.fill_diagonal(s, 1.0)
        return s

    def _form_groups(self, now: float) -> None:
        grouping = dynamic_groups(
            self._averaged_similarity(), self.config.p, self.config.fixed_groups
        )
        self._start_compensation(grouping, now, "initial")
        self.phase = "async"
        if not self._regrouping():
            self._rows = self._empty_rows()  # the [n, D] cache is not needed any more
            self._s_sum, self._s_count = np.zeros((0, 0)), np.zeros((0, 0), dtype=np.int64)

    def _regroup(self, now: float, reason: str) -> None:
        members = [i for i, has in enumerate(self._has_row) if has]
        self._s_sum = np.zeros((0, 0))
        self._s_count = np.zeros((0, 0), dtype=np.int64)
        self._add_similarity(members)
        # Every client in self._ids has a cached update: a client is added with its first one.
        grouping = dynamic_groups(self._averaged_similarity(), self.config.p,
                                  self.config.fixed_groups)  # fmt: skip
        self._start_compensation(grouping, now, reason)

    def _start_compensation(self, grouping: Grouping, now: float, reason: str) -> None:
        cfg = self.config
        self.grouping = grouping
        self._comp = GroupCompensation(
            grouping.labels,
            self._model,
            alpha_global=cfg.alpha_global,
            alpha_max=cfg.alpha_max,
            beta=cfg.beta,
            t_constant=cfg.t_constant if cfg.t_mode == "constant" else None,
            t_factor=cfg.t_factor,
            compensate=cfg.compensate,
        )
        current = self.float_buffers.current
        self._group_buffers = (
            [current.clone() for _ in range(grouping.k)] if current is not None else []
        )
        self._emit_grouping(grouping, now, reason)

    # --------------------------------------------------------------------------- events

    def _emit_grouping(self, grouping: Grouping, now: float, reason: str) -> None:
        sizes = [len(g) for g in grouping.groups()]
        logger.info(
            "%s: grouping (%s) at v%d: k = %d groups of sizes %s; groups %s; merge heights %s",
            self.name, reason, self.version, grouping.k, sizes,
            [[self._ids[i] for i in g] for g in grouping.groups()],
            [round(h, 4) for h in grouping.heights],
        )  # fmt: skip
        self._emit(
            "grouping",
            now,
            reason=reason,
            clients=list(self._ids),
            labels=list(grouping.labels),
            k=grouping.k,
            p=self.config.p,
            fixed_groups=self.config.fixed_groups,
            n_cal=self.n_cal,
            heights=list(grouping.heights),
            ratios=list(grouping.ratios),
            linkage=grouping.linkage.tolist(),
        )

    def _emit_dropout(self, j: int, dropped: bool, now: float) -> None:
        assert self._comp is not None
        g = self._comp.labels[j]
        cid = self._ids[j]
        logger.info(
            "%s: %s %s (group %d, V_g = %d, V_i = %d, T = %d)", self.name, cid,
            "flagged as dropped" if dropped else "is back", g, self._comp.group_version[g],
            self._comp.client_version[j], self._comp.thresholds[g],
        )  # fmt: skip
        self._emit("dropout", now, client=cid, group=g, dropped=dropped)

    # --------------------------------------------------------------------------- state

    def _extra_state(self) -> dict[str, Any]:
        g = self.grouping
        n = len(self._ids) if self._rows.capacity else 0
        return {
            "phase": self.phase,
            "grouping": None
            if g is None
            else {
                "labels": list(g.labels),
                "k": g.k,
                "heights": list(g.heights),
                "ratios": list(g.ratios),
                "linkage": torch.from_numpy(g.linkage.copy()),
            },
            "n_cal": self.n_cal,
            "rounds_done": self.rounds_done,
            "ids": list(self._ids),
            **self._rows.state(n, key="rows"),
            "has_row": list(self._has_row),
            "s_sum": torch.from_numpy(self._s_sum.copy()),
            "s_count": torch.from_numpy(self._s_count.copy()),
            "round_open": self._round_open,
            "participants": dict(self._participants),
            "deadline": self._deadline,
            "acc": self._acc if self._acc_weight else None,
            "acc_weight": self._acc_weight,
            "acc_buffers": self._acc_buffers,
            "compensation": None if self._comp is None else self._comp.state_dict(),
            "group_buffers": list(self._group_buffers),
            "async_versions": self._async_versions,
        }

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.phase = str(state["phase"])
        g = state["grouping"]
        self.grouping = (
            None
            if g is None
            else Grouping(
                tuple(int(x) for x in g["labels"]),
                int(g["k"]),
                tuple(float(h) for h in g["heights"]),
                tuple(float(r) for r in g["ratios"]),
                g["linkage"].numpy().astype(np.float64),
            )
        )
        self.n_cal = None if state["n_cal"] is None else int(state["n_cal"])
        self.rounds_done = int(state["rounds_done"])
        self._ids = [str(c) for c in state["ids"]]
        self._index = {c: i for i, c in enumerate(self._ids)}
        rows = state["rows"]
        if rows.numel() and tuple(rows.shape) != (len(self._ids), self.dim):
            raise ValueError(f"saved update rows have shape {tuple(rows.shape)}")
        self._rows = self._empty_rows()  # any saved cache dtype, converted
        self._rows.load(state, rows.shape[0], self.max_clients, key="rows")
        self._has_row = [bool(h) for h in state["has_row"]]
        self._s_sum = state["s_sum"].numpy().astype(np.float64)
        self._s_count = state["s_count"].numpy().astype(np.int64)
        self._round_open = bool(state["round_open"])
        self._participants = {str(c): bool(r) for c, r in state["participants"].items()}
        self._deadline = state["deadline"]
        self._acc.zero_()
        if state["acc"] is not None:
            self._acc.copy_(state["acc"])
        self._acc_weight = float(state["acc_weight"])
        b = state["acc_buffers"]
        self._acc_buffers = None if b is None else b.to(self.device, torch.float64, copy=True)
        comp = state["compensation"]
        self._comp = (
            None if comp is None
            else GroupCompensation.from_state(comp, self.device, copy=self._copy_saved)
        )  # fmt: skip
        self._group_buffers = [
            t.to(device=self.device, dtype=torch.float32, copy=True) for t in state["group_buffers"]
        ]
        self._async_versions = int(state["async_versions"])


@dataclass
class FedFGConfig(FedDGICConfig):
    """FedFG ("federated fixed grouping", FedDGIC's baseline, spec 2.3): the same grouping phase
    cut at a fixed number of groups, Eq. 8 group updates, and no compensation (r_c = 1)."""

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}  # FedDGIC's would compensate

    fixed_groups: Count | None = 5
    compensate: bool = False

    def __post_init__(self) -> None:
        """Refuse what would make it FedDGIC."""
        super().__post_init__()
        if self.fixed_groups is None or self.compensate:
            raise ValueError(
                "fedfg has a fixed number of groups and no compensation; use strategy "
                "'feddgic' for Eq. 5 groups or compensation"
            )


class FedFG(FedDGIC[FedFGConfig], name="fedfg"):
    """FedFG: FedDGIC's pipeline with ``fixed_groups`` groups and ``alpha_comp = alpha_global``."""
