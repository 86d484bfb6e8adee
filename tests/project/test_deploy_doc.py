"""docs/deploy.md, followed on two hosts: its shell blocks run as written, the server's in one
network namespace and the clients' in another (tests/support/netns.py), with only the example
address replaced by the server host's. The server serves TLS with the page's certificate and
tokens; two `aggsrv client` processes on the client host train to their budget; the status, the
metrics and the status page are read from the client host. Then what the page says a client
with the wrong CA or a forged token gets. Needs root and `ip netns` (skips otherwise).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns import Host, Network, require_netns

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "deploy.md"
EXAMPLE_IP = "192.0.2.10"


def _blocks() -> list[tuple[str, str]]:
    """(which host, the script) of every bash block of the page, in order."""
    found = []
    for m in re.finditer(r"^```bash\n(.*?)^```", PAGE.read_text(), re.S | re.M):
        first, _, script = m.group(1).partition("\n")
        assert first.startswith("# "), f"a block of {PAGE.name} does not say its host: {first}"
        found.append((first[2:].strip(), script))
    return found


def test_the_page_says_where_each_block_runs() -> None:
    hosts = [where for where, _ in _blocks()]
    assert hosts == ["server host", "server host", "server host, in the background",
                     "client host", "client host"], hosts  # fmt: skip


def _env(address: str) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # where `aggsrv` is installed with this Python
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SERVER_IP": address}


def _script(text: str, address: str) -> str:
    return text.replace(f"SERVER_IP={EXAMPLE_IP}", f"SERVER_IP={address}")


def _run(host: Host, script: str, cwd: Path, env: dict, check: bool = True):
    done = subprocess.run(
        ["ip", "netns", "exec", host.netns, "bash", "-euo", "pipefail", "-c", script],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    if check:
        assert done.returncode == 0, (
            f"{script}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        )
    return done


@pytest.fixture
def hosts():
    require_netns()
    if shutil.which("openssl") is None or shutil.which("curl") is None:
        pytest.skip("the page's commands need openssl and curl")
    with Network(["server", "client"]) as net:
        yield net


def test_the_deploy_page_serves_clients_on_another_host(hosts: Network, tmp_path: Path) -> None:
    server, client = hosts["server"], hosts["client"]
    server_dir, client_dir = tmp_path / "server", tmp_path / "client"
    server_dir.mkdir()
    client_dir.mkdir()
    env = _env(server.address)
    (certs, tokens, serve, train, checks) = [_script(s, server.address) for _, s in _blocks()]

    _run(server, certs, server_dir, env)
    _run(server, tokens, server_dir, env)
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = server.popen(["bash", "-euo", "pipefail", "-c", serve], cwd=server_dir, env=env,
                            stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 60
    while "aggsrv listening on" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)

    for name in ("ca.pem", "site-1.token", "site-2.token", "admin.token"):  # the page's scp
        shutil.copy(server_dir / name, client_dir / name)
    second = train.replace("site-1", "site-2").replace("--index 0", "--index 1")
    runs = [
        client.popen(["bash", "-euo", "pipefail", "-c", s], cwd=client_dir, env=env,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for s in (train, second)
    ]  # fmt: skip
    for run in runs:
        out, _ = run.communicate(timeout=240)
        assert run.returncode == 0, out + log.read_text()[-3000:]

    said = _run(client, checks, client_dir, env).stdout.splitlines()
    assert "model       version 6 (oldest retained 0)" in said[0], said  # 2 clients x 3 updates
    assert 'aggsrv_updates_total{outcome="applied"} 6.0' in said, said
    version, updates = said[-1].split(" ", 1)  # the status page's /api/status
    assert int(version) == 6 and json.loads(updates.replace("'", '"'))["applied"] == 6, said

    # A client that trusts another CA cannot connect; a forged token is refused at once.
    other_ca = ("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 "
                "-subj /CN=other -keyout other.key -out other.pem")  # fmt: skip
    _run(client, other_ca, client_dir, env)
    wrong_ca = train.replace("--tls-ca ca.pem", "--tls-ca other.pem").replace(
        "--state-dir site-1", "--give-up-after 2"
    )
    done = _run(client, wrong_ca, client_dir, env, check=False)
    assert done.returncode == 3, done.stderr
    assert "failed to connect to all addresses" in done.stderr, done.stderr
    (client_dir / "forged.token").write_text("forged\n")
    forged = train.replace("--token-file site-1.token", "--token-file forged.token")
    done = _run(client, forged.replace("--state-dir site-1", ""), client_dir, env, check=False)
    assert done.returncode == 2 and "UNAUTHENTICATED" in done.stderr, done.stderr

    proc.terminate()
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
