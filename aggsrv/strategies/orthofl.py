"""ORTHOFL (Zhang et al., "Orthogonal Calibration for Asynchronous Federated Learning").

Fully asynchronous: every accepted update is one server round ``t`` and makes one new version.
The global model is a staleness-weighted moving average of the raw client weights, and every
client trains from its own *calibrated* model (docs/algorithms/orthofl.md, sections 1.4 and 1.6).

Variant P (``shift_source = "ma_global"``, the default, the paper's Eqs. 4-8 and Algorithm 1).
Per client ``m`` the strategy keeps two [D] snapshots and a round number:

* ``C_m``: the weights ``m`` was last sent (its job's "weights"; the initial global at first);
* ``G_m``: the global model right after ``m``'s last update was aggregated (``W^(tau+)``), or the
  global model when it got its first job;
* ``tau_m``: the version ``G_m`` is.

On an arrival ``X`` (the client's final weights; a DELTA update is ``C_m + delta``):
``dW = W - G_m``, ``dm = X - C_m``; per segment ``l`` of the layout's offsets (one segment per
named tensor, spec G5) ``c_l = <dW, dm> / <dm, dm>`` (0 where ``<dm, dm> <= eps``) and
``Y = X + dW - c_l dm``; normalisation segments (``layout.is_norm``) are not calibrated (Y = X
there, spec G6). The global becomes ``W <- (1 - beta_t) W + beta_t X`` with
``beta_t = beta * (t - tau)^(-a)`` (``t - tau`` below); then ``G_m <- W``, ``C_m <- Y``,
``tau_m <- t`` and the client's next job carries ``Y`` as its "weights". Both passes are one
call of ``kernels.orthogonal_calibrate``. When no update was aggregated since ``G_m``
(``version == tau_m``; the paper's ``t - tau = 1``) ``dW`` is 0 and the calibration is skipped:
``Y == X`` bit for bit (spec G4, acceptance check 2).

Variant C (``shift_source = "client_chain"``, the released code, spec 1.6). The published,
evaluated model is the moving average ``A`` of the raw client weights; a separate chain ``V``
of calibrated client models is what clients train from. Per client only ``S_m`` (the weights
it was sent) is kept. ``Y = X + (V - S_m) - c_l (X - S_m)`` per calibrated segment (= V +
(1 - c_l)(X - S_m)), ``Y = X`` on norm segments; ``A <- (1 - alpha) A + alpha X`` with the same
``alpha = beta * (t - tau)^(-a)``; ``V <- Y``, ``S_m <- Y``. The code's quirks are flags:
``first_update_alpha_one`` (alpha = 1 for the very first server update) and ``zero_sum_skip``
(skip a segment whose shift sums to exactly 0, instead of relying on an all-zero shift giving
c = 0); both default off and also apply to variant P where they make sense.

Staleness. ``t - tau = s + 1``, where ``s = version - job.base_version`` is the staleness the
server computes for every strategy at arrival (docs/strategies.md): the paper's tau is "the
round when client m last communicated with the server", which is when the client was handed
its job. When a client asks for its next job right after its update was applied (the paper's
protocol and the simulator's), the job starts from version ``tau_m`` and ``version - tau_m``
is that same ``s``. If other updates land between a client's update and its next job request,
the job's ``s`` is smaller than ``version - tau_m``: ``beta_t`` uses ``s``, while the shift is
still measured from ``G_m``, the global the client's model ``C_m`` was calibrated against
(``tau_m`` only names that snapshot's version).

Memory bound (variant P): per client that was ever issued a job, ``C_m`` and ``G_m``: at most
``2 x clients x D x 4`` bytes, plus the model versions, one [D] staging buffer and, for DELTA
updates, one [D] scratch row. ``C_m`` is the job's "weights" tensor, which the server streams
and :meth:`Strategy.client_weights` reads, so it lives on the strategy's device like every
job's start weights. ``G_m`` lives on the host (pinned when CUDA is available) when the
strategy's device is CUDA and is copied in for each arrival (one [D] host-to-device and one
device-to-host copy per update); on a CPU device ``G_m`` is the published version tensor itself
(no copy). Variant C keeps only ``S_m`` (= the job weights) per client plus ``V``:
``clients x D x 4`` bytes plus ``2 x D x 4``.

Snapshots are kept for clients with no outstanding job too: the spec's state is persistent per
client (a client's model is "global + a personal offset" ``C_m - G_m``, spec 1.4), and a
client that has reported keeps a calibrated model waiting for its next job. Dropping them would
change the algorithm, so it is only done on request: :meth:`OrthoFL.release_client` forgets a
client that has no outstanding job (a client that will not come back); if it does come back it
starts again from the global model, like a new client.

BatchNorm buffers (spec G6). The float buffers (running_mean/running_var, the layout's [B]
section) go through the same arithmetic as the weights, with one segment per buffer tensor:
they enter the moving average with the same ``beta_t`` (the global model's statistics), and
they are normalisation state, so by default they are not calibrated: a client's next job
carries its own uploaded statistics back (``Y = X`` on those segments, the released code's
FedBN-like behaviour), exactly as for the norm *parameters*. Per client the strategy keeps the
[B] counterparts of ``C_m``/``G_m`` (variant C: ``S_m`` and the chain ``V``), so with
``calibrate_norm = True`` (the pure-paper reading: every float tensor calibrated) the buffers
are calibrated by the same formula, and negative calibrated variances are clamped to 0 (spec
G6). Integer buffers (num_batches_tracked) never travel: each client keeps its own.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from aggsrv import kernels
from aggsrv.strategies.base import Strategy
from aggsrv.strategies.buffers import Lease
from aggsrv.strategies.errors import JobSuperseded, NonFiniteResult
from aggsrv.strategies.job import Job
from aggsrv.strategies.update_filters import FilteredConfig
from aggsrv.values import Outcome, Status, Update, UpdateKind

__all__ = ["SHIFT_SOURCES", "OrthoFL", "OrthoFLConfig"]

logger = logging.getLogger(__name__)

SHIFT_SOURCES = ("ma_global", "client_chain")


@dataclass
class OrthoFLConfig(FilteredConfig):
    """ORTHOFL settings (spec section 2.2 and gaps G1-G6).

    ``beta`` and ``a``: ``beta_t = beta * (t - tau)^(-a)`` (paper: 0.6 and 0.5).
    ``shift_source``: "ma_global" (variant P, the paper) or "client_chain" (variant C, the
    released code). ``calibrate_norm``: also calibrate normalisation-layer segments (the pure
    paper reading; default False, as the code). ``eps``: a segment's coefficient is 0 where
    ``|dm|^2 <= eps`` (spec G3). ``first_update_alpha_one`` and ``zero_sum_skip``: the released
    code's quirks (spec G2, G4), default off.

    Presets: ``paper`` is the defaults spelled out (variant P); ``released_code`` switches to
    variant C, the shift source of the released code, which the regime map (issue 20,
    bench/experiments/README.md "Regime maps") found ahead of variant P where job times
    spread (per-client Raspberry-Pi speeds, or log-normal job times).
    """

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "paper": {"beta": 0.6, "a": 0.5, "shift_source": "ma_global", "calibrate_norm": False},
        "released_code": {"beta": 0.6, "a": 0.5, "shift_source": "client_chain"},
    }
    PRESET_NOTES: ClassVar[Mapping[str, str]] = {
        "released_code": "variant C (shift from the client's chain); ahead of the paper's "
        "variant where job times spread (bench/experiments/README.md, regime maps)",
    }

    HELP: ClassVar[Mapping[str, str]] = {
        "beta": "moving-average weight: beta_t = beta * (t - tau)^(-a), in (0, 1]",
        "a": "staleness exponent of beta_t (>= 0)",
        "shift_source": "ma_global (variant P, the paper) or client_chain (variant C, the code)",
        "calibrate_norm": "also calibrate normalisation-layer segments",
        "eps": "a segment's coefficient is 0 where |dm|^2 <= eps",
        "first_update_alpha_one": "the released code's quirk: alpha = 1 for the first update",
        "zero_sum_skip": "the released code's quirk: skip a segment whose shift sums to 0",
    }

    beta: float = 0.6
    a: float = 0.5
    shift_source: str = "ma_global"
    calibrate_norm: bool = False
    eps: float = 0.0
    first_update_alpha_one: bool = False
    zero_sum_skip: bool = False

    def __post_init__(self) -> None:
        """Check ranges."""
        super().__post_init__()
        if not 0.0 < self.beta <= 1.0:
            raise ValueError(f"beta must be in (0, 1], got {self.beta}")
        if not self.a >= 0.0:
            raise ValueError(f"a must be >= 0, got {self.a}")
        if self.shift_source not in SHIFT_SOURCES:
            raise ValueError(
                f"shift_source must be one of {SHIFT_SOURCES}, got {self.shift_source!r}"
            )
        if not self.eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {self.eps}")


class OrthoFL(Strategy[OrthoFLConfig], name="orthofl"):
    """ORTHOFL: per-client calibrated models, a staleness-weighted moving-average global."""

    buffer_rule = "own"  # the moving average of the weights, see the module docstring

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Set up the segment tables, per-client snapshot maps and (variant C) the chain V."""
        super().__init__(*args, **kwargs)
        self._offsets = self.layout.offsets
        L = self._offsets.numel() - 1
        if self.config.calibrate_norm:
            self._mask = torch.ones(L, dtype=torch.bool)
        else:
            self._mask = ~self.layout.is_norm
        self._no_mask = torch.zeros(L, dtype=torch.bool)
        self._lengths = (self._offsets[1:] - self._offsets[:-1]).to(self.device)
        self._sent: dict[str, torch.Tensor] = {}  # C_m (variant C: S_m), on the device
        # A lease on each kept snapshot that may be a version buffer (C_m, G_m, V): ("sent",
        # client), ("snap", client), ("chain",). Read at the client's next update.
        self._holds: dict[tuple[str, ...], Lease] = {}
        self._snap: dict[str, torch.Tensor] = {}  # G_m (variant P only), see _snap_device
        self._tau: dict[str, int] = {}  # tau_m: the version of the snapshot
        self._host_snapshots = self.device.type == "cuda"
        self._staging: torch.Tensor | None = None  # device copy of a host G_m
        self._scratch: torch.Tensor | None = None  # X for DELTA updates
        # Variant C: the chain of calibrated client models V (starts at the initial model).
        self._chain: torch.Tensor | None = self._model if self.chain_mode else None
        self._hold(("chain",), self._chain)
        # The float buffers' counterparts ([B] each): C_m (S_m), G_m and V; one segment per
        # buffer tensor, calibrated only with calibrate_norm.
        self._b_offsets = self.layout.buffer_offsets
        nb = self._b_offsets.numel() - 1
        self._b_all = torch.ones(nb, dtype=torch.bool)
        self._b_none = torch.zeros(nb, dtype=torch.bool)
        self._b_sent: dict[str, torch.Tensor] = {}
        self._b_snap: dict[str, torch.Tensor] = {}
        self._b_chain = self.float_buffers.current if self.chain_mode else None
        self.last_coeffs: torch.Tensor | None = None  # c_l of the last arrival (diagnostics)

    # ----------------------------------------------------------------------- public helpers

    @property
    def chain_mode(self) -> bool:
        """True for variant C (the released code's client chain)."""
        return self.config.shift_source == "client_chain"

    def mixing_weight(self, t_minus_tau: int) -> float:
        """``beta_t = beta * (t - tau)^(-a)`` for ``t - tau >= 1``."""
        if t_minus_tau < 1:
            raise ValueError(f"t - tau must be >= 1, got {t_minus_tau}")
        return float(self.config.beta * float(t_minus_tau) ** -self.config.a)

    def client_tau(self, client_id: str) -> int | None:
        """The version of the client's snapshot (its last aggregation or first job), if any."""
        return self._tau.get(client_id)

    def snapshot_bytes(self) -> int:
        """Bytes held in per-client snapshots (C_m and G_m, and their [B] float-buffer
        counterparts), counting shared tensors once."""
        seen: set[int] = set()
        total = 0
        snapshots = (self._sent, self._snap, self._b_sent, self._b_snap)
        for t in (t for snaps in snapshots for t in snaps.values()):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total

    def release_client(self, client_id: str) -> bool:
        """Forget a client's snapshots if it has no outstanding job; True if dropped.

        For a client that will not come back; if it does, it starts from the global model.
        """
        if self.outstanding_job(client_id) is not None:
            return False
        found = client_id in self._tau
        for snapshots in (self._sent, self._snap, self._b_sent, self._b_snap):
            snapshots.pop(client_id, None)
        self._hold(("sent", client_id), None)
        self._hold(("snap", client_id), None)
        self._tau.pop(client_id, None)
        return found

    # ----------------------------------------------------------------------- jobs

    def _job_tensors(self, client_id: str) -> dict[str, torch.Tensor]:
        if client_id not in self._tau:
            # First job (or after release_client): start from the current global (variant P)
            # or the chain V (variant C), with a zero personal offset.
            if self.chain_mode:
                assert self._chain is not None
                self._sent[client_id] = self._chain
            else:
                self._sent[client_id] = self._model
                self._snap[client_id] = self._host_copy(self._model, None)
                self._hold(("snap", client_id), self._snap[client_id])
            self._hold(("sent", client_id), self._sent[client_id])
            if self.float_buffers.enabled:
                current = self.float_buffers.current
                if self.chain_mode:
                    self._b_sent[client_id] = self._b_chain
                else:
                    self._b_sent[client_id] = self._b_snap[client_id] = current
            self._tau[client_id] = self.version
        tensors = {"weights": self._sent[client_id]}
        if self.float_buffers.enabled:
            tensors["buffers"] = self._b_sent[client_id]
        return tensors

    def _hold(self, key: tuple[str, ...], t: torch.Tensor | None) -> None:
        """Keep ``t`` (None: nothing) under the lease named ``key``, giving up what it held."""
        old = self._holds.pop(key, None)
        if t is not None:
            self._holds[key] = self._versions.lease(t)
        if old is not None:
            old.release()

    def _host_copy(self, src: torch.Tensor, reuse: torch.Tensor | None) -> torch.Tensor:
        """G_m for ``src`` (a published version): the tensor itself on a CPU device, else a
        host copy (into ``reuse`` when given: a client's own previous host snapshot)."""
        if not self._host_snapshots:
            return src
        if reuse is None:
            reuse = torch.empty(
                src.numel(), dtype=torch.float32, pin_memory=torch.cuda.is_available()
            )
        reuse.copy_(src)
        return reuse

    # ----------------------------------------------------------------------- update

    def _check(self, update: Update, job: Job, staleness: int, now: float) -> None:
        # Every job this strategy issues has snapshots (release_client keeps them while a job
        # is outstanding); refuse before any state changes if that were ever not so.
        if update.client_id not in self._tau:
            raise JobSuperseded(
                f"orthofl holds no snapshot for client {update.client_id!r}; ask for a new job"
            )

    def _apply(self, update: Update, job: Job, staleness: int, now: float) -> Outcome:
        cfg = self.config
        cid = update.client_id
        if update.kind is UpdateKind.DELTA:
            if self._scratch is None:
                self._scratch = torch.empty(self.dim, dtype=torch.float32, device=self.device)
            x = self.client_weights(update, job, out=self._scratch)
            self._require_finite(x, "the client's weights (its job's weights plus the delta)")
        else:
            x = update.tensor
        sent = job.weights
        t_minus_tau = staleness + 1  # the one staleness of every strategy (module docstring)
        beta_t = self.mixing_weight(t_minus_tau)
        # Whether the global moved since G_m; if not, dW = 0 exactly and Y = X (spec G4).
        drifted = self.version != self._tau[cid]
        if cfg.first_update_alpha_one and self.version == 0:
            beta_t = 1.0
        if self.chain_mode:
            assert self._chain is not None
            w, snap, ma = self._chain, sent, self._model
            mask = self._mask
        else:
            w, ma = self._model, None
            snap = self._snap[cid]
            if snap.device != self.device:
                if self._staging is None:
                    self._staging = torch.empty(self.dim, dtype=torch.float32, device=self.device)
                snap = self._staging.copy_(snap, non_blocking=True)
            mask = self._mask if drifted else self._no_mask
        if cfg.zero_sum_skip and bool(mask.any()):
            sums = torch.segment_reduce(w - snap, "sum", lengths=self._lengths)
            if self.reduce is not None:  # a shard: the whole segments' sums
                sums = self.reduce(sums.to(torch.float64))
            mask = mask & (sums != 0).cpu()
        y = self._versions.take()
        new = self._new_model_buffer()
        y, new, coeffs = kernels.orthogonal_calibrate(
            x, sent, w, snap, self._offsets, beta_t,
            calibrate=mask, ma=ma, eps=cfg.eps, out_y=y, out_ma=new, return_coeffs=True,
            reduce=self.reduce,
        )  # fmt: skip
        # Both results are checked before anything changes (the client's next model is kept).
        try:
            self._require_finite(y, "the client's calibrated model")
            self._check_version(new)
        except NonFiniteResult:
            self._versions.retire(y)
            raise
        buffers = None
        if update.buffers is not None:
            # Calibrated exactly when norm segments would be (variant P skips an undrifted G_m).
            calibrate = cfg.calibrate_norm and (self.chain_mode or drifted)
            buffers = self._calibrated_buffers(cid, update.buffers, beta_t, calibrate)
        yb, new_b = buffers if buffers is not None else (None, None)
        self._require_finite_buffers(yb, "the client's calibrated float buffers")
        self._require_finite_buffers(new_b, "the next float buffers")
        self.last_coeffs = coeffs
        if buffers is not None:
            self._commit_buffers(cid, *buffers)
        version = self._publish(new)
        self._sent[cid] = y
        self._hold(("sent", cid), y)
        if self.chain_mode:
            self._chain = y
            self._hold(("chain",), y)
        else:
            prev = self._snap[cid]
            self._snap[cid] = self._host_copy(new, prev if self._host_snapshots else None)
            self._hold(("snap", cid), self._snap[cid])
        self._tau[cid] = version
        # Y is kept only through the leases above (and its jobs'): reused once they are gone.
        self._versions.retire(y)
        logger.debug("orthofl: %s t-tau=%d beta_t=%.4g -> v%d", cid, t_minus_tau, beta_t, version)
        return Outcome(Status.APPLIED, version)

    def _calibrated_buffers(
        self, cid: str, xb: torch.Tensor, beta_t: float, calibrate: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The [B] buffers through the same calibration and moving average as the weights:
        (the client's next buffers, the next global ones), not yet checked finite; nothing
        changes."""
        current = self.float_buffers.current
        assert current is not None
        if self.chain_mode:
            assert self._b_chain is not None
            w, snap, ma = self._b_chain, self._b_sent[cid], current
        else:
            w, snap, ma = current, self._b_snap[cid], None
        mask = self._b_all if calibrate else self._b_none
        # Float buffers live whole on one shard (ShardLayout): no reduce.
        yb, new_b = kernels.orthogonal_calibrate(
            xb, self._b_sent[cid], w, snap, self._b_offsets, beta_t,
            calibrate=mask, ma=ma, eps=self.config.eps,
        )  # fmt: skip
        if calibrate and self.checks.variance_index.numel():
            # A calibrated variance can come out negative (spec G6: clamp at 0).
            yb[self.checks.variance_index] = yb[self.checks.variance_index].clamp(min=0.0)
        return yb, new_b

    def _commit_buffers(self, cid: str, yb: torch.Tensor, new_b: torch.Tensor) -> None:
        """Keep the buffers :meth:`_calibrated_buffers` computed."""
        self.float_buffers.set(new_b)
        self._b_sent[cid] = yb
        if self.chain_mode:
            self._b_chain = yb
        else:
            self._b_snap[cid] = new_b

    # ----------------------------------------------------------------------- state

    def _extra_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "sent": dict(self._sent),
            "snap": dict(self._snap),
            "tau": dict(self._tau),
        }
        if self.chain_mode:
            state["chain"] = self._chain
        if self.float_buffers.enabled:
            state["buffers"] = {"sent": dict(self._b_sent), "snap": dict(self._b_snap),
                                "chain": self._b_chain}  # fmt: skip
        return state

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        def host(t: torch.Tensor) -> torch.Tensor:
            if not self._host_snapshots:
                return self._restored(t, self.dim, "D")
            _check_snapshot(t, self.dim, "D")
            return self._host_copy(t.detach().to(torch.float32), None)

        self._tau = {str(c): int(v) for c, v in state["tau"].items()}
        self._sent = {str(c): self._restored(t, self.dim, "D") for c, t in state["sent"].items()}
        self._snap = {str(c): host(t) for c, t in state["snap"].items()}
        if set(self._sent) != set(self._tau) or (
            not self.chain_mode and set(self._snap) != set(self._tau)
        ):
            raise ValueError("saved orthofl state has inconsistent per-client snapshots")
        if self.chain_mode:
            if "chain" not in state:
                raise ValueError("saved orthofl state has no client chain (variant C)")
            self._chain = self._restored(state["chain"], self.dim, "D")
        else:
            self._chain = None
        self._load_buffer_snapshots(state.get("buffers"))
        for lease in self._holds.values():
            lease.release()
        self._holds = {}
        for cid, t in self._sent.items():
            self._hold(("sent", cid), t)
        for cid, t in self._snap.items():
            self._hold(("snap", cid), t)
        self._hold(("chain",), self._chain)
        # Jobs that started from the same version may carry different client models: the base
        # class restored one tensor per version, so point every job at its client's C_m.
        for job_id, job in list(self.jobs.open.items()):
            sent = self._sent.get(job.client_id)
            if sent is None:
                raise ValueError(f"saved job {job_id} has no snapshot for {job.client_id!r}")
            tensors = dict(job.tensors)
            tensors["weights"] = sent
            if self.float_buffers.enabled:
                tensors["buffers"] = self._b_sent[job.client_id]
            self.jobs.open[job_id] = dataclasses.replace(
                job, tensors=types.MappingProxyType(tensors)
            )

    def _load_buffer_snapshots(self, state: Mapping[str, Any] | None) -> None:
        if not self.float_buffers.enabled:
            return
        if state is None:
            raise ValueError("saved orthofl state has no float-buffer snapshots")
        nb = self.float_buffers.numel
        self._b_sent = {str(c): self._restored(t, nb, "B") for c, t in state["sent"].items()}
        self._b_snap = {str(c): self._restored(t, nb, "B") for c, t in state["snap"].items()}
        if set(self._b_sent) != set(self._tau) or (
            not self.chain_mode and set(self._b_snap) != set(self._tau)
        ):
            raise ValueError("saved orthofl state has inconsistent float-buffer snapshots")
        self._b_chain = self._restored(state["chain"], nb, "B") if self.chain_mode else None

    def _restored(self, t: torch.Tensor, n: int, what: str) -> torch.Tensor:
        """A saved [n] snapshot as float32 on the strategy's device (a clear error otherwise);
        snapshots that shared a tensor live (clients sent the same version) share it again."""
        _check_snapshot(t, n, what)
        return self._restore(t)


def _check_snapshot(t: torch.Tensor, n: int, what: str) -> None:
    if tuple(t.shape) != (n,):
        raise ValueError(f"saved snapshot has shape {tuple(t.shape)}, {what}={n}")
