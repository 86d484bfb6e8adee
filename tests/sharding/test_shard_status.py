"""Watching a sharded federation: two `aggsrv serve --shards 2` processes with HMAC auth (one
secret), their Prometheus endpoints and rank 0's status page. Rank 0's `aggsrv status`, its
GetStatus and /api/status list both shards with the slices the client was handed and the
versions each shard serves; every series a shard serves carries its `shard` label (the real
HTTP endpoints, parsed by prometheus_client); after shard 1 is killed, rank 0 shows it
unreachable and itself no longer taking writes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch
from browser import headless_chromium, wait_until
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import REPO, ServeProcess, free_port

from aggsrv import cli
from aggsrv.client.client import Client
from aggsrv.layout import ModelLayout
from aggsrv.server import auth
from aggsrv.strategies import Status


def _layout() -> ModelLayout:
    # D = 251: the 64-element cut of 2 shards falls inside a.weight.
    return ModelLayout.from_named_shapes(
        [("a.weight", (11, 13)), ("a.bias", (11,)), ("b.weight", (7, 11)), ("b.bias", (7,)),
         ("c.weight", (2, 7)), ("c.bias", (2,))]
    )  # fmt: skip


def _families(port: int, query: str = "") -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics{query}", timeout=10) as resp:
        return {f.name: f for f in text_string_to_metric_families(resp.read().decode())}


def _api_status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=10) as resp:
        return json.load(resp)


def _cli(command: str, address: str, token: str, *extra: str) -> str:
    """`aggsrv COMMAND ADDRESS --token TOKEN ...`'s output, run in this process (the command
    line itself is run once, in a process of its own, by the test)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main([command, address, "--token", token, *extra]) == 0
    return out.getvalue()


def _cli_process(command: str, address: str, token: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "aggsrv.cli", command, address, "--token", token],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def _page_rows(browser) -> list[list[str]]:
    """The cells of the status page's shards table, as shown."""
    from selenium.webdriver.common.by import By

    rows = browser.find_elements(By.CSS_SELECTOR, "#shards tr")
    return [[td.text for td in row.find_elements(By.TAG_NAME, "td")] for row in rows]


def _wait_for(what: str, check, limit: float = 20.0):
    t0 = time.monotonic()
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() - t0 < limit, f"no {what} within {limit} s"
        time.sleep(0.2)


def test_rank_0_shows_every_shard_and_each_shard_labels_its_metrics(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    auth.save_secret(secret_file, auth.new_secret())
    secret = auth.load_secret(secret_file)
    admin = auth.issue_token(secret, auth.ADMIN_SUBJECT, auth.ROLE_ADMIN)
    settings = tmp_path / "shard.toml"
    settings.write_text("shard_heartbeat_seconds = 0.2\nrate_limit_per_second = 0.0\n")
    url = f"tcp://127.0.0.1:{free_port()}"
    metrics_ports = [free_port(), free_port()]
    dashboard_port = free_port()

    def shard_args(r: int) -> list[str]:
        return [
            "--shards", "2", "--rank", str(r), "--dist-url", url,
            "--state-dir", str(tmp_path / f"state{r}"),
            "--strategy", "fedasync", "--config", str(settings), "--auth", "hmac",
            "--auth-secret-file", str(secret_file), "--metrics-port", str(metrics_ports[r]),
            *(["--dashboard-port", str(dashboard_port)] if r == 0 else []),
        ]  # fmt: skip

    shards = [ServeProcess(tmp_path / f"shard{r}.log", free_port(), *shard_args(r)) for r in (0, 1)]
    try:
        for s in shards:
            s.wait_serving(60)
        layout = _layout()
        gen = torch.Generator().manual_seed(random.randrange(1 << 30))
        pushes = random.randint(1, 3)
        client = Client(shards[0].address, "c0", token=auth.issue_token(secret, "c0"),
                        timeout=20, retries=0)  # fmt: skip
        client.register(layout=layout, initial=torch.randn(layout.numel, generator=gen))
        for _ in range(pushes):
            job = client.get_job()
            delta = torch.randn(layout.numel, generator=gen)
            assert client.push(job, delta, num_samples=5).status is Status.APPLIED
        bounds = client.shard_map.bounds
        slices = [(bounds[r], bounds[r + 1]) for r in range(2)]
        addresses = [s.address for s in shards]

        # GetStatus (what `aggsrv status` asks), with the operator's admin token. A shard of
        # rank >= 1 publishes a version once rank 0 says it is durable (its next message).
        def status_at(version: int):
            with Client(shards[0].address, "operator", token=admin, retries=0) as op:
                s = op.status()
            return s if [r.version for r in s.shards] == [version] * 2 else None

        status = _wait_for(f"both shards at version {pushes}", lambda: status_at(pushes))
        assert status.failure == ""
        rows = [(r.rank, r.address, (r.begin, r.end), r.version, r.reachable, r.takes_writes)
                for r in status.shards]  # fmt: skip
        assert rows == [(r, addresses[r], slices[r], pushes, True, True) for r in range(2)]
        assert all(r.error == "" and r.durability == "on" for r in status.shards)
        assert all(r.wal_bytes > 0 for r in status.shards), status.shards  # the pushes' records
        heard = status.server_time.ToNanoseconds() - status.shards[1].last_heard.ToNanoseconds()
        assert abs(heard) < 5e9  # asked while rank 0 answered (after it read its clock)
        with Client(shards[1].address, "operator", token=admin, retries=0) as op:
            assert len(op.status().shards) == 0  # only rank 0 asks the others

        text = _cli_process("status", shards[0].address, admin)
        for r in range(2):
            line = next(ln for ln in text.splitlines() if addresses[r] in ln)
            begin, end = slices[r]
            want = [str(r), addresses[r], f"[{begin},", f"{end})", str(pushes), "yes"]
            assert line.split()[:6] == want, text
        as_json = json.loads(_cli("status", shards[0].address, admin, "--json"))
        assert [int(s.get("end", 0)) for s in as_json["shards"]] == [e for _, e in slices]

        page = _api_status(dashboard_port)["shards"]
        assert [(s["rank"], s["address"], s["begin"], s["end"], s["version"], s["takes_writes"])
                for s in page] == [
            (r, addresses[r], *slices[r], pushes, True) for r in range(2)
        ]  # fmt: skip

        # A checkpoint rank 0 is asked for is cut at the same call on every shard: both rows
        # name it, in every view.
        _cli("checkpoint", shards[0].address, admin)

        def checkpointed():  # shard 1 cuts it when rank 0's next message orders it
            s = status_at(pushes)
            done = s is not None and all(
                r.HasField("last_checkpoint_version") and r.last_checkpoint_version == pushes
                for r in s.shards
            )
            return s if done else None

        _wait_for(f"both shards' checkpoints of version {pushes}", checkpointed)
        text = _cli("status", shards[0].address, admin)
        assert text.count(f"ckpt v{pushes}") == 2, text
        page = _api_status(dashboard_port)["shards"]
        assert [s["last_checkpoint"]["version"] for s in page] == [pushes] * 2

        # Every series of each shard carries its shard label (the restricted scrape too).
        for r, port in enumerate(metrics_ports):
            families = _families(port)
            labels = {s.labels.get("shard") for f in families.values() for s in f.samples}
            assert labels == {str(r)}, (r, labels)
            (version,) = families["aggsrv_global_version"].samples
            assert version.value == pushes
            # Every shard answers every update for its slice: the federation's counts, N times
            # over the shards (docs/operations.md: read them on shard="0").
            applied = [
                s.value
                for s in families["aggsrv_updates"].samples
                if s.name == "aggsrv_updates_total" and s.labels["outcome"] == "applied"
            ]
            assert applied == [pushes]
            # The per-client series are rank 0's only (it sees every client).
            assert ("aggsrv_clients" in families) == (r == 0)
            (only,) = _families(port, "?name[]=aggsrv_global_version").values()
            assert [s.labels for s in only.samples] == [{"shard": str(r)}]
        assert _families(metrics_ports[0])["aggsrv_clients"].samples  # one per state

        # A shard that hangs holds rank 0's aggregation thread in a collective, but not its
        # status: the shard is shown unreachable (DEADLINE_EXCEEDED), with what it last said.
        def status_of_1(reachable: bool):
            with Client(shards[0].address, "operator", token=admin, timeout=20, retries=0) as op:
                s = op.status()
            return s.shards[1] if s.shards[1].reachable == reachable else None

        shards[1].proc.send_signal(signal.SIGSTOP)
        try:
            hung = _wait_for("hung shard 1 shown unreachable", lambda: status_of_1(False))
        finally:
            shards[1].proc.send_signal(signal.SIGCONT)
        assert hung.error.startswith("DEADLINE_EXCEEDED") and not hung.takes_writes, hung
        assert hung.version == pushes and (hung.begin, hung.end) == slices[1]
        back = _wait_for("shard 1 answering again", lambda: status_of_1(True))
        assert back.takes_writes and back.error == ""

        shards[1].proc.kill()
        shards[1].proc.wait(10)

        def lost():
            with Client(shards[0].address, "operator", token=admin, retries=0) as op:
                s = op.status()
            return s if not s.shards[1].reachable and s.failure else None

        status = _wait_for("unreachable shard 1 on rank 0", lost)
        zero, one = status.shards
        assert not one.takes_writes and one.error.startswith("UNAVAILABLE"), one
        assert one.version == pushes and (one.begin, one.end) == slices[1]  # as last heard
        assert zero.reachable and not zero.takes_writes and "lost" in zero.failure
        text = _cli("status", shards[0].address, admin)
        assert "UNREACHABLE" in text and "shard 1: unreachable: UNAVAILABLE" in text, text
        assert "REFUSED" in text.split("\n", 2)[1], text  # rank 0's own writes line
        page = _api_status(dashboard_port)["shards"]
        assert [(s["reachable"], s["takes_writes"]) for s in page] == [(True, False),
                                                                      (False, False)]  # fmt: skip
        client.close()
        _the_page_shows_the_shards(dashboard_port, addresses, slices, pushes)
    finally:
        for s in shards:
            s.close()


def _the_page_shows_the_shards(port: int, addresses: list[str], slices: list, version: int) -> None:
    """The status page in a real browser, after shard 1 was killed: one row per shard."""
    browser = headless_chromium()
    try:
        browser.get(f"http://127.0.0.1:{port}/")
        rows = wait_until(lambda: _page_rows(browser), "the shards table")
        writes = ["no", "unreachable"]  # rank 0 refuses writes; shard 1 does not answer
        for r, row in enumerate(rows):
            begin, end = slices[r]
            assert row[:5] == [str(r), addresses[r], f"[{begin}, {end})", str(version), writes[r]]
        assert "lost" in rows[0][7] and rows[1][7].startswith("UNAVAILABLE"), rows
        out = Path(os.environ.get("AGGSRV_TEST_ARTIFACTS", REPO / "test-artifacts"))
        out.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(out / "dashboard-shards.png"))
    finally:
        browser.quit()
