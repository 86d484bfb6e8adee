"""FedDGIC's Algorithm 2 (docs/algorithms/feddgic.md 1.5): the spec's worked trace row by row,
the compensation ratios and Eq. 8 values it lists, and Eq. 11's invariant."""

from __future__ import annotations

import math

import pytest
import torch

from aggsrv.strategies.compensation import GroupCompensation, compensated_alpha, group_alpha

# Spec 1.5.7: step, node, staleness, alpha_group, W_g, V_g after, D_g, alpha_comp, W_global.
TRACE = [
    ("a", 0, 0.8, 0.800000, 1, 0, 0.5, 0.400000),
    ("b", 0, 0.8, 1.760000, 2, 0, 0.5, 1.080000),
    ("c", 0, 0.8, 2.752000, 3, 0, 0.5, 1.916000),
    ("a", 0, 0.8, 1.350400, 4, 0, 0.5, 1.633200),
    ("b", 0, 0.8, 1.870080, 5, 0, 0.5, 1.751640),
    ("c", 0, 0.8, 2.774016, 6, 0, 0.5, 2.262828),
    ("a", 0, 0.8, 1.354803, 7, 0, 0.5, 1.808816),
    ("b", 0, 0.8, 1.870961, 8, 0, 0.5, 1.839888),
    ("a", 0, 0.8, 1.174192, 9, 0, 0.5, 1.507040),
    ("b", 0, 0.8, 1.834838, 10, 1, 0.646447, 1.718944),
    ("a", 0, 0.8, 1.166968, 11, 1, 0.646447, 1.362121),
    ("b", 0, 0.8, 1.833394, 12, 1, 0.646447, 1.666773),
]


def test_worked_trace_row_by_row() -> None:
    """One group {a, b, c}, alpha_max 0.8, beta 1, alpha_global 0.5, T = 4; c falls silent
    after step 6 and is flagged at step 10; coming back at step 13 it has staleness 3."""
    comp = GroupCompensation([0, 0, 0], torch.zeros(1, dtype=torch.float64), alpha_global=0.5,
                             alpha_max=0.8, beta=1.0, t_constant=4)  # fmt: skip
    value = {"a": 1.0, "b": 2.0, "c": 3.0}
    for node, stale, a_grp, w_g, v_g, d_g, a_comp, w in TRACE:
        i = "abc".index(node)
        step = comp.submit(i, torch.tensor([value[node]], dtype=torch.float64))
        assert (step.staleness, step.version_after, step.dropped) == (stale, v_g, d_g), node
        assert step.alpha_group == pytest.approx(a_grp, abs=1e-12)
        assert step.alpha_comp == pytest.approx(a_comp, abs=5e-7)
        assert comp.group_models[0].item() == pytest.approx(w_g, abs=5e-7)
        assert comp.global_model.item() == pytest.approx(w, abs=5e-7)
    assert comp.dropped == [False, False, True]
    back = comp.submit(2, torch.tensor([3.0], dtype=torch.float64))
    assert back.staleness == 3 and back.alpha_group == pytest.approx(0.2)
    assert comp.dropped == [False, False, False] and back.dropped == 0


def test_listed_ratios() -> None:
    """Spec 1.5.2 and 1.5.5 value lists."""
    assert [round(group_alpha(0.8, 1.0, s), 4) for s in range(5)] == [0.8, 0.4, 0.2667, 0.2, 0.16]
    cases = {(3, 1): 0.646447, (4, 1): 0.603150, (2, 1): 0.75, (5, 2): 0.685020,
             (6, 1): 0.564725, (4, 0): 0.5}  # fmt: skip
    for (n, d), want in cases.items():
        assert compensated_alpha(0.5, n, d) == pytest.approx(want, abs=5e-7), (n, d)
    with pytest.raises(ValueError, match="dropped < members"):
        compensated_alpha(0.5, 3, 3)


@pytest.mark.parametrize(("n", "d"), [(3, 1), (5, 2), (7, 3), (4, 0)])
def test_eq11_survivors_keep_the_groups_share(n: int, d: int) -> None:
    """(1 - alpha_comp)^(N - D) = (1 - alpha_global)^N: the survivors leave the old global
    model the share a full group would."""
    for a in (0.1, 0.5, 0.9):
        left = (1 - compensated_alpha(a, n, d)) ** (n - d)
        assert math.isclose(left, (1 - a) ** n, rel_tol=1e-12)


def test_groups_are_independent_and_thresholds_default_per_group() -> None:
    g = torch.Generator().manual_seed(0)
    labels = [0, 1, 0, 1, 1, 2]
    comp = GroupCompensation(labels, torch.zeros(5))
    assert comp.thresholds == [4, 6, 2]  # 2 N_g, at least 2
    w = torch.randn(5, generator=g)
    step = comp.submit(1, w)
    assert step.group == 1 and comp.group_version == [0, 1, 0]
    torch.testing.assert_close(comp.group_models[1], 0.8 * w)
    torch.testing.assert_close(comp.group_models[0], torch.zeros(5))
    torch.testing.assert_close(comp.global_model, 0.5 * 0.8 * w)
    with pytest.raises(ValueError, match="every group"):
        GroupCompensation([0, 2], torch.zeros(1))
    with pytest.raises(ValueError, match="not in the grouping"):
        comp.submit(6, w)
