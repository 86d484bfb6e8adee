"""Jobs have a lease: an abandoned job is retired once ``job_lease_seconds`` have passed since it
was issued, and the weights it started from are freed with it, so idle clients cannot make the
server hold one model copy each forever. An update for an expired job is refused like one for a
superseded job (ABORTED), with a message that says why."""

from __future__ import annotations

import secrets

import pytest
import torch
from state_helpers import assert_same_state
from strategy_cases import strategy_cases

from aggsrv.layout import ModelLayout
from aggsrv.strategies import STRATEGIES, JobSuperseded, Strategy, Update, UpdateKind, make_strategy

LAYOUT = ModelLayout.from_named_shapes([("w", (9, 5)), ("b", (9,))])
D = LAYOUT.numel


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def held_bases(s: Strategy) -> set[int]:
    """The distinct [D] start weights the open jobs keep alive (the model's own excluded)."""
    jobs = [s.outstanding_job(c) for c in s.clients]
    return storages(j.weights for j in jobs if j is not None) - storages([s.global_model()])


def delta_update(job, uid: str, value: float = 0.01) -> Update:
    return Update(job.client_id, job.job_id, job.base_version, uid, 1, job.recipe.work_target,
                  UpdateKind.DELTA, torch.full((D,), value))  # fmt: skip


def test_idle_clients_jobs_expire_and_free_their_weights() -> None:
    lease = 30.0
    s = make_strategy("fedasync", layout=LAYOUT, initial=torch.randn(D),
                      config={"job_lease_seconds": lease})  # fmt: skip
    idle = [f"idle{i}" for i in range(17)]
    for c in ["busy", *idle]:
        s.on_register(c, 0.0)
    # Each idle client takes a job at another version, then never reports.
    t = 0.0
    for i, c in enumerate(idle):
        t = float(i)
        assert s.job_for(c, t).base_version == s.version
        job = s.job_for("busy", t)
        s.on_update(delta_update(job, f"b{i}"), t)
    assert len(held_bases(s)) == len(idle)
    assert s.next_deadline() == pytest.approx(0.0 + lease)  # the first idle job's expiry
    # Halfway through the leases: the older half is retired, the rest stays.
    s.on_timer(8.5 + lease)
    assert len(held_bases(s)) == len(idle) - 9
    assert s.job_state("idle0", 1) == "superseded"
    s.on_timer(t + lease)
    assert held_bases(s) == set() and s.next_deadline() is None
    assert all(s.outstanding_job(c) is None for c in idle)


def test_update_for_an_expired_job_is_aborted_with_the_reason_and_changes_nothing() -> None:
    s = make_strategy("fedbuff", layout=LAYOUT, initial=torch.randn(D),
                      config={"job_lease_seconds": 10.0, "buffer_size": 2})  # fmt: skip
    s.on_register("a", 0.0)
    job = s.job_for("a", 1.0)
    before = s.state_dict()
    with pytest.raises(JobSuperseded, match=r"lease.*job_lease_seconds=10"):
        s.on_update(delta_update(job, "late"), 11.0)  # the timer has not fired yet
    assert_same_state(s.state_dict(), before)
    assert s.on_update(delta_update(job, "in-time"), 10.5 - 1e-9).status.name == "BUFFERED"
    # A client asking again after its job expired gets a fresh job.
    old = s.job_for("a", 12.0)
    assert s.job_for("a", 12.0 + 10.0).job_id != old.job_id


def test_lease_can_be_turned_off_and_is_checked() -> None:
    s = make_strategy("fedasync", layout=LAYOUT, initial=torch.randn(D),
                      config={"job_lease_seconds": None})  # fmt: skip
    s.on_register("a", 0.0)
    job = s.job_for("a", 0.0)
    assert s.next_deadline() is None
    assert s.on_update(delta_update(job, "u"), 1e9).status.name == "APPLIED"
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="job_lease_seconds"):
            make_strategy("fedasync", layout=LAYOUT, initial=torch.zeros(D),
                          config={"job_lease_seconds": bad})  # fmt: skip


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_retires_abandoned_jobs(name: str) -> None:
    """Whatever else a strategy waits for (rounds, epochs, groupings), an abandoned job goes at
    its lease, and a state saved with open jobs resumes with the same expiries."""
    config = {**strategy_cases(4)[name], "job_lease_seconds": 5.0}
    s = make_strategy(name, layout=LAYOUT, initial=torch.randn(D), config=config)
    clients = [f"c{i}" for i in range(4)]
    for c in clients:
        s.on_register(c, 0.0)
    issued = [c for c in clients if s.job_for(c, 1.0) is not None]
    assert issued, "no strategy hands out no job at all"
    restored = make_strategy(name, layout=LAYOUT, initial=torch.randn(D), config=config)
    restored.load_state_dict(s.state_dict())
    for strategy in (s, restored):
        t = 1.0
        while any(strategy.outstanding_job(c) for c in issued):
            deadline = strategy.next_deadline()
            assert deadline is not None and deadline <= 6.0 + 1e-9, deadline
            t = max(t, deadline)
            strategy.on_timer(t)
        assert t <= 6.0 + 1e-9
    assert_same_state(restored.state_dict(), s.state_dict())


def test_default_lease_is_an_hour() -> None:
    s = make_strategy("fedasync", layout=LAYOUT, initial=torch.zeros(D))
    assert s.config.job_lease_seconds == 3600.0
    seed = secrets.randbits(16)
    s.on_register("a", float(seed))
    s.job_for("a", float(seed))
    assert s.next_deadline() == float(seed) + 3600.0


def test_server_memory_returns_to_its_bound_once_idle_jobs_expire(servers) -> None:
    """Idle clients each holding a job at another version pin one model copy each until their
    leases end; then the server holds what docs/operations.md's bound says: the current
    version, the retained versions and at most two spare buffers."""
    import time

    from server_helpers import flat, tiny_model

    from aggsrv.client.client import Client

    srv = servers(strategy="fedasync", retained_versions=2,
                  strategy_config={"job_lease_seconds": 1.5})  # fmt: skip
    model = tiny_model(3)
    d = flat(model).numel()
    copy_bytes = 4 * d
    idle = [Client(srv.address, f"idle{i}") for i in range(9)]
    try:
        with Client(srv.address, "busy") as busy:
            busy.register(model)
            for c in idle:
                c.register(model)
                c.get_job()
                busy.push(busy.get_job(), torch.full((d,), 0.01), num_samples=1, epochs=1.0)
            held = srv.run(srv.federation.call(srv.federation.cache_bytes))
            assert held >= (len(idle) + 1) * copy_bytes
            deadline = time.monotonic() + 10.0
            bound = (1 + 2 + 2) * copy_bytes  # current + retained_versions + 2 spares
            strategy = srv.strategy
            while time.monotonic() < deadline:
                if all(strategy.outstanding_job(c.client_id) is None for c in idle):
                    break
                time.sleep(0.1)
            held = srv.run(srv.federation.call(srv.federation.cache_bytes))
            assert held <= bound, (held, bound)
    finally:
        for c in idle:
            c.close()
