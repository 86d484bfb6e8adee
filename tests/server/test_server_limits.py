"""Each limit refuses with its status and a message that names it, before the server allocates
or changes anything: concurrent calls, registrations, the offered model's size, labels, ids."""

from __future__ import annotations

import grpc
import pytest
import torch
from server_helpers import flat, register_messages, tiny_model

from aggsrv import protocol as P
from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.v1 import aggregation_pb2 as pb
from aggsrv.v1 import aggregation_pb2_grpc as pb_grpc
from aggsrv.v1 import tensor_pb2 as tpb

SC = grpc.StatusCode


def _code(fn) -> tuple[SC, str]:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return SC.OK, ""


def test_calls_beyond_max_concurrent_rpcs_are_resource_exhausted(servers) -> None:
    # FedAvg sync waits for 3 clients, so the GetJob calls of two registered clients stay open.
    srv = servers(
        strategy="fedavg", strategy_config={"mode": "sync", "min_clients": 3},
        max_concurrent_rpcs=2, pending_interval_seconds=0.2,
    )  # fmt: skip
    model = tiny_model(3)
    layout = ModelLayout.from_module(model)
    with Client(srv.address, "c0") as c0, Client(srv.address, "c1") as c1:
        c0.register(model)
        c1.register(model)
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.AggregationStub(channel)
        streams = [
            stub.GetJob(pb.GetJobRequest(client_id=f"c{i}", layout_hash=layout.hash), timeout=20)
            for i in range(2)
        ]
        try:
            for s in streams:  # each call is open on the server once its first message arrives
                assert next(s).WhichOneof("kind") == "pending"
            code, _ = _code(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=5))
            assert code == SC.RESOURCE_EXHAUSTED
        finally:
            for s in streams:
                s.cancel()
        # The limit counts calls in flight: with the two streams gone, calls are served again.
        for _ in range(100):
            code, _ = _code(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=5))
            if code == SC.OK:
                break
        assert code == SC.OK


def test_registrations_beyond_max_clients_are_resource_exhausted(servers) -> None:
    srv = servers(strategy="fedasync", max_clients=2)
    model = tiny_model(4)
    with Client(srv.address, "a") as a, Client(srv.address, "b") as b:
        a.register(model)
        b.register(model)
        with Client(srv.address, "c", retries=0) as c:
            code, details = _code(lambda: c.register(model))
        assert code == SC.RESOURCE_EXHAUSTED and "max_clients=2" in details
        a.register(model)  # a known client may register again
    assert set(srv.federation.clients) == {"a", "b"}


def test_an_oversized_model_is_refused_before_allocation(servers) -> None:
    srv = servers(strategy="fedasync", max_model_bytes=1 << 20)
    # A layout of 2**40 elements: if the server allocated its staging slot first, this would
    # fail with MemoryError or take the machine down instead of a status.
    layout = ModelLayout.from_named_shapes([("w", (1 << 20, 1 << 20))])
    req = pb.RegisterRequest(
        header=pb.RegisterHeader(
            client_id="big", layout=P.layout_to_pb(layout), layout_hash=layout.hash,
            initial_dtype=tpb.WIRE_DTYPE_FLOAT32,
            initial_tensors=[tpb.TensorInfo(name="weights", numel=layout.numel)],
        )
    )  # fmt: skip
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.AggregationStub(channel)
        code, details = _code(lambda: stub.Register(iter([req]), timeout=10))
    assert code == SC.RESOURCE_EXHAUSTED and "max_model_bytes" in details
    assert srv.federation.strategy is None
    # A model within the limit is adopted afterwards.
    model = tiny_model(5)
    small = ModelLayout.from_module(model)
    msgs = register_messages(small, "ok", {"weights": flat(model)})
    with grpc.insecure_channel(srv.address) as channel:
        resp = pb_grpc.AggregationStub(channel).Register(iter(msgs), timeout=10)
    assert resp.initial_model_adopted
    assert torch.equal(srv.model(), flat(model))


@pytest.mark.parametrize(
    ("labels", "needle"),
    [
        ({f"k{i}": "v" for i in range(5)}, "at most 4"),
        ({"k": "v" * 257}, "256 bytes"),
        ({"k" * 257: "v"}, "256 bytes"),
    ],
    ids=["too_many", "long_value", "long_key"],
)
def test_labels_beyond_the_limits_are_invalid_argument(servers, labels, needle) -> None:
    srv = servers(strategy="fedasync", max_labels=4)
    model = tiny_model(6)
    with Client(srv.address, "first") as first:
        first.register(model)
    with Client(srv.address, "labelled", retries=0) as c:
        code, details = _code(lambda: c.register(model, labels=labels))
    assert code == SC.INVALID_ARGUMENT and needle in details
    assert "labelled" not in srv.federation.clients


@pytest.mark.parametrize("client_id", ["", "x" * 129, "a b", "é", "a/b"])
def test_ids_outside_the_alphabet_are_invalid_argument(servers, client_id) -> None:
    srv = servers(strategy="fedasync")
    model = tiny_model(7)
    with Client(srv.address, "first") as first:
        first.register(model)
    with Client(srv.address, client_id, retries=0) as c:
        code, details = _code(lambda: c.register(model))
    assert code == SC.INVALID_ARGUMENT and "[A-Za-z0-9._:@-]" in details
    assert set(srv.federation.clients) == {"first"}
