"""One finiteness proof per value: the server's decoder proves an upload finite in the pass
that reads it, and the strategy trusts that proof instead of reading the values again; a NaN is
still refused, by the decoder, with nothing applied."""

from __future__ import annotations

import grpc
import pytest
import torch
from server_helpers import RunningServer

import aggsrv.strategies.validation as V
from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.values import Status, UpdateKind

LAYOUT = ModelLayout.from_named_shapes([("a.w", (37, 11)), ("a.b", (11,)), ("c.w", (5, 3))])


def test_a_pushed_update_is_read_for_nan_once(monkeypatch) -> None:
    counted: list[int] = []
    real = V.count_non_finite
    monkeypatch.setattr(V, "count_non_finite", lambda t: counted.append(t.numel()) or real(t))
    srv = RunningServer(strategy="fedasync", rate_limit_per_second=0.0)
    try:
        with Client(srv.address, "a") as c:
            initial = torch.randn(LAYOUT.numel)
            c.register(layout=LAYOUT, initial=initial)
            ack = c.push(c.get_job(), torch.randn(LAYOUT.numel) * 0.1, kind=UpdateKind.DELTA)
            assert ack.status is Status.APPLIED and ack.version == 1
            assert LAYOUT.numel not in counted  # the strategy did not count NaN/Inf again
            bad = torch.randn(LAYOUT.numel)
            bad[123] = float("nan")
            with pytest.raises(grpc.RpcError) as info:
                c.push(c.get_job(), bad, kind=UpdateKind.DELTA)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            version, _ = c.get_model()
            assert version == 1 and srv.strategy.version == 1
            assert bool(torch.isfinite(srv.model()).all())
    finally:
        srv.stop()
