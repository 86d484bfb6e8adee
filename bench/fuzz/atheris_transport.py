"""Coverage-guided fuzzing (atheris / libFuzzer) of what a PushUpdate stream goes through before
any state is touched: protobuf parsing of each message, the header's tensor infos, and chunk
assembly into a staging slot with the trailer's checks.

Any input must end in a decoded update or a clean CodecError / ValueError; any other exception,
a hang or a write outside the slot is a finding (libFuzzer stops and prints the input).

    python bench/fuzz/atheris_transport.py -runs=100000          # or -max_total_time=600
    python bench/fuzz/atheris_transport.py CORPUS_DIR            # keep and grow a corpus

tests/transport/test_fuzz_atheris.py runs it for a few thousand inputs in CI when atheris is
installed.
"""

from __future__ import annotations

import sys

import atheris

# Loaded first, so that only aggsrv's codec and protocol code below is instrumented.
import torch  # noqa: F401, I001
from google.protobuf.message import DecodeError

import aggsrv.strategies  # noqa: F401
from aggsrv.layout import LayoutMismatchError
from aggsrv.v1 import aggregation_pb2 as pb

with atheris.instrument_imports(include=["aggsrv.transport", "aggsrv.protocol"]):
    from aggsrv import protocol as P
    from aggsrv.transport import CodecError, Decoder, StagingSlot, WireDtype

D = 37  # the "model": odd, so chunks rarely line up with it
B = 3  # float buffers
CHUNK_BYTES = 64
SLOT = StagingSlot(D + 8, {"buffers": B})  # larger than needed: the tail must stay untouched
EXPECTED = {"update": D, "buffers": B}
SENTINEL = 12345.0


NAMES = ["update", "buffers", "", "weights", "update\x00"]


def _header(fdp: atheris.FuzzedDataProvider) -> pb.UpdateHeader:
    """A header built from the input (structure-aware: random bytes seldom parse as one)."""
    if fdp.ConsumeBool():
        try:
            return pb.UpdateMessage.FromString(
                fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 200))
            ).header
        except DecodeError:
            return pb.UpdateHeader()
    header = pb.UpdateHeader(dtype=fdp.ConsumeIntInRange(-1, 5))
    for _ in range(fdp.ConsumeIntInRange(0, 3)):
        info = header.tensors.add(
            name=fdp.PickValueInList(NAMES),
            numel=fdp.PickValueInList([D, B, 0, 1, D + 1, 2**40, fdp.ConsumeIntInRange(0, 99)]),
            encoding=fdp.ConsumeIntInRange(0, 4),
        )
        if fdp.ConsumeBool():
            info.nnz = fdp.ConsumeIntInRange(0, 2 * D)
    return header


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    SLOT.flat[D:].fill_(SENTINEL)
    header = _header(fdp)
    dtype = None
    try:
        dtype = P.wire_dtype(header.dtype)
        sparse = P.sparse_infos(list(header.tensors))
        declared = {i.name: int(i.numel) for i in header.tensors}
        if declared != EXPECTED:
            return  # the service refuses this before decoding
        decoder = Decoder(SLOT, EXPECTED, dtype, CHUNK_BYTES, sparse=sparse)
        for _ in range(fdp.ConsumeIntInRange(0, 12)):
            if fdp.ConsumeIntInRange(0, 9) == 0:
                out = decoder.finish(
                    fdp.ConsumeIntInRange(0, 2**32 - 1), fdp.ConsumeIntInRange(0, 4 * (D + B) + 8)
                )
                assert set(out) == set(EXPECTED)
                assert all(bool(t.isfinite().all()) for t in out.values())
                break
            name = fdp.PickValueInList(NAMES)
            offset = fdp.PickValueInList([0, 4, 64, 148, -4, 2**62, fdp.ConsumeIntInRange(0, 200)])
            decoder.feed(name, offset, fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 80)))
    except (CodecError, ValueError, LayoutMismatchError):
        pass
    assert bool((SLOT.flat[D:] == SENTINEL).all()), "the decoder wrote outside the update"
    assert dtype is None or isinstance(dtype, WireDtype)


def main(argv: list[str]) -> None:
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
