"""What the server's log and checkpoints rely on, for every strategy:

* ``Strategy.change_count`` moves exactly when ``job_for`` changes the strategy's state (the
  server logs a GetJob's call only then, so replay stays bit-identical); oracle: the state dict
  before and after the call, compared byte for byte.
* A checkpoint round trip keeps tensor sharing: tensors that share memory in the live strategy
  (a version's weights held by many jobs, Fed-OGD's basis, the float buffers every job carries)
  share it again after ``load_state_dict``, and the saved state holds each of them once.
"""

from __future__ import annotations

import io
import secrets
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from state_helpers import assert_same_state
from strategy_cases import strategy_cases
from strategy_runs import StrategyRun

from aggsrv.strategies import make_strategy

NAMES = list(strategy_cases(5))


def _same(a: Any, b: Any) -> bool:
    try:
        assert_same_state(a, b)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("name", NAMES)
def test_change_count_moves_exactly_when_job_for_changes_state(name: str) -> None:
    seed = secrets.randbits(31)
    run = StrategyRun(name, seed)
    s = run.strategy
    seen = {"changed": 0, "unchanged": 0}

    def checked_job_for(cid: str) -> None:
        before, count = s.state_dict(), s.change_count
        run.job_for(cid)
        changed = not _same(before, s.state_dict())
        assert changed == (s.change_count != count), (
            f"{name} seed {seed}: job_for({cid!r}) at t={run.now:.3f} "
            f"{'changed' if changed else 'did not change'} the state but change_count "
            f"went {count} -> {s.change_count}"
        )
        seen["changed" if changed else "unchanged"] += 1

    for _ in range(120):
        run.step(on_job=checked_job_for)
    assert seen["changed"] >= 2 and seen["unchanged"] >= 2, (name, seed, seen)


def _tensor_paths(obj: Any, path: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(attribute path, tensor) for every tensor reachable from a strategy's attributes."""
    if depth > 7:
        return
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict | types.MappingProxyType):
        for k, v in obj.items():
            yield from _tensor_paths(v, f"{path}[{k!r}]", depth + 1)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _tensor_paths(v, f"{path}[{i}]", depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type | types.ModuleType):
        for k, v in vars(obj).items():
            if k not in ("_versions", "layout", "reducer", "event_sink"):
                yield from _tensor_paths(v, f"{path}.{k}", depth + 1)


def sharing(strategy: Any) -> set[frozenset[str]]:
    """The groups of attribute paths (two or more) whose tensors share one storage."""
    groups: dict[int, set[str]] = {}
    for path, t in _tensor_paths(strategy, "s"):
        if t.numel():
            groups.setdefault(t.untyped_storage().data_ptr(), set()).add(path)
    return {frozenset(g) for g in groups.values() if len(g) > 1}


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip_keeps_tensor_sharing(name: str) -> None:
    seed = secrets.randbits(31)
    run = StrategyRun(name, seed)
    for _ in range(150):
        run.step()
    for cid in run.registered:  # as many outstanding jobs as the strategy hands out
        run.job_for(cid)
    live = run.strategy
    buf = io.BytesIO()
    torch.save(live.state_dict(), buf)
    buf.seek(0)
    restored = make_strategy(
        name, layout=live.layout, initial=torch.zeros(live.dim),
        initial_buffers=torch.ones(live.layout.buffer_numel), config=live.config,
    )  # fmt: skip
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert_same_state(live.state_dict(), restored.state_dict(), f"{name} seed {seed}")
    # Restored sharing implies saved sharing: a tensor saved twice comes back as two copies.
    assert sharing(restored) == sharing(live), f"{name} seed {seed}: sharing differs after restore"
