"""Client-level differential privacy for the strategies whose published model is a sum of
clipped contributions (FedAvg in both modes, FedProx, FedBuff, FedAsync, CA2FL): clipping,
Gaussian noise once per published version, and an accountant of what was really released
(docs/privacy.md). CA2FL's cached contributions are charged as its module docstring says.

**Mechanism.** Each accepted update's delta ``u`` (client weights minus its job's start
weights) is clipped to ``u * min(1, C / |u|)`` (``C = dp_clip_norm``, the whole model's L2
norm), so one contribution moves the strategy's running sum by at most ``w C`` (``w <= 1``, the
weight the strategy gives it). When a version is published, Gaussian noise ``N(0, (z C)^2 I)``
(``z = dp_noise_multiplier``) is added to that sum once, then the strategy divides and steps as
it always does (FedBuff's ``server_lr / M``, FedAvg's mean and server optimizer, FedAsync's
``alpha_s``): the noise is scaled as the aggregate is. FedAvg weighs every contribution alike
under DP (a weight by ``num_samples`` would let one client's weight, so its sensitivity, grow).

**Neighbouring federations** (``dp_neighbour``) differ in the content of one client's updates:
every update of that client replaced by zero ("zero_out", the default) or by anything
("replace_one", which doubles every sensitivity), while who contributed to which version, and
when, stays the same. Asynchronous arrivals are not a sampling step the server controls, so
they are not amplified, and the arrival pattern is treated as public (an observer of the
published versions sees their timing anyway); only sync FedAvg's Poisson sampling from a
secret key is (:mod:`aggsrv.strategies.dp_accounting`).

**Accounting.** A published version is a Gaussian mechanism on the clipped sum: for a client
whose contributions to that version weigh ``s`` in total (``s = 1`` for one unweighted update),
its sensitivity is ``s C`` against noise ``z C``: a Gaussian mechanism of mean ``mu_t = s / z``.
Gaussian mechanisms compose exactly into one with ``mu^2 = sum_t mu_t^2``, so the accountant
keeps one number per client, ``mu^2`` over the versions it contributed to (each with its own z,
so a resumed server may change z), and the guarantee of the run is that of the client with the
largest ``mu^2``: epsilon for ``dp_delta`` by ``dp_accountant`` (the exact Gaussian-DP
conversion by default, or dp-accounting's PLD or RDP accountant). A version is counted when it
is published; updates waiting in a buffer are not released yet.
``dp_target_epsilon`` refuses a release that would take any client past it, and from then on
the strategy publishes nothing more (:class:`PrivacyBudgetSpent`).

**Noise source.** :mod:`aggsrv.strategies.dp_noise`: a 256-bit key from the operating system,
held in memory only, every (shard, draw) its own AES-CTR stream, a ziggurat with a tail past 12
standard deviations, and two draws summed per value against floating-point attacks. A fixed
``dp_seed`` derives the key from a number for reproducible experiments (the simulator sets it
from the run's seed; ``aggsrv serve`` refuses it without ``dp_insecure_seed``). A restarted
server draws a fresh key, so the versions that recovery republishes from the log carry new
noise: each replayed release is charged twice.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from aggsrv.layout import ModelLayout
from aggsrv.strategies.dp_accounting import (
    ACCOUNTANT_KINDS,
    NEIGHBOUR_FACTORS,
    PrivacyAccountant,
    dp_accounting_module,
)
from aggsrv.strategies.dp_clipping import clip_norm_of, clipped_per_layer, private_delta
from aggsrv.strategies.dp_noise import PURPOSE_COUNT, NoiseKey, cipher_module, fill_gaussian
from aggsrv.strategies.errors import StrategyError
from aggsrv.strategies.job import Job
from aggsrv.values import Update

__all__ = [
    "DP_STRATEGIES",
    "GaussianPrivacy",
    "PrivacyBudgetSpent",
    "PrivacyConfig",
    "privacy_for",
    "refuse_privacy_keys",
]

logger = logging.getLogger(__name__)

DP_STRATEGIES = ("fedavg", "fedprox", "fedbuff", "fedasync", "ca2fl")
CLIPPING = ("server", "client")
LAYER_SPLITS = ("whole", "equal", "size")
# Client-side clipping: a delta up to this much above C is float rounding of a clipped one
# (scaled down to C exactly, not counted as clipped); a larger one is clipped by the server.
CLIENT_CLIP_SLACK = 1e-3


class PrivacyBudgetSpent(StrategyError, code="FAILED_PRECONDITION", reason="privacy_budget_spent"):
    """Publishing the next version would take the privacy loss past ``dp_target_epsilon``: the
    strategy publishes no more versions (updates already acknowledged stay in its state)."""


@dataclass
class PrivacyConfig:
    """The ``dp_`` keys (a mixin of the configs of :data:`DP_STRATEGIES`)."""

    HELP: ClassVar[Mapping[str, str]] = {
        "dp_clip_norm": "differential privacy: clip each update's delta to this L2 norm C; "
        "unset = no DP",
        "dp_noise_multiplier": "DP: Gaussian noise of std z * C on each published sum (z)",
        "dp_delta": "DP: the delta that epsilon is reported for",
        "dp_target_epsilon": "DP: publish no version that takes epsilon past this; unset = "
        "no limit",
        "dp_seed": "DP: a fixed noise seed, for reproducible experiments only; unset = a "
        "256-bit key from the OS",
        "dp_insecure_seed": "DP: let `aggsrv serve` run with dp_seed (its noise can then be "
        "recomputed and subtracted)",
        "dp_accountant": "DP: gdp (exact Gaussian-DP conversion), pld (privacy loss "
        "distributions) or rdp (Renyi DP)",
        "dp_neighbour": "DP: zero_out (one client's updates set to zero) or replace_one "
        "(replaced by any; doubles the sensitivity)",
        "dp_clipping": "DP: server (it clips) or client (the recipe asks clients to clip; the "
        "server clips the rest)",
        "dp_adaptive_quantile": "DP: move C toward this quantile of the update norms (Andrew et "
        "al. 2021); unset = C fixed",
        "dp_adaptive_lr": "DP: adaptive clipping's learning rate (C *= exp(-lr (b - quantile)))",
        "dp_adaptive_count_stddev": "DP: std of the noise on the count of unclipped updates; "
        "unset = contributions of the release / 20",
        "dp_clip_layers": "DP: whole (one norm) or per tensor: equal (C / sqrt(L) each) or size "
        "(C sqrt(n_l / D) each)",
    }

    dp_clip_norm: float | None = None
    dp_noise_multiplier: float = 0.0
    dp_delta: float = 1e-5
    dp_target_epsilon: float | None = None
    dp_seed: int | None = None
    dp_insecure_seed: bool = False
    dp_accountant: str = "gdp"
    dp_neighbour: str = "zero_out"
    dp_clipping: str = "server"
    dp_adaptive_quantile: float | None = None
    dp_adaptive_lr: float = 0.2
    dp_adaptive_count_stddev: float | None = None
    dp_clip_layers: str = "whole"

    @property
    def client_clip_norm(self) -> float | None:
        """The clipping norm a job's recipe asks the client to apply (client-side clipping)."""
        return self.dp_clip_norm if self.private and self.dp_clipping == "client" else None

    @property
    def private(self) -> bool:
        """Whether the ``dp_`` keys turn differential privacy on."""
        return self.dp_clip_norm is not None

    def check_privacy(self, aggregator: str = "mean") -> None:
        """Ranges, and that the keys make sense together (call from ``__post_init__``)."""
        # Plain floats (a numpy float64 from a program would not load back from a checkpoint).
        for key in (
            "dp_clip_norm",
            "dp_noise_multiplier",
            "dp_delta",
            "dp_target_epsilon",
            "dp_adaptive_quantile",
            "dp_adaptive_lr",
            "dp_adaptive_count_stddev",
        ):
            value = getattr(self, key)
            if value is not None:
                setattr(self, key, float(value))
        if self.dp_clip_layers not in LAYER_SPLITS:
            raise ValueError(
                f"dp_clip_layers must be one of {LAYER_SPLITS}, got {self.dp_clip_layers!r}"
            )
        if self.dp_clip_layers != "whole" and (
            self.dp_clipping == "client" or self.dp_adaptive_quantile is not None
        ):
            raise ValueError(
                "per-layer clipping (dp_clip_layers) is done by the server with a fixed C: "
                "use it with dp_clipping = 'server' and without dp_adaptive_quantile"
            )
        if self.dp_accountant not in ACCOUNTANT_KINDS:
            raise ValueError(
                f"dp_accountant must be one of {ACCOUNTANT_KINDS}, got {self.dp_accountant!r}"
            )
        if self.dp_neighbour not in NEIGHBOUR_FACTORS:
            raise ValueError(
                f"dp_neighbour must be one of {tuple(NEIGHBOUR_FACTORS)}, got {self.dp_neighbour!r}"
            )
        if self.dp_clipping not in CLIPPING:
            raise ValueError(f"dp_clipping must be one of {CLIPPING}, got {self.dp_clipping!r}")
        c = self.dp_clip_norm
        if c is not None and not (math.isfinite(c) and c > 0):
            raise ValueError(f"dp_clip_norm must be a finite number > 0 or unset, got {c}")
        z = self.dp_noise_multiplier
        if not (math.isfinite(z) and z >= 0):
            raise ValueError(f"dp_noise_multiplier must be a finite number >= 0, got {z}")
        if not 0.0 < self.dp_delta < 1.0:
            raise ValueError(f"dp_delta must be in (0, 1), got {self.dp_delta}")
        target = self.dp_target_epsilon
        if target is not None and not (math.isfinite(target) and target > 0):
            raise ValueError(f"dp_target_epsilon must be a finite number > 0, got {target}")
        if c is None:
            extra = [
                f.name for f in dataclasses.fields(PrivacyConfig)
                if f.name != "dp_clip_norm" and getattr(self, f.name) != f.default
            ]  # fmt: skip
            if extra:
                raise ValueError(
                    f"{', '.join(extra)} set without dp_clip_norm: differential privacy needs "
                    "a clipping norm (set dp_clip_norm, or leave the dp_ keys out)"
                )
            return
        if getattr(self, "max_update_norm", None) is not None:
            raise ValueError(
                "max_update_norm cannot be used with the dp_ keys (dp_clip_norm is set): it "
                "refuses an update because of its norm, and whether a version is then published "
                "reveals that norm, which the privacy guarantee does not cover. Differential "
                "privacy clips every update to dp_clip_norm instead: leave max_update_norm unset"
            )
        if aggregator != "mean":
            raise ValueError(
                f"differential privacy bounds a sum of clipped updates; the {aggregator!r} "
                "aggregator is not a sum, so its sensitivity is not bounded by the clipping "
                "norm: use aggregator = 'mean' with the dp_ keys"
            )
        q = self.dp_adaptive_quantile
        if q is not None:
            if not 0.0 < q < 1.0:
                raise ValueError(f"dp_adaptive_quantile must be in (0, 1), got {q}")
            if not (math.isfinite(self.dp_adaptive_lr) and self.dp_adaptive_lr > 0):
                raise ValueError(f"dp_adaptive_lr must be > 0, got {self.dp_adaptive_lr}")
            sb = self.dp_adaptive_count_stddev
            if sb is not None and not (math.isfinite(sb) and sb > 0):
                raise ValueError(f"dp_adaptive_count_stddev must be > 0 or unset, got {sb}")
            if self.dp_clipping == "client":
                raise ValueError(
                    "adaptive clipping (dp_adaptive_quantile) moves C after every release; "
                    "use it with dp_clipping = 'server' (a job's recipe is made once)"
                )
        if target is not None and z == 0:
            raise ValueError(
                "dp_target_epsilon needs dp_noise_multiplier > 0 (without noise the first "
                "release has epsilon = infinity)"
            )
        dp_accounting_module()  # fail at configuration, not at the first release
        cipher_module()


def refuse_privacy_keys(kind: str, keys: list[str]) -> None:
    """The error for ``dp_`` keys given to a strategy that does not support them."""
    raise ValueError(
        f"{kind} does not support differential privacy ({', '.join(keys)}): its published "
        "model is not a sum of clipped contributions that Gaussian noise can bound. The dp_ "
        f"keys work with {', '.join(DP_STRATEGIES)} (docs/privacy.md)"
    )


def privacy_for(
    config: object,
    layout: ModelLayout,
    device: torch.device,
    rank: int = 0,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> GaussianPrivacy | None:
    """The DP component a strategy holds for ``config`` (None unless its ``dp_`` keys turn
    differential privacy on). ``layout``: the strategy's (a shard's slice on a sharded server)."""
    if not (isinstance(config, PrivacyConfig) and config.private):
        return None
    if layout.buffer_numel:
        raise ValueError(
            f"differential privacy covers the model's weights, and this model has "
            f"{layout.buffer_numel} float buffer values (BatchNorm statistics) that would "
            "be published without noise: use a model without running statistics "
            "(GroupNorm or LayerNorm instead of BatchNorm) with the dp_ keys"
        )
    whole_offsets = getattr(layout, "whole", layout).offsets
    return GaussianPrivacy(
        config, layout.numel, device, rank, reduce,
        layer_sizes=torch.diff(whole_offsets).tolist(), layer_offsets=layout.offsets.tolist(),
    )  # fmt: skip


class GaussianPrivacy:
    """A strategy's DP machinery: each update's clipped delta and clip factor, the noise of
    each release, the accountant and the budget (``strategy.privacy``; None when DP is off)."""

    def __init__(
        self,
        config: PrivacyConfig,
        dim: int,
        device: torch.device,
        rank: int = 0,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        layer_sizes: list[int] | None = None,
        layer_offsets: list[int] | None = None,
    ) -> None:
        """``rank``/``reduce``: a shard's rank and the strategy's sum over the shards (None on
        one server), so that every shard moves an adaptive C alike. ``layer_sizes``: the whole
        model's layout tensors' sizes, ``layer_offsets`` where this strategy's slice of each
        starts (and the last ends), for per-layer clipping."""
        assert config.dp_clip_norm is not None
        self.rank = rank
        self.reduce = reduce
        # Per-layer clipping: each layout tensor's bound, their squares adding up to C^2.
        self.layer_bounds: list[float] | None = None
        if config.dp_clip_layers != "whole":
            sizes = layer_sizes or [dim]
            total = float(sum(sizes))
            c = float(config.dp_clip_norm)
            self.layer_bounds = [
                c / math.sqrt(len(sizes)) if config.dp_clip_layers == "equal"
                else c * math.sqrt(n / total)
                for n in sizes
            ]  # fmt: skip
        bounds = layer_offsets if layer_offsets is not None else [0, dim]
        self._segments = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        self._layer_scratch: torch.Tensor | None = None
        self._delta_scratch: torch.Tensor | None = None
        self.clip_norm = float(config.dp_clip_norm)
        self.client_side = config.dp_clipping == "client"
        # Adaptive clipping: the quantile C tracks, its rate, the count's noise (None: m / 20),
        # and the release being gathered: contributions and those not clipped.
        self.quantile = config.dp_adaptive_quantile
        self.adaptive_lr = config.dp_adaptive_lr
        self.count_stddev = config.dp_adaptive_count_stddev
        self.pending_count = 0
        self.pending_below = 0
        self.noise_multiplier = float(config.dp_noise_multiplier)
        self.target_epsilon = config.dp_target_epsilon
        self.accountant = PrivacyAccountant(
            self.noise_multiplier, config.dp_delta, kind=config.dp_accountant,
            neighbour=config.dp_neighbour,
        )  # fmt: skip
        self.dim = dim
        self.device = device
        self.exhausted = False  # a release was refused for the budget: no more versions
        # The noise's secret, in memory only (never in the state): a restarted server draws
        # a fresh one. A fixed dp_seed is for reproducible experiments (`aggsrv serve` refuses
        # it without dp_insecure_seed).
        self.key = (
            NoiseKey.insecure(config.dp_seed) if config.dp_seed is not None
            else NoiseKey.from_os()
        )  # fmt: skip
        self.draws = 0  # the update noises drawn (each draw its own stream)
        self.count_draws = 0  # adaptive clipping's noised counts drawn
        # Recovery replays the log: versions published before the crash are published again
        # with fresh noise, so each replayed release is charged twice (see end_recovery).
        self.recovering = False
        self._republished: list[tuple[dict[str, float], tuple[float, float] | None]] = []
        self._host_noise: np.ndarray | None = None
        self._noise: torch.Tensor | None = None
        self.clipped = 0  # updates whose delta was scaled down (not part of the state)
        self.last_noise_std = 0.0

    @property
    def adaptive(self) -> bool:
        return self.quantile is not None

    def split_noise(self, contributions: int) -> tuple[float, float | None]:
        """Adaptive clipping's split of the noise for a release of ``contributions``: the
        update's multiplier ``z_u`` and the count's std ``sigma_b``, so that the two releases
        together cost one Gaussian mechanism of multiplier z (Andrew et al. 2021, Theorem 1),
        which is what the accountant charges. The count's sensitivity is 1, not the paper's
        1/2: a zeroed-out update (norm 0) counts as unclipped where the real one may not, so
        its centred bit moves from -1/2 to +1/2; a replaced one moves it by 1 too. The update's
        sensitivity is ``k C``: ``k = 1`` under ``zero_out``, 2 under ``replace_one``. The
        squared means add up, ``(k / z_u)^2 + (1 / sigma_b)^2 = (k / z)^2``, so ``1/z_u^2 =
        1/z^2 - 1/(k sigma_b)^2`` (``zero_out``: the paper's ``1/z^2 = 1/z_u^2 +
        1/sigma_b^2``). ``(z, None)`` without adaptive clipping, and for a release that cannot
        afford the count (``k sigma_b <= z``): C then stays as it is."""
        z = self.noise_multiplier
        if not self.adaptive or contributions == 0:
            return z, None
        sigma = self.count_stddev if self.count_stddev is not None else contributions / 20.0
        if z == 0:
            return 0.0, 0.0
        wide = self.accountant.factor * sigma  # the count's noise per unit of the update's
        if wide <= z * (1.0 + 1e-9):
            return z, None
        return (z**-2 - wide**-2) ** -0.5, sigma

    def weight_of(self, weight: float) -> float:
        """A contribution's sensitivity in units of C for the accountant: its weight, or 1 under
        adaptive clipping (the count sees the update whatever its weight)."""
        return 1.0 if self.adaptive else weight

    def contribute(self, client: str, weight: float, factor: float) -> None:
        """A contribution of ``weight``, clipped by ``factor``, was folded into the release
        being gathered."""
        self.accountant.contribute(client, self.weight_of(weight))
        self.pending_count += 1
        self.pending_below += factor == 1.0

    def released(self) -> None:
        """The version was published: spend it, and under adaptive clipping move C with the
        noised share of unclipped updates. While recovery replays the log, the release is
        remembered: the version was (or may have been) published before the crash with other
        noise, and :meth:`end_recovery` charges it a second time."""
        if self.recovering and self.key.secure:
            acc = self.accountant
            if acc.pending or acc.sampled is not None:
                self._republished.append((dict(acc.pending), acc.round_key()))
        self.accountant.release()
        m, below = self.pending_count, self.pending_below
        self.pending_count = self.pending_below = 0
        if not self.adaptive or m == 0:
            return
        _, sigma = self.split_noise(m)
        if sigma is None:
            return
        draw = np.zeros(1, dtype=np.float64)
        if sigma > 0:
            fill_gaussian(self.key, self.rank, self.count_draws, draw, sigma, PURPOSE_COUNT)
            self.count_draws += 1
        noise = torch.from_numpy(draw).to(self.device)
        if self.reduce is not None:
            # Shards draw from streams of their own: rank 0's draw, the same C on every shard.
            if self.rank:
                noise.zero_()
            noise = self.reduce(noise)
        share = (below - m / 2.0 + float(noise[0])) / m + 0.5
        assert self.quantile is not None
        self.clip_norm *= math.exp(-self.adaptive_lr * (share - self.quantile))

    def clip_factor(self, norm: float) -> float:
        """``min(1, C / |u|)`` for a delta of L2 norm ``norm`` (float64, the whole model's).
        With client-side clipping a delta above C is clipped like any other, never refused: a
        refusal would publish (by the version that then does not appear) that the client's delta
        was large. A delta within ``C (1 + CLIENT_CLIP_SLACK)`` is float rounding of a clipped
        one and does not count as clipped."""
        if norm <= self.clip_norm:
            return 1.0
        if not (self.client_side and norm <= self.clip_norm * (1.0 + CLIENT_CLIP_SLACK)):
            self.clipped += 1
        return self.clip_norm / norm

    def clip_factor_of(self, update: Update, job: Job, delta: torch.Tensor | None = None) -> float:
        """:meth:`clip_factor` of an accepted update (``delta``: its delta, when the caller has
        built it already)."""
        return self.clip_factor(clip_norm_of(update, job, delta, self.reduce))

    def private_update(self, update: Update, job: Job) -> Update:
        """An accepted update as DP folds it in: its delta as a DELTA update (``non_finite``, a
        zero delta, when it held NaN/Inf), clipped per layer under ``dp_clip_layers``."""
        update = private_delta(update, job, self._delta_buffer, self.reduce)
        if self.layer_bounds is None:
            return update
        out = self._layer_buffer()
        return clipped_per_layer(update, job, out, self._segments, self.layer_factors, self.reduce)

    def _delta_buffer(self) -> torch.Tensor:
        """The [D] float32 buffer a WEIGHTS or NaN/Inf update's delta is written into (made on
        first use: DELTA uploads need none)."""
        if self._delta_scratch is None:
            self._delta_scratch = torch.empty(self.dim, dtype=torch.float32, device=self.device)
        return self._delta_scratch

    def _layer_buffer(self) -> torch.Tensor:
        """The [D] float32 buffer per-layer clipping writes an update's clipped delta into."""
        if self._layer_scratch is None:
            self._layer_scratch = torch.empty(self.dim, dtype=torch.float32, device=self.device)
        return self._layer_scratch

    def layer_factors(self, squares: list[float]) -> list[float]:
        """Per layer ``min(1, C_l / |u_l|)`` from the layers' squared norms (whole tensors)."""
        assert self.layer_bounds is not None
        factors = [
            1.0 if sq <= c * c else c / math.sqrt(sq)
            for sq, c in zip(squares, self.layer_bounds, strict=True)
        ]
        self.clipped += any(f < 1.0 for f in factors)
        return factors

    def require_budget(self, client: str | None = None, weight: float = 0.0) -> None:
        """Refuse (:class:`PrivacyBudgetSpent`) a release, with the pending contributions and
        ``weight`` more for ``client``, that would take epsilon past the target; changes nothing
        but the exhausted flag."""
        release = dict(self.accountant.pending)
        if client is not None:
            release[client] = release.get(client, 0.0) + self.weight_of(weight)
        self.require_budget_for(release)

    def require_budget_for(self, sensitivities: Mapping[str, float]) -> None:
        """:meth:`require_budget` for a release that charges each client its sensitivity (in
        units of C; CA2FL computes its own)."""
        if self.exhausted:
            raise PrivacyBudgetSpent(self._spent_text())
        if self.target_epsilon is None:
            return
        after = self.accountant.epsilon_of(self.accountant.worst_after(sensitivities))
        if after > self.target_epsilon:
            self._exhaust(after)

    def require_open(self) -> None:
        """Refuse (:class:`PrivacyBudgetSpent`) once the budget stopped the publications."""
        if self.exhausted:
            raise PrivacyBudgetSpent(self._spent_text())

    def set_release(self, sensitivities: Mapping[str, float]) -> None:
        """The release about to be published charges these per-client sensitivities."""
        self.accountant.pending = dict(sensitivities)
        self.pending_count = len(sensitivities)

    def _exhaust(self, after: float) -> None:
        self.exhausted = True
        message = (
            f"publishing the next version would take epsilon to {after:.4g}, past "
            f"dp_target_epsilon = {self.target_epsilon:g}: " + self._spent_text()
        )
        logger.warning("differential privacy: %s", message)
        raise PrivacyBudgetSpent(message)

    def _spent_text(self) -> str:
        return (
            f"the privacy budget is spent (epsilon = {self.accountant.epsilon():.4g} at delta = "
            f"{self.accountant.delta:g} after {self.accountant.releases} releases); the server "
            "publishes no more versions and takes no more updates"
        )

    def release_noise(self, extra: int = 0) -> torch.Tensor | None:
        """:meth:`noise` for the version about to be published, to add to the clipped sum before
        the strategy scales it (None without noise, z = 0). A release refused after the draw
        (its model would not be finite) has spent it: the next one is fresh, since the refusal,
        which everyone sees, depended on that draw."""
        return None if self.noise_multiplier == 0 else self.noise(extra)

    def noise(self, extra: int = 0) -> torch.Tensor:
        """A fresh [D] float64 draw of N(0, (z C)^2) for a release of the pending contributions
        and ``extra`` more (a scratch buffer, overwritten by the next draw), from the secure
        sampler (:mod:`aggsrv.strategies.dp_noise`) on the CPU, then moved to the model's
        device. Every call is a new draw (a refused release's draw is never used again)."""
        if self._host_noise is None:
            self._host_noise = np.empty(self.dim, dtype=np.float64)
            host = torch.from_numpy(self._host_noise)
            self._noise = host if self.device.type == "cpu" else host.to(self.device)
        std = self.split_noise(self.pending_count + extra)[0] * self.clip_norm
        fill_gaussian(self.key, self.rank, self.draws, self._host_noise, std)
        self.draws += 1
        assert self._noise is not None
        if self.device.type != "cpu":
            self._noise.copy_(torch.from_numpy(self._host_noise))
        self.last_noise_std = std
        return self._noise

    def begin_recovery(self) -> None:
        """Recovery starts replaying the log: the releases it makes are remembered. The replay
        itself is charged as the live server was (so its budget checks decide alike)."""
        self.recovering = True
        self._republished = []

    def end_recovery(self) -> None:
        """Recovery ended: every release it made was published a second time with fresh noise
        (a new key), so each is charged again; if that takes epsilon past the target, the budget
        is spent now."""
        self.recovering = False
        for pending, round_key in self._republished:
            self.accountant.republished(pending, round_key)
        self._republished = []
        target = self.target_epsilon
        if target is not None and not self.exhausted:
            eps = self.accountant.epsilon()
            if eps > target:
                self.exhausted = True
                logger.warning(
                    "differential privacy: the versions republished by recovery took epsilon to "
                    "%.4g, past dp_target_epsilon = %g: %s", eps, target, self._spent_text()
                )  # fmt: skip

    def snapshot(self) -> dict[str, Any]:
        """What has been spent, for status and metrics (any thread: reads plain values)."""
        return {
            "epsilon": self.accountant.epsilon(),
            "delta": self.accountant.delta,
            "clip_norm": self.clip_norm,
            "noise_multiplier": self.noise_multiplier,
            "releases": self.accountant.releases,
            "target_epsilon": self.target_epsilon,
            "budget_spent": self.exhausted,
            "updates_clipped": self.clipped,
        }

    def state(self) -> dict[str, Any]:
        return {
            **self.accountant.state(),
            # The stream's position, not its key: a seeded (insecure) run resumed from here
            # goes on with fresh draws; a secure key is never saved.
            "noise_draws": self.draws,
            "count_draws": self.count_draws,
            "exhausted": self.exhausted,
            "clip_norm": self.clip_norm,
            "pending_count": self.pending_count,
            "pending_below": self.pending_below,
        }

    def load(self, state: Mapping[str, Any]) -> None:
        self.accountant.load(state)
        self.draws = int(state.get("noise_draws", 0))
        self.count_draws = int(state.get("count_draws", 0))
        self.exhausted = bool(state["exhausted"])
        if self.adaptive:  # the C it had moved to; a fixed C is the config's
            self.clip_norm = float(state["clip_norm"])
        self.pending_count = int(state["pending_count"])
        self.pending_below = int(state["pending_below"])
