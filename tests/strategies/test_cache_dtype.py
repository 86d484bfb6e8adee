"""The compressed client cache (``cache_dtype``) of MIFA, Fed-OGD and CA2FL: each strategy's
algorithm run on the rows as the cache stores them, against float64 oracles that round the rows
themselves (the wire's int8 encoder for ``int8``, torch's bfloat16 for ``bfloat16``); saved states
that resume bit for bit and convert between dtypes; the bytes a row takes; and the refusals."""

from __future__ import annotations

import io
import secrets

import numpy as np
import pytest
import torch
from state_helpers import assert_same_state

from aggsrv import kernels
from aggsrv.layout import ModelLayout
from aggsrv.strategies.ca2fl import CA2FL
from aggsrv.strategies.fedogd import FedOGD
from aggsrv.strategies.mifa import MIFA
from aggsrv.transport.quantized import Quantization, quantize
from aggsrv.values import Status, Update, UpdateKind

F64 = torch.float64
# 1,117 values: blocks of 128 with a ragged last one, two layers.
LAYOUT = ModelLayout.from_named_shapes([("fc.weight", (37, 29)), ("fc.bias", (44,))])
D = LAYOUT.numel
DTYPES = ["float32", "bfloat16", "int8"]


def stored(row: torch.Tensor, dtype: str) -> torch.Tensor:
    """A float32 row as the cache stores it, in float64: rounded by an independent encoder."""
    if dtype == "float32":
        return row.to(F64)
    if dtype == "bfloat16":
        return row.to(torch.bfloat16).to(F64)
    _, decoded = quantize(row, Quantization.INT8, 128)
    return decoded.to(F64)


_uid = iter(range(10**9))


def push(s, cid: str, delta: torch.Tensor, t: float):
    job = s.outstanding_job(cid) or s.job_for(cid, t)
    upd = Update(cid, job.job_id, job.base_version, f"u{next(_uid)}", 5, job.recipe.work_target,
                 UpdateKind.DELTA, delta.clone())  # fmt: skip
    return s.on_update(upd, t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mifa_steps_by_the_mean_of_the_rows_as_stored(dtype: str, gen: torch.Generator) -> None:
    w = torch.randn(D, generator=gen)
    lr = 0.1
    cfg = {"learning_rate": lr, "cache_dtype": dtype, "epoch_timeout": None, "detect": False,
           "tiers": {"a": 1, "b": 1, "s": 2}}  # fmt: skip
    s = MIFA(LAYOUT, w, cfg)
    for c in "abs":
        s.on_register(c, 0.0)
    rows: dict[str, torch.Tensor] = {}
    oracle = w.to(F64)
    for t in range(4):
        for c in "abs":
            if s.outstanding_job(c) is None:
                s.job_for(c, float(t))
        for c in (["s"] if t % 2 else []) + ["a", "b"]:
            d = torch.randn(D, generator=gen) * 0.05 * (1 + 10 * (c == "s"))
            rows[c] = stored(torch.div(d, -lr), dtype)  # the row: -DELTA / lr, then stored
            out = push(s, c, d, t + 0.5)
        assert (out.status, out.version) == (Status.APPLIED, t + 1)
        oracle = oracle - lr * torch.stack(list(rows.values())).sum(0) / 3
        torch.testing.assert_close(s.global_model().to(F64), oracle, rtol=1e-6, atol=1e-6)
    if dtype != "float32":  # the rounding is there to see: the float32 cache differs
        ref = stored(torch.div(d, -lr), "float32")
        assert not torch.equal(rows["b"], ref)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_fedogd_bases_are_the_group_means_of_the_rows_as_stored(
    dtype: str, gen: torch.Generator
) -> None:
    lr = 0.05
    cfg = {"learning_rate": lr, "cache_dtype": dtype, "epoch_timeout": None, "detect": False,
           "tiers": {"a": 1, "b": 1, "s": 2}, "aggregation": "group_sum"}  # fmt: skip
    s = FedOGD(LAYOUT, torch.randn(D, generator=gen), cfg)
    for c in "abs":
        s.on_register(c, 0.0)
    rows: dict[str, torch.Tensor] = {}
    for t in range(3):
        for c in "abs":
            if s.outstanding_job(c) is None:
                s.job_for(c, float(t))
        for c in ["s", "a", "b"] if t == 0 else ["a", "b"]:
            d = torch.randn(D, generator=gen) * 0.05
            rows[c] = stored(torch.div(d, -lr), dtype)
            push(s, c, d, t + 0.5)
        b_a, b_s = s.bases
        torch.testing.assert_close(b_a.to(F64), (rows["a"] + rows["b"]) / 2, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(b_s.to(F64), rows["s"], rtol=1e-6, atol=1e-7)


class CA2FLOracle:
    """CA2FL in float64 with the cache holding each delta as stored."""

    def __init__(self, init: torch.Tensor, k: int, lr: float, n: int, dtype: str) -> None:
        self.x, self.k, self.lr, self.n, self.dtype = init.to(F64), k, lr, n, dtype
        self.h: dict[str, torch.Tensor] = {}
        self.buf: list[torch.Tensor] = []
        self.hbar = torch.zeros_like(self.x)

    def arrive(self, c: str, delta: torch.Tensor) -> None:
        if not self.buf:
            self.hbar = sum(self.h.values(), torch.zeros_like(self.x)) / self.n
        self.buf.append(delta.to(F64) - self.h.get(c, torch.zeros_like(self.x)))
        self.h[c] = stored(delta, self.dtype)
        if len(self.buf) == self.k:
            self.x = self.x + self.lr * (self.hbar + sum(self.buf) / self.k)
            self.buf = []


@pytest.mark.parametrize("dtype", DTYPES)
def test_ca2fl_calibrates_with_the_rows_as_stored(dtype: str, gen: torch.Generator) -> None:
    init = torch.randn(D, generator=gen)
    s = CA2FL(layout=LAYOUT, initial=init,
              config={"buffer_size": 3, "server_lr": 0.5, "cache_dtype": dtype})  # fmt: skip
    o = CA2FLOracle(init, 3, 0.5, 4, dtype)
    for c in "abcd":
        s.on_register(c, 0.0)
    for step in range(23):
        c = "abcd"[int(torch.randint(4, (1,), generator=gen))]
        d = torch.randn(D, generator=gen)
        push(s, c, d, float(step))
        o.arrive(c, d)
        torch.testing.assert_close(s.global_model().to(F64), o.x, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s.cached_update(c).to(F64), o.h[c], rtol=0, atol=0)


def test_ca2fl_robust_rules_run_on_the_decoded_rows(gen: torch.Generator) -> None:
    """With the coordinate median: h_bar is the median of the decoded cache rows at a buffer's
    start, the correction the median of ``delta - h_i`` with h_i decoded (float64 oracle)."""
    init = torch.randn(D, generator=gen)
    s = CA2FL(layout=LAYOUT, initial=init,
              config={"buffer_size": 2, "aggregator": "median", "cache_dtype": "int8"})  # fmt: skip
    for c in "abcde":
        s.on_register(c, 0.0)
    x, h = init.to(F64), {}
    hbar, calibrated = None, []
    for step in range(12):
        c = "abcde"[step % 5]
        d = torch.randn(D, generator=gen)
        if not calibrated:
            hbar = np.median(np.stack(list(h.values())), axis=0) if h else np.zeros(D)
        calibrated.append(d.to(F64).numpy() - h.get(c, np.zeros(D)))
        h[c] = stored(d, "int8").numpy()
        push(s, c, d, float(step))
        if len(calibrated) == 2:
            x = x + 1.0 * torch.from_numpy(hbar + np.median(np.stack(calibrated), axis=0))
            calibrated = []
            torch.testing.assert_close(s.global_model().to(F64), x, rtol=1e-5, atol=1e-5)
    assert s.version == 6


def _mifa(dtype: str, w: torch.Tensor) -> MIFA:
    s = MIFA(LAYOUT, w, {"epoch_timeout": 0.9, "learning_rate": 0.2, "cache_dtype": dtype})
    for c in "abc":
        s.on_register(c, 0.0)
    return s


def _epochs(s: MIFA, gen: torch.Generator, epochs: range) -> None:
    for t in epochs:
        for c in "abc":
            if s.outstanding_job(c) is None:
                s.job_for(c, float(t))
        for c in "ab" if t % 2 else "abc":
            push(s, c, torch.randn(D, generator=gen) * 0.1, t + 0.5)
        s.on_timer(t + 0.9)


def _saved(s: MIFA) -> dict:
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_a_saved_compressed_cache_resumes_bit_exactly(dtype: str, gen: torch.Generator) -> None:
    w = torch.randn(D, generator=gen)
    a = _mifa(dtype, w)
    _epochs(a, gen, range(3))
    state = _saved(a)
    if dtype == "int8":  # saved as stored: codes and scales, a quarter of float32's bytes
        extra = state["extra"]
        assert extra["cache"].dtype == torch.int8 and extra["cache_scales"].dtype == torch.float32
    b = _mifa(dtype, torch.zeros(D))
    b.load_state_dict(state)
    assert_same_state(b.state_dict(), a.state_dict())
    seed = secrets.randbits(31)
    _epochs(a, torch.Generator().manual_seed(seed), range(3, 6))
    _epochs(b, torch.Generator().manual_seed(seed), range(3, 6))
    assert torch.equal(a.global_model(), b.global_model())


CONVERSIONS = [("float32", "int8"), ("int8", "float32"), ("int8", "bfloat16"), ("bfloat16", "int8")]


@pytest.mark.parametrize(("saved", "resumed"), CONVERSIONS)
def test_a_saved_cache_resumes_in_another_dtype(
    saved: str, resumed: str, gen: torch.Generator
) -> None:
    a = _mifa(saved, torch.randn(D, generator=gen))
    _epochs(a, gen, range(2))
    b = _mifa(resumed, torch.zeros(D))
    b.load_state_dict(_saved(a))
    for c in "abc":
        row = a._cache.read(a._row[c]).clone()  # what a held, rounded again by b's dtype
        torch.testing.assert_close(b._cache.read(b._row[c]).to(F64), stored(row, resumed),
                                   rtol=0, atol=0)  # fmt: skip
    assert b.row_cache().dtype == resumed


def test_bytes_per_row_and_status_info(gen: torch.Generator) -> None:
    nblocks = -(-D // 128)
    want = {"float32": 4 * D, "bfloat16": 2 * D, "int8": D + 4 * nblocks}
    for dtype, per_row in want.items():
        s = _mifa(dtype, torch.randn(D, generator=gen))
        info = s.row_cache()
        assert (info.dtype, info.rows, info.bytes_per_row) == (dtype, 3, per_row)
        stored_bytes = sum(
            t.untyped_storage().nbytes() for t in s._cache.state(3).values()
            if isinstance(t, torch.Tensor)
        )  # fmt: skip
        cap = s._cache.capacity
        assert s._cache.nbytes == cap * per_row
        assert stored_bytes == cap * per_row  # the views' storages: every allocated row
    fed_ogd = FedOGD(LAYOUT, torch.zeros(D), {"send_differences": True, "detect": False})
    assert fed_ogd.row_cache() is None  # its privacy variant keeps no rows


def test_refusals() -> None:
    with pytest.raises(ValueError, match="cache_dtype must be one of float32, bfloat16, int8"):
        MIFA(LAYOUT, torch.zeros(D), {"cache_dtype": "float16"})
    with pytest.raises(ValueError, match="ca2fl with dp_ keys keeps its cache in float32"):
        dp = {"dp_clip_norm": 1.0, "dp_noise_multiplier": 1.0}
        CA2FL(layout=LAYOUT, initial=torch.zeros(D), config={"cache_dtype": "int8", **dp})
    with pytest.raises(ValueError, match="unknown FedBuffConfig key 'cache_dtype'"):
        from aggsrv.strategies.fedbuff import FedBuff

        FedBuff(LAYOUT, torch.zeros(D), {"cache_dtype": "int8"})


@pytest.mark.parametrize(("dtype", "big"), [("bfloat16", 3.399e38), ("int8", 3.4028234e38)])
@pytest.mark.parametrize("aggregator", ["mean", "median"])
def test_ca2fl_refuses_a_finite_row_that_would_not_be_finite_as_stored(
    dtype: str, big: float, aggregator: str
) -> None:
    """A float32 value near the top of the range rounds to inf in bfloat16, or decodes to inf
    from int8 (127 x the rounded scale): refused with nothing changed, and the server goes on."""
    s = CA2FL(layout=LAYOUT, initial=torch.zeros(D),
              config={"buffer_size": 3, "server_lr": 1e-3, "cache_dtype": dtype,
                      "aggregator": aggregator})  # fmt: skip
    for c in "abc":
        s.on_register(c, 0.0)
    push(s, "b", torch.ones(D) * 0.01, 0.0)
    s.job_for("a", 1.0)  # the job is issued before the snapshot: only the update is refused
    before = s.state_dict()
    huge = torch.zeros(D)
    huge[3] = big
    assert torch.isfinite(huge).all()
    with pytest.raises(Exception, match="past float32's range"):
        push(s, "a", huge, 1.0)
    assert_same_state(s.state_dict(), before)
    for i, c in enumerate("abca"):  # the server goes on
        push(s, c, torch.ones(D) * 0.01, 2.0 + i)
    assert torch.isfinite(s.global_model()).all() and s.version >= 1


def test_a_non_finite_row_never_enters_the_cache(gen: torch.Generator) -> None:
    s = CA2FL(layout=LAYOUT, initial=torch.zeros(D), config={"cache_dtype": "int8"})
    s.on_register("a", 0.0)
    push(s, "a", torch.ones(D), 0.0)
    before = s.cached_update("a").clone()
    bad = torch.ones(D)
    bad[5] = float("inf")
    with pytest.raises(Exception, match="NaN/Inf updates are refused"):
        push(s, "a", bad, 1.0)
    assert torch.equal(s.cached_update("a"), before)
    assert kernels.quantized_row_bytes(D, 128) == s.row_cache().bytes_per_row


def _pair_cosines(rows: torch.Tensor, offsets: list[int], mode: str) -> np.ndarray:
    """FedDGIC's similarity pair by pair in float64 (independent of the kernels)."""

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        na, nb = a.norm().item(), b.norm().item()
        return 0.0 if na == 0 or nb == 0 else (a @ b).item() / (na * nb)

    m = rows.shape[0]
    spans = list(zip(offsets[:-1], offsets[1:], strict=True))
    sizes = np.array([e - b for b, e in spans], dtype=np.float64)
    s = np.zeros((m, m))
    for i in range(m):
        for j in range(m):
            if mode == "none":
                s[i, j] = cos(rows[i], rows[j])
                continue
            per = np.array([cos(rows[i, b:e], rows[j, b:e]) for b, e in spans])
            s[i, j] = per.mean() if mode == "per_layer_mean" else per @ sizes / sizes.sum()
    return s


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("layer_norm", ["per_layer_mean", "none", "param_weighted"])
def test_feddgic_similarity_of_the_rows_as_stored(
    dtype: str, layer_norm: str, gen: torch.Generator
) -> None:
    from aggsrv.strategies import make_strategy

    n = 5
    # Two modules of different scale: the layer normalisation is there to see.
    layout = ModelLayout.from_named_shapes([("a.weight", (37, 29)), ("b.weight", (44,))])
    s = make_strategy("feddgic", layout=layout, initial=torch.randn(D, generator=gen),
                      config={"cache_dtype": dtype, "layer_norm": layer_norm, "min_available": n,
                              "similarity_rounds": 2})  # fmt: skip
    for i in range(n):
        s.on_register(f"c{i}", 0.0)
    assert s.row_cache().dtype == dtype
    offsets = [int(o) for o in layout.module_offsets]
    assert len(offsets) == 3
    stored_rows = {}
    for c in [f"c{i}" for i in range(n)]:
        d = torch.randn(D, generator=gen) * torch.rand(1, generator=gen)
        d[offsets[1] :] *= 30.0
        stored_rows[c] = stored(d, dtype)
        push(s, c, d, 0.0)
    rows = torch.stack([stored_rows[c] for c in s._ids])
    want = _pair_cosines(rows, offsets, layer_norm)
    np.testing.assert_allclose(s._s_sum, want, rtol=1e-5, atol=1e-6)
    assert s.rounds_done == 1 and s.row_cache().rows == n


def test_feddgic_int8_rows_resume_bit_exactly_mid_grouping(gen: torch.Generator) -> None:
    from aggsrv.strategies import make_strategy

    def fresh(w: torch.Tensor):
        s = make_strategy("feddgic", layout=LAYOUT, initial=w,
                          config={"cache_dtype": "int8", "min_available": 4,
                                  "similarity_rounds": 3})  # fmt: skip
        for i in range(4):
            s.on_register(f"c{i}", 0.0)
        return s

    a = fresh(torch.randn(D, generator=gen))
    for i in range(6):  # one round of four, then two of the next
        push(a, f"c{i % 4}", torch.randn(D, generator=gen), float(i))
    state = _saved(a)
    assert state["extra"]["rows"].dtype == torch.int8
    b = fresh(torch.zeros(D))
    b.load_state_dict(state)
    assert_same_state(b.state_dict(), a.state_dict())
    deltas = [torch.randn(D, generator=gen) for _ in range(6)]
    for i, d in enumerate(deltas, start=6):
        push(a, f"c{i % 4}", d, float(i))
        push(b, f"c{i % 4}", d, float(i))
    assert a.phase == b.phase == "async"
    assert torch.equal(a.global_model(), b.global_model())
    assert a.grouping.labels == b.grouping.labels


def test_a_state_saved_before_cache_dtype_existed_resumes_without_a_config_warning(
    gen: torch.Generator, caplog: pytest.LogCaptureFixture
) -> None:
    a = _mifa("float32", torch.randn(D, generator=gen))
    _epochs(a, gen, range(2))
    state = _saved(a)
    del state["config"]["cache_dtype"]  # what a server of the previous release saved
    b = _mifa("float32", torch.zeros(D))
    with caplog.at_level("WARNING"):
        b.load_state_dict(state)
    assert "differs from the saved one" not in caplog.text
    c = _mifa("int8", torch.zeros(D))  # a real change of config is still said
    with caplog.at_level("WARNING"):
        c.load_state_dict(state)
    assert "differs from the saved one" in caplog.text
