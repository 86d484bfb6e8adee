"""The receiver's scan for refused codes (INT8 -128, INT4 nibble 0b1000) against a numpy oracle:
every length around the 8-byte words and the scan's spans, refused codes at random places, in
the word-aligned body and in its tail."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from aggsrv.transport.code_scan import first_refused_code


def oracle(body: np.ndarray, bits: int) -> int:
    if bits == 8:
        hits = np.flatnonzero(body == 0x80)
        return int(hits[0]) if hits.size else -1
    values = np.stack([body & 0x0F, body >> 4], axis=1).reshape(-1)
    hits = np.flatnonzero(values == 8)
    return int(hits[0]) if hits.size else -1


def clean(n: int, bits: int, rng: np.random.Generator) -> np.ndarray:
    if bits == 8:
        return rng.integers(-127, 128, n).astype(np.int8).view(np.uint8)
    nib = rng.integers(-7, 8, (n, 2)).astype(np.int8).view(np.uint8) & 0x0F
    return (nib[:, 0] | (nib[:, 1] << 4)).astype(np.uint8)


@pytest.mark.parametrize("bits", [8, 4])
def test_first_refused_code_matches_numpy(bits: int) -> None:
    seed = secrets.randbits(31)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    lengths = [*range(0, 20), 4095, 4096, 4097, 8191, 8200, int(rng.integers(10_000, 50_000))]
    for n in lengths:
        body = clean(n, bits, rng)
        assert first_refused_code(body, bits) == -1
        for _ in range(3 if n else 0):
            bad = body.copy()
            for pos in rng.integers(0, n, int(rng.integers(1, 4))):
                if bits == 8:
                    bad[pos] = 0x80
                else:
                    bad[pos] = (
                        (bad[pos] & 0xF0) | 0x08
                        if rng.random() < 0.5
                        else ((bad[pos] & 0x0F) | 0x80)
                    )
            assert first_refused_code(bad, bits) == oracle(bad, bits), (n, bits)


def test_unaligned_and_read_only_buffers() -> None:
    # The bytes of a gRPC message: read-only, at any address.
    raw = bytes(np.arange(64, dtype=np.uint8) % 0x7F) + b"\x80" + bytes(20)
    for start in range(8):
        body = np.frombuffer(raw, dtype=np.uint8, offset=start)
        assert not body.flags.writeable
        assert first_refused_code(body, 8) == 64 - start


def test_a_refused_code_in_the_last_byte_is_found() -> None:
    for n in (1, 7, 8, 9, 4103):
        body = np.zeros(n, dtype=np.uint8)
        body[-1] = 0x80
        assert first_refused_code(body, 8) == n - 1
        assert first_refused_code(body, 4) == 2 * n - 1
        body[-1] = 0x08
        assert first_refused_code(body, 4) == 2 * n - 2
