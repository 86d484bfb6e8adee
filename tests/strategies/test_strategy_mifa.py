"""MIFA (Gu et al. 2021; docs/algorithms/fedogd.md E11): uniform mean over every client's
newest cached update."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from aggsrv.layout import ModelLayout
from aggsrv.strategies.mifa import MIFA, MIFAConfig
from aggsrv.values import ProjectionMode, Status, Update, UpdateKind

LAYOUT = ModelLayout.from_named_shapes([("fc.weight", (3, 2)), ("fc.bias", (3,))])
D = LAYOUT.numel  # 9


class Driver:
    def __init__(self, s: MIFA) -> None:
        self.s = s
        self.n = 0

    def submit(self, cid: str, delta: torch.Tensor, t: float, kind=UpdateKind.DELTA) -> Any:
        job = self.s.outstanding_job(cid)
        assert job is not None, cid
        self.n += 1
        tensor = delta if kind is UpdateKind.DELTA else job.weights + delta
        upd = Update(cid, job.job_id, job.base_version, f"u{self.n}", 5, 1.0, kind, tensor)
        return self.s.on_update(upd, t)


@pytest.mark.parametrize("count_empty", [True, False])
@pytest.mark.parametrize("kind", [UpdateKind.DELTA, UpdateKind.WEIGHTS])
def test_uniform_mean_of_cached_updates_against_a_hand_trace(
    count_empty: bool, kind: UpdateKind
) -> None:
    gen = torch.Generator().manual_seed(21)
    w = torch.randn(D, generator=gen)
    lr = 0.1
    cfg = {
        "learning_rate": lr,
        "count_empty_rows": count_empty,
        "tiers": {"a": 1, "b": 1, "s": 2},
        "detect": False,
        "epoch_timeout": None,
    }
    s = MIFA(LAYOUT, w, cfg)
    drv = Driver(s)
    for c in ("a", "b", "s"):
        s.on_register(c, 0.0)
    cache: dict[str, torch.Tensor] = {}
    oracle = w.double()
    for t in range(4):
        for c in ("a", "b", "s"):
            if s.outstanding_job(c) is None:
                job = s.job_for(c, float(t))
                assert set(job.tensors) == {"weights"}
                assert job.recipe.projection is ProjectionMode.NONE
        order = (["s"] if t % 2 == 1 else []) + ["a", "b"]
        for c in order:
            d = torch.randn(D, generator=gen) * 0.05
            cache[c] = -d.double() / lr  # G_i = -DELTA / lr
            out = drv.submit(c, d, t + 0.5, kind)
        assert (out.status, out.version) == (Status.APPLIED, t + 1)
        n = 3 if count_empty else len(cache)  # MIFA: 1/N over all N clients, zero rows included
        oracle = oracle - lr * torch.stack(list(cache.values())).sum(0) / n
        torch.testing.assert_close(s.global_model().double(), oracle, rtol=1e-6, atol=1e-6)


def test_defaults_and_bad_configs() -> None:
    cfg = MIFAConfig()
    assert cfg.server_lr is None and cfg.count_empty_rows and cfg.effective_server_lr == 0.05
    assert cfg.learning_rate == 0.05 and not MIFAConfig.PRESETS
    with pytest.raises(ValueError, match="server_lr must be > 0"):
        MIFAConfig(server_lr=-1.0)
    with pytest.raises(ValueError, match="unknown MIFAConfig key 'aggregation'"):
        MIFAConfig.from_dict({"aggregation": "group_sum"})
    with pytest.raises(ValueError, match="epoch_timeout must be > 0"):
        MIFAConfig.from_dict({"epoch_timeout": 0})


def test_state_dict_round_trip_resumes_bit_exactly() -> None:
    def drive(s: MIFA, drv: Driver, epochs: range) -> None:
        for t in epochs:
            for c in ("a", "b", "c"):
                if s.outstanding_job(c) is None:
                    s.job_for(c, float(t))
            for c in ("a", "b") if t % 2 else ("a", "b", "c"):
                job = s.outstanding_job(c)
                drv.submit(c, (torch.linspace(-1, 1, D) - job.weights) * 0.1, t + 0.5)
            s.on_timer(t + 0.9)

    cfg = {"epoch_timeout": 0.9, "learning_rate": 0.2}
    a = MIFA(LAYOUT, torch.zeros(D), cfg)
    for c in ("a", "b", "c"):
        a.on_register(c, 0.0)
    da = Driver(a)
    drive(a, da, range(3))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = MIFA(LAYOUT, torch.ones(D), cfg)
    b.load_state_dict(torch.load(buf, weights_only=False))
    db = Driver(b)
    db.n = da.n
    drive(a, da, range(3, 6))
    drive(b, db, range(3, 6))
    assert a.version >= 5
    assert torch.equal(a.global_model(), b.global_model())


def test_short_simulated_run_learns(tmp_path) -> None:
    from aggsrv import sim

    res = sim.run(
        {
            "strategy": "aggsrv.strategies.mifa:MIFA",
            "strategy_config": {"learning_rate": 0.05, "batch_size": 16, "epoch_timeout": 1.5},
            "transport": "inproc",
            "dataset": "digits",
            "clients": 5,
            "model": "mlp",
            "profile": "tiers",
            "budget": "6s",
            "eval_every": "1s",
            "seed": 3,
            "out": str(tmp_path),
        },
        progress=False,
    )
    accs = [m["test_accuracy"] for m in res.metrics]
    assert accs[0] < 0.2 and res.final_accuracy > 0.6
