"""FedDGIC's asynchronous aggregation with gradient compensation (docs/algorithms/feddgic.md 1.5):
group models with version counters, the staleness-controlled group update (Eq. 8), dropout
detection by the version threshold T, and the compensated global merge (Eqs. 9-10), applied one
submission at a time in Algorithm 2's order (spec 1.5.6).

Conventions the spec decides and this module follows:

* Eq. 8 reads ``V_g`` before the increment of line 10, so ``V_g - V_i`` counts the submissions
  of *other* members since client i's last one; the first ``N_g`` are free.
* Dropout scan right after the increment, over the other members j of the group:
  ``dropped[j] = V_g - V_j >= T``; the submitter is alive by definition (this un-flags a client
  that comes back).
* ``alpha_comp = 1 - (1 - alpha_global)^(N_g / (N_g - D_g))`` in float64 via expm1/log1p.
* ``T`` per group: ``t_factor * N_g`` with a minimum of 2 (spec section 2, "per_group_multiple"),
  or one constant for every group.

The tensors are whatever the caller keeps (float32 [D] on the strategy's device, or float64
scalars in the spec's trace); each step writes a new global tensor (a published version is
never written again) and updates the group model in place (group models are server-internal).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aggsrv.strategies.state_copy import restore_tensor

__all__ = [
    "CompensationPlan",
    "CompensationStep",
    "GroupCompensation",
    "compensated_alpha",
    "group_alpha",
]


def group_alpha(alpha_max: float, beta: float, staleness: int) -> float:
    """Eq. 8's mixing ratio for ``staleness = max(V_g - V_i - N_g, 0)``."""
    return alpha_max / (1.0 + beta * max(staleness, 0))


def compensated_alpha(alpha_global: float, members: int, dropped: int) -> float:
    """Eq. 9: ``1 - (1 - alpha_global)^(N_g / (N_g - D_g))`` (``D_g < N_g``)."""
    if not 0 <= dropped < members:
        raise ValueError(f"need 0 <= dropped < members, got {dropped} of {members}")
    r_c = members / (members - dropped)
    return -math.expm1(r_c * math.log1p(-alpha_global))


@dataclass(frozen=True)
class CompensationStep:
    """What one submission did (a row of the spec's trace, for logs and tests)."""

    client: int
    group: int
    staleness: int
    alpha_group: float
    version_after: int  # V_g after the increment
    dropped: int  # D_g
    alpha_comp: float


@dataclass(frozen=True)
class CompensationPlan:
    """One submission computed but not applied (:meth:`GroupCompensation.plan`)."""

    step: CompensationStep
    group_model: torch.Tensor  # the submitter's group model after Eq. 8
    global_model: torch.Tensor  # the global model after Eq. 10
    dropped: dict[int, bool]  # the new dropout flag of each member of the group


class GroupCompensation:
    """Algorithm 2 over a fixed grouping: ``labels[i]`` is client i's group."""

    def __init__(
        self,
        labels: Sequence[int],
        initial: torch.Tensor,
        *,
        alpha_global: float = 0.5,
        alpha_max: float = 0.8,
        beta: float = 1.0,
        t_constant: int | None = None,
        t_factor: int = 2,
        compensate: bool = True,
    ) -> None:
        """``compensate=False`` still detects dropouts but merges with ``alpha_global`` (r_c = 1:
        FedFG, spec 2.3)."""
        if not labels:
            raise ValueError("labels must name the group of at least one client")
        k = max(labels) + 1
        if min(labels) < 0 or set(labels) != set(range(k)):
            raise ValueError(f"labels must use every group 0..{k - 1}, got {sorted(set(labels))}")
        if not 0.0 <= alpha_global < 1.0 or not 0.0 < alpha_max <= 1.0 or beta < 0:
            raise ValueError("need 0 <= alpha_global < 1, 0 < alpha_max <= 1 and beta >= 0")
        if t_constant is not None and t_constant < 1:
            raise ValueError(f"t_constant must be >= 1, got {t_constant}")
        if t_factor < 1:
            raise ValueError(f"t_factor must be >= 1, got {t_factor}")
        self.labels = tuple(int(g) for g in labels)
        self.members = [[i for i, g in enumerate(self.labels) if g == grp] for grp in range(k)]
        self.alpha_global, self.alpha_max, self.beta = alpha_global, alpha_max, beta
        self.compensate = compensate
        self.t_constant, self.t_factor = t_constant, t_factor
        self.thresholds = [self._threshold(len(m)) for m in self.members]
        self.global_model = initial
        self.group_models = [initial.clone() for _ in range(k)]
        self.group_version = [0] * k  # V_g
        self.client_version = [0] * len(self.labels)  # V_i
        self.dropped = [False] * len(self.labels)

    def add_client(self) -> int:
        """A client that was not grouped joins as a singleton group (its model: the current
        global model); returns its index."""
        i = len(self.labels)
        g = len(self.members)
        self.labels = (*self.labels, g)
        self.members.append([i])
        self.thresholds.append(self._threshold(1))
        self.group_models.append(self.global_model.detach().clone())
        self.group_version.append(0)
        self.client_version.append(0)
        self.dropped.append(False)
        return i

    def _threshold(self, size: int) -> int:
        return self.t_constant if self.t_constant is not None else max(2, self.t_factor * size)

    def submit(
        self, client: int, weights: torch.Tensor, out: torch.Tensor | None = None
    ) -> CompensationStep:
        """Lines 7-14 for one submission; ``self.global_model`` is what the client gets back
        (written into ``out`` when given, a fresh tensor otherwise; never in place)."""
        return self.commit(self.plan(client, weights, out))

    def plan(
        self,
        client: int,
        weights: torch.Tensor,
        out: torch.Tensor | None = None,
        joining: bool = False,
    ) -> CompensationPlan:
        """What :meth:`submit` would do, computed without changing anything, so the caller can
        check the results first and then :meth:`commit` them. ``joining``: ``client`` is one
        past the last index, a client that :meth:`add_client` would add (a group of its own)."""
        n = len(self.labels)
        valid = client == n if joining else 0 <= client < n
        if not valid:
            raise ValueError(f"client {client} is not in the grouping of {n}")
        g = len(self.members) if joining else self.labels[client]
        members = [client] if joining else self.members[g]
        n_g = len(members)
        v_g_before = 0 if joining else self.group_version[g]
        v_i = 0 if joining else self.client_version[client]
        staleness = max(v_g_before - v_i - n_g, 0)
        a_grp = group_alpha(self.alpha_max, self.beta, staleness)
        w_g = self.global_model if joining else self.group_models[g]
        group_model = torch.lerp(w_g, weights.to(w_g.dtype), a_grp)  # a W_new + (1 - a) W_g
        v_g = v_g_before + 1
        t = self._threshold(1) if joining else self.thresholds[g]
        dropped = {j: j != client and v_g - self.client_version[j] >= t for j in members}
        d_g = sum(dropped.values())
        a_comp = compensated_alpha(self.alpha_global, n_g, d_g if self.compensate else 0)
        global_model = torch.lerp(self.global_model, group_model, a_comp, out=out)
        step = CompensationStep(client, g, staleness, a_grp, v_g, d_g, a_comp)
        return CompensationPlan(step, group_model, global_model, dropped)

    def commit(self, plan: CompensationPlan) -> CompensationStep:
        """Apply a :meth:`plan` (adding the client first when it is new)."""
        step = plan.step
        if step.client == len(self.labels):
            self.add_client()
        g = step.group
        self.group_models[g] = plan.group_model
        self.group_version[g] = step.version_after
        for j, flag in plan.dropped.items():
            self.dropped[j] = flag
        self.global_model = plan.global_model
        self.client_version[step.client] = step.version_after
        return step

    def state_dict(self) -> dict[str, Any]:
        """Counters, flags and models (the caller clones the tensors)."""
        return {
            "labels": list(self.labels),
            "alpha_global": self.alpha_global,
            "alpha_max": self.alpha_max,
            "beta": self.beta,
            "t_constant": self.t_constant,
            "t_factor": self.t_factor,
            "compensate": self.compensate,
            "global_model": self.global_model,
            "group_models": list(self.group_models),
            "group_version": list(self.group_version),
            "client_version": list(self.client_version),
            "dropped": list(self.dropped),
        }

    @classmethod
    def from_state(
        cls,
        state: Mapping[str, Any],
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        copy: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None,
    ) -> GroupCompensation:
        """Rebuild from :meth:`state_dict` output (tensors copied to ``device``, with
        ``copy(t, dtype)`` when given: the strategy's copier, which keeps shared tensors shared)."""

        comp = cls(
            [int(g) for g in state["labels"]],
            restore_tensor(state["global_model"], device, dtype, copy),
            alpha_global=float(state["alpha_global"]),
            alpha_max=float(state["alpha_max"]),
            beta=float(state["beta"]),
            t_constant=state["t_constant"],
            t_factor=int(state["t_factor"]),
            compensate=bool(state["compensate"]),
        )
        models = state["group_models"]
        if len(models) != len(comp.members):
            raise ValueError(f"saved {len(models)} group models for {len(comp.members)} groups")
        comp.group_models = [restore_tensor(t, device, dtype, copy) for t in models]
        comp.group_version = [int(v) for v in state["group_version"]]
        comp.client_version = [int(v) for v in state["client_version"]]
        comp.dropped = [bool(d) for d in state["dropped"]]
        if len(comp.client_version) != len(comp.labels) or len(comp.dropped) != len(comp.labels):
            raise ValueError("saved per-client counters do not match the grouping")
        return comp
