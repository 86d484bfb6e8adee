"""serialized_chunk_stream gives, byte for byte, what protobuf's own SerializeToString gives for
chunk_stream's messages (the oracle), for every message type that carries chunks, odd sizes,
unicode tensor names, offsets of 0 and above 2^32, and chunk lengths with multi-byte varints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aggsrv import protocol as P
from aggsrv.v1 import aggregation_pb2 as pb


@pytest.mark.parametrize("message_cls", [pb.JobMessage, pb.ModelMessage, pb.UpdateMessage])
@pytest.mark.parametrize("dtype", [P.WireDtype.FLOAT32, P.WireDtype.BFLOAT16])
def test_serialized_stream_equals_protobufs_serialization(message_cls, dtype) -> None:
    rng = np.random.default_rng()
    tensors = {
        "weights": torch.as_tensor(rng.standard_normal(int(rng.integers(1, 70_000))),
                                   dtype=torch.float32),
        "bn.running_var ünï": torch.as_tensor(rng.standard_normal(3), dtype=torch.float32),
        "x": torch.as_tensor(rng.standard_normal(37), dtype=torch.float32),
    }  # fmt: skip
    chunk_bytes = int(rng.integers(16, 40_000)) // 4 * 4
    ours = list(P.serialized_chunk_stream(tensors, dtype, chunk_bytes, message_cls))
    theirs = [
        m.SerializeToString() for m in P.chunk_stream(tensors, dtype, chunk_bytes, message_cls)
    ]
    assert len(ours) == len(theirs) > 3
    assert ours == theirs
    parsed = [message_cls.FromString(b) for b in ours]
    assert parsed[-1].WhichOneof("kind") == "trailer"
    assert {m.chunk.tensor for m in parsed[:-1]} == set(tensors)


def test_field_edge_values_match_protobuf() -> None:
    # Offsets beyond 32 bits and data long enough for a 3-byte length varint (the stream test's
    # tensors are too small for them).
    for name, offset, n in [("", 0, 1), ("a", 1, 127), ("é" * 70, 2**33 + 4, 2**14 + 1),
                            ("t", 127, 2**21 + 8)]:  # fmt: skip
        data = np.random.default_rng().bytes(n)
        oracle = pb.JobMessage(
            chunk=P.tpb.TensorChunk(tensor=name, offset=offset, data=data)
        ).SerializeToString()
        ours = P._chunk_message(P._key(2, 2), name, offset, data)
        assert ours == oracle, (name, offset, n)
