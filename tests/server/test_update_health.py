"""Update norms: the robust outlier rule by hand, and the metrics of a real server."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from server_helpers import RunningServer, scrape_metrics, tiny_model

from aggsrv.client.client import Client
from aggsrv.server.update_health import UpdateNorms
from aggsrv.values import UpdateKind


def test_an_update_far_from_the_recent_norms_is_an_outlier() -> None:
    rng = np.random.default_rng(5)
    norms = UpdateNorms(window=512, threshold=3.5, refresh=32, min_seen=32)
    typical = np.exp(rng.normal(0.0, 0.1, 31))
    assert not any(norms.observe(float(v)) for v in typical)
    assert not norms.observe(1000.0)  # the 32nd: nothing is called an outlier before 32 seen
    for v in np.exp(rng.normal(0.0, 0.1, 40)):
        norms.observe(float(v))
    # Median log-norm ~0, robust sd ~0.1: x100 and /100 are ~46 sd away, x1.2 is ~1.8.
    assert norms.observe(100.0) and norms.observe(0.01) and norms.observe(0.0)
    assert not norms.observe(1.2)


def test_equal_norms_still_flag_a_scaled_update() -> None:
    """Clients clipping to one bound send equal norms: no spread, yet x1000 is an outlier."""
    norms = UpdateNorms()
    assert not any(norms.observe(5.0) for _ in range(64))
    assert norms.observe(5000.0) and not norms.observe(5.0)


def _scrape(port: int) -> dict[str, float]:
    """The unlabelled samples of /metrics by name."""
    return {name: v for (name, labels), v in scrape_metrics(port).items() if not labels}


def test_a_real_server_counts_norms_and_flags_the_scaled_update() -> None:
    srv = RunningServer(strategy="fedasync", metrics_port=0, rate_limit_per_second=0.0)
    try:
        with Client(srv.address, "c1") as client:
            client.register(tiny_model(13))
            D = client.layout.numel
            g = torch.Generator().manual_seed(13)
            sent = []
            for _ in range(40):
                delta = torch.randn(D, generator=g) * 0.01
                sent.append(math.sqrt(float((delta.double() ** 2).sum())))
                client.push(client.get_job(), delta)
            m = _scrape(srv.server.metrics_port)
            assert m["aggsrv_update_norm_count"] == 40
            assert abs(m["aggsrv_update_norm_sum"] - sum(sent)) <= 1e-5 * sum(sent)
            assert m["aggsrv_update_norm_outliers_total"] == 0
            client.push(client.get_job(), torch.randn(D, generator=g) * 10.0)  # x1000
            m = _scrape(srv.server.metrics_port)
            assert m["aggsrv_update_norm_outliers_total"] == 1
            # A WEIGHTS upload's norm is the model's, not a step's: not observed.
            job = client.get_job()
            client.push(job, job.weights + 0.01, kind=UpdateKind.WEIGHTS)
            m = _scrape(srv.server.metrics_port)
            assert m["aggsrv_update_norm_count"] == 41
            assert m["aggsrv_update_norm_outliers_total"] == 1
    finally:
        srv.stop()


def test_the_recent_change_is_refreshed_at_most_once_an_interval() -> None:
    from aggsrv.server.update_health import RecentChange

    change = RecentChange(interval=1.0)
    w0, w1, w2, w3 = (torch.full((5,), v) for v in (0.0, 1.0, 3.0, 4.0))
    change.refresh(w0, now=0.0)
    assert change.current is None and change.generation == 0  # nothing to compare with yet
    change.refresh(w1, now=0.5)  # within the interval: ignored
    assert change.current is None
    change.refresh(w2, now=1.0)
    first, norm = change.current
    assert torch.equal(first, w2 - w0) and norm == pytest.approx(3.0 * 5**0.5)
    assert change.generation == 2
    change.refresh(w3, now=2.0)
    second, norm = change.current
    # Written into the other buffer: a reader still holding the first sees it unchanged.
    assert torch.equal(second, w3 - w2) and torch.equal(first, w2 - w0) and norm > 0
    assert second.data_ptr() != first.data_ptr() and change.generation == 4


def test_a_sign_flipped_update_is_a_cosine_outlier_on_a_real_server() -> None:
    """Clients whose updates share a direction (plus noise), then one that sends the opposite:
    its cosine to the model's recent change is counted as an outlier."""
    srv = RunningServer(strategy="fedasync", metrics_port=0, rate_limit_per_second=0.0)
    try:
        with Client(srv.address, "c1") as client:
            client.register(tiny_model(14))
            srv.federation.direction.interval = 0.0  # refresh on every version (a short test)
            D = client.layout.numel
            g = torch.Generator().manual_seed(14)
            common = torch.randn(D, generator=g)
            for _ in range(40):
                client.push(client.get_job(), 0.01 * (common + 0.3 * torch.randn(D, generator=g)))
            m = _scrape(srv.server.metrics_port)
            assert m["aggsrv_update_cosine_count"] == 39  # the first had no change to compare
            # Histograms with negative buckets have no _sum: most cosines lie above 0.6.
            low = scrape_metrics(srv.server.metrics_port)[
                ("aggsrv_update_cosine_bucket", frozenset({("le", "0.6")}))
            ]
            assert low <= 3
            assert m["aggsrv_update_cosine_outliers_total"] == 0
            client.push(client.get_job(), -0.01 * common)
            m = _scrape(srv.server.metrics_port)
            assert m["aggsrv_update_cosine_outliers_total"] == 1
    finally:
        srv.stop()


@pytest.mark.parametrize("strategy", ["fedasync", "fedbuff"])
def test_the_norm_of_an_update_folded_from_its_codes_is_the_decoded_values(strategy) -> None:
    """FedAsync and FedBuff take INT8 deltas as codes: the norm metric comes from the codes, in
    the pass that folds them (FedBuff's flushing update: chunk by chunk)."""
    from aggsrv.client.compression import Compression
    from aggsrv.transport import Quantization, quantize

    config = {"buffer_size": 3} if strategy == "fedbuff" else {}
    srv = RunningServer(strategy=strategy, metrics_port=0, rate_limit_per_second=0.0,
                        strategy_config=config)  # fmt: skip
    spec = Compression(quantization="int8", error_feedback=False)
    try:
        with Client(srv.address, "c1", compression=spec) as client:
            client.register(tiny_model(7))
            D = client.layout.numel
            g = torch.Generator().manual_seed(7)
            sent = []
            for _ in range(6):
                delta = torch.randn(D, generator=g) * 0.01
                _, decoded = quantize(delta, Quantization.INT8, 128)
                sent.append(float(decoded.double().norm()))
                client.push(client.get_job(), delta)
            m = _scrape(srv.server.metrics_port)
    finally:
        srv.stop()
    assert m["aggsrv_update_norm_count"] == 6
    assert m["aggsrv_update_norm_sum"] == pytest.approx(sum(sent), rel=1e-6)
