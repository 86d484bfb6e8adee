"""Float buffers (BatchNorm running statistics) in the strategies: how each rule folds clients'
buffers into the global ones (against float64 oracles computed here), ORTHOFL's G6
(docs/algorithms/orthofl.md; no calibration by default, same moving average as the weights; the
pure-paper calibration with its variance clamp), refusals that change nothing, and state dicts that
resume bit-exactly."""

from __future__ import annotations

import pytest
import torch
from state_helpers import assert_same_state

from aggsrv.layout import ModelLayout
from aggsrv.strategies import InvalidUpdate, Update, UpdateKind, make_strategy

# D = 3*5 + 3 + 3 + 4 = 25 trainable, B = 3 + 3 + 2 = 8 buffer elements (two variance ranges).
LAYOUT = ModelLayout(
    [("fc.weight", (3, 5)), ("bn.weight", (3,)), ("bn.bias", (3,)), ("head.bias", (4,))],
    [("bn.running_mean", (3,)), ("bn.running_var", (3,)), ("ln.running_var", (2,))],
    norm_flags=[False, True, True, False],
)
D, B = LAYOUT.numel, LAYOUT.buffer_numel
VAR = torch.tensor([3, 4, 5, 6, 7])  # running_var elements of the buffer vector


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _buffers(g: torch.Generator) -> torch.Tensor:
    b = torch.randn(B, generator=g)
    b[VAR] = torch.rand(len(VAR), generator=g) + 0.1  # variances are positive
    return b


def _strategy(name: str, seed: int = 0, **config):
    g = _gen(seed)
    return make_strategy(
        name,
        layout=LAYOUT,
        initial=torch.randn(D, generator=g),
        initial_buffers=_buffers(g),
        config=config,
    ), g


def _update(job, delta, buffers, num_samples=10, work=1.0, uid=None) -> Update:
    return Update(
        client_id=job.client_id,
        job_id=job.job_id,
        base_version=job.base_version,
        update_id=uid or f"{job.client_id}-{job.job_id}",
        num_samples=num_samples,
        work_done=work,
        kind=UpdateKind.DELTA,
        tensor=delta,
        buffers=buffers,
    )


def test_layout_with_buffers_needs_initial_buffers() -> None:
    with pytest.raises(ValueError, match="initial_buffers"):
        make_strategy("fedasync", layout=LAYOUT, initial=torch.zeros(D))
    with pytest.raises(ValueError, match=r"flat \[8\]"):
        make_strategy("fedasync", layout=LAYOUT, initial=torch.zeros(D),
                      initial_buffers=torch.zeros(B + 1))  # fmt: skip
    plain = ModelLayout([("w", (4,))])
    with pytest.raises(ValueError, match="no float buffers"):
        make_strategy("fedasync", layout=plain, initial=torch.zeros(4),
                      initial_buffers=torch.ones(3))  # fmt: skip
    s = make_strategy("fedasync", layout=plain, initial=torch.zeros(4))
    s.on_register("c", 0.0)
    assert s.global_buffers() is None and "buffers" not in s.job_for("c", 0.0).tensors


def test_fedavg_round_buffers_are_the_sample_weighted_mean_without_dropped_work() -> None:
    s, g = _strategy("fedavg", round_timeout=None, local_epochs=2.0, min_available=4)
    start = s.global_buffers().clone()
    ids = ["a", "b", "c", "d"]
    for cid in ids:
        s.on_register(cid, 0.0)
    jobs = {cid: s.job_for(cid, 0.0) for cid in ids}
    assert all(torch.equal(j.tensors["buffers"], start) for j in jobs.values())
    sent = {cid: _buffers(g) for cid in ids}
    samples = {"a": 7, "b": 30, "c": 1, "d": 55}
    # "d" did half its epochs: FedAvg's default drops partial work, buffers included.
    for cid in ids:
        work = 1.0 if cid == "d" else 2.0
        out = s.on_update(_update(jobs[cid], torch.randn(D, generator=g), sent[cid],
                                  samples[cid], work), 1.0)  # fmt: skip
        if cid != "d":
            assert torch.equal(s.global_buffers(), start)  # nothing moves before the close
    assert out.version == 1 and s.version == 1
    n = torch.tensor([samples[c] for c in "abc"], dtype=torch.float64)
    oracle = (torch.stack([sent[c].double() for c in "abc"]) * n[:, None]).sum(0) / n.sum()
    torch.testing.assert_close(s.global_buffers().double(), oracle, rtol=0, atol=1e-6)
    assert not torch.equal(start, s.global_buffers())
    assert torch.equal(s.job_for("a", 2.0).tensors["buffers"], s.global_buffers())


def test_feden_round_buffers_are_the_uniform_mean_including_partial_work() -> None:
    """FedEN (docs/algorithms/feden.md 1.9): partial work counts, uniform
    weights: statistics alike."""
    s, g = _strategy("feden", round_timeout=None, local_epochs=2.0, min_available=3,
                     participation=1.0)  # fmt: skip
    for cid in "abc":
        s.on_register(cid, 0.0)
    jobs = {cid: s.job_for(cid, 0.0) for cid in "abc"}
    sent = {cid: _buffers(g) for cid in "abc"}
    for cid, work in zip("abc", (2.0, 1.0, 2.0), strict=True):  # b did half its epochs
        s.on_update(_update(jobs[cid], torch.randn(D, generator=g), sent[cid], 5 + ord(cid),
                            work), 1.0)  # fmt: skip
    assert s.version == 1
    oracle = torch.stack([sent[c].double() for c in "abc"]).mean(0)
    torch.testing.assert_close(s.global_buffers().double(), oracle, rtol=0, atol=1e-6)


def test_fedasync_buffers_follow_the_weights_moving_average() -> None:
    s, g = _strategy("fedasync", alpha=0.6, staleness="polynomial", a=0.5)
    for cid in "ab":
        s.on_register(cid, 0.0)
    ja, jb = s.job_for("a", 0.0), s.job_for("b", 0.0)
    b0 = s.global_buffers().double()
    xa, xb = _buffers(g), _buffers(g)
    s.on_update(_update(ja, torch.randn(D, generator=g), xa), 1.0)
    b1 = (1 - 0.6) * b0 + 0.6 * xa.double()
    torch.testing.assert_close(s.global_buffers().double(), b1, rtol=0, atol=1e-6)
    s.on_update(_update(jb, torch.randn(D, generator=g), xb), 2.0)  # staleness 1
    a = 0.6 * 2**-0.5
    torch.testing.assert_close(
        s.global_buffers().double(), (1 - a) * b1 + a * xb.double(), rtol=0, atol=1e-6
    )


def test_fedbuff_buffers_flush_with_the_buffer_as_a_weighted_mean() -> None:
    s, g = _strategy("fedbuff", buffer_size=3, staleness_weighting=True)
    ids = ["a", "b", "c", "d"]
    for cid in ids:
        s.on_register(cid, 0.0)
    jobs = {cid: s.job_for(cid, 0.0) for cid in ids}
    start = s.global_buffers().clone()
    sent = [_buffers(g) for _ in range(3)]
    for cid, b in zip("abc", sent, strict=True):
        s.on_update(_update(jobs[cid], torch.randn(D, generator=g), b), 1.0)
    assert s.version == 1  # all staleness 0: weights 1
    oracle = torch.stack([b.double() for b in sent]).mean(0)
    torch.testing.assert_close(s.global_buffers().double(), oracle, rtol=0, atol=1e-6)
    assert not torch.equal(s.global_buffers(), start)
    # The next buffer: one stale update (s = 1, weight 1/sqrt 2) and two fresh ones.
    late = _buffers(g)
    s.on_update(_update(jobs["d"], torch.randn(D, generator=g), late), 2.0)
    fresh = []
    for cid in "ab":
        b = _buffers(g)
        fresh.append(b)
        s.on_update(_update(s.job_for(cid, 2.0), torch.randn(D, generator=g), b), 3.0)
    w = torch.tensor([2**-0.5, 1.0, 1.0], dtype=torch.float64)
    stack = torch.stack([late.double(), *(b.double() for b in fresh)])
    torch.testing.assert_close(
        s.global_buffers().double(), (stack * w[:, None]).sum(0) / w.sum(), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("name", ["mifa", "fedogd"])
def test_cached_strategies_average_every_clients_latest_buffers(name) -> None:
    # c is a straggler (an epoch does not wait for it) that reports in epoch 0 only.
    s, g = _strategy(name, epoch_timeout=None, min_updates=2, tiers={"c": 2})
    for cid in "abc":
        s.on_register(cid, 0.0)
    latest = {}
    for epoch in range(2):
        reporters = "cab" if epoch == 0 else "ab"  # c's buffers stay its epoch-0 ones
        jobs = {cid: s.job_for(cid, float(epoch)) for cid in reporters}
        for cid in reporters:
            latest[cid] = _buffers(g)
            s.on_update(_update(jobs[cid], 0.01 * torch.randn(D, generator=g), latest[cid]),
                        float(epoch) + 0.5)  # fmt: skip
        assert s.version == epoch + 1
        oracle = torch.stack([latest[c].double() for c in "abc"]).mean(0)
        torch.testing.assert_close(s.global_buffers().double(), oracle, rtol=0, atol=1e-6)


def _calibrate_reference(x, sent, w, snap, offsets, mask):
    """Per-segment ORTHOFL calibration in float64 (docs/algorithms/orthofl.md 1.4), y = x
    on unmasked segments."""
    x, sent, w, snap = (t.double() for t in (x, sent, w, snap))
    y = x.clone()
    for i, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)):
        if not mask[i]:
            continue
        dm, dw = x[lo:hi] - sent[lo:hi], w[lo:hi] - snap[lo:hi]
        nn_ = float(dm @ dm)
        c = float(dw @ dm) / nn_ if nn_ > 0 else 0.0
        y[lo:hi] = x[lo:hi] + dw - c * dm
    return y


def test_orthofl_buffers_are_averaged_not_calibrated_and_return_to_their_client() -> None:
    """docs/algorithms/orthofl.md G6 default: the global statistics are the beta_t moving average of
    the clients'; a client's next job carries its own uploaded statistics back (Y = X on
    buffers)."""
    s, g = _strategy("orthofl", beta=0.6, a=0.5)
    for cid in "ab":
        s.on_register(cid, 0.0)
    ja, jb = s.job_for("a", 0.0), s.job_for("b", 0.0)
    b0 = s.global_buffers().double()
    assert torch.equal(ja.tensors["buffers"], s.global_buffers())
    xa, xb = _buffers(g), _buffers(g)
    s.on_update(_update(ja, torch.randn(D, generator=g), xa), 1.0)  # t - tau = 1
    b1 = 0.4 * b0 + 0.6 * xa.double()
    torch.testing.assert_close(s.global_buffers().double(), b1, rtol=0, atol=1e-6)
    assert torch.equal(s.job_for("a", 1.0).tensors["buffers"], xa)  # bit-exact, its own
    s.on_update(_update(jb, torch.randn(D, generator=g), xb), 2.0)  # t - tau = 2
    beta = 0.6 * 2**-0.5
    torch.testing.assert_close(
        s.global_buffers().double(), (1 - beta) * b1 + beta * xb.double(), rtol=0, atol=1e-6
    )
    assert torch.equal(s.job_for("b", 2.0).tensors["buffers"], xb)


@pytest.mark.parametrize("shift_source", ["ma_global", "client_chain"])
def test_orthofl_calibrate_norm_calibrates_buffers_and_clamps_variances(shift_source) -> None:
    """The pure-paper reading (calibrate_norm): buffers go through the same per-segment formula
    as the weights (one segment per buffer tensor), negative variances clamped to 0."""
    s, g = _strategy("orthofl", beta=0.6, a=0.5, calibrate_norm=True, shift_source=shift_source)
    for cid in "ab":
        s.on_register(cid, 0.0)
    ja, jb = s.job_for("a", 0.0), s.job_for("b", 0.0)
    chain = s.global_buffers().clone()
    sent_b = jb.tensors["buffers"].clone()
    snap_b = s.global_buffers().clone()
    xa = _buffers(g)
    s.on_update(_update(ja, torch.randn(D, generator=g), xa), 1.0)
    ya = s.job_for("a", 1.0).tensors["buffers"]
    if shift_source == "client_chain":
        # Variant C calibrates every arrival: Y = V + (1 - c)(X - S_m); here V = S_m, so Y = X.
        torch.testing.assert_close(ya, xa, rtol=0, atol=1e-6)
        chain = ya.clone()
    else:
        assert torch.equal(ya, xa)  # t - tau = 1: no calibration, bit-exact
    w_before = s.global_buffers().clone()
    # b's statistics far from the global ones: the calibration pushes some variances below 0.
    xb = _buffers(g)
    xb[VAR] = torch.tensor([0.05, 0.02, 0.01, 0.03, 0.02])
    s.on_update(_update(jb, torch.randn(D, generator=g), xb), 2.0)
    yb = s.job_for("b", 2.0).tensors["buffers"]
    offsets = LAYOUT.buffer_offsets
    if shift_source == "client_chain":
        ref = _calibrate_reference(xb, sent_b, chain, sent_b, offsets, [True] * 3)
    else:
        ref = _calibrate_reference(xb, sent_b, w_before, snap_b, offsets, [True] * 3)
    assert (ref[VAR] < 0).any()  # the clamp is exercised
    expected = ref.clone()
    expected[VAR] = expected[VAR].clamp(min=0.0)
    torch.testing.assert_close(yb.double(), expected, rtol=0, atol=1e-5)
    assert (yb[VAR] >= 0).all()
    # The global statistics are never calibrated: the moving average of the raw uploads.
    beta = 0.6 * 2**-0.5
    torch.testing.assert_close(
        s.global_buffers().double(),
        (1 - beta) * w_before.double() + beta * xb.double(),
        rtol=0,
        atol=1e-6,
    )


@pytest.mark.parametrize(
    ("buffers", "match"),
    [
        (None, "must carry"),
        (torch.ones(B + 2), r"flat float32 \[8\]"),
        (torch.ones(B, dtype=torch.float64), r"flat float32 \[8\]"),
        (torch.tensor([1.0, 2, 3, 1, 1, float("nan"), 1, 1]), "NaN or Inf"),
        (torch.tensor([1.0, 2, 3, 1, -0.5, 1, 1, 1]), "negative running_var"),
    ],
)
@pytest.mark.parametrize("name", ["fedasync", "fedbuff", "orthofl", "mifa"])
def test_bad_buffers_are_refused_and_change_nothing(name, buffers, match) -> None:
    s, g = _strategy(name, epoch_timeout=None) if name == "mifa" else _strategy(name)
    s.on_register("a", 0.0)
    job = s.job_for("a", 0.0)
    before = s.state_dict()
    with pytest.raises(InvalidUpdate, match=match):
        s.on_update(_update(job, torch.randn(D, generator=g), buffers), 1.0)
    assert_same_state(before, s.state_dict())


def test_buffers_on_a_model_without_any_are_refused() -> None:
    s = make_strategy("fedasync", layout=ModelLayout([("w", (4,))]), initial=torch.zeros(4))
    s.on_register("a", 0.0)
    job = s.job_for("a", 0.0)
    with pytest.raises(InvalidUpdate, match="has none"):
        s.on_update(_update(job, torch.ones(4), torch.ones(2)), 1.0)


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("fedbuff", {"buffer_size": 3}),
        ("fedavg", {"round_timeout": None, "min_available": 3}),
        ("mifa", {"epoch_timeout": None, "min_updates": 3}),
        ("orthofl", {"calibrate_norm": True}),
        ("orthofl", {"shift_source": "client_chain"}),
    ],
)
def test_state_dict_with_buffers_resumes_bit_exactly(name, config) -> None:
    """Halfway (pending buffer sums, remembered rows, per-client snapshots) save, load into a
    fresh strategy, and both continue identically."""
    s, g = _strategy(name, **config)
    ids = ["a", "b", "c"]
    for cid in ids:
        s.on_register(cid, 0.0)
    for cid in ids[:2]:
        s.on_update(_update(s.job_for(cid, 0.0), torch.randn(D, generator=g), _buffers(g)), 1.0)
    saved = s.state_dict()
    t, _ = _strategy(name, seed=99, **config)
    t.load_state_dict(saved)
    assert_same_state(saved, t.state_dict())
    tail_g = _gen(5)
    tail = [(cid, torch.randn(D, generator=tail_g), _buffers(tail_g)) for cid in ids * 2]
    for strat in (s, t):
        for cid, delta, b in tail:
            job = strat.job_for(cid, 2.0)
            if job is None or job.client_id != cid:
                continue
            strat.on_update(_update(job, delta, b), 2.0)
    assert_same_state(s.state_dict(), t.state_dict())
    assert torch.equal(s.global_buffers(), t.global_buffers())


def test_orthofl_snapshot_bytes_count_the_buffer_snapshots() -> None:
    """Variant P per client: C_m and G_m for the weights and the buffers, exactly
    2 x clients x (D + B) x 4 bytes once both clients have reported (all distinct tensors:
    each C_m is its calibrated model, each G_m the version its update made); a released client
    holds nothing."""
    s, g = _strategy("orthofl")
    for cid in "ab":
        s.on_register(cid, 0.0)
    assert s.snapshot_bytes() == 0
    for cid in "ab":
        s.on_update(_update(s.job_for(cid, 0.0), torch.randn(D, generator=g), _buffers(g)), 1.0)
    assert s.snapshot_bytes() == 2 * 2 * (D + B) * 4
    assert s.release_client("a") and s.release_client("b") and s.snapshot_bytes() == 0
