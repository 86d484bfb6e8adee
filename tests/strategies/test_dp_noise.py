"""Differential privacy's noise (aggsrv.strategies.dp_noise): a secret key that never leaves
memory, independent counter-addressed streams, and a Gaussian sampler whose body and tail
follow N(0, 1) (scipy's distributions as the oracle), reaching past 12 standard deviations."""

from __future__ import annotations

import logging
import math
import pickle
import secrets
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from server_helpers import RunningServer

from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import durability as durable
from aggsrv.server.config import ServerConfig
from aggsrv.strategies import make_strategy
from aggsrv.strategies.dp_noise import (
    _FI,
    _KI,
    _R,
    _WI,
    BLOCK,
    PURPOSE_COUNT,
    PURPOSE_UPDATE,
    TRUNCATION,
    NoiseKey,
    _fill,
    draw_values,
    fill_gaussian,
    standard_normals,
    tail_normals,
)
from aggsrv.values import UpdateKind

P_MIN = 1e-4  # a fresh key per run: a correct sampler fails one of these 1 time in 10,000


def _fresh() -> NoiseKey:
    return NoiseKey.from_os()


# ------------------------------------------------------------------ the key and its streams


def test_two_keys_that_agree_in_their_low_64_bits_give_different_streams() -> None:
    """torch's CPU generator kept a seed's low 32 bits only; our keys are 256 bits and every
    bit counts: keys equal but in one high byte draw unrelated noise."""
    raw = bytearray(secrets.token_bytes(32))
    other = bytearray(raw)
    other[0] ^= 0x80  # the top bit of the key; the low 64 bits (the last 8 bytes) agree
    a = draw_values(NoiseKey(bytes(raw), secure=True), 0, 0, 4099, 1.0)
    b = draw_values(NoiseKey(bytes(other), secure=True), 0, 0, 4099, 1.0)
    assert raw[-8:] == other[-8:]
    assert not np.any(a == b)
    assert abs(stats.pearsonr(a, b).statistic) < 0.1


def test_each_shard_draw_and_purpose_has_its_own_stream() -> None:
    key = _fresh()
    n = 2 * BLOCK + 77  # three blocks, drawn on several threads
    first = draw_values(key, 0, 0, n, 1.0)
    assert np.array_equal(first, draw_values(key, 0, 0, n, 1.0))  # a function of its address
    others = [
        draw_values(key, 1, 0, n, 1.0),  # another shard
        draw_values(key, 0, 1, n, 1.0),  # the next release
        draw_values(key, 0, 0, n, 1.0, PURPOSE_COUNT),  # adaptive clipping's count
    ]
    for other in others:
        assert not np.any(first == other)
    # The blocks do not repeat one another either.
    assert not np.any(first[:BLOCK] == first[BLOCK : 2 * BLOCK])
    # One block alone is the same values as the block of a longer draw.
    assert np.array_equal(draw_values(key, 0, 0, 1000, 1.0), first[:1000])
    # The std scales the same stream.
    assert np.allclose(draw_values(key, 0, 0, n, 2.5), 2.5 * first, rtol=1e-15, atol=0)


def test_a_key_is_never_printed_nor_pickled() -> None:
    key = _fresh()
    assert "secure" in repr(key) and key._key.hex() not in repr(key)
    with pytest.raises(TypeError, match="not serialisable"):
        pickle.dumps(key)
    assert not NoiseKey.insecure(5).secure
    assert NoiseKey.insecure(5).stream_key(0, 0, 0) == NoiseKey.insecure(5).stream_key(0, 0, 0)
    with pytest.raises(ValueError, match="32 bytes"):
        NoiseKey(b"short", secure=True)


LAYOUT = ModelLayout.from_named_shapes([("w", (211,)), ("b", (8,))])
DIM = LAYOUT.numel


def _strategy(name: str, x0: torch.Tensor, **config):
    return make_strategy(name, layout=LAYOUT, initial=x0, config=config)


def test_the_key_is_neither_logged_nor_written_to_disk(tmp_path: Path, caplog) -> None:
    """A durable DP server with checkpoints and a write-ahead log: no file of its state
    directory and no log line holds the key (raw or hex); a server resumed from that state
    draws a fresh key and keeps the accountant's spending."""
    caplog.set_level(logging.DEBUG)
    keys = {"buffer_size": 2, "dp_clip_norm": 0.5, "dp_noise_multiplier": 1.1}
    settings = {"strategy": "fedbuff", "strategy_config": keys, "durability": "on",
                "state_dir": str(tmp_path / "state"), "rate_limit_per_second": 0.0,
                "checkpoint_every_updates": 2}  # fmt: skip
    srv = RunningServer(**settings)
    try:
        with Client(srv.address, "a") as a:
            a.register(layout=LAYOUT, initial=torch.randn(DIM))
            secret = srv.strategy.privacy.key._key
            for _ in range(5):
                a.push(a.get_job(), torch.randn(DIM), kind=UpdateKind.DELTA)
        spent = srv.strategy.privacy.accountant.spent["a"]
        assert spent > 0
    finally:
        srv.stop()
    files = [p for p in (tmp_path / "state").rglob("*") if p.is_file()]
    assert len(durable.list_checkpoints(tmp_path / "state")) >= 2  # adoption and after pushes
    for path in files:
        data = path.read_bytes()
        assert secret not in data and secret.hex().encode() not in data, path
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert secret.hex() not in text and repr(secret) not in text
    resumed = RunningServer(**settings, resume=True)
    try:
        privacy = resumed.strategy.privacy
        assert privacy.key._key != secret and privacy.key.secure
        assert privacy.accountant.spent["a"] >= spent  # carried over (replays charged again)
    finally:
        resumed.stop()


def test_serve_refuses_a_fixed_seed_without_the_insecure_opt_in() -> None:
    keys = {"dp_clip_norm": 1.0, "dp_noise_multiplier": 1.0, "dp_seed": 3}
    with pytest.raises(ValueError, match="dp_seed.*dp_insecure_seed"):
        ServerConfig(strategy="fedbuff", strategy_config=keys)
    ServerConfig(strategy="fedbuff", strategy_config={**keys, "dp_insecure_seed": True})


def test_dp_with_a_state_dir_needs_the_write_ahead_log(tmp_path: Path) -> None:
    """With checkpoints only, a resumed server would not charge what it published since."""
    keys = {"dp_clip_norm": 1.0, "dp_noise_multiplier": 1.0}
    with pytest.raises(ValueError, match="durability = 'on'"):
        ServerConfig(strategy="fedbuff", strategy_config=keys, state_dir=str(tmp_path),
                     durability="off")  # fmt: skip
    ServerConfig(strategy="fedbuff", strategy_config=keys, state_dir=str(tmp_path))
    ServerConfig(strategy="fedbuff", strategy_config=keys, state_dir="", durability="off",
                 auth="none")  # nothing kept, nothing resumed  # fmt: skip


def test_max_update_norm_is_refused_with_the_dp_keys() -> None:
    """A refusal by norm would publish (by the version that does not appear) the norm."""
    with pytest.raises(ValueError, match="max_update_norm.*dp_") as refused:
        _strategy("fedasync", torch.zeros(DIM), dp_clip_norm=1.0, max_update_norm=2.0)
    assert "dp_clip_norm" in str(refused.value)
    _strategy("fedasync", torch.zeros(DIM), max_update_norm=2.0)  # without DP: fine


def test_a_seeded_strategy_draws_the_documented_stream() -> None:
    """The noise a DP strategy adds is draw ``i`` of its key's stream for release ``i``: a
    FedAsync release with a zero delta moves the model by exactly alpha * N."""
    seed, z, alpha = 11, 1.3, 0.5
    x0 = torch.zeros(DIM)
    s = _strategy("fedasync", x0, alpha=alpha, dp_clip_norm=1.0, dp_noise_multiplier=z,
                  dp_seed=seed, staleness="constant")  # fmt: skip
    s.on_register("a", 0.0)
    job = s.job_for("a", 0.0)
    from aggsrv.strategies import Update

    s.on_update(Update("a", job.job_id, 0, "u", 1, 1.0, UpdateKind.DELTA, torch.zeros(DIM)), 1.0)
    expect = alpha * draw_values(NoiseKey.insecure(seed), 0, 0, DIM, z)
    np.testing.assert_allclose(s.global_model().double().numpy(), expect, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ the sampler's law


def test_every_layer_of_the_ziggurat_has_the_same_area() -> None:
    """The tables' construction: layer i (1..255) spans [0, x_i] x [f(x_i), f(x_{i-1})] with
    f(x) = exp(-x^2/2), the top layer closes at f = 1, and each has the base layer's area
    V = R f(R) + the tail's (scipy's survival function as the oracle), to 1e-12."""
    x = _WI * 2.0**52
    f = np.exp(-0.5 * x * x)
    tail = math.sqrt(2 * math.pi) * stats.norm.sf(_R)
    v = _R * math.exp(-0.5 * _R * _R) + tail
    assert x[255] == pytest.approx(_R, rel=1e-15) and _FI[255] == pytest.approx(f[255])
    np.testing.assert_allclose(x[2:] * (f[1:-1] - f[2:]), v, rtol=1e-12)
    assert x[1] * (1.0 - f[1]) == pytest.approx(v, rel=1e-12)  # the top layer closes
    # The base layer: a strip of width V / f(R) (its part below R is accepted at once).
    assert x[0] * math.exp(-0.5 * _R * _R) == pytest.approx(v, rel=1e-12)
    # The acceptance bound of layer i is x_{i-1} / x_i (0 for the top layer) in 52-bit units.
    np.testing.assert_allclose(_KI[2:].astype(float), x[1:-1] / x[2:] * 2.0**52, rtol=1e-15)
    assert _KI[1] == 0 and _KI[0] == int(_R / x[0] * 2.0**52)


def test_the_body_follows_the_normal_law() -> None:
    """Kolmogorov-Smirnov against N(0, 1) for the sampler alone and for the released values
    (two draws summed, then scaled), with their moments."""
    key = _fresh()
    single = standard_normals(key.stream_key(0, 0, PURPOSE_UPDATE), 300_001)
    assert stats.kstest(single, "norm").pvalue > P_MIN
    sigma = 0.37
    released = draw_values(key, 0, 1, 300_007, sigma)
    assert stats.kstest(released / sigma, "norm").pvalue > P_MIN
    n = released.size
    assert abs(released.mean()) < 5 * sigma / math.sqrt(n)
    assert abs(released.var() / sigma**2 - 1) < 5 * math.sqrt(2 / n)
    # Symmetric, fourth moment of a normal (3).
    assert abs(stats.kurtosis(released, fisher=False) - 3) < 5 * math.sqrt(24 / n)


@pytest.mark.parametrize("start", [_R, 6.0, 8.0])
def test_the_tail_follows_the_normal_law_beyond_6_and_8_sigma(start: float) -> None:
    """The tail method the sampler uses beyond R = 3.65, run from 6 and 8 standard deviations:
    its draws follow N(0, 1) given X > start (Kolmogorov-Smirnov against scipy's conditional
    law), so the tail is no coarse grid and no truncation near 5.8 sigma."""
    key = _fresh()
    tail = tail_normals(key.stream_key(0, 0, 2), 60_000, start)
    assert tail.min() > start
    log_sf_start = stats.norm.logsf(start)

    def cdf(x):
        return -np.expm1(stats.norm.logsf(x) - log_sf_start)

    assert stats.kstest(tail, cdf).pvalue > P_MIN
    # Its mean is the inverse Mills ratio at start.
    mills = math.exp(stats.norm.logpdf(start) - log_sf_start)
    assert abs(tail.mean() - mills) < 5 * tail.std() / math.sqrt(tail.size)


def test_the_sampler_lands_in_its_tail_as_often_as_the_normal_law_says() -> None:
    """Importance counting of the full sampler's tail: the share of draws beyond R = 3.654 is
    2 Q(R) (a binomial count over 2M draws, within 5 standard deviations)."""
    key = _fresh()
    draws = standard_normals(key.stream_key(0, 0, 3), 2_000_003)
    beyond = int(np.count_nonzero(np.abs(draws) > _R))
    p = 2 * stats.norm.sf(_R)
    n = draws.size
    assert abs(beyond - n * p) < 5 * math.sqrt(n * p * (1 - p))
    # And what lands there follows N(0, 1) given |X| > R (the sampler's own tail, not the
    # method's from another start).
    tail = np.abs(draws[np.abs(draws) > _R])
    log_sf_r = stats.norm.logsf(_R)
    assert stats.kstest(tail, lambda x: -np.expm1(stats.norm.logsf(x) - log_sf_r)).pvalue > P_MIN


def _tail_words(xx: float) -> np.ndarray:
    """Words that drive one draw down the tail branch to R + xx (the largest 53-bit uniforms
    for the acceptance test)."""
    layer0_outside = np.uint64(int(_KI[0]) + 1) << np.uint64(9)  # layer 0, beyond the strip
    u1 = -math.expm1(-xx * _R)
    w1 = np.uint64(int(math.ceil(u1 * 2.0**53)) << 11)
    w2 = np.uint64(((1 << 53) - 1) << 11)
    return np.array([layer0_outside, w1, w2], dtype=np.uint64)


def test_one_draw_reaches_past_12_sigma_and_no_further_than_its_stated_truncation() -> None:
    """The truncation point is R + sqrt(2 * 53 ln 2) = 12.23 sigma: words that drive the tail
    to 12.2 sigma give a value there, and the acceptance test of 53-bit uniforms cannot accept
    more (checked at the bound)."""
    assert pytest.approx(_R + math.sqrt(2 * 53 * math.log(2)), rel=1e-15) == TRUNCATION
    assert TRUNCATION > 12.2
    out = np.zeros(1)
    done, used = _fill(_tail_words(8.5), out, 1.0, 1, _KI, _WI, np.ones(256))
    assert (done, used) == (1, 3)
    # (1 - u1) = exp(-31) sits on the 2^-53 grid: xx is 8.5 to 1e-4.
    assert out[0] == pytest.approx(_R + 8.5, abs=1e-3) and out[0] > 12.0
    # Past the truncation the acceptance test fails: the words run out before a value.
    done, _ = _fill(_tail_words(TRUNCATION - _R + 0.01), out, 1.0, 1, _KI, _WI, np.ones(256))
    assert done == 0


def test_the_count_noise_and_a_fixed_seed_repeat() -> None:
    """fill_gaussian writes into a given array: 1 value for adaptive clipping's count, equal
    to the stream's first value; it refuses float32 (the noise is float64 until it is added)."""
    key = NoiseKey.insecure(7)
    one = np.zeros(1)
    fill_gaussian(key, 2, 5, one, 0.6, PURPOSE_COUNT)
    assert one[0] == draw_values(key, 2, 5, 1, 0.6, PURPOSE_COUNT)[0] != 0
    with pytest.raises(ValueError, match="float64"):
        fill_gaussian(key, 0, 0, np.zeros(3, dtype=np.float32), 1.0)


def test_a_fixed_seed_is_warned_about_in_the_log_the_json_and_the_page(caplog) -> None:
    """`dp_insecure_seed`: the server logs a warning at start, `/api/status` says
    ``privacy.insecure_seed``, and the page shows the warning in a real browser (skipped
    without Debian's chromium); a server with a key from the OS says neither."""
    import json
    import urllib.request

    from browser import headless_chromium, wait_until

    keys = {"dp_clip_norm": 1.0, "dp_noise_multiplier": 1.0, "dp_seed": 9,
            "dp_insecure_seed": True}  # fmt: skip
    caplog.set_level(logging.WARNING)
    for seeded in (False, True):  # the browser (which may skip) last
        config = keys if seeded else {"dp_clip_norm": 1.0, "dp_noise_multiplier": 1.0}
        srv = RunningServer(strategy="fedasync", strategy_config=config, dashboard_port=0,
                            rate_limit_per_second=0.0)  # fmt: skip
        try:
            with Client(srv.address, "a") as a:
                a.register(layout=LAYOUT, initial=torch.randn(DIM))
                a.push(a.get_job(), torch.randn(DIM), kind=UpdateKind.DELTA)
            url = f"http://127.0.0.1:{srv.server.dashboard_port}/api/status"
            with urllib.request.urlopen(url, timeout=10) as resp:
                assert json.load(resp)["privacy"]["insecure_seed"] is seeded
            warned = [r for r in caplog.records if "NO privacy guarantee" in r.getMessage()]
            assert bool(warned) is seeded
            caplog.clear()
            if seeded:
                from selenium.webdriver.common.by import By

                browser = headless_chromium()
                try:
                    browser.get(f"http://127.0.0.1:{srv.server.dashboard_port}/")
                    shown = wait_until(
                        lambda b=browser: b.find_element(By.ID, "dp-insecure").is_displayed(),
                        "the page's warning",
                    )
                    text = browser.find_element(By.ID, "dp-insecure").text
                    assert shown and "no privacy guarantee" in text
                finally:
                    browser.quit()
        finally:
            srv.stop()


def _draw_in_child(queue) -> None:
    out = np.empty(3 * BLOCK)
    fill_gaussian(NoiseKey.insecure(1), 0, 0, out, 1.0)
    queue.put(out[:5].tolist())


def test_a_forked_process_draws_noise_after_its_parent_did() -> None:
    """A sweep forks workers after the parent may have drawn noise on its thread pool: the
    child has none of those threads and must make its own (it used to wait forever)."""
    import multiprocessing

    parent = np.empty(3 * BLOCK)
    fill_gaussian(NoiseKey.insecure(1), 0, 0, parent, 1.0)  # the pool's threads now exist
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_draw_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=60) == parent[:5].tolist()
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
