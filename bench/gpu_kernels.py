"""Time every Triton kernel of aggsrv.kernels against the equivalent eager torch code on a GPU.

    python bench/gpu_kernels.py                # CUDA: realistic shapes, GB/s or GFLOP/s + ratio
    python bench/gpu_kernels.py --dry-run      # CPU: tiny shapes under the Triton interpreter,
                                               # every kernel and baseline checked, exit 1 on error

Effective bandwidth counts the bytes the fused algorithm must move (the same count for both
sides, so the ratio is the time ratio); the Gram-based kernels (cosines, Gram, squared distances)
report 2*K*M*D / t as GFLOP/s.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

DRY = "--dry-run" in sys.argv
if DRY and not torch.cuda.is_available():
    # Must precede the import of the module that defines the kernels.
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # an installed aggsrv, else the checkout this script lives in
    from aggsrv.kernels import reference as ref
    from aggsrv.kernels import triton as tk

    from aggsrv import kernels as api
except ImportError:  # pragma: no cover - running from a bare checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from aggsrv.kernels import reference as ref
    from aggsrv.kernels import triton as tk

    from aggsrv import kernels as api


@dataclass
class Case:
    """One kernel: the Triton call, the torch baseline, and how much work one call does."""

    name: str
    triton_fn: Callable[[], torch.Tensor]
    torch_fn: Callable[[], torch.Tensor]
    reference: Callable[[], torch.Tensor]
    nbytes: int = 0  # bytes the fused algorithm reads + writes
    flops: int = 0  # for the Gram-based kernels
    cosine: bool = False  # compare with an absolute tolerance


def _group_means(backend, X, groups, num_groups):
    """Call a backend's group_means, which writes into a caller-provided [G, D] buffer."""
    out = torch.empty(num_groups, X.shape[1], dtype=X.dtype, device=X.device)
    backend.group_means(X, torch.as_tensor(groups).cpu(), num_groups, out)
    return out


def make_offsets(D: int, L: int, gen: torch.Generator) -> torch.Tensor:
    """A ragged layer table like a real model: a few big tensors, many small ones, one empty."""
    sizes = torch.rand(L, generator=gen, dtype=torch.float64) ** 4
    sizes[L // 2] = 0.0
    sizes = (sizes / sizes.sum() * D).floor().to(torch.int64)
    sizes[0] += D - int(sizes.sum())
    return torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])


def segments(offs: torch.Tensor) -> list[tuple[int, int]]:
    o = offs.tolist()
    return list(zip(o[:-1], o[1:], strict=True))


def expand(coef: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-segment values [.., L] repeated over their elements [.., D] (torch baseline helper)."""
    lengths = (offs[1:] - offs[:-1]).to(coef.device)
    return coef.repeat_interleave(lengths, dim=-1)


def build_cases(K: int, D: int, L: int, dtype: torch.dtype, device: str) -> list[Case]:
    """Every kernel at one shape, with its torch baseline and the float64 reference."""
    gen = torch.Generator().manual_seed(0)
    offs = make_offsets(D, L, gen)
    segs = segments(offs)
    whole = torch.tensor([0, D], dtype=torch.int64)
    esz = torch.finfo(dtype).bits // 8

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    X, b = rnd(K, D), rnd(1, D)
    x, sent, w, snap, ma = (rnd(1, D) for _ in range(5))
    calibrate = torch.ones(L, dtype=torch.bool)
    calibrate[1::3] = False
    groups = torch.randint(-1, 4, (K,), generator=gen)
    weights = torch.rand(K, generator=gen, dtype=torch.float64)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out_g = torch.empty_like(X)
    out_y, out_ma = torch.empty_like(x), torch.empty_like(x)
    out_s = torch.empty(D, device=device, dtype=dtype)

    def t_project() -> torch.Tensor:
        tk.project_out(X, b, offs, True, 1e-12, out_g)
        return out_g

    def torch_project() -> torch.Tensor:
        Xa, ba = X.to(acc), b.to(acc)
        gb = torch.stack([Xa[:, s:e] @ ba[0, s:e] for s, e in segs], 1)
        bb = torch.stack([ba[0, s:e] @ ba[0, s:e] for s, e in segs])
        c = torch.where(bb > 1e-12, gb / bb.clamp_min(1e-30), torch.zeros_like(gb)).clamp(max=0)
        return (Xa - expand(c, offs) * ba).to(dtype)

    def r_project() -> torch.Tensor:
        o = torch.empty_like(X)
        ref.project_out(X, b, offs, True, 1e-12, o)
        return o

    def t_calib() -> torch.Tensor:
        c = tk.orthogonal_calibrate(
            x, sent, w, snap, ma, offs, 0.1, calibrate, 1e-12, out_y, out_ma
        )
        return torch.cat([c, out_y[0].to(acc), out_ma[0].to(acc)])

    def torch_calib() -> torch.Tensor:
        xa, sa, wa, pa, ma_a = (t[0].to(acc) for t in (x, sent, w, snap, ma))
        dm, dg = xa - sa, wa - pa
        num = torch.stack([dg[s:e] @ dm[s:e] for s, e in segs])
        den = torch.stack([dm[s:e] @ dm[s:e] for s, e in segs])
        ok = (den > 1e-12) & calibrate.to(device)
        c = torch.where(ok, num / den.clamp_min(1e-30), torch.zeros_like(num))
        on = expand(calibrate.to(device, acc), offs)
        y = torch.where(on > 0, xa + (dg - expand(c, offs) * dm), xa).to(dtype)
        new_ma = (0.9 * ma_a + 0.1 * xa).to(dtype)
        return torch.cat([c, y.to(acc), new_ma.to(acc)])

    def r_calib() -> torch.Tensor:
        y, m = torch.empty_like(x), torch.empty_like(x)
        c = ref.orthogonal_calibrate(x, sent, w, snap, ma, offs, 0.1, calibrate, 1e-12, y, m)
        return torch.cat([c, y[0].to(acc), m[0].to(acc)])

    def torch_cos(layerwise: bool) -> torch.Tensor:
        mats = []
        for s, e in segs if layerwise else [(0, D)]:
            xs = X[:, s:e].to(acc)
            n = xs.norm(dim=1)
            den = n[:, None] * n[None, :]
            cos = torch.where(den > 0, (xs @ xs.T) / den.clamp_min(1e-30), 0.0).clamp(-1, 1)
            mats.append(cos)
        return torch.stack(mats) if layerwise else mats[0]

    def torch_lnc() -> torch.Tensor:
        keep = [i for i, (s, e) in enumerate(segs) if e > s]
        return torch_cos(True)[keep].mean(0)

    def t_gm() -> torch.Tensor:
        return _group_means(tk, X, groups, 4)

    def torch_gm() -> torch.Tensor:
        gdev = groups.to(device)
        keep = gdev >= 0
        sums = torch.zeros(4, D, device=device, dtype=acc).index_add_(
            0, gdev[keep], X[keep].to(acc)
        )
        counts = torch.bincount(gdev[keep], minlength=4).clamp_min(1).to(acc)
        return (sums / counts[:, None]).to(dtype)

    def t_ws() -> torch.Tensor:
        tk.weighted_sum(X, weights, out_s, 1.0, 0.0)
        return out_s

    def torch_ws() -> torch.Tensor:
        return (weights.to(device, acc) @ X.to(acc)).to(dtype)

    def r_ws() -> torch.Tensor:
        o = torch.empty_like(out_s)
        ref.weighted_sum(X, weights, o, 1.0, 0.0)
        return o

    # Robust aggregation: distances to a point, norm clipping, the Weiszfeld and centered
    # clipping steps (compositions of backend calls), Krum's scores from the Gram pass.
    point = X.mean(0, keepdim=True)
    bound = float(X.double().norm(dim=1).median())  # about half the rows clipped
    out_c = torch.empty_like(X)
    f = max(K // 4 - 1, 0)

    def t_clip() -> torch.Tensor:
        tk.clip_rows(X, bound, out_c)
        return out_c

    def torch_clip() -> torch.Tensor:
        Xa = X.to(acc)
        return (Xa * (bound / Xa.norm(dim=1, keepdim=True)).clamp(max=1.0)).to(dtype)

    def r_clip() -> torch.Tensor:
        o = torch.empty_like(X)
        ref.clip_rows(X, bound, o)
        return o

    def weiszfeld_step(backend) -> torch.Tensor:
        dist = backend.sq_distances_to(X, point).cpu().sqrt()
        b = 1.0 / dist.clamp_min(1e-8)
        o = torch.empty(D, device=device, dtype=dtype)
        backend.weighted_sum(X, (b / b.sum()).contiguous(), o, 1.0, 0.0)
        return o

    def torch_weiszfeld() -> torch.Tensor:
        Xa = X.to(acc)
        b = 1.0 / (Xa - point.to(acc)).norm(dim=1).clamp_min(1e-8)
        return ((b / b.sum()) @ Xa).to(dtype)

    def centered(backend: str) -> torch.Tensor:
        return api.centered_clip(X, point[0], 0.5 * bound, backend=backend)

    def torch_centered() -> torch.Tensor:
        diff = X.to(acc) - point.to(acc)
        c = (0.5 * bound / diff.norm(dim=1)).clamp(max=1.0) / K
        return (point[0].to(acc) + c @ diff).to(dtype)

    cut = max(1, K // 10)  # the trimmed mean's rows cut at each end (trim 0.1)

    def t_order(fn, *args) -> torch.Tensor:
        fn(X, *args, out_s)
        return out_s

    def r_order(fn, *args) -> torch.Tensor:
        o = torch.empty_like(out_s)
        fn(X, *args, o)
        return o

    def torch_order(c: int) -> torch.Tensor:
        # A sort, not torch.median: that returns the lower middle value for even K.
        srt = X.to(acc).sort(dim=0).values
        return srt[c : K - c].mean(dim=0).to(dtype)

    n_rows = int((groups >= 0).sum())
    gram_flops = 2 * K * K * D
    q_codes = torch.randint(-127, 128, (D,), dtype=torch.int8, device=device)
    q_scales = torch.rand(-(-D // 128), dtype=torch.float32, device=device) * 1e-3

    # The INT8 row cache (cache_dtype = "int8"): the same rows quantized once, block 128.
    Q = api.quantize_rows(X, 128)
    q_dec = api.dequantize_rows(Q)

    def q_ws(backend: str) -> torch.Tensor:
        return api.quantized_weighted_sum(Q, weights, backend=backend)

    def q_acc(backend) -> torch.Tensor:
        out = X[0].clone()
        backend.quantized_accumulate(out, q_codes, q_scales, 128, 0.3, 8, out)
        return out

    # A running float64 sum (FedBuff's buffer) and a row added into a fresh copy of it.
    running = X[1].to(torch.float64)

    def f64_acc(fn) -> torch.Tensor:
        acc = running.clone()
        fn(acc, X[0].contiguous(), 0.3)
        return acc

    return [
        Case(
            "layer_dots",
            lambda: tk.layer_dots(X, b, offs),
            lambda: torch.stack([X[:, s:e].to(acc) @ b[0, s:e].to(acc) for s, e in segs], 1),
            lambda: ref.layer_dots(X, b, offs),
            nbytes=(K + 1) * D * esz,
        ),
        Case(
            "project_out",
            t_project,
            torch_project,
            r_project,
            nbytes=(3 * K + 2) * D * esz,  # pass 1 reads g, pass 2 reads g and writes out
        ),
        Case("orthogonal_calibrate", t_calib, torch_calib, r_calib, nbytes=11 * D * esz),
        Case(
            "cosine_matrix",
            lambda: tk.cosine_matrix(X, whole, None, False),
            lambda: torch_cos(False),
            lambda: ref.cosine_matrix(X, whole, None, False),
            flops=gram_flops,
            cosine=True,
        ),
        Case(
            "cosine_matrix[layerwise]",
            lambda: tk.cosine_matrix(X, offs, None, True),
            lambda: torch_cos(True),
            lambda: ref.cosine_matrix(X, offs, None, True),
            flops=gram_flops,
            cosine=True,
        ),
        Case(
            "gram_matrix",
            lambda: tk.gram_matrix(X, None),
            lambda: X.to(acc) @ X.to(acc).T,
            lambda: ref.gram_matrix(X, None),
            flops=gram_flops,
        ),
        Case(
            "pairwise_sq_distances",
            lambda: tk.pairwise_sq_distances(X, None),
            lambda: torch.cdist(X.to(acc), X.to(acc)).square(),
            lambda: ref.pairwise_sq_distances(X, None),
            flops=gram_flops,
        ),
        Case(
            "layer_normalized_cosine",
            lambda: tk.layer_normalized_cosine(X, offs),
            torch_lnc,
            lambda: ref.layer_normalized_cosine(X, offs),
            flops=gram_flops,
            cosine=True,
        ),
        Case(
            "group_means",
            t_gm,
            torch_gm,
            lambda: _group_means(ref, X, groups, 4),
            nbytes=(n_rows + 4) * D * esz,
        ),
        Case("weighted_sum", t_ws, torch_ws, r_ws, nbytes=(K + 1) * D * esz),
        Case(
            "sq_distances_to",
            lambda: tk.sq_distances_to(X, point),
            lambda: ((X.to(acc) - point.to(acc)) ** 2).sum(1),
            lambda: ref.sq_distances_to(X, point),
            nbytes=(K + 1) * D * esz,
        ),
        # Half the rows above the bound; pass 1 reads X, pass 2 reads X and writes every row.
        Case("clip_rows", t_clip, torch_clip, r_clip, nbytes=3 * K * D * esz),
        Case(
            "geometric_median step",  # one distance pass and one weighted sum
            lambda: weiszfeld_step(tk),
            torch_weiszfeld,
            lambda: weiszfeld_step(ref),
            nbytes=(2 * K + 2) * D * esz,
        ),
        Case(
            "centered_clip(iters=1)",
            lambda: centered("triton"),
            torch_centered,
            lambda: centered("reference"),
            nbytes=(2 * K + 3) * D * esz,
        ),
        Case(
            "krum_scores(pairwise_sq)",
            lambda: api.krum_scores(tk.pairwise_sq_distances(X, None), f),
            lambda: api.krum_scores(torch.cdist(X.to(acc), X.to(acc)).square(), f),
            lambda: api.krum_scores(ref.pairwise_sq_distances(X, None), f),
            flops=gram_flops,
        ),
        Case(
            "coordinate_median",
            lambda: t_order(tk.coordinate_median),
            lambda: torch_order((K - 1) // 2),
            lambda: r_order(ref.coordinate_median),
            nbytes=(K + 1) * D * esz,
        ),
        Case(
            "trimmed_mean",
            lambda: t_order(tk.trimmed_mean, cut),
            lambda: torch_order(cut),
            lambda: r_order(ref.trimmed_mean, cut),
            nbytes=(K + 1) * D * esz,
        ),
        # An INT8 update (block 128) added into a fresh copy of row 0: the copy (read + write),
        # then the kernel reads it, the codes and the scales and writes it.
        Case(
            "quantized_accumulate(int8)",
            lambda: q_acc(tk),
            lambda: (
                X[0]
                + 0.3 * (q_codes.to(torch.float32) * q_scales.repeat_interleave(128)[:D]).to(dtype)
            ),
            lambda: q_acc(ref),
            nbytes=4 * D * esz + D + 4 * q_scales.numel(),
        ),
        # A row added into a float64 running sum: the copy of the sum (read + write), then
        # the kernel reads the row and the sum and writes the sum.
        Case(
            "accumulate(float64 sum)",
            lambda: f64_acc(tk.accumulate),
            lambda: f64_acc(lambda a, x, w: a.add_(x, alpha=w)),
            lambda: f64_acc(ref.accumulate),
            nbytes=3 * 8 * D + D * esz,
        ),
        # The weighted sum of the INT8 cache: codes and scales read once, a float32 [D] written.
        Case(
            "quantized_weighted_sum(int8 cache)",
            lambda: q_ws("triton"),
            lambda: weights.to(device, torch.float32) @ q_dec,
            lambda: q_ws("reference"),
            nbytes=K * (D + 4 * Q.scales.shape[1]) + 4 * D,
        ),
    ]


def error(got: torch.Tensor, want: torch.Tensor, cosine: bool) -> float:
    """Absolute max error for cosines, norm-wise relative error for vectors."""
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    if cosine:
        return (got64 - want64).abs().max().item()
    return (got64 - want64).norm().item() / max(want64.norm().item(), 1e-30)


def dry_run() -> int:
    """Run every kernel and baseline once on tiny shapes and check them against the reference."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    failures = 0
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for case in build_cases(K=5, D=777, L=6, dtype=dtype, device=device):
            want = case.reference()
            for side, fn in (("triton", case.triton_fn), ("torch", case.torch_fn)):
                err = error(fn(), want, case.cosine)
                ok = err <= tol
                failures += not ok
                print(f"{'ok ' if ok else 'BAD'} {case.name:26s} {side:6s} {dtype} err={err:.2e}")
    print("dry run:", "all ok" if failures == 0 else f"{failures} mismatches")
    return 1 if failures else 0


def bench(dtype: torch.dtype) -> int:
    """Time Triton against torch at the realistic shapes on the current CUDA device."""
    from triton.testing import do_bench

    torch.backends.cuda.matmul.allow_tf32 = False  # the baseline must be as exact as ours
    print(f"device: {torch.cuda.get_device_name()}  dtype: {dtype}")
    print(f"{'shape':>22s} {'kernel':26s} {'triton ms':>10s} {'torch ms':>10s} "
          f"{'triton':>13s} {'torch':>13s} {'speedup':>8s} {'err':>9s}")  # fmt: skip
    for K, D, L in ((64, 4_000_000, 62), (16, 11_200_000, 62)):
        for case in build_cases(K, D, L, dtype, "cuda"):
            err = error(case.triton_fn(), case.reference(), case.cosine)
            t_tri = do_bench(case.triton_fn, warmup=10, rep=50)
            t_tor = do_bench(case.torch_fn, warmup=10, rep=50)
            if case.flops:
                unit, work = "GFLOP/s", case.flops
            else:
                unit, work = "GB/s", case.nbytes
            rate_tri = work / (t_tri * 1e-3) / 1e9
            rate_tor = work / (t_tor * 1e-3) / 1e9
            print(f"{f'K={K} D={D} L={L}':>22s} {case.name:26s} {t_tri:10.3f} {t_tor:10.3f} "
                  f"{rate_tri:8.1f} {unit:4s} {rate_tor:8.1f} {unit:4s} "
                  f"{t_tor / t_tri:7.2f}x {err:9.1e}")  # fmt: skip
            del case
        torch.cuda.empty_cache()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the dry run or the benchmark."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, checked, no timing")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    if args.dry_run:
        return dry_run()
    if not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    return bench(getattr(torch, args.dtype))


if __name__ == "__main__":
    sys.exit(main())
