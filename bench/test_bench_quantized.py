"""What an INT8/INT4 update costs the server to fold in (docs/compression.md), against the float32
update it replaces: `aggsrv.kernels.quantized_accumulate` (one pass over the codes: decode and
add) beside `out.add_(x, alpha=w)` on a float32 update (what FedBuff's sum does), interleaved in
one run, on the CPU backend.

Run: `pytest bench/test_bench_quantized.py --benchmark-only -s` (`AGGSRV_BENCH_SCALE=0.01` for
a smoke run). D = 4M float32 (16.8 MB: the rows fit in a large last-level cache) and ResNet-34's
21.8M (87 MB: they do not) at scale 1. Candidates: **ours** the fused kernel; **floor** the
float32 add_ (the target: ours <= 1.1x it); **naive** the server's path today: the transport's
decoder (its checks, then `kernels.dequantize` into a float32 buffer), then add_.
GB/s = the bytes each must move (out read and written, 8D, plus the update's own bytes).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import random_tensor, run_case, scaled

from aggsrv import kernels
from aggsrv.transport import Quantization, decode_quantized, quantize

BLOCK = 128


@pytest.mark.parametrize("size", [4 * 1024 * 1024, 21_797_672], ids=["4M", "resnet34"])
@pytest.mark.parametrize("q", [Quantization.INT8, Quantization.INT4])
def test_bench_quantized_accumulate(benchmark: Any, q: Quantization, size: int) -> None:
    D = scaled(size)
    x = random_tensor(D, seed=1) * 0.01
    wire, _ = quantize(x, q, BLOCK)
    nblocks = -(-D // BLOCK)
    scales = torch.frombuffer(bytearray(wire[: 4 * nblocks]), dtype=torch.float32)
    body = torch.frombuffer(bytearray(wire[4 * nblocks :]), dtype=torch.uint8)
    codes = body.view(torch.int8) if q is Quantization.INT8 else body
    bits = 8 if q is Quantization.INT8 else 4
    out = random_tensor(D, seed=2)
    staging = torch.empty(D)
    w = 0.25

    def ours() -> None:
        kernels.quantized_accumulate(out, codes, scales, BLOCK, w, bits=bits, backend="cpu")

    def floor() -> None:
        out.add_(x, alpha=w)

    def naive() -> None:
        decode_quantized(wire, q, D, BLOCK, "update", out=staging)
        out.add_(staging, alpha=w)

    run_case(
        benchmark,
        f"quantized_accumulate {q.value} D={D / 1e6:.1f}M (update {len(wire) / 1e6:.2f} MB "
        f"vs {4 * D / 1e6:.1f} MB float32)",
        {"ours": ours, "floor": floor, "naive": naive},
        nbytes=8 * D + len(wire),
        floor_max=1.1,
        naive_min=None,
    )
