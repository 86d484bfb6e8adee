"""deploy/grafana/aggsrv.json against a real Prometheus (Debian's `prometheus`, skipped with the
reason where it is missing) scraping a live server with clients pushing: every panel's query
returns data through Prometheus's HTTP API."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
from server_helpers import RunningServer, tiny_model

from aggsrv.client.client import Client

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "aggsrv.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _finite(result: list) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def test_the_dashboard_is_valid_and_covers_the_operators_questions() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    for metric in (
        "aggsrv_clients",
        "aggsrv_slowest_job_seconds",
        "aggsrv_client_lag_bucket",
        "aggsrv_client_update_rate_bucket",
        "aggsrv_client_silence_seconds_bucket",
        "aggsrv_staleness_bucket",
        "aggsrv_job_turnaround_seconds_bucket",
        "aggsrv_versions_published_total",
        "aggsrv_updates_total",
        "aggsrv_eval",
    ):
        assert any(metric in e for e in exprs), metric  # fmt: skip
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all(p.get("description") for p in dash["panels"])
    config = (REPO / "deploy" / "prometheus" / "prometheus.yml").read_text()
    assert "job_name: aggsrv" in config


EVAL_MODULE = """
def evaluate(state):
    return {"accuracy": float(state["0.weight"].abs().mean())}
"""


@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="needs Debian's prometheus package (apt-get install prometheus)",
)
def test_every_panel_query_returns_data_from_a_real_prometheus(tmp_path, monkeypatch) -> None:
    (tmp_path / "evalmod_graf.py").write_text(textwrap.dedent(EVAL_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "evalmod_graf", raising=False)
    srv = RunningServer(
        strategy="fedbuff", strategy_config={"buffer_size": 2}, metrics_port=0,
        rate_limit_per_second=0.0,
        durability="on", state_dir=str(tmp_path / "state"),
        eval="evalmod_graf:evaluate", eval_every_versions=5,
    )  # fmt: skip
    prom_port = _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        textwrap.dedent(f"""
        global:
          scrape_interval: 1s
        scrape_configs:
          - job_name: aggsrv
            static_configs:
              - targets: ["127.0.0.1:{srv.server.metrics_port}"]
        """)
    )
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    try:
        with Client(srv.address, "c1") as c1, Client(srv.address, "c2") as c2:
            c1.register(tiny_model(11))
            c2.register(tiny_model(11))
            D = c1.layout.numel
            held = c2.get_job()  # held through the test: a lag and a slowest client
            bad = torch.randn(D)
            bad[1] = float("inf")
            with pytest.raises(Exception, match="INVALID_ARGUMENT|finite"):
                c1.push(c1.get_job(), bad)
            missing = set(exprs)
            deadline = time.monotonic() + 60
            while missing and time.monotonic() < deadline:
                for _ in range(5):  # keep the rates moving between scrapes
                    c1.push(c1.get_job(), torch.randn(D))
                time.sleep(0.5)
                if prom.poll() is not None:
                    pytest.fail(f"prometheus exited: {prom.stderr.read().decode()[-2000:]}")
                for expr in list(missing):
                    try:
                        if _finite(_query(prom_port, expr)):
                            missing.discard(expr)
                    except OSError:
                        break  # not listening yet
            assert not missing, f"panel queries without data after 60 s: {sorted(missing)}"
            c2.push(held, torch.randn(D))
    finally:
        prom.terminate()
        prom.wait(timeout=20)
        srv.stop()
