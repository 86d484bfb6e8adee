"""ORTHOFL (both variants) against hand-computed traces and a float64 oracle of
docs/algorithms/orthofl.md 1.4 / 1.6 ("spec" below)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from state_helpers import assert_same_state as _same

from aggsrv.layout import ModelLayout
from aggsrv.strategies.fedasync import FedAsync
from aggsrv.strategies.job import Job
from aggsrv.strategies.orthofl import OrthoFL, OrthoFLConfig
from aggsrv.values import Status, Update, UpdateKind

F64 = torch.float64

# Hand traces: two calibrated segments and one normalisation segment, two elements each.
TINY = ModelLayout.from_named_shapes(
    [("fc.weight", (2,)), ("fc.bias", (2,)), ("bn.weight", (2,))], norm_names=["bn"]
)
# Random traces: a few segments of odd sizes, one of them a norm layer.
LAYOUT = ModelLayout.from_named_shapes(
    [("c.weight", (3, 5)), ("c.bias", (3,)), ("norm.weight", (3,)), ("norm.bias", (3,)),
     ("fc.weight", (2, 6)), ("fc.bias", (2,))],
    norm_names=["norm"],
)  # fmt: skip
D = LAYOUT.numel


def make_update(job: Job, weights: torch.Tensor, kind: UpdateKind = UpdateKind.WEIGHTS) -> Update:
    tensor = weights.clone() if kind is UpdateKind.WEIGHTS else weights - job.weights
    return Update(
        client_id=job.client_id,
        job_id=job.job_id,
        base_version=job.base_version,
        update_id=f"{job.client_id}-{job.job_id}",
        num_samples=10,
        work_done=job.recipe.work_target,
        kind=kind,
        tensor=tensor,
    )


def t32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def tiny(variant: str = "ma_global", **config: Any) -> OrthoFL:
    cfg = {"beta": 0.5, "a": 1.0, "shift_source": variant, **config}
    s = OrthoFL(layout=TINY, initial=t32(1, 2, 3, 4, 5, 6), config=cfg)
    for c in ("A", "B"):
        s.on_register(c, 0.0)
    return s


# ----------------------------------------------------------------------------- hand traces


def test_hand_trace_paper_variant() -> None:
    """Spec 1.4 by hand (beta = 0.5, a = 1: beta_t = 0.5 / (t - tau)); every value is dyadic,
    so the float32 results are exact."""
    s = tiny()
    ja, jb = s.job_for("A", 0.0), s.job_for("B", 0.0)
    assert torch.equal(ja.weights, t32(1, 2, 3, 4, 5, 6)) and torch.equal(jb.weights, ja.weights)
    # t=1, A (t - tau = 1): no calibration, Y = X; W1 = (W0 + X) / 2.
    xa = t32(2, 2, 3, 6, 6, 6)
    out = s.on_update(make_update(ja, xa), 1.0)
    assert out.status is Status.APPLIED and out.version == 1
    assert torch.equal(s.global_model(), t32(1.5, 2, 3, 5, 5.5, 6))
    ja2 = s.job_for("A", 1.0)
    assert torch.equal(ja2.weights, xa) and ja2.base_version == 1
    # t=2, B (tau = 0, t - tau = 2, beta_t = 0.25). dW = W1 - W0 = [.5,0 | 0,1 | .5,0];
    # dm = X - W0 = [1,1 | 2,2 | -1,1]; c = [0.5/2, 2/8] = [.25, .25];
    # Y = X + dW - c dm = [2.25,2.75 | 4.5,6.5] and Y = X = [4,7] on the norm segment.
    xb = t32(2, 3, 5, 6, 4, 7)
    s.on_update(make_update(jb, xb, UpdateKind.DELTA), 2.0)
    assert s.last_coeffs is not None and s.last_coeffs.tolist() == [0.25, 0.25, 0.0]
    assert torch.equal(s.global_model(), t32(1.625, 2.25, 3.5, 5.25, 5.125, 6.25))
    jb2 = s.job_for("B", 2.0)
    assert torch.equal(jb2.weights, t32(2.25, 2.75, 4.5, 6.5, 4, 7))
    # t=3, A again (tau_A = 1, t - tau = 2). G_A = W1, C_A = xa; dm = [2,0 | 0,-2 | 1,1];
    # dW = W2 - W1 = [.125,.25 | .5,.25 | ...]; c = [.25/4, -.5/4] = [.0625, -.125] (the
    # opposing component is removed too); Y = [4,2.25 | 3.5,4 | 7,7].
    xa2 = t32(4, 2, 3, 4, 7, 7)
    s.on_update(make_update(ja2, xa2), 3.0)
    assert s.last_coeffs.tolist() == [0.0625, -0.125, 0.0]
    assert torch.equal(s.job_for("A", 3.0).weights, t32(4, 2.25, 3.5, 4, 7, 7))
    assert torch.equal(s.global_model(), t32(2.21875, 2.1875, 3.375, 4.9375, 5.59375, 6.4375))
    assert s.version == 3


def test_late_job_request_mixes_with_the_staleness_of_its_job() -> None:
    """t - tau = s + 1 with the server's s = version - job.base_version, also when the client
    asks for its next job after other updates landed (tau_m, the version of G_m, is older than
    the job). By hand (beta = 0.5, a = 1): A's update makes v1, B's v2 (s = 1, beta_t = 0.25),
    then A asks for its job at v2 and uploads at v2: s = 0, beta_t = 0.5, where counting from
    A's last aggregation (v1) would give 0.25. The shift is still measured from G_A = W1, the
    global A's model was calibrated against, so Y is the same as in the trace above."""
    s = tiny()
    ja, jb = s.job_for("A", 0.0), s.job_for("B", 0.0)
    s.on_update(make_update(ja, t32(2, 2, 3, 6, 6, 6)), 1.0)
    s.on_update(make_update(jb, t32(2, 3, 5, 6, 4, 7)), 2.0)
    assert torch.equal(s.global_model(), t32(1.625, 2.25, 3.5, 5.25, 5.125, 6.25))
    ja2 = s.job_for("A", 2.0)
    assert ja2.base_version == 2 and s.client_tau("A") == 1
    assert torch.equal(ja2.weights, t32(2, 2, 3, 6, 6, 6))  # Y_A from v1, unchanged
    s.on_update(make_update(ja2, t32(4, 2, 3, 4, 7, 7)), 3.0)
    assert s.last_coeffs is not None and s.last_coeffs.tolist() == [0.0625, -0.125, 0.0]
    assert torch.equal(s.job_for("A", 3.0).weights, t32(4, 2.25, 3.5, 4, 7, 7))
    # W3 = W2 / 2 + X / 2.
    assert torch.equal(s.global_model(), t32(2.8125, 2.125, 3.25, 4.625, 6.0625, 6.625))


def test_hand_trace_code_variant() -> None:
    """Spec 1.6 by hand: Y = V + (1 - c) (X - S_m), A is the evaluated moving average."""
    s = tiny("client_chain")
    ja, jb = s.job_for("A", 0.0), s.job_for("B", 0.0)
    xa = t32(2, 2, 3, 6, 6, 6)
    s.on_update(make_update(ja, xa), 1.0)
    assert torch.equal(s.global_model(), t32(1.5, 2, 3, 5, 5.5, 6))  # A1
    assert torch.equal(s.job_for("A", 1.0).weights, xa)  # V1 = Y_A = X_A (no shift yet)
    # B: S_B = W0, V1 - S_B = [1,0 | 0,2 | 1,0], dm = [1,1 | 2,2 | -1,1]; c = [.5, .5];
    # Y = V1 + (1 - c) dm = [2.5,2.5 | 4,7] and X on the norm segment.
    s.on_update(make_update(jb, t32(2, 3, 5, 6, 4, 7)), 2.0)
    assert s.last_coeffs.tolist() == [0.5, 0.5, 0.0]
    assert torch.equal(s.job_for("B", 2.0).weights, t32(2.5, 2.5, 4, 7, 4, 7))
    assert torch.equal(s.global_model(), t32(1.625, 2.25, 3.5, 5.25, 5.125, 6.25))  # A2


def test_first_update_alpha_one_and_zero_sum_skip() -> None:
    """The released code's quirks: alpha = 1 for the very first update; a segment whose shift
    sums to exactly 0 is not calibrated."""
    s = tiny("client_chain", first_update_alpha_one=True)
    ja = s.job_for("A", 0.0)
    xa = t32(2, 1, 3, 5, 6, 6)  # shift seen by B: [1,-1 | 0,1 | ...]: segment 0 sums to 0
    s.on_update(make_update(ja, xa), 1.0)
    assert torch.equal(s.global_model(), xa)
    xb = t32(2, 3, 5, 6, 4, 7)
    ref = tiny("client_chain", first_update_alpha_one=True)
    s2 = tiny("client_chain", first_update_alpha_one=True, zero_sum_skip=True)
    for strat in (ref, s2):
        a, b = strat.job_for("A", 0.0), strat.job_for("B", 0.0)
        strat.on_update(make_update(a, xa), 1.0)
        strat.on_update(make_update(b, xb), 2.0)
    # Segment 0: dm = [1,1], shift [1,-1]: c = 0, Y = X + shift = [3,2] without the flag,
    # Y = X = [2,3] with it. Segment 1: shift [0,1] sums to 1: calibrated in both.
    assert ref.job_for("B", 2.0).weights[:2].tolist() == [3.0, 2.0]
    assert s2.job_for("B", 2.0).weights[:2].tolist() == [2.0, 3.0]
    assert torch.equal(ref.job_for("B", 2.0).weights[2:], s2.job_for("B", 2.0).weights[2:])


def test_mixing_weights_by_hand() -> None:
    s = OrthoFL(layout=TINY, initial=t32(1, 2, 3, 4, 5, 6))  # beta 0.6, a 0.5 (paper)
    assert s.mixing_weight(1) == pytest.approx(0.6, abs=0, rel=1e-15)
    assert s.mixing_weight(2) == pytest.approx(0.6 / math.sqrt(2), rel=1e-15)
    assert s.mixing_weight(4) == pytest.approx(0.3, rel=1e-15)
    assert s.mixing_weight(9) == pytest.approx(0.2, rel=1e-15)
    with pytest.raises(ValueError):
        s.mixing_weight(0)


def test_moving_average_uses_t_minus_tau_equal_to_s_plus_one(gen: torch.Generator) -> None:
    """A client whose job is 3 versions old (s = 3) is mixed in with beta (s + 1)^-a."""
    init = torch.randn(D, generator=gen)
    s = OrthoFL(layout=LAYOUT, initial=init, config={"beta": 0.6, "a": 0.5})
    for c in "ABCD":
        s.on_register(c, 0.0)
    jobs = {c: s.job_for(c, 0.0) for c in "ABCD"}
    for c in "BCD":
        s.on_update(make_update(jobs[c], jobs[c].weights + torch.randn(D, generator=gen)), 1.0)
    assert s.staleness(jobs["A"]) == 3
    w = s.global_model().clone()
    x = jobs["A"].weights + 0.1 * torch.randn(D, generator=gen)
    s.on_update(make_update(jobs["A"], x), 2.0)
    beta = 0.6 * 4**-0.5
    expect = (1 - beta) * w.to(F64) + beta * x.to(F64)
    torch.testing.assert_close(s.global_model().to(F64), expect, rtol=1e-6, atol=1e-6)


def test_no_delay_identity_y_equals_x_and_fedasync_ma(gen: torch.Generator) -> None:
    """Acceptance check 2: the same client twice in a row gets Y == X bit for bit, and W
    follows the FedAsync moving average with beta_t = beta."""
    init = torch.randn(D, generator=gen)
    s = OrthoFL(layout=LAYOUT, initial=init)
    fa = FedAsync(layout=LAYOUT, initial=init, config={"alpha": 0.6, "a": 0.5})
    for strat in (s, fa):
        strat.on_register("A", 0.0)
    for step in range(4):
        job, fjob = s.job_for("A", float(step)), fa.job_for("A", float(step))
        x = job.weights + 0.1 * torch.randn(D, generator=gen)
        s.on_update(make_update(job, x), float(step))
        assert torch.equal(s.job_for("A", float(step)).weights, x)
        assert not s.last_coeffs.any()
        # FedAsync's client starts from the global, ORTHOFL's from its own Y: feed FedAsync
        # the same final weights X (WEIGHTS update) and the models agree to rounding.
        fa.on_update(make_update(fjob, x), float(step))
        torch.testing.assert_close(s.global_model(), fa.global_model(), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- oracle


class Oracle:
    """Spec 1.4 (variant P) and 1.6 (variant C) literally, float64, per-segment loops."""

    def __init__(self, init: torch.Tensor, layout: ModelLayout, variant: str, **cfg: Any):
        self.W = init.to(F64).clone()
        self.V = self.W.clone()  # variant C chain
        o = layout.offsets.tolist()
        self.segs = list(zip(o[:-1], o[1:], strict=True))
        self.norm = layout.is_norm.tolist()
        self.variant = variant
        self.beta, self.a = cfg.get("beta", 0.6), cfg.get("a", 0.5)
        self.C: dict[str, torch.Tensor] = {}
        self.G: dict[str, torch.Tensor] = {}
        self.tau: dict[str, int] = {}
        self.t = 0

    def weights_for(self, c: str) -> torch.Tensor:
        if c not in self.tau:
            self.C[c] = (self.V if self.variant == "client_chain" else self.W).clone()
            self.G[c] = self.W.clone()
            self.tau[c] = self.t
        return self.C[c]

    def arrive(self, c: str, x32: torch.Tensor, base: int) -> None:
        """Client c's weights from a job that started from version ``base``: t - tau = s + 1
        with s = (versions so far) - base; the shift is measured from G_c."""
        x = x32.to(F64)
        beta_t = self.beta * (self.t + 1 - base) ** -self.a
        chain = self.variant == "client_chain"
        shift = (self.V - self.C[c]) if chain else (self.W - self.G[c])
        dm = x - self.C[c]
        y = x.clone()
        for seg, (s, e) in enumerate(self.segs):
            if self.norm[seg]:
                continue
            b = float(dm[s:e] @ dm[s:e])
            coef = float(shift[s:e] @ dm[s:e]) / b if b > 0 else 0.0
            y[s:e] = x[s:e] + shift[s:e] - coef * dm[s:e]
        self.W = (1 - beta_t) * self.W + beta_t * x
        self.t += 1
        self.C[c], self.G[c], self.tau[c] = y, self.W.clone(), self.t
        if chain:
            self.V = y


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> None:
    err = float((a.to(F64) - b.to(F64)).norm())
    assert err <= rel * max(float(b.norm()), 1e-12), (err, float(b.norm()))


@pytest.mark.parametrize("variant", ["ma_global", "client_chain"])
def test_random_trace_matches_float64_oracle(variant: str, gen: torch.Generator) -> None:
    """Five clients, random arrival order, WEIGHTS and DELTA updates, some late job requests:
    Y (the next job's weights) and the published model follow the oracle step by step (the
    oracle is re-synced to the strategy's float32 values after each check, so rounding does
    not compound through large coefficients); calibrated segments of Y - X are orthogonal to
    the client's update (acceptance check 1); norm segments of Y are X bit for bit."""
    init = torch.randn(D, generator=gen)
    s = OrthoFL(layout=LAYOUT, initial=init, config={"shift_source": variant})
    o = Oracle(init, LAYOUT, variant)
    clients = [f"c{i}" for i in range(5)]
    jobs: dict[str, Job] = {}
    for c in clients:
        s.on_register(c, 0.0)
        jobs[c] = s.job_for(c, 0.0)
        close(jobs[c].weights, o.weights_for(c))
    idle: list[str] = []
    norm = torch.repeat_interleave(LAYOUT.is_norm, LAYOUT.offsets.diff())
    segs = list(zip(LAYOUT.offsets[:-1].tolist(), LAYOUT.offsets[1:].tolist(), strict=True))
    for step in range(40):
        c = clients[int(torch.randint(len(clients), (1,), generator=gen))]
        if c in idle:  # a late job request: other updates landed since its last one
            idle.remove(c)
            jobs[c] = s.job_for(c, float(step))
            close(jobs[c].weights, o.weights_for(c))
            o.C[c] = jobs[c].weights.to(F64)
            continue
        job = jobs.pop(c)
        x = job.weights + 0.1 * torch.randn(D, generator=gen)
        kind = UpdateKind.DELTA if step % 3 == 0 else UpdateKind.WEIGHTS
        out = s.on_update(make_update(job, x, kind), float(step))
        assert out.status is Status.APPLIED and out.version == o.t + 1
        o.arrive(c, x, job.base_version)
        close(s.global_model(), o.W)
        o.W = s.global_model().to(F64)
        o.G[c] = o.W.clone()
        y = s._sent[c]  # the calibrated model waiting for the client's next job
        close(y, o.C[c])
        o.C[c] = y.to(F64)
        if variant == "client_chain":
            o.V = o.C[c].clone()
        assert torch.equal(y[norm], x[norm])
        # |<P, dm>| <= 1e-5 |P| |dm| per calibrated segment, plus float32 rounding of Y.
        p, dm = (y - x).to(F64), (x - job.weights).to(F64)
        for seg, (a, b) in enumerate(segs):
            if not LAYOUT.is_norm[seg]:
                n_dm = float(dm[a:b].norm())
                bound = 1e-5 * float(p[a:b].norm()) * n_dm + 1e-6 * float(y[a:b].norm()) * n_dm
                assert abs(float(p[a:b] @ dm[a:b])) <= bound
        if step % 4 == 1:
            idle.append(c)
            continue
        jobs[c] = s.job_for(c, float(step))
        assert jobs[c].weights is y


def test_calibrate_norm_calibrates_norm_segments(gen: torch.Generator) -> None:
    """calibrate_norm=True (the pure-paper reading) calibrates norm segments too."""
    init = torch.randn(D, generator=gen)
    out = {}
    for flag in (False, True):
        s = OrthoFL(layout=LAYOUT, initial=init, config={"calibrate_norm": flag})
        g = torch.Generator().manual_seed(7)
        for c in "AB":
            s.on_register(c, 0.0)
        ja, jb = s.job_for("A", 0.0), s.job_for("B", 0.0)
        s.on_update(make_update(ja, ja.weights + torch.randn(D, generator=g)), 1.0)
        xb = jb.weights + torch.randn(D, generator=g)
        s.on_update(make_update(jb, xb), 2.0)
        out[flag] = (s.job_for("B", 2.0).weights, xb, s.last_coeffs)
    norm = torch.repeat_interleave(LAYOUT.is_norm, LAYOUT.offsets.diff())
    assert torch.equal(out[False][0][norm], out[False][1][norm])
    assert not torch.equal(out[True][0][norm], out[True][1][norm])
    assert torch.equal(out[False][0][~norm], out[True][0][~norm])
    assert (out[False][2][LAYOUT.is_norm] == 0).all() and (out[True][2][LAYOUT.is_norm] != 0).all()


# ----------------------------------------------------------------------------- state


def _drive(s: OrthoFL, g: torch.Generator, steps: int, start: int) -> None:
    """Deterministic continuation: clients in a fixed rotation, updates from generator g."""
    for i in range(start, start + steps):
        c = "ABC"[i % 3]
        job = s.outstanding_job(c) or s.job_for(c, float(i))
        x = job.weights + 0.1 * torch.randn(D, generator=g)
        s.on_update(make_update(job, x, UpdateKind.DELTA if i % 2 else UpdateKind.WEIGHTS), i)
        if c != "C":  # C asks late: its pending Y waits without a job
            s.job_for(c, float(i))


@pytest.mark.parametrize("variant", ["ma_global", "client_chain"])
def test_state_dict_resumes_bit_exactly(variant: str, gen: torch.Generator) -> None:
    init = torch.randn(D, generator=gen)
    cfg = {"shift_source": variant}
    s = OrthoFL(layout=LAYOUT, initial=init, config=cfg)
    for c in "ABC":
        s.on_register(c, 0.0)
    _drive(s, gen, 7, 0)
    # Two jobs from the same version carrying different client models (C asks late).
    jc, ja = s.job_for("C", 7.0), s.outstanding_job("A")
    assert ja is not None and ja.base_version == jc.base_version == s.version
    assert not torch.equal(ja.weights, jc.weights)
    state = s.state_dict()
    r = OrthoFL(layout=LAYOUT, initial=torch.zeros(D), config=cfg)
    r.load_state_dict(state)
    _same(r.state_dict(), state)
    for c in "ABC":
        assert torch.equal(r.outstanding_job(c).weights, s.outstanding_job(c).weights)
    seed = int(torch.randint(2**31, (1,), generator=gen))
    _drive(s, torch.Generator().manual_seed(seed), 8, 7)
    _drive(r, torch.Generator().manual_seed(seed), 8, 7)
    _same(r.state_dict(), s.state_dict())
    assert torch.equal(r.global_model(), s.global_model())


def test_release_client_and_snapshot_bound(gen: torch.Generator) -> None:
    s = OrthoFL(layout=LAYOUT, initial=torch.randn(D, generator=gen))
    for c in "AB":
        s.on_register(c, 0.0)
    assert s.snapshot_bytes() == 0  # registered clients without jobs hold nothing
    ja, jb = s.job_for("A", 0.0), s.job_for("B", 0.0)
    s.on_update(make_update(ja, ja.weights + torch.randn(D, generator=gen)), 1.0)
    s.on_update(make_update(jb, jb.weights + torch.randn(D, generator=gen)), 2.0)
    assert s.snapshot_bytes() <= 2 * 2 * D * 4
    s.job_for("B", 2.0)
    assert not s.release_client("B")  # outstanding job: kept
    assert s.release_client("A") and s.client_tau("A") is None
    job = s.job_for("A", 3.0)  # back like a new client: the global model, tau = now
    assert job.weights is s.global_model() and s.client_tau("A") == s.version


def test_config_checks() -> None:
    assert OrthoFLConfig().beta == 0.6 and OrthoFLConfig().a == 0.5
    assert OrthoFLConfig().shift_source == "ma_global" and not OrthoFLConfig().calibrate_norm
    for bad in ({"beta": 0.0}, {"beta": 1.5}, {"a": -1}, {"shift_source": "x"}, {"eps": -1}):
        with pytest.raises(ValueError):
            OrthoFLConfig.from_dict(bad)
    with pytest.raises(ValueError, match="unknown"):
        OrthoFLConfig.from_dict({"bn_calibrate": True})


# ----------------------------------------------------------------------------- simulation


@pytest.mark.parametrize("variant", ["ma_global", "client_chain"])
def test_simulated_run_learns_digits(variant: str, tmp_path: Path) -> None:
    from aggsrv.sim import run

    result = run(
        {
            "strategy": "aggsrv.strategies.orthofl:OrthoFL",
            "strategy_config": {
                "shift_source": variant, "learning_rate": 0.05, "batch_size": 16,
            },
            "dataset": "digits",
            "clients": 5,
            "model": "mlp",
            "transport": "inproc",
            "budget": "8s",
            "seed": 3,
            "out": str(tmp_path),
        },
        progress=False,
    )  # fmt: skip
    assert result.summary["updates_applied"] > 10 and result.summary["updates_rejected"] == 0
    assert result.final_accuracy > 0.6, result.final_accuracy  # chance is 0.1


def test_host_snapshot_path_matches_shared_snapshots(gen: torch.Generator) -> None:
    """The CUDA layout of the snapshots (G_m as private host copies, rewritten in place) gives
    bit-identical results to the CPU layout (G_m = the published version tensor). Forced on a
    CPU strategy, since the host-to-device staging copy needs a GPU."""
    init = torch.randn(D, generator=gen)
    a = OrthoFL(layout=LAYOUT, initial=init)
    b = OrthoFL(layout=LAYOUT, initial=init)
    b._host_snapshots = True
    seed = int(torch.randint(2**31, (1,), generator=gen))
    for s in (a, b):
        for c in "ABC":
            s.on_register(c, 0.0)
        _drive(s, torch.Generator().manual_seed(seed), 10, 0)
    _same(a.state_dict(), b.state_dict())
    assert all(b._snap[c] is not b.global_model() for c in b._snap)
    assert any(a._snap[c] is a.global_model() for c in a._snap)
