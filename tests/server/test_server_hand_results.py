"""The server over real gRPC on loopback against float64 results computed by hand: FedBuff's
buffered mean, FedAvg k-async sample-weighted, FedAdam's first two steps, and a WEIGHTS upload
giving the same result as its DELTA."""

from __future__ import annotations

import pytest
import torch
from push_helpers import assert_close_to_hand, fresh_gen, rand, registered_clients
from server_helpers import (
    flat,
    tiny_model,
)

from aggsrv.values import Status, UpdateKind


def test_fedbuff_two_buffered_third_applies_mean(servers) -> None:
    gen = fresh_gen()
    lr = 0.7
    srv = servers(strategy="fedbuff", strategy_config={"buffer_size": 3, "server_lr": lr})
    model = tiny_model(11)
    x0 = flat(model)
    clients = registered_clients(srv.address, ["a", "b", "c"], model)
    try:
        jobs = [c.get_job() for c in clients]
        assert all(j.base_version == 0 and torch.equal(j.weights, x0) for j in jobs)
        deltas = [rand(x0.numel(), gen) for _ in clients]
        results = [c.push(j, d, epochs=1.0) for c, j, d in zip(clients, jobs, deltas, strict=True)]
        assert [r.status for r in results] == [Status.BUFFERED, Status.BUFFERED, Status.APPLIED]
        assert [r.version for r in results] == [0, 0, 1]
        # Nothing moves before the third delta.
        want = x0.double() + lr * torch.stack([d.double() for d in deltas]).mean(0)
        got = srv.model()
        assert_close_to_hand(got, want)
        version, pulled = clients[0].get_model()
        assert version == 1 and torch.equal(pulled, got)
        _, v0 = clients[0].get_model(version=0)
        assert torch.equal(v0, x0)
        # A replayed BUFFERED update: DUPLICATE(BUFFERED, its version 0), applied once.
        again = clients[0].push(jobs[0], deltas[0], epochs=1.0, update_id=results[0].update_id)
        assert again.status is Status.DUPLICATE and again.original is Status.BUFFERED
        assert again.version == 0
        assert torch.equal(srv.model(), got) and srv.strategy.version == 1
    finally:
        for c in clients:
            c.close()


def test_fedavg_k_async_sample_weighted_mean(servers) -> None:
    gen = fresh_gen()
    srv = servers(strategy="fedavg", strategy_config={"mode": "k_async", "k": 2})
    model = tiny_model(12)
    x0 = flat(model)
    a, b = registered_clients(srv.address, ["a", "b"], model)
    try:
        ja, jb = a.get_job(), b.get_job()
        da, db = rand(x0.numel(), gen), rand(x0.numel(), gen)
        na, nb = (int(v) for v in torch.randint(1, 500, (2,), generator=gen))
        ra = a.push(ja, da, num_samples=na, epochs=1.0)
        assert ra.status is Status.BUFFERED and ra.version == 0
        assert torch.equal(srv.model(), x0)
        rb = b.push(jb, db, num_samples=nb, epochs=1.0)
        assert rb.status is Status.APPLIED and rb.version == 1
        want = x0.double() + (na * da.double() + nb * db.double()) / (na + nb)
        assert_close_to_hand(srv.model(), want)
    finally:
        a.close()
        b.close()


def test_fedadam_first_two_steps_by_hand(servers) -> None:
    """FedAdam (fedavg.py): m = b1 m + (1-b1) d, v = b2 v + (1-b2) d^2 with m0 = 0, v0 = tau^2,
    x += lr m / (sqrt(v) + tau); defaults b1 = 0.9, b2 = 0.99, tau = 1e-3, lr = 0.01."""
    gen = fresh_gen()
    srv = servers(
        strategy="fedavg", strategy_config={"mode": "k_async", "k": 2, "server_opt": "adam"}
    )
    b1, b2, tau, lr = 0.9, 0.99, 1e-3, 0.01
    model = tiny_model(13)
    x = flat(model).double()
    a, b = registered_clients(srv.address, ["a", "b"], model)
    m = torch.zeros_like(x)
    v = torch.full_like(x, tau**2)
    try:
        for step in (1, 2):
            ja, jb = a.get_job(), b.get_job()
            assert ja.base_version == jb.base_version == step - 1
            da, db = rand(x.numel(), gen, 0.1), rand(x.numel(), gen, 0.1)
            na, nb = (int(n) for n in torch.randint(1, 100, (2,), generator=gen))
            assert a.push(ja, da, num_samples=na, epochs=1.0).status is Status.BUFFERED
            rb = b.push(jb, db, num_samples=nb, epochs=1.0)
            assert rb.status is Status.APPLIED and rb.version == step
            d = (na * da.double() + nb * db.double()) / (na + nb)
            m = b1 * m + (1 - b1) * d
            v = b2 * v + (1 - b2) * d * d
            x = x + lr * m / (v.sqrt() + tau)
            assert_close_to_hand(srv.model(), x, atol=1e-5 * step)
        # The moments are state: m and v match the hand values too.
        extra = srv.state()["extra"]
        assert_close_to_hand(extra["m"], m, atol=1e-6)
        assert_close_to_hand(extra["v"], v, atol=1e-8)
    finally:
        a.close()
        b.close()


STRATEGY_CASES = {
    "fedasync": ("fedasync", {"alpha": 0.4, "staleness": "constant"}),
    "fedbuff": ("fedbuff", {"buffer_size": 2, "server_lr": 0.5}),
    "fedavg": ("fedavg", {"mode": "k_async", "k": 2}),
}


def _hand(name: str, x0: torch.Tensor, deltas: list[torch.Tensor], ns: list[int]) -> torch.Tensor:
    """The float64 model after the two updates (both from version 0) of STRATEGY_CASES[name]."""
    x = x0.double()
    ds = [d.double() for d in deltas]
    if name == "fedasync":  # x <- (1 - a) x + a (x0 + d), twice (the second one 1 stale)
        for d in ds:
            x = 0.6 * x + 0.4 * (x0.double() + d)
        return x
    if name == "fedbuff":
        return x + 0.5 * (ds[0] + ds[1]) / 2
    return x + (ns[0] * ds[0] + ns[1] * ds[1]) / (ns[0] + ns[1])


@pytest.mark.parametrize("name", list(STRATEGY_CASES))
def test_weights_kind_gives_the_delta_result(servers, name: str) -> None:
    gen = fresh_gen()
    strategy, cfg = STRATEGY_CASES[name]
    model = tiny_model(14)
    x0 = flat(model)
    deltas = [rand(x0.numel(), gen) for _ in range(2)]
    ns = [int(n) for n in torch.randint(1, 50, (2,), generator=gen)]
    results = {}
    for kind in (UpdateKind.DELTA, UpdateKind.WEIGHTS):
        srv = servers(strategy=strategy, strategy_config=cfg)
        clients = registered_clients(srv.address, ["a", "b"], model)
        jobs = [c.get_job() for c in clients]
        outcomes = []
        for c, j, d, n in zip(clients, jobs, deltas, ns, strict=True):
            payload = d if kind is UpdateKind.DELTA else j.weights + d
            outcomes.append(c.push(j, payload, kind=kind, num_samples=n, epochs=1.0).status)
        for c in clients:
            c.close()
        assert outcomes[-1] is Status.APPLIED, (kind, outcomes)
        results[kind] = srv.model()
        assert_close_to_hand(results[kind], _hand(name, x0, deltas, ns))
    # WEIGHTS - start differs from the delta by float32 rounding of x0 + d only.
    assert_close_to_hand(results[UpdateKind.WEIGHTS], results[UpdateKind.DELTA].double())
