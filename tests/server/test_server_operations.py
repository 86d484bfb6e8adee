"""Operating a running server: Prometheus metrics scraped over HTTP against counts made by hand,
the --eval hook (values checked against the retained version's model, the gauge and the
status fields; a failing hook; a bad spec), `aggsrv status` as a subprocess, and the structured
JSON log lines of accepted and refused updates.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import (
    raw_push,
    tiny_model,
    update_messages,
)

from aggsrv.client.client import Client
from aggsrv.logs import JsonFormatter
from aggsrv.server.app import Server
from aggsrv.server.config import ServerConfig
from aggsrv.values import Status

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 20.0  # every poll below gives up after this long


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics: (sample name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(metrics: dict, name: str, **labels: str) -> float:
    return metrics[(name, frozenset(labels.items()))]


def wait_for(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def registered(address: str, names: list[str], seed: int = 3) -> list[Client]:
    """Clients with retries off (a refusal is seen once); the first offers the initial model."""
    model = tiny_model(seed)
    clients = [Client(address, n, retries=0, timeout=15) for n in names]
    for c in clients:
        c.register(model)
    return clients


def delta(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.1


# ----------------------------------------------------------------------------- metrics


def test_metrics_endpoint_counts_updates_bytes_and_state(servers) -> None:
    srv = servers(metrics_port=0)
    port = srv.server.metrics_port
    assert isinstance(port, int) and 0 < port < 65536, "metrics_port=0 must bind a free port"
    a, b = registered(srv.address, ["a", "b"])
    d = a.layout.numel
    sent = received = 0
    received += 4 * d  # a's initial model (b registers without weights: the server has one)
    try:
        ja, jb = a.get_job(), b.get_job()  # both from version 0
        sent += 2 * 4 * d
        first = a.push(ja, delta(d, 1), epochs=1.0)
        assert (first.status, first.version, first.staleness) == (Status.APPLIED, 1, 0)
        received += 4 * d
        second = b.push(jb, delta(d, 2), epochs=1.0)
        assert (second.status, second.version, second.staleness) == (Status.APPLIED, 2, 1)
        received += 4 * d
        # A replay: decoded in full (its bytes count), then answered DUPLICATE by the strategy.
        dup = a.push(ja, delta(d, 1), epochs=1.0, update_id=first.update_id)
        assert dup.status is Status.DUPLICATE
        received += 4 * d
        ja2 = a.get_job()
        sent += 4 * d
        # Refused in the header: no payload byte is read.
        bad_hash = raw_push(
            srv.address, update_messages(a, ja2, delta(d, 3), layout_hash="ab" * 32)
        )
        assert bad_hash.code() == grpc.StatusCode.FAILED_PRECONDITION
        nobody = raw_push(srv.address, update_messages(a, ja2, delta(d, 3), client_id="nobody"))
        assert nobody.code() == grpc.StatusCode.NOT_FOUND
        # Refused after the whole payload arrived (NaN is found by finish()): its bytes count.
        nan = delta(d, 4)
        nan[d // 2] = float("nan")
        refused = raw_push(srv.address, update_messages(a, ja2, nan))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
        received += 4 * d
        _, pulled = a.get_model()
        sent += 4 * d

        m = scrape(port)
        fed = srv.federation
        status = a.status()
        assert sample(m, "aggsrv_updates_total", outcome="applied") == 2
        assert sample(m, "aggsrv_updates_total", outcome="duplicate") == 1
        assert sample(m, "aggsrv_updates_total", outcome="failed_precondition") == 1
        assert sample(m, "aggsrv_updates_total", outcome="not_found") == 1
        assert sample(m, "aggsrv_updates_total", outcome="invalid_argument") == 1
        assert dict(status.rejected_by_code) == {
            "FAILED_PRECONDITION": 1,
            "NOT_FOUND": 1,
            "INVALID_ARGUMENT": 1,
        }
        assert (status.updates_accepted, status.updates_applied) == (2, 2)
        assert (status.updates_duplicate, status.updates_rejected) == (1, 3)
        assert sample(m, "aggsrv_received_bytes_total") == received == 5 * 4 * d
        assert sample(m, "aggsrv_sent_bytes_total") == sent == 4 * 4 * d
        assert sample(m, "aggsrv_global_version") == status.version == fed.version == 2
        assert sample(m, "aggsrv_clients_known") == status.clients_known == 2
        assert sample(m, "aggsrv_clients_active") == 2
        # Staleness is observed once per accepted update (not for the duplicate): a's and b's
        # updates were both based on version 0, so staleness 0 and 1.
        assert sample(m, "aggsrv_staleness_count") == 2
        assert sample(m, "aggsrv_staleness_sum") == 1
        assert sample(m, "aggsrv_staleness_bucket", le="0.0") == 1
        assert sample(m, "aggsrv_staleness_bucket", le="1.0") == 2
        # One strategy call per update that reached it: two applied, one duplicate.
        assert sample(m, "aggsrv_aggregation_seconds_count") == 3
        assert sample(m, "aggsrv_aggregation_seconds_sum") > 0
        cache = sample(m, "aggsrv_cache_bytes")
        assert cache > 0 and cache == fed.cache_bytes() == status.cache_bytes
        # Retained versions 0, 1 and 2 hold different values, so three storages of 4*d bytes
        # at least (the newest may be the model's own storage: each is counted once).
        assert cache >= 3 * 4 * d
        assert sample(m, "aggsrv_queue_depth") == 0
        assert sample(m, "aggsrv_uploads_in_progress") == 0
        assert sample(m, "aggsrv_wal_bytes") == 0  # durability off
        assert sample(m, "aggsrv_rate_limited_total") == 0
        assert not any(name == "aggsrv_eval" for name, _ in m), "no --eval hook configured"
        assert torch.equal(pulled, srv.model())
    finally:
        a.close()
        b.close()


# ----------------------------------------------------------------------------- eval hook

EVAL_MODULE = """
import math

def evaluate(state):
    return {
        "accuracy": float(state["0.weight"].sum()),
        "loss": float((state["2.bias"].double() ** 2).sum()),
        "tensors": len(state),
        "diverged": math.nan,  # not finite: dropped by the server
    }
"""


def hand_metrics(client: Client, version: int) -> dict[str, float]:
    """What EVAL_MODULE gives for a retained version, from the model pulled over gRPC."""
    got_version, weights = client.get_model(version)
    assert got_version == version
    state = client.layout.unflatten(weights)
    return {
        "accuracy": float(state["0.weight"].sum()),
        "loss": float((state["2.bias"].double() ** 2).sum()),
        "tensors": float(len(state)),
    }


def test_eval_hook_metrics_match_the_model_by_hand(servers, tmp_path, monkeypatch) -> None:
    (tmp_path / "evalmod_ops.py").write_text(textwrap.dedent(EVAL_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "evalmod_ops", raising=False)
    srv = servers(eval="evalmod_ops:evaluate", eval_every_versions=2, metrics_port=0)
    (a,) = registered(srv.address, ["a"], seed=5)
    try:
        # Version 0 is evaluated first (the starting model).
        wait_for(lambda: a.status().HasField("eval_version"), "the first evaluation")
        s = a.status()
        assert s.eval_version == 0
        assert dict(s.eval_metrics) == hand_metrics(a, 0)
        for i in range(4):
            job = a.get_job()
            assert a.push(job, delta(a.layout.numel, 10 + i), epochs=1.0).version == i + 1
        wait_for(lambda: a.status().eval_version >= 4, "the evaluation of version 4")
        s = a.status()
        assert s.version == 4 and s.eval_version == 4
        want = hand_metrics(a, 4)
        assert dict(s.eval_metrics) == want
        assert "diverged" not in s.eval_metrics
        assert want != hand_metrics(a, 0)  # the pushes moved the model
        m = scrape(srv.server.metrics_port)
        assert sample(m, "aggsrv_eval_version") == 4
        for name, value in want.items():
            assert sample(m, "aggsrv_eval", metric=name) == value
        assert srv.federation.last_eval == (4, want)
    finally:
        a.close()
        sys.modules.pop("evalmod_ops", None)


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_failing_eval_hook_is_logged_and_the_server_keeps_serving(servers, tmp_path, monkeypatch):
    (tmp_path / "evalbad_ops.py").write_text(
        "def evaluate(state):\n    raise RuntimeError('boom from the hook')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "evalbad_ops", raising=False)
    handler = ListHandler()
    eval_log = logging.getLogger("aggsrv.server.evaluation")
    eval_log.addHandler(handler)
    try:
        srv = servers(eval="evalbad_ops:evaluate", eval_every_versions=1)
        (a,) = registered(srv.address, ["a"])

        def failures() -> list[logging.LogRecord]:
            return [r for r in list(handler.records) if r.levelno == logging.ERROR]

        wait_for(lambda: len(failures()) >= 1, "the hook's first failure to be logged")
        assert a.push(a.get_job(), delta(a.layout.numel, 1), epochs=1.0).status is Status.APPLIED
        wait_for(lambda: len(failures()) >= 2, "the failure on version 1")
        record = failures()[0]
        assert "eval hook failed" in record.getMessage()
        assert "boom from the hook" in record.getMessage()
        assert record.exc_info is not None
        s = a.status()
        assert not s.HasField("eval_version") and not s.eval_metrics
        assert srv.federation.last_eval is None
        # Still serving: another update is applied and health says SERVING.
        assert a.push(a.get_job(), delta(a.layout.numel, 2), epochs=1.0).version == 2
        with grpc.insecure_channel(srv.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        a.close()
    finally:
        eval_log.removeHandler(handler)
        sys.modules.pop("evalbad_ops", None)


@pytest.mark.parametrize(
    ("spec", "named"),
    [("nosuchmod_aggsrv_ops:f", "nosuchmod_aggsrv_ops"), ("json:no_such_function", "json")],
)
def test_bad_eval_spec_fails_at_start_naming_it(spec: str, named: str) -> None:
    # The config only checks the form; the import happens at start.
    cfg = ServerConfig(
        host="127.0.0.1", port=0, auth="none", durability="off", state_dir="", eval=spec
    )
    server = Server(cfg)
    with pytest.raises(ValueError, match=named) as info:
        asyncio.run(server.start())
    assert spec in str(info.value)
    assert server.port is None  # failed before binding anything
    with pytest.raises(ValueError, match="module:function"):
        ServerConfig(auth="none", durability="off", state_dir="", eval="no_colon")


# ----------------------------------------------------------------------------- aggsrv status


def test_status_cli_text_and_json(servers) -> None:
    srv = servers()
    (a,) = registered(srv.address, ["a"])
    try:
        for i in range(3):
            a.push(a.get_job(), delta(a.layout.numel, i), epochs=1.0)
        cmd = [sys.executable, "-m", "aggsrv.cli", "status", srv.address, "--timeout", "20"]
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert text.returncode == 0, text.stderr
        lines = dict(line.split(None, 1) for line in text.stdout.splitlines() if line.strip())
        assert lines["model"].startswith("version 3 ")
        assert lines["durability"] == "off"
        assert lines["strategy"] == "fedasync"
        assert lines["updates"].startswith("3 accepted (3 applied)")
        assert lines["auth"] == "none"
        raw = subprocess.run(
            [*cmd, "--json"], capture_output=True, text=True, timeout=120, cwd=REPO
        )
        assert raw.returncode == 0, raw.stderr
        data = json.loads(raw.stdout)
        # MessageToDict writes uint64 as a JSON string.
        assert int(data["version"]) == 3 and data["durability"] == "off"
        assert int(data["updatesAccepted"]) == 3 and data["hasModel"] is True
    finally:
        a.close()


# ----------------------------------------------------------------------------- JSON logs


def test_json_log_lines_for_accepted_and_refused_updates(servers) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("aggsrv")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        srv = servers()
        (a,) = registered(srv.address, ["a"])
        d = a.layout.numel
        job = a.get_job()
        ok = a.push(job, delta(d, 1), epochs=1.0)
        assert ok.status is Status.APPLIED
        job = a.get_job()
        nan = delta(d, 2)
        nan[0] = float("inf")
        nan_msgs = update_messages(a, job, nan)
        nan_id = nan_msgs[0].header.update_id
        assert raw_push(srv.address, nan_msgs).code() == grpc.StatusCode.INVALID_ARGUMENT
        hash_msgs = update_messages(a, job, delta(d, 3), layout_hash="cd" * 32)
        assert raw_push(srv.address, hash_msgs).code() == grpc.StatusCode.FAILED_PRECONDITION
        # A malformed id is not echoed into the log (it could hold anything, newlines included).
        bad_id = update_messages(a, job, delta(d, 3), client_id="evil\nid")
        assert raw_push(srv.address, bad_id).code() == grpc.StatusCode.INVALID_ARGUMENT

        def update_lines() -> list[dict]:
            lines = [json.loads(x) for x in stream.getvalue().splitlines() if x.strip()]
            return [x for x in lines if x.get("event") == "update"]

        wait_for(lambda: len(update_lines()) >= 4, "four update log lines")
        lines = [json.loads(x) for x in stream.getvalue().splitlines() if x.strip()]
        for line in lines:  # every line is one JSON object with the standard keys
            assert {"time", "level", "logger", "message"} <= set(line)
        assert any(x.get("event") == "register" and x["client_id"] == "a" for x in lines)
        applied, refused_nan, refused_hash, refused_id = update_lines()
        assert applied["outcome"] == "applied" and applied["level"] == "info"
        assert applied["client_id"] == "a" and applied["update_id"] == ok.update_id
        assert applied["version"] == 1 and applied["staleness"] == 0
        assert applied["logger"] == "aggsrv.server.service"
        assert refused_nan["outcome"] == "invalid_argument"
        assert refused_nan["client_id"] == "a" and refused_nan["update_id"] == nan_id
        assert refused_nan["version"] == 1
        assert "INVALID_ARGUMENT" in refused_nan["message"]
        assert refused_hash["outcome"] == "failed_precondition"
        assert refused_hash["update_id"] == hash_msgs[0].header.update_id
        assert refused_id["outcome"] == "invalid_argument"
        assert refused_id["client_id"] is None
        assert "evil\nid" not in stream.getvalue()
        a.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
