"""Compressed updates on a sharded federation (docs/compression.md, docs/sharding.md): a client
streaming to every shard quantizes each shard's slice on its own (INT8), a client of rank 0 only
sends its whole update quantized (INT4, float16 uploads), and rank 0 forwards the decoded slices
in float32 (a half type would round them). The model moves by exactly what the two updates
decode to: the same as one unsharded server given those decoded deltas as float32 updates.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from server_helpers import RunningServer
from test_shard_relay import CASES, Federations, _layout

from aggsrv.client.client import Client
from aggsrv.client.compression import Compression
from aggsrv.values import UpdateKind


def test_quantized_updates_direct_and_relayed_apply_what_they_decode_to(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    layout = _layout()
    d = layout.numel
    w0 = torch.randn(d, generator=g)
    deltas = [torch.randn(d, generator=g) * 0.01 for _ in range(2)]
    feds = Federations(2, ["fedbuff"], tmp_path)
    sent = []
    try:
        address = feds.next_addresses()[0]
        direct = feds.client(address, "direct", direct=True,
                             compression=Compression(quantization="int8", block=10))  # fmt: skip
        relayed = feds.client(address, "relayed", direct=False, upload_dtype="float16",
                              compression=Compression(quantization="int4"))  # fmt: skip
        with direct, relayed:
            direct.register(layout=layout, initial=w0)
            relayed.register(layout=layout)
            for client, delta in zip((direct, relayed), deltas, strict=True):
                client.push(client.get_job(), delta, kind=UpdateKind.DELTA)
                sent.append(client._compressor.sent.clone())
            # A quantized slice really is per shard: blocks restart at the slice's start.
            assert direct.shard_map is not None and direct.shard_map.bounds[1] % 10
            _, sharded = direct.get_model()
        feds.shut_down(address)
    finally:
        feds.close()
    one = RunningServer(strategy="fedbuff", strategy_config=CASES["fedbuff"],
                        rate_limit_per_second=0.0)  # fmt: skip
    try:
        with Client(one.address, "a") as a, Client(one.address, "b") as b:
            a.register(layout=layout, initial=w0)
            b.register(layout=layout)
            for client, delta in zip((a, b), sent, strict=True):
                client.push(client.get_job(), delta, kind=UpdateKind.DELTA, encoding="dense")
            _, want = a.get_model()
    finally:
        one.stop()
    assert torch.equal(sharded, want)
    assert not torch.allclose(sharded, w0 + (deltas[0] + deltas[1]) / 2, rtol=0, atol=1e-8)
