"""An upload crossing to a device cache while it arrives, through the real gRPC path on loopback.

A server whose cache is on a GPU queues copies of each landed stretch of an upload as the chunks
come (aggsrv.transport.crossing). Here the same path runs on the CPU (the federation's
``cross_uploads_on_cpu``), stretches of a few elements long: the model must be bit for bit the
model of a server that copies nothing, durable or not, and a refused upload, cut off with its
copies queued, must change nothing and leave its slot to the next upload."""

from __future__ import annotations

import grpc
import pytest
import torch
from server_helpers import RunningServer, raw_push, tiny_model, update_messages

from aggsrv.client import Client
from aggsrv.client.compression import Compression
from aggsrv.transport import crossing as crossing_module
from aggsrv.values import Status, UpdateKind


def _run(crosses: bool, durability: str, tmp_path, seed: int) -> tuple[torch.Tensor, int]:
    """Pushes of four clients (float32, bfloat16, INT8 codes, top-k INT8; a refused one
    between them): (the model, the copies the crossings queued)."""
    config = {"strategy": "fedasync", "rate_limit_per_second": 0.0, "max_concurrent_uploads": 1}
    if durability == "on":
        config |= {"durability": "on", "state_dir": str(tmp_path / f"state-{crosses}")}
    srv = RunningServer(**config)
    srv.federation.cross_uploads_on_cpu = crosses
    gen = torch.Generator().manual_seed(seed)
    try:
        model = tiny_model(seed)
        with (
            Client(srv.address, "a") as a,
            Client(srv.address, "b", upload_dtype="bfloat16") as b,
            # INT8 codes FedAsync folds as codes (they do not cross), and a top-k section of
            # INT8 values decoded whole at the trailer (it crosses then).
            Client(srv.address, "c", compression=Compression(quantization="int8")) as c8,
            Client(srv.address, "d", compression=Compression("int8", top_k=0.3)) as ck,
        ):
            a.register(model)
            for c in (b, c8, ck):
                c.register(layout=a.layout)
            for c in (a, b, c8, ck):
                c.chunk_bytes = 40  # many chunks per upload
            for r in range(3):
                for c in (a, b, c8, ck):
                    job = c.get_job()
                    delta = 0.1 * torch.randn(c.layout.numel, generator=gen)
                    got = c.push(job, delta, kind=UpdateKind.DELTA, num_samples=3 + r, steps=1)
                    assert got.status is Status.APPLIED, got
                # Cut off after half its chunks: refused, nothing applied.
                job = a.get_job()
                stream = update_messages(a, job, torch.ones(a.layout.numel), chunk_bytes=40)
                before = srv.model()
                refused = raw_push(srv.address, stream[: len(stream) // 2])
                assert isinstance(refused, grpc.RpcError), refused
                assert refused.code() == grpc.StatusCode.DATA_LOSS, refused.details()
                assert torch.equal(srv.model(), before)
                assert a.push(job, torch.zeros(a.layout.numel), kind=UpdateKind.DELTA,
                              num_samples=1, steps=1).status is Status.APPLIED  # fmt: skip
        copies = sum(x.copies for x in srv.federation._crossings.values())
        return srv.model(), copies
    finally:
        srv.stop()


@pytest.mark.parametrize("durability", ["off", "on"])
def test_an_upload_that_crossed_while_arriving_gives_the_same_model(
    durability: str, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(crossing_module, "STEP_BYTES", 4 * 7)
    seed = int(torch.randint(1 << 20, (1,)))
    crossed, copies = _run(True, durability, tmp_path, seed)
    plain, none = _run(False, durability, tmp_path, seed)
    assert none == 0
    # Stretches of each upload crossed before its trailer (58 values in chunks of 10).
    assert copies >= 6 * 4, copies
    assert torch.equal(crossed, plain), seed


def test_no_device_memory_for_an_upload_is_refused_and_changes_nothing(monkeypatch) -> None:
    """The device has no room for an upload's copy: RESOURCE_EXHAUSTED, nothing applied, the
    slot free for the next upload."""
    srv = RunningServer(
        strategy="fedasync", strategy_config={"alpha": 1.0, "staleness": "constant"},
        rate_limit_per_second=0.0, max_concurrent_uploads=1,
    )  # fmt: skip
    srv.federation.cross_uploads_on_cpu = True
    real = crossing_module.DeviceCrossing._target
    full = [True]

    def target(self, name):
        if full[0]:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, name)

    monkeypatch.setattr(crossing_module.DeviceCrossing, "_target", target)
    try:
        with Client(srv.address, "a") as a:
            a.register(tiny_model(3))
            job = a.get_job()
            before = srv.model()
            delta = torch.full((a.layout.numel,), 0.25)
            with pytest.raises(grpc.RpcError) as refused:
                a.push(job, delta, kind=UpdateKind.DELTA, num_samples=1, steps=1)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "device memory" in refused.value.details()
            assert torch.equal(srv.model(), before)
            full[0] = False
            got = a.push(job, delta, kind=UpdateKind.DELTA, num_samples=1, steps=1)
            assert got.status is Status.APPLIED
            assert torch.equal(srv.model(), before + delta)
    finally:
        srv.stop()
