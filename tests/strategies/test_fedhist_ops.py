"""FedHist's arithmetic (docs/algorithms/fedhist.md 1.2, 1.4, 6): the spec's worked vectors, EGS's
argmin with ties, HAA's clamp and fallback, INA's norm, and the reduction to TWAFL."""

from __future__ import annotations

import math

import pytest
import torch

from aggsrv.strategies.fedhist_ops import (
    egs_fuse,
    haa_weights,
    hindsight_utility,
    ina_combine,
    temporal_weight,
    utility_ema,
)


def test_temporal_weights_match_the_spec_table() -> None:
    table = {1: 0.7358, 2: 0.5413, 3: 0.3983, 5: 0.2156, 10: 0.04649}
    for tau, want in table.items():
        assert temporal_weight(tau) == pytest.approx(want, rel=2e-4), tau
    assert temporal_weight(100) == pytest.approx(4.7e-14, rel=0.02)
    assert temporal_weight(290) > 0.0  # float64: no underflow where float32 would flush


def test_worked_utility_vectors() -> None:
    """sim_T 0.3, |S| 4, tau_his 3: s = 0.5 -> 0.481363, s = 0.1 -> -0.318637; EMA gamma 0.2."""
    up = hindsight_utility(0.5, 3, 0.3, 4)
    down = hindsight_utility(0.1, 3, 0.3, 4)
    assert up == pytest.approx(0.481363, abs=5e-7)
    assert down == pytest.approx(-0.318637, abs=5e-7)
    assert utility_ema(0.0, up, 0.2) == pytest.approx(0.096273, abs=5e-7)
    assert utility_ema(0.0, down, 0.2) == pytest.approx(-0.063727, abs=5e-7)


def test_egs_fuses_with_the_least_similar_history_row_ties_to_the_newest() -> None:
    g = torch.Generator().manual_seed(0)
    local = torch.randn(5, 33, generator=g)
    history = torch.randn(4, 33, generator=g)
    fused, chosen = egs_fuse(local, history, alpha=0.3)
    for i in range(5):
        cos = torch.nn.functional.cosine_similarity(local[i : i + 1], history, dim=1)
        j = int(torch.argmin(cos))
        assert int(chosen[i]) == j
        torch.testing.assert_close(fused[i], local[i] + 0.3 * history[j])
    # Two identical rows: the newer (larger index) one is chosen.
    tied = torch.stack([history[0], history[1], history[0]])
    _, pick = egs_fuse(-history[0:1], tied, alpha=1.0)
    assert int(pick[0]) == 2
    same, none = egs_fuse(local, None, alpha=0.3)  # warm-up: nothing cached
    assert none is None and torch.equal(same, local)


def test_haa_weights_clamp_and_fallback() -> None:
    p = haa_weights([1, 2, 4], [0.0, 0.0, 0.0], lam=0.5)
    raw = torch.tensor([temporal_weight(t) for t in (1, 2, 4)], dtype=torch.float64)
    torch.testing.assert_close(p, raw / raw.sum())
    p = haa_weights([1, 1], [0.4, -10.0], lam=0.1)  # the second clamps to 0
    assert p.tolist() == [1.0, 0.0]
    p = haa_weights([300, 302], [-5.0, -5.0], lam=1.0)  # all clamp: the fallback
    fb = torch.tensor([1.0, temporal_weight(2)], dtype=torch.float64)
    torch.testing.assert_close(p, fb / fb.sum())
    with pytest.raises(ValueError, match="tau must be >= 1"):
        haa_weights([0, 1], [0.0, 0.0], lam=0.1)


def test_ina_takes_the_aggregate_direction_and_the_mean_norm() -> None:
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(4, 50, generator=g) * torch.tensor([[1.0], [3.0], [0.5], [2.0]])
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    out = ina_combine(rows, p)
    a = (p[:, None] * rows.double()).sum(0)
    mean_norm = rows.double().norm(dim=1).mean()
    torch.testing.assert_close(out.double(), a / a.norm() * mean_norm, rtol=1e-5, atol=1e-6)
    zero = ina_combine(torch.zeros(2, 7), torch.tensor([0.5, 0.5]))
    assert torch.equal(zero, torch.zeros(7))


def test_reduction_to_staleness_weighted_averaging() -> None:
    """alpha = 0, lambda = 0, no rescaling: FedHist's step is TWAFL's (e/2)^-tau average."""
    g = torch.Generator().manual_seed(2)
    local, history = torch.randn(3, 20, generator=g), torch.randn(2, 20, generator=g)
    taus = [1, 3, 2]
    fused, _ = egs_fuse(local, history, alpha=0.0)
    out = ina_combine(fused, haa_weights(taus, [0.7, -0.2, 0.1], lam=0.0), rescale=False)
    w = torch.tensor([temporal_weight(t) for t in taus], dtype=torch.float64)
    want = (w[:, None] * local.double()).sum(0) / w.sum()
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    assert math.isclose(float(haa_weights(taus, [0, 0, 0], 0.0).sum()), 1.0)
