"""`aggsrv serve --dashboard-port`: the JSON document against what clients did over gRPC, and
the page in a real headless Chromium (Debian's chromium and chromium-driver, with Selenium;
skipped with the reason where they are missing). The browser test saves a screenshot to
$AGGSRV_TEST_ARTIFACTS (default test-artifacts/ at the repository root)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from browser import headless_chromium, wait_until
from server_helpers import RunningServer, tiny_model

from aggsrv.client.client import Client

REPO = Path(__file__).resolve().parents[2]

EVAL_MODULE = """
def evaluate(state):
    w = state["0.weight"].double()
    return {"accuracy": float(w.abs().mean()), "loss": float((w ** 2).mean())}
"""


def _get(port: int, path: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("Content-Type", "")


def _status(port: int) -> dict:
    code, body, kind = _get(port, "/api/status")
    assert code == 200 and kind == "application/json", (code, body[:200])
    return json.loads(body)


@pytest.fixture
def dashboard_server(tmp_path, monkeypatch):
    (tmp_path / "evalmod_dash.py").write_text(textwrap.dedent(EVAL_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "evalmod_dash", raising=False)
    srv = RunningServer(
        strategy="fedasync", dashboard_port=0, rate_limit_per_second=0.0,
        eval="evalmod_dash:evaluate", eval_every_versions=1,
    )  # fmt: skip
    yield srv
    srv.stop()


def test_the_json_document_says_what_the_clients_did(dashboard_server) -> None:
    srv = dashboard_server
    port = srv.server.dashboard_port
    doc = _status(port)
    assert doc["format"] == 1 and doc["has_model"] is False and doc["version"] is None
    with Client(srv.address, "c1") as c1, Client(srv.address, "c2") as c2:
        c1.register(tiny_model(4))
        c2.register(tiny_model(4))
        D = c1.layout.numel
        held = c2.get_job()
        for _ in range(4):
            c1.push(c1.get_job(), torch.randn(D))
        doc = _status(port)
        assert doc["version"] == 4 and doc["versions_last_minute"] == 4
        assert doc["updates"] == {"accepted": 4, "applied": 4, "buffered": 0, "filtered": 0,
                                  "duplicate": 0, "rejected": 0}  # fmt: skip
        assert doc["clients"]["known"] == 2 and sum(doc["clients"]["states"].values()) == 2
        assert doc["clients"]["slowest"][0]["client"] == "c2"
        assert doc["staleness"]["count"] == 4 and doc["staleness"]["counts"][0] == 4
        assert doc["job_turnaround_seconds"]["count"] == 4
        lag = doc["client_lag"]  # c2 holds a job of base 0 at version 4
        assert lag["count"] == 1 and lag["sum"] == 4 and lag["le"][-1] is None
        assert doc["client_update_rate"]["count"] == 1  # c1's 4 updates; c2 sent none
        silence = doc["client_silence_seconds"]  # both registered, both just seen
        assert silence["count"] == 2 and silence["counts"][0] == 2 and silence["le"][0] == 1.0
        assert doc["strategy"]["name"] == "fedasync"
        assert doc["strategy"]["settings"]["alpha"] == 0.6
        # The settings for people, by group; DP's keys only when DP is on (here it is off).
        groups = dict(doc["strategy"]["groups"])
        assert list(groups) == ["strategy", "every strategy: the clients' recipe and bounds"]
        assert "alpha" in groups["strategy"] and "learning_rate" in groups[list(groups)[1]]
        shown = [k for keys in groups.values() for k in keys]
        assert not [k for k in shown if k.startswith("dp_")]
        assert set(shown) == {k for k in doc["strategy"]["settings"] if not k.startswith("dp_")}
        bad = torch.randn(D)
        bad[0] = float("nan")
        with pytest.raises(Exception, match="INVALID_ARGUMENT|NaN|finite"):
            c2.push(held, bad)
        # The server counts a refusal just after it answered it: wait for the count.
        doc = wait_until(
            lambda: (d := _status(port))["refusals"] and d, "the refusal's count", 10.0
        )
        assert doc["refusals"] == {"INVALID_ARGUMENT": 1} and doc["updates"]["rejected"] == 1
    # The eval hook runs on its own thread: wait for its results to reach the document.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not doc["evaluation"]:
        time.sleep(0.2)
        doc = _status(port)
    assert doc["evaluation"] and set(doc["evaluation"][-1]["metrics"]) == {"accuracy", "loss"}
    code, body, kind = _get(port, "/")
    assert code == 200 and kind.startswith("text/html") and b"dashboard.js" in body
    assert _get(port, "/dashboard.js")[0] == 200 and _get(port, "/dashboard.css")[0] == 200
    assert _get(port, "/etc/passwd")[0] == 404 and _get(port, "/../setup.py")[0] == 404


def test_the_page_in_a_real_browser_follows_the_federation(dashboard_server) -> None:
    srv = dashboard_server
    browser = headless_chromium()
    from selenium.webdriver.common.by import By

    def text(element_id: str) -> str:
        return browser.find_element(By.ID, element_id).text

    try:
        with Client(srv.address, "c1") as c1, Client(srv.address, "c2") as c2:
            c1.register(tiny_model(9))
            c2.register(tiny_model(9))
            D = c1.layout.numel
            c2.get_job()  # held: shows as lag and among the slowest
            for _ in range(3):
                c1.push(c1.get_job(), torch.randn(D))
            browser.get(f"http://127.0.0.1:{srv.server.dashboard_port}/")
            wait_until(lambda: text("version") == "3", "the page to show version 3")
            assert text("strategy-name") == "fedasync" and text("clients-known") == "2"
            assert text("updates-applied") == "3"
            # The numbers move as clients push, without reloading the page.
            for _ in range(4):
                c1.push(c1.get_job(), torch.randn(D))
            wait_until(lambda: text("version") == "7", "the page to follow to version 7")
            assert text("updates-applied") == "7" and text("updates-buffered") == "0"
            settings = browser.find_element(By.ID, "settings").text
            assert "every strategy: the clients' recipe and bounds" in settings
            assert "alpha" in settings and "dp_clip_norm" not in settings  # DP is off
            wait_until(lambda: text("eval-count") not in ("", "0"), "evaluation results")
            bars = browser.find_elements(By.CSS_SELECTOR, "#chart-staleness svg rect")
            assert bars, "the staleness histogram has bars"
            assert browser.find_elements(By.CSS_SELECTOR, "#chart-eval svg path")
            for chart in ("chart-lag", "chart-rate", "chart-silence"):
                assert browser.find_elements(By.CSS_SELECTOR, f"#{chart} svg rect"), chart
            rows = browser.find_elements(By.CSS_SELECTOR, "#slowest tr")
            assert rows and rows[0].text.startswith("c2")
            assert "error" not in browser.find_element(By.ID, "connection").get_attribute("class")
            assert not browser.find_element(By.ID, "shards-panel").is_displayed()  # one server
            out = Path(os.environ.get("AGGSRV_TEST_ARTIFACTS", REPO / "test-artifacts"))
            out.mkdir(parents=True, exist_ok=True)
            shot = out / "dashboard.png"
            assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        browser.quit()


def test_a_buffered_strategy_names_every_outcome_and_shows_dp_settings_when_on() -> None:
    """FedBuff with a buffer of 4: 9 updates are 2 that completed a version and 7 buffered;
    with the dp_ keys set, the settings have a differential-privacy group."""
    srv = RunningServer(
        strategy="fedbuff", dashboard_port=0, rate_limit_per_second=0.0,
        strategy_config={"buffer_size": 4, "dp_clip_norm": 1.0, "dp_noise_multiplier": 0.5,
                         "dp_seed": 3, "dp_insecure_seed": True},
    )  # fmt: skip
    try:
        with Client(srv.address, "c1") as c1:
            c1.register(tiny_model(2))
            for _ in range(9):
                c1.push(c1.get_job(), torch.randn(c1.layout.numel) * 0.01)
            doc = _status(srv.server.dashboard_port)
    finally:
        srv.stop()
    assert doc["version"] == 2
    assert doc["updates"] == {"accepted": 9, "applied": 2, "buffered": 7, "filtered": 0,
                              "duplicate": 0, "rejected": 0}  # fmt: skip
    groups = dict(doc["strategy"]["groups"])
    assert "differential privacy" in groups and "dp_clip_norm" in groups["differential privacy"]
