"""The row cache as an operator reads it: GetStatus's cache_dtype, cache_rows and
cache_row_bytes and the matching Prometheus gauges, on a real server over loopback, against the
bytes computed by hand from the format (D codes + 4 bytes per block of 128)."""

from __future__ import annotations

import math

import pytest
import torch
from test_server_operations import registered, sample, scrape

from aggsrv.values import Status


@pytest.mark.parametrize(
    ("strategy", "config", "per_value"),
    [("ca2fl", {"buffer_size": 2, "cache_dtype": "int8"}, None),
     ("mifa", {"cache_dtype": "bfloat16", "epoch_timeout": None}, 2),
     ("fedasync", {}, 0)],
)  # fmt: skip
def test_status_and_metrics_report_the_row_cache(servers, strategy, config, per_value) -> None:
    srv = servers(strategy=strategy, strategy_config=config, metrics_port=0)
    a, b = registered(srv.address, ["a", "b"])
    d = a.layout.numel
    for c in (a, b):
        job = c.get_job()
        out = c.push(job, torch.full((d,), 0.01), epochs=1.0)
        assert out.status in (Status.APPLIED, Status.BUFFERED)
    status = a.status()
    m = scrape(srv.server.metrics_port)
    if per_value == 0:  # no row cache
        assert (status.cache_dtype, status.cache_rows, status.cache_row_bytes) == ("", 0, 0)
        assert sample(m, "aggsrv_cache_rows") == sample(m, "aggsrv_cache_row_bytes") == 0
        return
    row_bytes = d + 4 * math.ceil(d / 128) if per_value is None else per_value * d
    assert status.cache_dtype == config["cache_dtype"]
    assert (status.cache_rows, status.cache_row_bytes) == (2, row_bytes)
    assert sample(m, "aggsrv_cache_rows") == 2
    assert sample(m, "aggsrv_cache_row_bytes") == row_bytes
