"""Recycled version buffers: reused only once retired and unleased, never under a reader."""

from __future__ import annotations

import threading

import torch

from aggsrv.layout import ModelLayout
from aggsrv.strategies import FedAsync, FedBuff, Update, UpdateKind
from aggsrv.strategies.buffers import VersionBuffers

CPU = torch.device("cpu")


def test_a_retired_buffer_is_reused_only_once_no_lease_is_held() -> None:
    pool = VersionBuffers(37, CPU)
    a = pool.take()
    lease = pool.lease(a)
    pool.retire(a)
    b = pool.take()
    assert b is not a and (pool.allocated, pool.recycled) == (2, 0)  # `a` is leased
    lease.release()
    lease.release()  # twice: a no-op
    assert pool.take() is a and pool.recycled == 1
    assert pool.leased(a) == 0


def test_an_unretired_buffer_is_never_reused_even_unleased() -> None:
    pool = VersionBuffers(8, CPU)
    current = pool.take()
    pool.lease(current).release()
    assert pool.take() is not current and len(pool) == 0


def test_a_lease_on_a_view_holds_the_whole_buffer() -> None:
    pool = VersionBuffers(37, CPU)
    b = pool.take()
    with pool.lease(b[3:9], b[10:12]):
        pool.retire(b)
        assert pool.leased(b) == 2
        assert pool.take().data_ptr() != b.data_ptr()
    assert pool.take() is b  # the spare is the whole buffer, not a view


def test_a_late_lease_takes_a_spare_out_of_reuse() -> None:
    pool = VersionBuffers(8, CPU)
    b = pool.take()
    pool.retire(b)
    assert len(pool) == 1
    lease = pool.lease(b)
    assert len(pool) == 0 and pool.take() is not b
    lease.release()
    assert pool.take() is b


def test_foreign_shapes_and_views_are_not_adopted() -> None:
    pool = VersionBuffers(8, CPU)
    for t in (torch.zeros(9), torch.zeros(16)[:8], torch.zeros(8, dtype=torch.float64)):
        pool.retire(t)
        assert not pool.lease(t).held
    assert len(pool) == 0
    pool.retire(torch.zeros(8))
    assert len(pool) == 1


def test_spares_are_bounded() -> None:
    pool = VersionBuffers(4, CPU, max_spares=3)
    for _ in range(5):
        pool.retire(torch.zeros(4))
    assert len(pool) == 3


def test_leases_from_many_threads_balance() -> None:
    pool = VersionBuffers(16, CPU)
    b = pool.take()
    pool.retire(pool.take())  # a spare that must not be b

    def reader() -> None:
        for _ in range(500):
            pool.lease(b).release()

    threads = [threading.Thread(target=reader) for _ in range(4)]
    with pool.lease(b):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        pool.retire(b)
        assert pool.take() is not b and pool.take() is not b
    assert pool.leased(b) == 0 and pool.take() is b


def _update(strategy, job, delta, n: int) -> Update:
    return Update(
        client_id=job.client_id,
        job_id=job.job_id,
        base_version=job.base_version,
        update_id=f"u{n}",
        num_samples=3,
        work_done=1.0,
        kind=UpdateKind.DELTA,
        tensor=delta,
    )


def test_fedasync_snapshots_stay_intact_while_buffers_are_recycled() -> None:
    """Readers lease some versions (as retained snapshots and streams do) while many updates
    arrive: every leased version keeps its values, and the others are reused."""
    gen = torch.Generator().manual_seed(11)
    D = 1031
    layout = ModelLayout.from_named_shapes([("w", (D - 5,)), ("b", (5,))])
    x0 = torch.randn(D, generator=gen)
    s = FedAsync(layout, x0, {"alpha": 0.5, "staleness": "constant"})
    s.on_register("a", 0.0)
    s.on_register("b", 0.0)
    expected = x0.double()
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {0: (s.global_model(), x0.clone())}
    leases = [s.lease(s.global_model())]
    stale_job = s.job_for("b", 0.0)  # its lease keeps version 0 as its base
    for n in range(1, 41):
        job = s.job_for("a", float(n))
        delta = torch.randn(D, generator=gen)
        s.on_update(_update(s, job, delta, n), float(n))
        expected = expected + 0.5 * delta.double()
        model = s.global_model()
        torch.testing.assert_close(model.double(), expected, rtol=0, atol=1e-5)
        if n % 7 == 0:
            held[n] = (model, model.clone())  # a reader keeps this version
            leases.append(s.lease(model))
    assert s._versions.recycled > 20  # versions nobody leased were reused
    assert s._versions.allocated <= 2 + len(held)
    for version, (tensor, values) in held.items():
        assert torch.equal(tensor, values), version
    assert torch.equal(stale_job.weights, x0)
    # The stale job's update still mixes against its own (intact) base.
    delta = torch.randn(D, generator=gen)
    s.on_update(_update(s, stale_job, delta, 99), 50.0)
    want = 0.5 * expected + 0.5 * (x0.double() + delta.double())
    torch.testing.assert_close(s.global_model().double(), want, rtol=0, atol=1e-5)


def test_fedbuff_reuses_buffers_and_matches_the_float64_mean() -> None:
    gen = torch.Generator().manual_seed(12)
    D = 257
    layout = ModelLayout.from_named_shapes([("w", (D,))])
    x = torch.randn(D, generator=gen)
    s = FedBuff(layout, x, {"buffer_size": 2, "server_lr": 1.0, "staleness_weighting": False})
    s.on_register("a", 0.0)
    expected = x.double()
    for n in range(1, 25):
        job = s.job_for("a", float(n))
        delta = torch.randn(D, generator=gen)
        s.on_update(_update(s, job, delta, n), float(n))
        if n % 2 == 1:
            pending = delta.double()
        else:
            expected = expected + (pending + delta.double()) / 2
            torch.testing.assert_close(s.global_model().double(), expected, rtol=0, atol=1e-5)
    assert s._versions.recycled > 0
