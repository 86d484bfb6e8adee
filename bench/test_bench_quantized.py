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
The same with ``base=``: FedAsync's ``new = x + a * delta`` written into the next version (x
read, new written), against ``torch.add(x, delta, alpha=a, out=new)``.

The int8 row cache (kernels/quantized_rows.py: MIFA, Fed-OGD and CA2FL with cache_dtype int8)
against the float32 cache it replaces, K in {16, 64} rows of D = 4M at scale 1, interleaved in
one run on the CPU backend, the same rows in both (the float32 rows quantized once, blocks of
128): **ours** the int8 kernel, **floor** the float32 kernel on the float32 rows (the target:
ours <= 1.15x it).

* `quantized_weighted_sum(Q, w, out=)` against `weighted_sum(X32, w, out=)` (float32 out);
* `quantized_gram(Q)` against `gram_matrix(X32)`, GFLOP/s counting 2 K^2 D (one full mm).

A second line per case gives each cache's GB/s on the bytes it actually moves (int8: K (D + 4
ceil(D / 128)) bytes of codes and scales read; float32: 4 K D read; the weighted sums also write
their 4D-byte out) and its time per row.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import emit, fmt_size, fmt_time, random_tensor, run_case, scaled

from aggsrv import kernels
from aggsrv.transport import Quantization, decode_quantized, quantize

BLOCK = 128


def _section(values: torch.Tensor, q: Quantization) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    """The wire section of ``values`` and, over copies of its bytes, its float32 scales and its
    uint8 code bytes (what a kernel takes)."""
    wire, _ = quantize(values, q, BLOCK)
    nblocks = -(-values.numel() // BLOCK)
    scales = torch.frombuffer(bytearray(wire[: 4 * nblocks]), dtype=torch.float32)
    return wire, scales, torch.frombuffer(bytearray(wire[4 * nblocks :]), dtype=torch.uint8)


@pytest.mark.parametrize("size", [4 * 1024 * 1024, 21_797_672], ids=["4M", "resnet34"])
@pytest.mark.parametrize("q", [Quantization.INT8, Quantization.INT4])
def test_bench_quantized_accumulate(benchmark: Any, q: Quantization, size: int) -> None:
    D = scaled(size)
    x = random_tensor(D, seed=1) * 0.01
    wire, scales, body = _section(x, q)
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


@pytest.mark.parametrize("size", [4 * 1024 * 1024, 21_797_672], ids=["4M", "resnet34"])
def test_bench_quantized_step_into_a_new_version(benchmark: Any, size: int) -> None:
    """FedAsync's step ``new = x + a * delta`` written into the next version: the fused kernel
    with ``base=x`` against ``torch.add(x, delta, alpha=a, out=new)`` on a float32 delta."""
    D = scaled(size)
    delta = random_tensor(D, seed=1) * 0.01
    wire, scales, body = _section(delta, Quantization.INT8)
    codes = body.view(torch.int8)
    x = random_tensor(D, seed=2)
    new = torch.empty(D)
    staging = torch.empty(D)
    a = 0.6

    def ours() -> None:
        kernels.quantized_accumulate(new, codes, scales, BLOCK, a, base=x, backend="cpu")

    def floor() -> None:
        torch.add(x, delta, alpha=a, out=new)

    def naive() -> None:
        decode_quantized(wire, Quantization.INT8, D, BLOCK, "update", out=staging)
        torch.add(x, staging, alpha=a, out=new)

    run_case(
        benchmark,
        f"quantized step x + a*delta int8 D={D / 1e6:.1f}M",
        {"ours": ours, "floor": floor, "naive": naive},
        nbytes=8 * D + len(wire),
        floor_max=1.1,
        naive_min=None,
    )


@pytest.mark.parametrize("size", [4 * 1024 * 1024, 21_797_672], ids=["4M", "resnet34"])
def test_bench_server_work_per_int8_update(benchmark: Any, size: int) -> None:
    """What the server does with an INT8 DELTA once its bytes arrived, FedAsync's step: check the
    section (`quantized_values`), then fold the codes into the next version and take their norm
    in the same pass (`quantized_accumulate(base=x, squares=)`). **floor** the float32
    accumulate on the same D, `torch.add(x, delta, alpha=a, out=new)` (the target: ours <= 1.1x
    it); **naive** the path
    before codes were kept: decode into a float32 buffer, the decoder's NaN/Inf and norm pass
    over it, then the same add; **float32** what a float32 upload costs past its bytes: that pass
    and the add."""
    from aggsrv.fused_dots import squares
    from aggsrv.transport import quantized_values

    D = scaled(size)
    delta = random_tensor(D, seed=1) * 0.01
    wire, _ = quantize(delta, Quantization.INT8, BLOCK)
    raw = memoryview(bytearray(wire))
    x = random_tensor(D, seed=2)
    new = torch.empty(D)
    staging = torch.empty(D)
    a = 0.6

    def ours() -> None:
        q = quantized_values(raw, Quantization.INT8, D, BLOCK, "update")
        squares = torch.zeros(1, dtype=torch.float64)
        kernels.quantized_accumulate(
            new, q.codes, q.scales, BLOCK, a, base=x, squares=squares, backend="cpu"
        )

    def floor() -> None:
        torch.add(x, delta, alpha=a, out=new)

    def naive() -> None:
        decode_quantized(raw, Quantization.INT8, D, BLOCK, "update", out=staging)
        squares(staging.numpy())
        torch.add(x, staging, alpha=a, out=new)

    def float32() -> None:
        squares(delta.numpy())
        torch.add(x, delta, alpha=a, out=new)

    run_case(
        benchmark,
        f"server work per int8 update (check, norm, fold into x + a*delta) D={D / 1e6:.1f}M",
        {"ours": ours, "floor": floor, "naive": naive, "float32": float32},
        nbytes=8 * D + len(wire),
        floor_max=1.1,
        naive_min=None,
        baseline="float32",
    )


@pytest.mark.parametrize("size", [4 * 1024 * 1024, 21_797_672], ids=["4M", "resnet34"])
def test_bench_fedasync_on_update_int8_against_float32(benchmark: Any, size: int) -> None:
    """FedAsync's whole `on_update` (validation, ledger, the step, the check of the version it
    publishes) on an INT8 DELTA kept as codes (**ours**) against the same call on a float32 delta
    (**floor**; its values were proven finite by the decoder already, but the strategy's own
    checks read them again)."""
    from aggsrv.layout import ModelLayout
    from aggsrv.strategies import make_strategy
    from aggsrv.transport import quantized_values
    from aggsrv.values import Update, UpdateKind

    D = scaled(size)
    layout = ModelLayout.from_named_shapes([("w", (D,))])
    delta = random_tensor(D, seed=1) * 0.01
    wire, _ = quantize(delta, Quantization.INT8, BLOCK)
    raw = memoryview(bytearray(wire))
    staging = torch.empty(D)
    strategies = {
        name: make_strategy(
            "fedasync", {"alpha": 0.6}, layout=layout, initial=random_tensor(D, seed=2)
        )
        for name in ("ours", "floor")
    }
    for s in strategies.values():
        s.on_register("a", 0.0)
    count = iter(range(10**9))

    def push(name: str) -> None:
        s = strategies[name]
        job = s.job_for("a", 0.0)
        codes = quantized_values(raw, Quantization.INT8, D, BLOCK, "u") if name == "ours" else None
        tensor = staging if codes is not None else delta
        s.on_update(Update("a", job.job_id, job.base_version, f"u{next(count)}", 1, 1.0,
                           UpdateKind.DELTA, tensor, quantized=codes), 0.0)  # fmt: skip

    run_case(
        benchmark,
        f"FedAsync on_update int8 codes vs float32 D={D / 1e6:.1f}M",
        {"ours": lambda: push("ours"), "floor": lambda: push("floor")},
        nbytes=8 * D + len(wire),
        floor_max=1.1,
        naive=None,
    )


# --------------------------------------------------------------------------------------------
# The int8 row cache against the float32 cache, per row: target <= 1.15x the float32 kernel
# --------------------------------------------------------------------------------------------


def _cache_rows(K: int, size: int) -> tuple[int, torch.Tensor, kernels.QuantizedRows]:
    """D, the float32 rows [K, D] and the same rows quantized (blocks of BLOCK)."""
    D = scaled(size)
    X32 = random_tensor(K, D, seed=3) * 0.01
    return D, X32, kernels.quantize_rows(X32, BLOCK, backend="cpu")


def _per_row_line(
    benchmark: Any, title: str, info: dict, K: int, int8_bytes: int, float32_bytes: int
) -> None:
    """Each cache's GB/s on its own bytes, and its time per row."""
    t8, t32 = info["ours_s"], info["floor_s"]
    emit(
        benchmark,
        f"  {title} per row: int8 {fmt_time(t8 / K)}/row ({int8_bytes / t8 / 1e9:.1f} GB/s of "
        f"{int8_bytes / 1e6:.1f} MB), float32 {fmt_time(t32 / K)}/row "
        f"({float32_bytes / t32 / 1e9:.1f} GB/s of {float32_bytes / 1e6:.1f} MB)",
        {
            "int8_bytes": int8_bytes,
            "float32_bytes": float32_bytes,
            "int8_GBps": int8_bytes / t8 / 1e9,
            "float32_GBps": float32_bytes / t32 / 1e9,
            "int8_s_per_row": t8 / K,
            "float32_s_per_row": t32 / K,
        },
    )


@pytest.mark.parametrize("K", [16, 64])
def test_bench_int8_cache_weighted_sum(benchmark: Any, K: int) -> None:
    D, X32, Q = _cache_rows(K, 4 * 1024 * 1024)
    w = torch.rand(K, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) + 0.5
    out, out32 = torch.empty(D), torch.empty(D)
    row8 = kernels.quantized_row_bytes(D, BLOCK)

    def ours() -> None:
        kernels.quantized_weighted_sum(Q, w, out=out, backend="cpu")

    def floor() -> None:
        kernels.weighted_sum(X32, w, out=out32, backend="cpu")

    title = (
        f"int8 cache quantized_weighted_sum K={K} D={fmt_size(D)} (row {row8 / 1e6:.2f} MB "
        f"vs {4 * D / 1e6:.1f} MB float32)"
    )
    info = run_case(benchmark, title, {"ours": ours, "floor": floor}, floor_max=1.15, naive=None)
    _per_row_line(benchmark, title.split(" (")[0], info, K, K * row8 + 4 * D, K * 4 * D + 4 * D)


@pytest.mark.parametrize("K", [16, 64])
def test_bench_int8_cache_gram(benchmark: Any, K: int) -> None:
    D, X32, Q = _cache_rows(K, 4 * 1024 * 1024)
    row8 = kernels.quantized_row_bytes(D, BLOCK)

    def ours() -> None:
        kernels.quantized_gram(Q, backend="cpu")

    def floor() -> None:
        kernels.gram_matrix(X32, backend="cpu")

    title = (
        f"int8 cache quantized_gram K={K} D={fmt_size(D)} (row {row8 / 1e6:.2f} MB "
        f"vs {4 * D / 1e6:.1f} MB float32)"
    )
    info = run_case(
        benchmark, title, {"ours": ours, "floor": floor},
        flops=2.0 * K * K * D, floor_max=1.15, naive=None,
    )  # fmt: skip
    _per_row_line(benchmark, title.split(" (")[0], info, K, K * row8, K * 4 * D)
