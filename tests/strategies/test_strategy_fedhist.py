"""The ``fedhist`` and ``twafl`` strategies (docs/algorithms/fedhist.md 1.2-1.4, 5, 6) against an
independent float64 numpy oracle of the section 1.4 pseudocode that materialises the fused rows
and g_pred; the TWAFL reduction, INA's norm invariant, the set S on a hand-computed schedule,
determinism, state dicts that resume bit-exactly, refusals that change nothing, the default
history, float buffers and the epoch recipe's gradient scale."""

from __future__ import annotations

import dataclasses
import io
import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from state_helpers import assert_same_state

from aggsrv.layout import ModelLayout
from aggsrv.strategies import make_strategy
from aggsrv.strategies.errors import InvalidUpdate
from aggsrv.strategies.fedhist import TWAFL, FedHist, FedHistConfig, TWAFLConfig
from aggsrv.strategies.fedhist_ops import (
    RoundInputs,
    aggregate_round,
    egs_fuse,
    haa_weights,
    ina_combine,
    temporal_weight,
)
from aggsrv.values import Status, Update, UpdateKind

# D = 4*7 + 4 + 5 = 37, odd, over three tensors.
LAYOUT = ModelLayout.from_named_shapes([("fc.weight", (4, 7)), ("fc.bias", (4,)), ("head.b", (5,))])
D = LAYOUT.numel
DECAY = math.e / 2.0


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------- oracle


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 0.0 if na == 0 or nb == 0 else float(a @ b / (na * nb))


class Oracle:
    """Spec 1.4 in plain float64 numpy: fused rows g~_i and g_pred are materialised."""

    def __init__(
        self,
        w0: np.ndarray,
        *,
        k: int,
        h: int,
        alpha: float,
        lam: float,
        gamma: float,
        sim_t: float,
        eta: float,
        rescale: bool = True,
        raw_norms: bool = False,
        include_current: bool = True,
    ) -> None:
        self.w = np.array(w0, dtype=np.float64)
        self.k, self.h, self.alpha, self.lam, self.gamma = k, h, alpha, lam, gamma
        self.sim_t, self.eta, self.rescale, self.raw_norms = sim_t, eta, rescale, raw_norms
        self.include_current = include_current
        self.version = 0
        self.G: list[np.ndarray] = []  # global gradients, oldest first
        self.L: dict[int, list[tuple[str, int, int, np.ndarray]]] = {}  # round -> (c, v, tau, g)
        self.buf: list[tuple[str, int, np.ndarray]] = []
        self.ubar: dict[str, float] = {}
        self.S: dict[int, list[tuple[int, int]]] = {}  # round r -> S as (round, row)
        self.stats: Counter[str] = Counter()

    def submit(self, client: str, v: int, g: np.ndarray) -> None:
        self.buf.append((client, v, np.asarray(g, dtype=np.float64)))
        if len(self.buf) == self.k:
            self._aggregate()

    def _aggregate(self) -> None:
        r = self.version + 1
        clients = [c for c, _, _ in self.buf]
        vs = [v for _, v, _ in self.buf]
        gs = [g for _, _, g in self.buf]
        taus = [r - v for v in vs]
        # EGS: least similar cached global gradient; ties to the most recent; zero g not fused
        fused = []
        for g in gs:
            if self.alpha != 0 and self.G and np.linalg.norm(g) > 0:
                cos = [_cos(g, gj) for gj in self.G]
                best = len(self.G) - 1
                for j in range(len(self.G) - 2, -1, -1):
                    if cos[j] < cos[best]:
                        best = j
                fused.append(g + self.alpha * self.G[best])
                self.stats["fused"] += 1
                self.stats[f"chose{len(self.G) - 1 - best}"] += 1
            else:
                fused.append(g.copy())
        # HAA
        raw = np.array(
            [
                DECAY ** (-t) + self.lam * self.ubar.get(c, 0.0)
                for t, c in zip(taus, clients, strict=True)
            ]
        )
        self.stats["clamped"] += int((raw < 0).sum())
        p = np.maximum(raw, 0.0)
        if p.sum() <= 0:
            self.stats["fallback"] += 1
            p = np.array([DECAY ** (-(t - min(taus))) for t in taus])
        p = p / p.sum()
        # INA
        a = sum(pi * fi for pi, fi in zip(p, fused, strict=True))
        if self.rescale:
            m = np.mean([np.linalg.norm(x) for x in (gs if self.raw_norms else fused)])
            na = np.linalg.norm(a)
            g_glob = a * (m / na) if na > 0 else np.zeros_like(a)
        else:
            g_glob = a
        self.w = self.w - self.eta * g_glob
        self.version = r
        self.G.append(g_glob)
        if len(self.G) > self.h:
            self.G.pop(0)
        self.L[r] = [(c, v, t, g) for c, v, t, g in zip(clients, vs, taus, gs, strict=True)]
        self.buf = []
        # hindsight
        q = r - self.h
        if q < 1:
            return
        last = r if self.include_current else r - 1
        members = [
            (t, i) for t in range(q, last + 1) for i, u in enumerate(self.L[t]) if u[1] == q - 1
        ]
        self.S[r] = members
        if members:
            g_pred = np.mean([self.L[t][i][3] for t, i in members], axis=0)
            for c, _, tau_his, g in self.L[q]:
                s = _cos(g, g_pred)
                d = DECAY ** (-tau_his)
                ph = 1.0 - d if s >= self.sim_t else d
                self.stats["reward" if s >= self.sim_t else "penalty"] += 1
                util = (s - self.sim_t) * ph * len(members)
                self.ubar[c] = (1.0 - self.gamma) * self.ubar.get(c, 0.0) + self.gamma * util
        del self.L[q]


# ------------------------------------------------------------------------------------------- driver


class Driver:
    """Feeds a strategy a reproducible random schedule: arrival order by per-client rates (slow
    clients stay stale for several rounds), deltas with a shared direction (so cosines fall on
    both sides of sim_T), both update kinds, 1 or 2 local steps."""

    def __init__(
        self,
        s: FedHist,
        seed: int,
        rates: list[float],
    ) -> None:
        self.s = s
        self.gen = _gen(seed)
        self.ids = [f"c{i}" for i in range(len(rates))]
        self.rates = torch.tensor(rates, dtype=torch.float64)
        self.kinds = (UpdateKind.DELTA, UpdateKind.WEIGHTS)
        self.common = torch.randn(D, generator=self.gen)
        self.n = 0
        self.sent_buffers: list[torch.Tensor] = []  # float buffers of the current round
        for c in self.ids:
            s.on_register(c, 0.0)
            assert s.job_for(c, 0.0) is not None

    def copy_for(self, s: FedHist) -> Driver:
        """The same schedule from here on, for another strategy in the same state."""
        other = Driver.__new__(Driver)
        other.__dict__.update(self.__dict__)
        other.s = s
        other.gen = torch.Generator()
        other.gen.set_state(self.gen.get_state())
        return other

    def step(self) -> tuple[str, int, np.ndarray, Any]:
        """Submit one update; returns (client, base version, float64 gradient, outcome)."""
        s = self.s
        ready = [i for i, c in enumerate(self.ids) if s.outstanding_job(c) is not None]
        pick = ready[int(torch.multinomial(self.rates[ready], 1, generator=self.gen))]
        cid = self.ids[pick]
        job = s.outstanding_job(cid)
        coef = float(torch.rand(1, generator=self.gen)) * 1.6 - 0.3
        scale = 0.02 + 0.1 * float(torch.rand(1, generator=self.gen))
        delta = scale * (coef * self.common + torch.randn(D, generator=self.gen))
        kind = self.kinds[int(torch.randint(len(self.kinds), (1,), generator=self.gen))]
        work = float(int(torch.randint(1, 3, (1,), generator=self.gen)))
        tensor = delta if kind is UpdateKind.DELTA else job.weights + delta
        buffers = _bn_buffers(self.gen) if s.float_buffers.enabled else None
        self.n += 1
        upd = Update(
            cid, job.job_id, job.base_version, f"u{self.n}", 10, work, kind, tensor, buffers
        )
        steps = s.steps_of(upd, job)
        lr = job.recipe.learning_rate
        if kind is UpdateKind.DELTA:
            g = -delta.double().numpy() / (lr * steps)
        else:
            g = -(tensor.double() - job.weights.double()).numpy() / (lr * steps)
        out = s.on_update(upd, float(self.n))
        if buffers is not None:
            self.sent_buffers.append(buffers)
        if out.status is Status.BUFFERED:
            assert s.job_for(cid, float(self.n)) is None  # waits in the round
        else:
            for c in self.ids:
                if s.outstanding_job(c) is None:
                    assert s.job_for(c, float(self.n)).base_version == s.version
        return cid, job.base_version, g, out

    def round(self) -> list[tuple[str, int, np.ndarray]]:
        """Submit until a round aggregates; the round's (client, base version, gradient)."""
        rows = []
        self.sent_buffers = []
        while True:
            cid, v, g, out = self.step()
            rows.append((cid, v, g))
            if out.status is Status.APPLIED:
                return rows


def _bn_buffers(g: torch.Generator) -> torch.Tensor:
    b = torch.randn(8, generator=g)
    b[4:] = torch.rand(4, generator=g) + 0.1  # running_var
    return b


RATES = [1.0, 1.0, 1.0, 1.0, 0.8, 0.25, 0.1]  # c5, c6 lag behind


def _fedhist(initial: torch.Tensor, name: str = "fedhist", **cfg: Any) -> FedHist:
    return make_strategy(name, layout=LAYOUT, initial=initial, config=cfg)


# ---------------------------------------------------------------------------------------- 1. oracle


@pytest.mark.parametrize(("include_current", "ina_norms"), [(True, "fused"), (False, "raw")])
def test_matches_an_independent_float64_oracle_over_a_random_schedule(
    include_current: bool, ina_norms: str
) -> None:
    k, h, alpha, lam, gamma, sim_t, lr, eta = 3, 2, 0.5, 5.0, 0.3, 0.3, 0.1, 0.05
    w0 = torch.randn(D, generator=_gen(11))
    s = _fedhist(
        w0,
        buffer_size=k,
        history=h,
        alpha=alpha,
        lam=lam,
        gamma=gamma,
        sim_threshold=sim_t,
        learning_rate=lr,
        server_lr=eta,
        ina_norms=ina_norms,
        include_current_round=include_current,
        seed=5,
    )
    oracle = Oracle(
        w0.double().numpy(),
        k=k,
        h=h,
        alpha=alpha,
        lam=lam,
        gamma=gamma,
        sim_t=sim_t,
        eta=eta,
        raw_norms=ina_norms == "raw",
        include_current=include_current,
    )
    seen_s: dict[int, list[tuple[int, int]]] = {}
    orig = s.relatively_fresh

    def spy(r: int, hh: int) -> list[tuple[int, list[int]]]:
        res = orig(r, hh)
        seen_s[r] = [(t, i) for t, rows in res for i in rows]
        return res

    s.relatively_fresh = spy  # type: ignore[method-assign]
    drv = Driver(s, seed=12, rates=RATES)
    stale_taus = []
    for r in range(1, 23):
        for cid, v, g in drv.round():
            oracle.submit(cid, v, g)
            stale_taus.append(r - v)
        assert s.version == oracle.version == r
        w = s.global_model().double().numpy()
        err = np.linalg.norm(w - oracle.w) / np.linalg.norm(oracle.w)
        assert err < 1e-5, (r, err)
        assert set(s.ubar) == set(oracle.ubar), r
        for c, u in oracle.ubar.items():
            assert s.ubar[c] == pytest.approx(u, abs=1e-5), (r, c)
    assert seen_s == oracle.S  # the same S every round (as (round, row) pairs)
    # every mechanism fired: stale updates, EGS picking older and newer rows, hindsight
    # rewards and penalties, the clamp
    assert max(stale_taus) >= 4
    st = oracle.stats
    assert st["fused"] > 0 and st["chose0"] > 0 and st["chose1"] > 0, st
    assert st["reward"] > 0 and st["penalty"] > 0, st
    assert st["clamped"] > 0 and s.clamped_weights == st["clamped"], st
    assert s.fallback_rounds == st["fallback"]
    assert s.evaluations == sum(1 for m in oracle.S.values() if m)
    assert any(u < 0 for u in oracle.ubar.values()) and any(u > 0 for u in oracle.ubar.values())


# ----------------------------------------------------------------------------------------- 2. TWAFL


def test_twafl_is_the_staleness_weighted_step_and_fedhist_reduces_to_it_bitwise() -> None:
    k, lr = 3, 0.1
    w0 = torch.randn(D, generator=_gen(21))
    tw = _fedhist(w0, "twafl", buffer_size=k, learning_rate=lr)
    assert isinstance(tw, TWAFL)
    fh = _fedhist(w0, buffer_size=k, learning_rate=lr, alpha=0.0, lam=0.0, rescale=False)
    dt, df = Driver(tw, 22, RATES), Driver(fh, 22, RATES)
    taus_seen = set()
    for r in range(1, 13):
        w_old = tw.global_model().double()
        rows = dt.round()
        rows_f = df.round()
        assert [(c, v) for c, v, _ in rows] == [(c, v) for c, v, _ in rows_f]
        taus = [r - v for _, v, _ in rows]
        taus_seen.update(taus)
        p = torch.tensor([DECAY ** (-t) for t in taus], dtype=torch.float64)
        p /= p.sum()
        want = w_old - lr * sum(
            pi * torch.from_numpy(g) for pi, (_, _, g) in zip(p, rows, strict=True)
        )
        err = (tw.global_model().double() - want).norm() / want.norm()
        assert err < 1e-6, (r, err)
        assert torch.equal(tw.global_model(), fh.global_model()), r
    assert len(taus_seen) >= 3 and tw.ubar == {} and tw.clamped_weights == 0


@pytest.mark.parametrize(
    "bad", [{"alpha": 0.1}, {"lam": 0.1}, {"rescale": True}, {"alpha": 0.1, "lam": 0.2}]
)
def test_twafl_config_refuses_fedhist_mechanisms(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="twafl is FedHist with alpha = 0"):
        TWAFLConfig(**bad)
    with pytest.raises(ValueError, match="twafl is FedHist"):
        TWAFLConfig.from_dict(bad)
    cfg = TWAFLConfig()
    assert (cfg.alpha, cfg.lam, cfg.rescale) == (0.0, 0.0, False)


@pytest.mark.parametrize("cls", [FedHistConfig, TWAFLConfig])
def test_defaults_and_the_paper_preset(cls: type[FedHistConfig]) -> None:
    """Defaults: K = 5 and eta = 0.1 (the server step, server_lr None), one mini-batch step per
    job; ``preset = "paper"`` gives the spec's K = 10 and eta = 0.01 and nothing else changes
    (FedHist's other paper values are its defaults), and keys beside it win."""
    d = cls()
    assert (d.buffer_size, d.learning_rate, d.server_lr, d.effective_server_lr) == (
        5,
        0.1,
        None,
        0.1,
    )
    assert (d.local_steps, d.local_epochs, d.preset) == (1, None, None)
    paper = cls.from_dict({"preset": "paper"})
    assert (paper.buffer_size, paper.learning_rate, paper.effective_server_lr) == (10, 0.01, 0.01)
    assert paper.local_steps == 1 and paper.history is None
    changed = {"buffer_size": 10, "learning_rate": 0.01, "preset": "paper"}
    assert dataclasses.replace(d, **changed) == paper
    assert "paper" in cls.PRESET_NOTES
    assert cls.from_dict({"preset": "paper", "buffer_size": 3}).buffer_size == 3
    assert cls.from_dict({"preset": "paper", "local_epochs": 1.0}).local_steps is None
    if cls is FedHistConfig:
        assert (paper.alpha, paper.lam, paper.gamma, paper.sim_threshold, paper.rescale) == (
            0.1, 0.1, 0.2, 0.3, True
        )  # fmt: skip


@pytest.mark.parametrize("kind", [UpdateKind.DELTA, UpdateKind.WEIGHTS])
@pytest.mark.parametrize("name", ["twafl", "fedhist"])
def test_one_fresh_update_with_k1_lands_on_the_clients_weights(name: str, kind: UpdateKind) -> None:
    g = _gen(31)
    w0 = torch.randn(D, generator=g)
    s = _fedhist(w0, name, buffer_size=1, learning_rate=0.05)  # server_lr None: = lr
    assert s.config.server_lr is None
    s.on_register("a", 0.0)
    job = s.job_for("a", 0.0)
    delta = 0.1 * torch.randn(D, generator=g)
    final = job.weights + delta
    tensor = delta if kind is UpdateKind.DELTA else final
    out = s.on_update(Update("a", job.job_id, 0, "u", 10, 1.0, kind, tensor), 1.0)
    assert (out.status, out.version) == (Status.APPLIED, 1)
    torch.testing.assert_close(s.global_model(), final, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------- 3. INA


def test_ina_step_norm_is_the_mean_fused_norm_of_the_round() -> None:
    k, h, alpha, lam, lr, eta = 3, 2, 0.5, 0.5, 0.1, 1.0
    s = _fedhist(
        0.001 * torch.randn(D, generator=_gen(41)),
        buffer_size=k,
        history=h,
        alpha=alpha,
        lam=lam,
        learning_rate=lr,
        server_lr=eta,
    )
    drv = Driver(s, 42, RATES)
    fused_rounds = 0
    for r in range(1, 9):
        extra = s.state_dict()["extra"]
        hist = extra["g"][extra["g_order"]] if extra["g_order"] else None
        ubar = dict(s.ubar)
        w_old = s.global_model().double()
        rows = drv.round()
        local = torch.stack([torch.from_numpy(g) for _, _, g in rows]).float()
        fused, chosen = egs_fuse(local, hist, alpha)
        fused_rounds += chosen is not None
        m = float(fused.double().norm(dim=1).mean())
        step = w_old - s.global_model().double()
        assert float(step.norm()) / eta == pytest.approx(m, rel=1e-6), r
        # the new history row is g_glob (before eta): same norm, INA's exactly
        extra = s.state_dict()["extra"]
        g_glob = extra["g"][extra["g_order"][-1]].double()
        assert float(g_glob.norm()) == pytest.approx(m, rel=1e-6), r
        # direction: the HAA-weighted sum of the fused rows
        p = haa_weights([r - v for _, v, _ in rows], [ubar.get(c, 0.0) for c, _, _ in rows], lam)
        a = (p[:, None] * fused.double()).sum(0)
        assert float(torch.dot(a, step) / (a.norm() * step.norm())) > 1 - 1e-6, r
    assert fused_rounds >= 6


def _reference_round(local, history, recency, taus, utils, alpha, lam, raw_norms):
    ordered = history[list(recency)]
    fused, pos = egs_fuse(local, ordered, alpha)
    chosen = torch.where(pos >= 0, torch.as_tensor(recency)[pos.clamp(min=0)], -1)
    p = haa_weights(taus, utils, lam)
    out = ina_combine(fused, p, norms_of=local if raw_norms else None)
    return out, chosen, fused, p


def _aggregate(local, history, recency, taus, utils, alpha, lam, raw_norms=False):
    out = torch.empty(local.shape[1])
    inputs = RoundInputs(
        local,
        local.double().norm(dim=1),
        history,
        history.double().norm(dim=1),
        recency,
        taus,
        utils,
        alpha=alpha,
        lam=lam,
        raw_norms=raw_norms,
    )
    res = aggregate_round(inputs, out=out)
    return out, res


@pytest.mark.parametrize("raw_norms", [False, True])
def test_aggregate_round_equals_the_materialised_reference(raw_norms: bool) -> None:
    g = _gen(51)
    k, hrows = 5, 6
    local = torch.randn(k, D, generator=g) * torch.rand(k, 1, generator=g).add(0.5)
    history = torch.randn(hrows, D, generator=g) * 3.0
    recency = [4, 0, 5, 2]  # oldest first, not row order; rows 1 and 3 are not in the history
    # the invalid rows are the least similar of all: they must never be chosen
    history[1] = -local.sum(0) * 10
    history[3] = -local[0] * 7
    local[3] = 0.0  # a zero local row is not fused
    taus, utils = [1, 3, 2, 6, 1], [0.2, -0.1, 0.0, 0.3, -0.05]
    alpha, lam = 0.4, 0.3
    out, res = _aggregate(local, history, recency, taus, utils, alpha, lam, raw_norms)
    want, chosen, fused, p = _reference_round(
        local, history, recency, taus, utils, alpha, lam, raw_norms
    )
    assert res.chosen.tolist() == chosen.tolist()
    assert res.chosen[3] == -1
    assert set(res.chosen.tolist()) <= {-1, *recency}
    assert len(set(res.chosen.tolist())) >= 3  # several rows chosen
    assert torch.equal(fused[3], local[3])
    torch.testing.assert_close(res.weights, p)
    assert (res.clamped, res.fallback) == (0, False)
    torch.testing.assert_close(res.fused_norms, fused.double().norm(dim=1), rtol=1e-6, atol=0)
    assert float((out.double() - want.double()).norm() / want.double().norm()) < 1e-6
    assert res.scale == pytest.approx(
        float(want.double().norm() / (p[:, None] * fused.double()).sum(0).norm()), rel=1e-6
    )
    # the choice is the argmin of a float64 cosine (spec 6.3)
    nh = history.double().numpy()
    for i in (0, 1, 2, 4):
        cos = [_cos(local[i].double().numpy(), nh[j]) for j in recency]
        assert recency[int(np.argmin(cos))] == int(res.chosen[i]), i


def test_aggregate_round_ties_go_to_the_most_recent_row_in_ring_order() -> None:
    """Two identical history rows; ring order [4, 5, 0, 2] makes row 0 newer than row 5 (row
    order would say the opposite). Small integers keep every dot product exact, so the tie is
    exact whatever the summation order."""
    g = _gen(52)
    history = torch.randint(-3, 4, (6, D), generator=g).float()
    history[5] = history[0]
    recency = [4, 5, 0, 2]
    local = torch.randint(-3, 4, (4, D), generator=g).float()
    local[0] = -history[0]
    local[1] = -2 * history[0]
    local[2] = -history[0] + 0  # same direction, different row
    local[3] = 0.0
    taus, utils = [1, 2, 3, 1], [0.0] * 4
    out, res = _aggregate(local, history, recency, taus, utils, 0.5, 0.1)
    assert res.chosen.tolist() == [0, 0, 0, -1]
    want, chosen, fused, _ = _reference_round(local, history, recency, taus, utils, 0.5, 0.1, False)
    assert chosen.tolist() == [0, 0, 0, -1]
    assert torch.equal(fused[3], local[3])
    assert float((out.double() - want.double()).norm() / want.double().norm()) < 1e-6
    # reversing the ring order flips the winner to row 5
    _, res = _aggregate(local, history, [2, 0, 5, 4], taus, utils, 0.5, 0.1)
    assert res.chosen.tolist() == [5, 5, 5, -1]


def test_exact_ties_between_identical_history_rows_with_generic_local_rows() -> None:
    g = _gen(51)
    local = torch.randn(64, D, generator=g)
    history = torch.randn(6, D, generator=g)
    history[5] = history[0]
    recency = [4, 0, 5, 2]  # row 5 is the newer copy
    # make the duplicated row the least similar for every local row
    history[[4, 2]] = local[:2].abs() + 1.0
    local = -local.abs() * 0.1 + history[0] * -1.0
    _, res = _aggregate(local, history, recency, [1] * 64, [0.0] * 64, 0.5, 0.1)
    assert res.chosen.tolist() == [5] * 64


# --------------------------------------------------------------------------------------------- 4. S


class Script:
    """Submits updates by client name; after a round every client without a job gets one."""

    def __init__(self, s: FedHist, clients: str) -> None:
        self.s, self.clients, self.n = s, clients, 0
        self.gen = _gen(61)
        for c in clients:
            s.on_register(c, 0.0)
            s.job_for(c, 0.0)

    def submit(self, cid: str, base: int) -> Any:
        job = self.s.outstanding_job(cid)
        assert job is not None and job.base_version == base, (cid, base)
        self.n += 1
        delta = 0.1 * torch.randn(D, generator=self.gen)
        upd = Update(cid, job.job_id, base, f"u{self.n}", 10, 1.0, UpdateKind.DELTA, delta)
        out = self.s.on_update(upd, float(self.n))
        if out.status is Status.APPLIED:
            for c in self.clients:
                if self.s.outstanding_job(c) is None:
                    self.s.job_for(c, float(self.n))
        return out


# (client, base version) per round, K = 2, h = 2
SCHEDULE = [
    [("a", 0), ("b", 0)],  # r1
    [("c", 0), ("a", 1)],  # r2
    [("b", 1), ("d", 0)],  # r3: q = 1, base 0
    [("c", 2), ("b", 3)],  # r4: q = 2, base 1
    [("d", 3), ("a", 2)],  # r5: q = 3, base 2 (round 3 had no fresh update)
    [("d", 5), ("a", 5)],  # r6: q = 4, base 3
    [("d", 6), ("b", 4)],  # r7: q = 5, base 4 (only in the current round)
    [("c", 4), ("a", 6)],  # r8: q = 6, base 5
]
# round r -> S as {round: rows}, written out by hand from the schedule
S_WITH_CURRENT = {
    3: {1: [0, 1], 2: [0], 3: [1]},
    4: {2: [1], 3: [0]},
    5: {4: [0], 5: [1]},
    6: {4: [1], 5: [0]},
    7: {7: [1]},
    8: {6: [0, 1]},
}
S_WITHOUT_CURRENT = {
    3: {1: [0, 1], 2: [0]},
    4: {2: [1], 3: [0]},
    5: {4: [0]},
    6: {4: [1], 5: [0]},
    7: {},
    8: {6: [0, 1]},
}


@pytest.mark.parametrize("include_current", [True, False])
def test_relatively_fresh_set_on_a_scripted_schedule(include_current: bool) -> None:
    s = _fedhist(
        torch.randn(D, generator=_gen(60)),
        buffer_size=2,
        history=2,
        alpha=0.2,
        lam=0.5,
        include_current_round=include_current,
    )
    seen: dict[int, dict[int, list[int]]] = {}
    orig = s.relatively_fresh

    def spy(r: int, h: int) -> list[tuple[int, list[int]]]:
        res = orig(r, h)
        seen[r] = dict(res)
        return res

    s.relatively_fresh = spy  # type: ignore[method-assign]
    script = Script(s, "abcd")
    evaluated = {3: "ab", 4: "ca", 5: "bd", 6: "cb", 7: "da", 8: "da"}  # round q's clients
    for r, arrivals in enumerate(SCHEDULE, start=1):
        before = dict(s.ubar)
        for cid, base in arrivals:
            out = script.submit(cid, base)
        assert (out.status, out.version) == (Status.APPLIED, r)
        if r >= 3 and seen[r]:
            # only round q's clients change
            changed = {c for c in s.ubar if s.ubar[c] != before.get(c)}
            assert changed == set(evaluated[r]), r
        else:
            assert s.ubar == before, r
    want = S_WITH_CURRENT if include_current else S_WITHOUT_CURRENT
    assert seen == want
    assert s.evaluations == sum(1 for m in want.values() if m)


# --------------------------------------------------------------------------------------- 5. weights


@pytest.mark.parametrize(
    ("taus", "utils", "lam"),
    [
        ([300, 301, 350, 1000, 5000], [0.0] * 5, 0.1),  # tiny or underflowing staleness terms
        ([5000, 5001, 6000], [0.0] * 3, 0.0),  # every term is exactly 0 in float64: fallback
        ([1, 2, 3, 40], [-1e6, -1e6, -1e3, -5.0], 0.1),  # all clamp: fallback
        ([300, 320, 400], [-1e9, -1e9, -1e9], 10.0),
        ([300, 1, 2], [-1e9, 0.5, -1e9], 1.0),
    ],
)
def test_haa_weights_stay_a_distribution(taus: list[int], utils: list[float], lam: float) -> None:
    p = haa_weights(taus, utils, lam)
    assert p.dtype == torch.float64 and p.shape == (len(taus),)
    assert bool(torch.isfinite(p).all()) and bool((p >= 0).all())
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-12)
    assert int(torch.argmax(p)) == int(np.argmin(taus))  # the freshest keeps the most weight
    # and a round with such weights gives a finite global gradient
    g = _gen(70)
    local = torch.randn(len(taus), D, generator=g)
    out, res = _aggregate(local, torch.randn(2, D, generator=g), [1, 0], taus, utils, 0.2, lam)
    assert bool(torch.isfinite(out).all()) and float(out.norm()) > 0
    torch.testing.assert_close(res.weights, p)


# ----------------------------------------------------------------------------------- 6. determinism


def test_same_seed_and_schedule_give_bitwise_identical_models() -> None:
    cfg = {"buffer_size": 3, "history": 2, "alpha": 0.3, "lam": 2.0, "seed": 9}
    w0 = torch.randn(D, generator=_gen(80))
    a, b = _fedhist(w0, **cfg), _fedhist(w0.clone(), **cfg)
    da, db = Driver(a, 81, RATES), Driver(b, 81, RATES)
    for r in range(1, 16):
        da.round()
        db.round()
        assert torch.equal(a.global_model(), b.global_model()), r
        assert a.ubar == b.ubar, r
    assert a.evaluations > 0 and a.ubar
    assert_same_state(a.state_dict(), b.state_dict())


# ----------------------------------------------------------------------------------------- 7. state


STATE_CFG = {"buffer_size": 3, "history": 2, "alpha": 0.5, "lam": 2.0, "server_lr": 0.05}


def _reload(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize(("rounds", "extra_steps"), [(1, 2), (4, 1)])
def test_state_dict_round_trip_resumes_bit_exactly(rounds: int, extra_steps: int) -> None:
    a = _fedhist(torch.randn(D, generator=_gen(90)), **STATE_CFG)
    da = Driver(a, 91, RATES)
    for _ in range(rounds):
        da.round()
    for _ in range(extra_steps):
        assert da.step()[3].status is Status.BUFFERED
    state = a.state_dict()
    extra = state["extra"]
    assert len(extra["cur_meta"]) == extra_steps  # mid-round
    if rounds >= 3:  # hindsight has started: L, G and Ubar are all populated
        assert extra["rounds"] and extra["g_order"] and extra["ubar"] and a.evaluations > 0
        assert extra["g_order"] != sorted(extra["g_order"])  # the ring has wrapped
    b = _fedhist(torch.ones(D), **STATE_CFG)
    b.load_state_dict(_reload(state))
    assert_same_state(a.state_dict(), b.state_dict())
    db = da.copy_for(b)
    for r in range(6):
        da.round()
        db.round()
        assert torch.equal(a.global_model(), b.global_model()), r
        assert a.ubar == b.ubar, r
    assert a.evaluations > 0
    assert_same_state(a.state_dict(), b.state_dict())


def test_load_state_dict_refuses_a_full_round() -> None:
    a = _fedhist(torch.randn(D, generator=_gen(92)), **STATE_CFG)
    da = Driver(a, 93, RATES)
    da.round()
    da.step()
    da.step()
    state = a.state_dict()  # two of three buffered
    smaller = _fedhist(torch.zeros(D), **{**STATE_CFG, "buffer_size": 2})
    with pytest.raises(ValueError, match="saved round holds 2 updates; buffer_size=2"):
        smaller.load_state_dict(_reload(state))
    forged = _reload(state)
    x = forged["extra"]
    x["cur_meta"].append(["c6", 0])
    x["cur"] = torch.cat([x["cur"], x["cur"][:1]])
    x["cur_norms"] = torch.cat([x["cur_norms"], x["cur_norms"][:1]])
    target = _fedhist(torch.zeros(D), **STATE_CFG)
    untouched = target.state_dict()
    with pytest.raises(ValueError, match="saved round holds 3 updates; buffer_size=3"):
        target.load_state_dict(forged)
    assert_same_state(untouched, target.state_dict())  # a refused state changes nothing


# -------------------------------------------------------------------------------------- 8. refusals


@pytest.mark.parametrize("kind", [UpdateKind.DELTA, UpdateKind.WEIGHTS])
def test_refused_updates_change_nothing_and_buffered_clients_wait(kind: UpdateKind) -> None:
    s = _fedhist(
        torch.randn(D, generator=_gen(100)), **{**STATE_CFG, "local_steps": 2, "buffer_size": 3}
    )
    drv = Driver(s, 101, RATES)
    for _ in range(4):
        drv.round()
    buffered = []
    for _ in range(2):
        cid, _, _, out = drv.step()
        assert out.status is Status.BUFFERED
        buffered.append(cid)
    version = s.version
    for cid in buffered:
        assert s.job_for(cid, 50.0) is None and s.outstanding_job(cid) is None
    cid = next(c for c in drv.ids if c not in buffered)
    job = s.job_for(cid, 50.0)
    delta = 0.1 * torch.randn(D, generator=_gen(102))
    tensor = delta if kind is UpdateKind.DELTA else job.weights + delta
    before = s.state_dict()
    bad = Update(cid, job.job_id, job.base_version, "bad", 10, 0.0, kind, tensor)
    with pytest.raises(InvalidUpdate, match="no local step"):
        s.on_update(bad, 51.0)  # would have been the round's K-th update
    assert_same_state(before, s.state_dict())
    assert s.version == version and s.buffered == 2
    # the job survives the refusal: the same client completes the round with a valid update
    good = Update(cid, job.job_id, job.base_version, "good", 10, 2.0, kind, tensor)
    out = s.on_update(good, 52.0)
    assert (out.status, out.version) == (Status.APPLIED, version + 1)
    for c in [*buffered, cid]:
        job = s.job_for(c, 53.0)
        assert job is not None and job.base_version == version + 1
        assert torch.equal(job.weights, s.global_model())


def test_epoch_recipe_refuses_an_update_without_samples() -> None:
    s = _fedhist(torch.randn(D, generator=_gen(103)), buffer_size=2, local_epochs=1.0)
    s.on_register("a", 0.0)
    job = s.job_for("a", 0.0)
    before = s.state_dict()
    upd = Update("a", job.job_id, 0, "u", 0, 1.0, UpdateKind.DELTA, torch.ones(D))
    with pytest.raises(InvalidUpdate, match="num_samples=0"):
        s.on_update(upd, 1.0)
    assert_same_state(before, s.state_dict())


# --------------------------------------------------------------------------------------- 9. history


@pytest.mark.parametrize(("n", "k", "h"), [(7, 2, 2), (7, 3, 2), (4, 3, 1), (20, 2, 5)])
def test_default_history_is_ceil_n_over_2k_at_the_first_aggregation(n: int, k: int, h: int) -> None:
    s = _fedhist(torch.randn(D, generator=_gen(110)), buffer_size=k, lam=0.5)
    assert s.config.history is None and s.history is None
    drv = Driver(s, 111, [1.0] * n)
    drv.round()
    assert s.history == h == math.ceil(n / (2 * k))
    s.on_register("late", 5.0)  # N grows, h does not
    s.job_for("late", 5.0)
    for r in range(2, h + 3):
        drv.round()
        extra = s.state_dict()["extra"]
        assert s.history == h and extra["history"] == h
        assert len(extra["g_order"]) == min(r, h)
        # hindsight starts at round h + 1 (round 1's fresh updates make S non-empty)
        assert s.evaluations == max(0, r - h), r


# -------------------------------------------------------------------------------------- 10. buffers

BN_LAYOUT = ModelLayout(
    [("fc.weight", (4, 7)), ("bn.weight", (4,)), ("bn.bias", (4,)), ("head.bias", (1,))],
    [("bn.running_mean", (4,)), ("bn.running_var", (4,))],
    norm_flags=[False, True, True, False],
)


def test_float_buffers_are_the_haa_weighted_mean_of_the_round() -> None:
    assert BN_LAYOUT.numel == D and BN_LAYOUT.buffer_numel == 8
    g = _gen(120)
    lam = 3.0
    s = make_strategy(
        "fedhist",
        layout=BN_LAYOUT,
        initial=torch.randn(D, generator=g),
        initial_buffers=_bn_buffers(g),
        config={"buffer_size": 3, "history": 1, "alpha": 0.3, "lam": lam},
    )
    drv = Driver(s, 121, RATES)
    uneven = 0
    for r in range(1, 9):
        ubar = dict(s.ubar)
        rows = drv.round()
        taus = [r - v for _, v, _ in rows]
        p = haa_weights(taus, [ubar.get(c, 0.0) for c, _, _ in rows], lam)
        stale = torch.tensor([temporal_weight(t) for t in taus], dtype=torch.float64)
        uneven += not torch.allclose(p, stale / stale.sum())  # Ubar moved the weights
        want = (p[:, None] * torch.stack(drv.sent_buffers).double()).sum(0)
        torch.testing.assert_close(s.global_buffers().double(), want, rtol=0, atol=1e-6)
        job = s.job_for(rows[0][0], 100.0 + r)
        assert torch.equal(job.tensors["buffers"], s.global_buffers())
    assert uneven >= 3


# --------------------------------------------------------------------------------------- 11. epochs


@pytest.mark.parametrize(
    ("num_samples", "batch_size", "work_done", "steps"),
    [(21, 8, 2.0, 6.0), (8, 8, 0.5, 0.5), (1, 32, 1.0, 1.0), (33, 32, 1.5, 3.0)],
)
@pytest.mark.parametrize("kind", [UpdateKind.DELTA, UpdateKind.WEIGHTS])
def test_epoch_recipe_divides_by_work_times_batches(
    num_samples: int, batch_size: int, work_done: float, steps: float, kind: UpdateKind
) -> None:
    g = _gen(130)
    w0 = torch.randn(D, generator=g)
    lr, eta = 0.1, 0.7
    cfg = FedHistConfig(
        buffer_size=1,
        alpha=0.0,
        lam=0.0,
        rescale=False,
        local_epochs=1.0,
        batch_size=batch_size,
        learning_rate=lr,
        server_lr=eta,
    )
    s = FedHist(LAYOUT, w0, cfg)
    s.on_register("a", 0.0)
    job = s.job_for("a", 0.0)
    assert job.recipe.local_steps is None and job.recipe.local_epochs == 1.0
    delta = 0.05 * torch.randn(D, generator=g)
    tensor = delta if kind is UpdateKind.DELTA else job.weights + delta
    upd = Update("a", job.job_id, 0, "u", num_samples, work_done, kind, tensor)
    assert s.steps_of(upd, job) == steps
    assert s.on_update(upd, 1.0).status is Status.APPLIED
    d = delta.double() if kind is UpdateKind.DELTA else tensor.double() - w0.double()
    want = w0.double() - eta * (-d / (lr * steps))
    torch.testing.assert_close(s.global_model().double(), want, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------- fewer than K


@pytest.mark.parametrize("name", ["twafl", "fedhist"])
def test_fewer_registered_clients_than_k_aggregate_every_client(name: str) -> None:
    g = _gen(140)
    w0 = torch.randn(D, generator=g)
    lr = 0.1
    s = _fedhist(w0, name, buffer_size=3, learning_rate=lr)
    for c in "ab":
        s.on_register(c, 0.0)
    deltas = {c: 0.1 * torch.randn(D, generator=g) for c in "ab"}
    outs = []
    for i, c in enumerate("ab"):
        job = s.job_for(c, 0.0)
        upd = Update(c, job.job_id, 0, f"u{i}", 10, 1.0, UpdateKind.DELTA, deltas[c])
        outs.append(s.on_update(upd, 1.0))
    assert [(o.status, o.version) for o in outs] == [(Status.BUFFERED, 0), (Status.APPLIED, 1)]
    # both fresh (tau 1): equal weights; round 1 has no history to fuse
    grads = torch.stack([-deltas[c].double() / lr for c in "ab"])
    a = grads.mean(0)
    if name == "fedhist":  # INA: the mean input norm
        a = a * grads.norm(dim=1).mean() / a.norm()
    torch.testing.assert_close(
        s.global_model().double(), w0.double() - lr * a, rtol=1e-6, atol=1e-6
    )
    assert all(s.job_for(c, 2.0).base_version == 1 for c in "ab")
