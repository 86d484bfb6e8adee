"""Kernels with ``reduce=`` on shards of the flat layout (docs/kernels.md "Sharded use").

N shards are simulated in one process, one call after another (numba's workqueue threading
layer is not thread-safe, so no threads), by record and replay: pass 1 calls the kernel on every
shard's slice with a reducer that records the packed partial sums and returns them unchanged;
the recorded partials are summed in float64 in rank order (what ``TorchReducer`` does); pass 2
calls every shard again with a reducer that returns that sum. The joined elementwise outputs and
the derived values must then equal one unsharded call and the float64 reference, and be the same
on every shard.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from aggsrv.kernels.triton import _common
from kernel_tolerances import assert_close_normwise, cos_tol, vec_tol

from aggsrv import kernels
from aggsrv.sharding import LocalReducer, ShardMap

BACKENDS = ["reference", "cpu", "triton"]
# Triton runs on CUDA tensors where there is a GPU, elsewhere under TRITON_INTERPRET=1
# (conftest.py sets it).
TRITON_DEV = "cuda" if torch.cuda.is_available() else "cpu"

# Empty first, middle and last-but-one segments; lengths that are not multiples of anything.
SIZES = [0, 37, 0, 150, 1, 90, 0, 40]
OFFS = torch.tensor([0, *np.cumsum(SIZES).tolist()], dtype=torch.int64)
D = int(OFFS[-1])
MAPS = [
    ShardMap.even(D, 1),
    ShardMap.even(D, 2, align=8),  # cut at 160: inside the 150-element segment [37, 187)
    ShardMap.even(D, 3, align=8),  # cuts at 104 and 208: inside [37, 187) and [188, 278)
    # An empty shard, and a shard wholly inside one segment (every other segment empty there).
    ShardMap((0, 48, 48, 112, D)),
]


def maps_for(backend: str) -> list[ShardMap]:
    """Every map on the CPU backends; under the Triton interpreter (about 1 ms per program) the
    2-shard map and the one with an empty shard and a shard inside one segment."""
    return [MAPS[1], MAPS[3]] if backend == "triton" else MAPS


def cases(full: list[tuple], triton: list[tuple]) -> list[tuple]:
    """(backend, *case): reference and cpu on every case, triton on the listed ones."""
    return [(b, *c) for b in ("reference", "cpu") for c in full] + [("triton", *c) for c in triton]


def assert_close_abs(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape
    err = (got.double().cpu() - want.double().cpu()).abs().max().item() if got.numel() else 0.0
    assert err <= tol, f"absolute error {err:.3g} > {tol}"


def rand(*shape: int, dtype: torch.dtype = torch.float32, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def on(backend: str, *tensors: Any) -> list[Any]:
    """The tensors (None passes) on the device that ``backend`` runs on."""
    device = TRITON_DEV if backend == "triton" else "cpu"
    return [None if t is None else t.to(device) for t in tensors]


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("AGGSRV_TEST_SEED") or random.randrange(1 << 30))
    print(f"seed {seed} (AGGSRV_TEST_SEED replays it)")  # shown with a failure
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------- record and replay


class _Record:
    """Pass 1: keeps a copy of the partial sums and returns them unchanged (in place)."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.seen.append(t.clone())
        return t


class _Replay:
    """Pass 2: returns the sum over the shards, written into its argument or as a new tensor."""

    def __init__(self, total: torch.Tensor, in_place: bool) -> None:
        self.total = total
        self.in_place = in_place
        self.seen: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.seen.append(t.clone())
        return t.copy_(self.total) if self.in_place else self.total.clone()


def sharded(
    call: Callable[[int, Any], Any], smap: ShardMap, packed: tuple[int, ...] | None = None
) -> list[Any]:
    """Run ``call(rank, reduce)`` on every shard twice (record, then replay of the sum over the
    shards); return the pass-2 results by rank. ``packed``: the packed shape docs/kernels.md
    gives (the same on every backend: shards sum these tensors)."""
    partials = []
    for rank in range(smap.shards):
        rec = _Record()
        call(rank, rec)
        assert len(rec.seen) == 1, f"reduce called {len(rec.seen)} times on shard {rank}"
        p = rec.seen[0]
        assert p.dtype == torch.float64 and p.is_contiguous()
        assert packed is None or tuple(p.shape) == packed, f"packed {tuple(p.shape)}, not {packed}"
        partials.append(p)
    assert len({p.shape for p in partials}) == 1, "packed shapes differ between shards"
    total = torch.zeros_like(partials[0])
    for p in partials:  # float64, in rank order
        total += p
    results = []
    for rank in range(smap.shards):
        rep = _Replay(total, in_place=rank % 2 == 0)
        results.append(call(rank, rep))
        assert len(rep.seen) == 1, f"reduce called {len(rep.seen)} times on shard {rank}"
        # Deterministic partials: a collective may be replayed (and shards must agree).
        assert torch.equal(rep.seen[0], partials[rank])
    return results


def same_on_every_shard(values: Sequence[torch.Tensor]) -> torch.Tensor:
    for v in values[1:]:
        assert v.dtype == values[0].dtype and torch.equal(v, values[0])
    return values[0]


def local(smap: ShardMap, rank: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Shard ``rank``'s slices (views: rows stay strided)."""
    lo, hi = smap.slice(rank)
    return [t[..., lo:hi] for t in tensors]


def loffs(smap: ShardMap, rank: int, offs: torch.Tensor = OFFS) -> torch.Tensor:
    return smap.local_offsets(offs, rank)


def acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------ kernels


@pytest.mark.parametrize(
    "backend,dtype", cases([(torch.float32,), (torch.float64,)], [(torch.float32,)])
)
def test_layer_dots(backend, dtype, gen):
    K = 3
    a = rand(K, D, dtype=dtype, gen=gen)
    a[1] = 0.0
    b = rand(D, dtype=dtype, gen=gen)
    bk = rand(K, D, dtype=dtype, gen=gen)
    a, b, bk = on(backend, a, b, bk)
    want = kernels.layer_dots(a, b, OFFS, backend=backend)
    want_rows = kernels.layer_dots(a, bk, backend=backend)  # whole vector, paired rows
    want_vec = kernels.layer_dots(a[0], b, OFFS, backend=backend)  # [D] input
    ref = kernels.layer_dots(a.double(), b.double(), OFFS, backend="reference")
    for smap in maps_for(backend):

        def segments(r, red, smap=smap):
            al, bl = local(smap, r, a, b)
            return kernels.layer_dots(al, bl, loffs(smap, r), reduce=red, backend=backend)

        def rows(r, red, smap=smap):
            al, bkl = local(smap, r, a, bk)
            return kernels.layer_dots(al, bkl, reduce=red, backend=backend)

        def vector(r, red, smap=smap):
            al, bl = local(smap, r, a, b)
            return kernels.layer_dots(al[0], bl, loffs(smap, r), reduce=red, backend=backend)

        got = same_on_every_shard(sharded(segments, smap))
        got_rows = same_on_every_shard(sharded(rows, smap))
        got_vec = same_on_every_shard(sharded(vector, smap))
        assert got.dtype == acc(dtype) and got.shape == (K, len(SIZES))
        assert got_rows.shape == (K,) and got_vec.shape == (len(SIZES),)
        assert_close_normwise(got, want, vec_tol(dtype))
        assert_close_normwise(got, ref, vec_tol(dtype))
        assert_close_normwise(got_rows, want_rows, vec_tol(dtype))
        assert_close_normwise(got_vec, want_vec, vec_tol(dtype))
        assert torch.equal(got[1], torch.zeros_like(got[1]))


def _projection_zero_coefs(g, b, offs, eps, only_conflicting) -> torch.Tensor:
    """[K, L] True where the float64 coefficient is 0 (the output segment copies g)."""
    gb = kernels.layer_dots(g.double(), b.double(), offs, backend="reference")
    bb = kernels.layer_dots(b.double(), b.double(), offs, backend="reference")
    zero = (bb <= eps)[None, :] | (gb == 0)
    if only_conflicting:
        zero |= gb >= 0
    return zero


@pytest.mark.parametrize(
    "backend,dtype,only_conflicting,eps,in_place",
    cases(
        [
            (torch.float32, False, 0.0, False),
            (torch.float32, True, 0.0, True),
            (torch.float64, True, 0.0, False),
            (torch.float64, False, 0.0, True),
            (torch.float32, False, "split", False),
            (torch.float32, True, "split", True),
            (torch.bfloat16, False, 0.0, False),
        ],
        [(torch.float32, True, "split", True), (torch.bfloat16, False, 0.0, False)],
    ),
)
def test_project_out(backend, dtype, only_conflicting, eps, in_place, gen):
    K = 4
    g = rand(K, D, dtype=dtype, gen=gen)
    g[2] = 0.0  # a zero row
    b = rand(D, dtype=dtype, gen=gen)
    b[OFFS[7] : OFFS[8]] = 0.0  # a zero basis segment: coefficient 0, bitwise copy
    if eps == "split":
        # Above eps for the whole segment [37, 187) but not for the parts of it that most
        # shards hold: only the summed <b, b> gives the single server's decision.
        seg = b[OFFS[3] : OFFS[4]].double()
        eps = 0.75 * float(seg @ seg)
    g, b = on(backend, g, b)
    want = kernels.project_out(
        g, b, OFFS, only_conflicting=only_conflicting, eps=eps, backend=backend
    )
    ref = kernels.project_out(
        g, b, OFFS, only_conflicting=only_conflicting, eps=eps, backend="reference"
    )
    zero = _projection_zero_coefs(g, b, OFFS, eps, only_conflicting)
    for smap in maps_for(backend):

        def call(r, red, smap=smap):
            gl, bl = local(smap, r, g, b)
            if in_place:
                gl = gl.clone()
                kw = {"out": gl}
            else:
                kw = {}
            return kernels.project_out(
                gl, bl, loffs(smap, r), only_conflicting=only_conflicting, eps=eps,
                reduce=red, backend=backend, **kw,
            )  # fmt: skip

        got = smap.join(sharded(call, smap))
        assert got.dtype == dtype
        assert_close_normwise(got, want, vec_tol(dtype))
        assert_close_normwise(got, ref, vec_tol(dtype))
        for l, (s, e) in enumerate(zip(OFFS[:-1].tolist(), OFFS[1:].tolist(), strict=True)):
            for k in range(K):
                if zero[k, l]:
                    assert torch.equal(got[k, s:e], g[k, s:e]), (k, l)


def test_project_out_multi_tile_segments_triton(monkeypatch, gen):
    """Tiny Triton blocks: segments span several tiles, cuts fall inside tiles."""
    monkeypatch.setattr(_common, "INTERP", _common.LaunchConfig(block=16, tile=48, num_warps=4))
    g, b = on("triton", rand(2, D, gen=gen), rand(D, gen=gen))
    want = kernels.project_out(g, b, OFFS, backend="reference")
    for smap in MAPS[1:3]:

        def call(r, red, smap=smap):
            gl, bl = local(smap, r, g, b)
            return kernels.project_out(gl, bl, loffs(smap, r), reduce=red, backend="triton")

        assert_close_normwise(smap.join(sharded(call, smap)), want, 1e-5)


@pytest.mark.parametrize(
    "backend,dtype,with_ma,eps",
    cases(
        [(torch.float32, False, 0.0), (torch.float64, True, 0.0), (torch.float32, True, "split")],
        [(torch.float32, True, "split")],
    ),
)
def test_orthogonal_calibrate(backend, dtype, with_ma, eps, gen):
    x, sent, w, snap, ma = (rand(D, dtype=dtype, gen=gen) for _ in range(5))
    sent[OFFS[5] : OFFS[6]] = x[OFFS[5] : OFFS[6]]  # dm = 0 on a segment: coefficient 0
    calibrate = torch.tensor([True, True, True, True, False, True, True, True])
    if eps == "split":
        dm = (x - sent)[OFFS[3] : OFFS[4]].double()
        eps = 0.75 * float(dm @ dm)
    x, sent, w, snap, ma = on(backend, x, sent, w, snap, ma)
    ma_arg = ma if with_ma else None

    def run(xs, ss, ws, ns, mas, offs, red, backend=backend):
        y_out = xs.clone()  # out_y aliases x
        return kernels.orthogonal_calibrate(
            y_out, ss, ws, ns, offs, 0.3, calibrate=calibrate, ma=mas, eps=eps, out_y=y_out,
            return_coeffs=True, reduce=red, backend=backend,
        )  # fmt: skip

    want_y, want_ma, want_c = run(x, sent, w, snap, ma_arg, OFFS, None)
    ref_y, ref_ma, ref_c = run(x, sent, w, snap, ma_arg, OFFS, None, backend="reference")
    for smap in maps_for(backend):

        def call(r, red, smap=smap):
            xl, sl, wl, nl, ml = local(smap, r, x, sent, w, snap, ma)
            return run(xl, sl, wl, nl, ml if with_ma else None, loffs(smap, r), red)

        res = sharded(call, smap)
        y = smap.join([t[0] for t in res])
        new_ma = smap.join([t[1] for t in res])
        c = same_on_every_shard([t[2] for t in res])
        assert c.dtype == acc(dtype) and y.dtype == dtype and new_ma.dtype == dtype
        for oracle in (want_c, ref_c):
            _assert_coeffs_close(c, oracle, x - sent, w - snap, OFFS, vec_tol(dtype))
        assert_close_normwise(y, want_y, vec_tol(dtype))
        assert_close_normwise(y, ref_y, vec_tol(dtype))
        assert_close_normwise(new_ma, want_ma, vec_tol(dtype))
        assert c[4] == 0 and c[5] == 0  # not calibrated; dm = 0
        assert torch.equal(y[OFFS[4] : OFFS[5]], x[OFFS[4] : OFFS[5]])  # not calibrated: x


def _assert_coeffs_close(
    got: torch.Tensor,
    want: torch.Tensor,
    dm: torch.Tensor,
    dg: torch.Tensor,
    offs: torch.Tensor,
    tol: float,
) -> None:
    """c_l = <dg, dm>_l / |dm|_l^2 to ``tol`` of its conditioning: a rounded dot product is
    accurate to tol |dg| |dm|, not to tol |<dg, dm>| (random vectors nearly cancel), so the
    coefficient's error bound is tol |dg|_l / |dm|_l per segment."""
    dm64, dg64 = dm.double().cpu(), dg.double().cpu()
    got64, want64 = got.double().cpu(), want.double().cpu()
    for l in range(len(offs) - 1):
        s, e = int(offs[l]), int(offs[l + 1])
        n_dm, n_dg = dm64[..., s:e].norm().item(), dg64[..., s:e].norm().item()
        bound = tol * n_dg / n_dm if n_dm > 0 else 0.0
        err = abs(got64[l].item() - want64[l].item())
        assert err <= bound, f"segment {l}: coefficient error {err:.3g} > {bound:.3g}"


def _self_rules(cos: torch.Tensor, X: torch.Tensor, offs: torch.Tensor | None) -> None:
    """Exact symmetry; diagonal exactly 1 for non-zero rows (per segment), 0 for zero rows."""
    mats = cos if cos.dim() == 3 else cos[None]
    bounds = offs.tolist() if offs is not None else [0, X.shape[1]]
    for l, mat in enumerate(mats):
        assert torch.equal(mat, mat.T)
        nonzero = (X[:, bounds[l] : bounds[l + 1]] != 0).any(dim=1)
        assert torch.equal(mat.diagonal(), nonzero.to(mat.dtype))


@pytest.mark.parametrize(
    "backend,dtype,mode",
    cases(
        [
            (torch.float32, "self"),
            (torch.float64, "self"),
            (torch.float16, "self"),
            (torch.float32, "other"),
            (torch.float64, "other"),
            (torch.float32, "layerwise"),
            (torch.float64, "layerwise"),
            (torch.float32, "layerwise-other"),
        ],
        [
            (torch.float16, "self"),
            (torch.float32, "other"),
            (torch.float64, "layerwise"),
            (torch.float32, "layerwise-other"),
        ],
    ),
)
def test_cosine_matrix(backend, dtype, mode, gen):
    K, M = 5, 3
    X = rand(K, D, dtype=dtype, gen=gen)
    X[1] = 0.0  # a zero row
    X[3, OFFS[5] : OFFS[6]] = 0.0  # a row that is zero on one (cut) segment
    Y = rand(M, D, dtype=dtype, gen=gen) if "other" in mode else None
    X, Y = on(backend, X, Y)
    layerwise = mode.startswith("layerwise")
    offs = OFFS if layerwise else None
    want = kernels.cosine_matrix(X, offs, other=Y, layerwise=layerwise, backend=backend)
    ref = kernels.cosine_matrix(
        X.double(), offs, other=None if Y is None else Y.double(), layerwise=layerwise,
        backend="reference",
    )  # fmt: skip
    for smap in maps_for(backend):

        def call(r, red, smap=smap):
            (Xl,) = local(smap, r, X)
            Yl = None if Y is None else local(smap, r, Y)[0]
            lo = loffs(smap, r) if layerwise else None
            return kernels.cosine_matrix(
                Xl, lo, other=Yl, layerwise=layerwise, reduce=red, backend=backend
            )

        got = same_on_every_shard(sharded(call, smap))
        assert got.dtype == acc(dtype) and got.shape == want.shape
        assert_close_abs(got, want, cos_tol(dtype))
        assert_close_abs(got, ref, cos_tol(dtype))
        assert got.abs().max() <= 1.0
        if Y is None:
            _self_rules(got, X, offs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cosine_matrix_k1(backend, gen):
    X, Y = on(backend, rand(1, D, gen=gen), rand(2, D, gen=gen))
    for smap in maps_for(backend):
        got = same_on_every_shard(
            sharded(
                lambda r, red, smap=smap: kernels.cosine_matrix(
                    local(smap, r, X)[0],
                    loffs(smap, r),
                    layerwise=True,
                    reduce=red,
                    backend=backend,
                ),  # fmt: skip
                smap,
            )
        )
        nonempty = torch.tensor([s > 0 for s in SIZES], dtype=torch.float32)
        assert torch.equal(got.cpu(), nonempty[:, None, None])  # 1 where the segment is non-empty
        cross = same_on_every_shard(
            sharded(
                lambda r, red, smap=smap: kernels.cosine_matrix(
                    local(smap, r, X)[0], other=local(smap, r, Y)[0], reduce=red, backend=backend
                ),
                smap,
            )
        )
        want = kernels.cosine_matrix(X, other=Y, backend="reference")
        assert_close_abs(cross, want, 1e-5)


def test_cosine_matrix_cpu_blas_cross_path(gen):
    """K x M above CROSS_DOTS_MAX: the CPU's BLAS cross Gram with separate norm passes."""
    X = rand(70, D, gen=gen)
    Y = rand(60, D, gen=gen)
    want = kernels.cosine_matrix(X.double(), other=Y.double(), backend="reference")
    smap = MAPS[2]
    got = same_on_every_shard(
        sharded(
            lambda r, red: kernels.cosine_matrix(
                *local(smap, r, X), other=local(smap, r, Y)[0], reduce=red, backend="cpu"
            ),
            smap,
        )
    )
    assert_close_abs(got, want, 1e-5)


@pytest.mark.parametrize(
    "backend,dtype", cases([(torch.float32,), (torch.float64,)], [(torch.float32,)])
)
def test_layer_normalized_cosine(backend, dtype, gen):
    K = 4
    X = rand(K, D, dtype=dtype, gen=gen)
    X[2, OFFS[3] : OFFS[4]] = 0.0  # zero on the segment that the cuts split
    X[0, OFFS[4] : OFFS[5]] = 0.0  # zero on the 1-element segment
    (X,) = on(backend, X)
    want = kernels.layer_normalized_cosine(X, OFFS, backend=backend)
    ref = kernels.layer_normalized_cosine(X.double(), OFFS, backend="reference")
    for smap in maps_for(backend):

        def call(r, red, smap=smap):
            return kernels.layer_normalized_cosine(
                local(smap, r, X)[0], loffs(smap, r), reduce=red, backend=backend
            )

        got = same_on_every_shard(sharded(call, smap))
        assert got.dtype == acc(dtype)
        assert_close_abs(got, want, cos_tol(dtype))
        assert_close_abs(got, ref, cos_tol(dtype))
        assert torch.equal(got, got.T)
        # Five non-empty segments; row 0 is zero on one, row 2 on another.
        assert got[1, 1] == 1 and got[3, 3] == 1
        diag = got.diagonal()[[0, 2]].cpu()
        assert_close_abs(diag, torch.tensor([0.8, 0.8], dtype=got.dtype), 1e-7)


@pytest.mark.parametrize(
    "backend,dtype,with_other",
    cases(
        [(torch.float32, False), (torch.float32, True), (torch.float64, False)],
        [(torch.float32, True), (torch.float64, False)],
    ),
)
def test_gram_matrix_and_distances(backend, dtype, with_other, gen):
    K, M = 4, 3
    X = rand(K, D, dtype=dtype, gen=gen)
    X[3] = 0.0
    Y = rand(M, D, dtype=dtype, gen=gen) if with_other else None
    X64, Y64 = X.double(), None if Y is None else Y.double()  # on the CPU
    X, Y = on(backend, X, Y)
    for fn in (kernels.gram_matrix, kernels.pairwise_sq_distances):
        want = fn(X, other=Y, backend=backend)
        ref = fn(X64, other=Y64, backend="reference").cpu()
        nx = (X64 * X64).sum(dim=1)
        ny = nx if Y64 is None else (Y64 * Y64).sum(dim=1)
        scale = nx.sqrt()[:, None] * ny.sqrt()[None, :]
        if fn is kernels.pairwise_sq_distances:
            scale = nx[:, None] + ny[None, :]
        for smap in maps_for(backend):

            def call(r, red, smap=smap, fn=fn):
                (Xl,) = local(smap, r, X)
                Yl = None if Y is None else local(smap, r, Y)[0]
                return fn(Xl, other=Yl, reduce=red, backend=backend)

            if Y is None:
                packed = (K, K)  # the symmetric Gram, norms on its diagonal
            elif fn is kernels.gram_matrix:
                packed = (K, M)
            else:
                packed = (K * M + K + M,)  # the Gram flattened, then both sides' squared norms
            got = same_on_every_shard(sharded(call, smap, packed))
            assert got.dtype == acc(dtype) and got.shape == want.shape
            # Norm-wise per entry (docs/kernels.md): |got - ref| <= tol * scale.
            for other_side in (want, ref):
                err = (got.double().cpu() - other_side.double().cpu()).abs()
                assert bool((err <= vec_tol(dtype) * scale + 1e-30).all())
            if Y is None:
                assert torch.equal(got, got.T)
                if fn is kernels.pairwise_sq_distances:
                    assert torch.equal(got.diagonal(), torch.zeros_like(got.diagonal()))
            if fn is kernels.pairwise_sq_distances:
                assert bool((got >= 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nnz_per_layer(backend, gen):
    X = rand(3, D, gen=gen)
    X[X.abs() < 0.5] = 0.0
    X[0, 5] = float("nan")  # counts
    X[1, 6] = -0.0  # does not
    X[2] = 0.0
    (X,) = on(backend, X)
    want = kernels.nnz_per_layer(X, OFFS, backend="reference")
    for smap in maps_for(backend):
        got = same_on_every_shard(
            sharded(
                lambda r, red, smap=smap: kernels.nnz_per_layer(
                    local(smap, r, X)[0], loffs(smap, r), reduce=red, backend=backend
                ),
                smap,
            )
        )
        assert got.dtype == torch.int64 and torch.equal(got, want)
        got_vec = same_on_every_shard(
            sharded(
                lambda r, red, smap=smap: kernels.nnz_per_layer(
                    local(smap, r, X)[0][0], reduce=red, backend=backend
                ),
                smap,
            )
        )
        assert got_vec.shape == (1,) and got_vec.item() == want[0].sum().item()


# ------------------------------------------------------------------ edge cases and rules


@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_local_still_reduces(backend, gen):
    """D = 0 everywhere (every shard empty): each call still reduces once and gives the
    unsharded result."""
    offs = torch.zeros(3, dtype=torch.int64)
    smap = ShardMap.even(0, 2)
    X, b = on(backend, torch.empty(2, 0), torch.empty(0))
    calls = {
        "layer_dots": lambda Xl, o, red: kernels.layer_dots(Xl, b, o, reduce=red, backend=backend),
        "project_out": lambda Xl, o, red: kernels.project_out(
            Xl, b, o, reduce=red, backend=backend
        ),
        "calibrate": lambda Xl, o, red: kernels.orthogonal_calibrate(
            b, b, b, b, o, 0.5, return_coeffs=True, reduce=red, backend=backend
        )[2],
        "cosine": lambda Xl, o, red: kernels.cosine_matrix(Xl, reduce=red, backend=backend),
        "cosine_layerwise": lambda Xl, o, red: kernels.cosine_matrix(
            Xl, o, layerwise=True, reduce=red, backend=backend
        ),
        "lnc": lambda Xl, o, red: kernels.layer_normalized_cosine(
            Xl, o, reduce=red, backend=backend
        ),
        "gram": lambda Xl, o, red: kernels.gram_matrix(Xl, other=Xl, reduce=red, backend=backend),
        "dist": lambda Xl, o, red: kernels.pairwise_sq_distances(Xl, reduce=red, backend=backend),
        "nnz": lambda Xl, o, red: kernels.nnz_per_layer(Xl, o, reduce=red, backend=backend),
    }
    for name, fn in calls.items():
        want = fn(X, offs, None)
        got = same_on_every_shard(sharded(lambda r, red, fn=fn: fn(X, offs, red), smap))
        assert torch.equal(got, want), name


def test_coefficients_are_whole_model_values_on_every_shard(gen):
    """A shard that holds none of a segment still returns that segment's whole-model
    coefficient (ORTHOFL's coefficients are whole-model values on every shard)."""
    vectors = [rand(D, dtype=torch.float64, gen=gen) for _ in range(4)]
    smap = MAPS[3]  # shard 2 holds only part of segment 3
    want = kernels.orthogonal_calibrate(*vectors, OFFS, 0.1, return_coeffs=True)[2]
    for backend in BACKENDS:

        def call(r, red, backend=backend):
            xl, sl, wl, nl = local(smap, r, *on(backend, *vectors))
            return kernels.orthogonal_calibrate(
                xl, sl, wl, nl, loffs(smap, r), 0.1, return_coeffs=True, reduce=red,
                backend=backend,
            )[2]  # fmt: skip

        got = sharded(call, smap)
        assert (want[[1, 3, 5, 7]] != 0).all()
        for c in got:
            assert_close_normwise(c, want, 1e-12)


def test_cpu_one_shard_with_reduce_is_bitwise_the_single_server(gen):
    """On the CPU a reduce that returns its input changes no bit: the split phases compute
    what the fused single-server paths compute."""
    g = rand(5, D, gen=gen)
    b = rand(D, gen=gen)
    x, sent, w, snap = (rand(D, gen=gen) for _ in range(4))
    Y = rand(3, D, gen=gen)
    ident = LocalReducer().sum_
    cases = [
        lambda red: kernels.layer_dots(g, b, OFFS, reduce=red),
        lambda red: kernels.project_out(g, b, OFFS, only_conflicting=True, reduce=red),
        lambda red: kernels.orthogonal_calibrate(
            x, sent, w, snap, OFFS, 0.2, return_coeffs=True, reduce=red
        ),
        lambda red: kernels.cosine_matrix(g, reduce=red),
        lambda red: kernels.cosine_matrix(g, OFFS, layerwise=True, reduce=red),
        lambda red: kernels.cosine_matrix(g, other=Y, reduce=red),
        lambda red: kernels.cosine_matrix(g, OFFS, other=Y, layerwise=True, reduce=red),
        lambda red: kernels.layer_normalized_cosine(g, OFFS, reduce=red),
        lambda red: kernels.gram_matrix(g, reduce=red),
        lambda red: kernels.pairwise_sq_distances(g, other=Y, reduce=red),
        lambda red: kernels.pairwise_sq_distances(g, reduce=red),
        lambda red: kernels.nnz_per_layer(g, OFFS, reduce=red),
    ]
    for i, case in enumerate(cases):
        plain, reduced = case(None), case(ident)
        for p, q in zip(
            plain if isinstance(plain, tuple) else (plain,),
            reduced if isinstance(reduced, tuple) else (reduced,),
            strict=True,
        ):
            assert torch.equal(p, q), i


def test_reduce_argument_is_checked(gen):
    X = rand(3, D, gen=gen)
    with pytest.raises(TypeError, match="reduce must be callable"):
        kernels.cosine_matrix(X, reduce=3)
    with pytest.raises(ValueError, match="reduce returned shape"):
        kernels.cosine_matrix(X, reduce=lambda t: t.reshape(-1))
    with pytest.raises(TypeError, match="reduce returned dtype"):
        kernels.layer_dots(X, X[0], OFFS, reduce=lambda t: t.float())
    with pytest.raises(TypeError, match="must return a torch.Tensor"):
        kernels.nnz_per_layer(X, OFFS, reduce=lambda t: None)
    # A non-contiguous result of the right shape is fine (made contiguous).
    got = kernels.gram_matrix(X, reduce=lambda t: t.T.contiguous().T)
    assert torch.equal(got, kernels.gram_matrix(X))
