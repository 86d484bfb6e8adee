"""Version buffers through a real server: a steady get_job + push loop recycles the buffers of
retired versions, and a buffer a reader holds (a slow model or job stream) is never handed out
while held, and is reused once released.

Readers are held in the service's host-copy step (``on_host`` / ``job_on_host``), after the
handler picked its version and before it streams a byte: the slowest a stream can be.
"""

from __future__ import annotations

import asyncio
import threading

import torch
from server_helpers import RunningServer

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import versions as V
from aggsrv.values import UpdateKind

LAYOUT = ModelLayout.from_named_shapes([("a", (7, 3)), ("b", (5,))])
RETAINED = 3


def _server() -> RunningServer:
    return RunningServer(
        strategy="fedasync",
        strategy_config={"alpha": 0.5, "staleness": "constant"},
        retained_versions=RETAINED,
        rate_limit_per_second=0.0,
    )


def _step(client: Client, gen: torch.Generator) -> int:
    job = client.get_job()
    delta = torch.randn(LAYOUT.numel, generator=gen) * 0.01
    return client.push(job, delta, kind=UpdateKind.DELTA, num_samples=1).version


def _held(monkeypatch, name: str, hold=lambda *args: True) -> tuple[threading.Event, ...]:
    """Hold the first call of RetainedVersions.<name> whose arguments ``hold`` picks until
    ``release`` is set; ``entered`` is set once it is being held."""
    entered, release = threading.Event(), threading.Event()
    original = getattr(V.RetainedVersions, name)

    async def holding(self, *args, **kwargs):
        if hold(*args) and not entered.is_set():
            entered.set()
            while not release.is_set():
                await asyncio.sleep(0.005)
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(V.RetainedVersions, name, holding)
    return entered, release


def test_a_steady_loop_recycles_every_version_buffer() -> None:
    srv = _server()
    gen = torch.Generator().manual_seed(1)
    try:
        with Client(srv.address, "a") as c:
            c.register(layout=LAYOUT, initial=torch.randn(LAYOUT.numel, generator=gen))
            for _ in range(RETAINED + 2):  # the retained versions fill up
                _step(c, gen)
            pool = srv.strategy._versions
            before = (pool.recycled, pool.allocated)
            for _ in range(9):
                _step(c, gen)
            assert (pool.recycled - before[0], pool.allocated - before[1]) == (9, 0)
    finally:
        srv.stop()


def _version_ptrs(srv: RunningServer) -> dict[int, int]:
    return {v: s.weights.data_ptr() for v, s in list(srv.federation.snapshots.items())}


def test_a_held_model_stream_keeps_its_buffer_until_released(monkeypatch) -> None:
    entered, release = _held(monkeypatch, "on_host")
    srv = _server()
    gen = torch.Generator().manual_seed(2)
    try:
        with Client(srv.address, "a") as a, Client(srv.address, "reader") as reader:
            a.register(layout=LAYOUT, initial=torch.randn(LAYOUT.numel, generator=gen))
            for _ in range(RETAINED + 2):
                _step(a, gen)
            held_version = srv.federation.published_version
            held = srv.federation.snapshots[held_version].weights
            want, held_ptr = held.clone(), held.data_ptr()
            got: list = []
            stream = threading.Thread(target=lambda: got.append(reader.get_model()), daemon=True)
            stream.start()
            assert entered.wait(30)
            seen = []
            for _ in range(2 * RETAINED + 6):  # the held version leaves the retained ones
                _step(a, gen)
                seen.append(srv.strategy.global_model().data_ptr())
            assert held_version not in srv.federation.snapshots
            assert held_ptr not in seen, "a buffer was handed out while a stream held it"
            assert torch.equal(held, want)
            release.set()
            stream.join(30)
            version, weights = got[0]
            assert version == held_version and torch.equal(weights, want.cpu())
            # Released: its buffer is reused for one of the next versions.
            after = []
            for _ in range(RETAINED + 3):
                _step(a, gen)
                after.append(srv.strategy.global_model().data_ptr())
            assert held_ptr in after
    finally:
        release.set()
        srv.stop()


def test_a_held_job_stream_keeps_its_buffer_after_the_job_is_superseded(monkeypatch) -> None:
    entered, release = _held(monkeypatch, "job_on_host", lambda job: job.client_id == "slow")
    srv = _server()
    gen = torch.Generator().manual_seed(3)
    try:
        with Client(srv.address, "a") as a, Client(srv.address, "slow") as slow:
            a.register(layout=LAYOUT, initial=torch.randn(LAYOUT.numel, generator=gen))
            slow.register(layout=LAYOUT)
            for _ in range(RETAINED + 2):
                _step(a, gen)
            base = srv.federation.published_version
            held = srv.strategy.global_model()
            want, held_ptr = held.clone(), held.data_ptr()
            got: list = []
            stream = threading.Thread(target=lambda: got.append(slow.get_job()), daemon=True)
            stream.start()
            assert entered.wait(30)
            seen = []
            for i in range(2 * RETAINED + 6):
                _step(a, gen)
                seen.append(srv.strategy.global_model().data_ptr())
                if i == 1:
                    # slow asks again from another connection: its first job is superseded
                    # (the strategy lets go of it), while the first stream still reads it.
                    with Client(srv.address, "slow") as again:
                        again.register(layout=LAYOUT)
                        assert again.get_job().base_version == base + 2
            assert held_ptr not in seen, "a buffer was handed out while a job stream held it"
            assert torch.equal(held, want)
            release.set()
            stream.join(30)
            assert got[0].base_version == base and torch.equal(got[0].weights, want.cpu())
            after = []
            for _ in range(RETAINED + 3):
                _step(a, gen)
                after.append(srv.strategy.global_model().data_ptr())
            assert held_ptr in after
    finally:
        release.set()
        srv.stop()


def test_a_lease_handed_to_a_reader_that_went_away_is_given_back() -> None:
    # A GetJob cancelled while its call runs on the aggregation thread: whichever comes first,
    # no lease is left behind.
    from aggsrv.server.versions import LeaseHandoff
    from aggsrv.strategies import FedAsync

    s = FedAsync(LAYOUT, torch.zeros(LAYOUT.numel))
    model = s.global_model()
    late = LeaseHandoff()
    late.abandon()  # the reader went away before the call took the lease
    assert not late.take(s, model).held and s._versions.leased(model) == 0
    early = LeaseHandoff()
    assert early.take(s, model).held and s._versions.leased(model) == 1
    early.abandon()  # ... or after
    assert s._versions.leased(model) == 0
    early.abandon()
    assert s._versions.leased(model) == 0
