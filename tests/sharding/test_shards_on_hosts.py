"""A sharded federation on separate network hosts (docs/sharding.md "The server processes"):
two `aggsrv serve --shards 2` processes (a state directory each) and one client process, each in
a network namespace of its own with its own address on a private bridge
(tests/support/netns.py), TLS and token auth on, nothing on loopback between them.

The clients push DELTAs to FedBuff with a buffer of all of them, so the joined model is known
exactly: the initial model plus the deltas' sum / K, in float64 rounded once to float32 (as
FedBuff's flush computes), with deltas whose sums are exact (one-hot, or dense multiples of
1/1024). They stream to both shards, or, from a host with no route to shard 1, through rank 0's
relay. Rank 0's status then shows both shards reachable over their TLS.

The hosts' links count every byte of every Ethernet frame; the bytes each shard's link takes
while the updates are pushed are compared with docs/sharding.md's scaling model (bytes in per
update: 4D/N + a header of about 200 B).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from netns import Host, Network, require_netns
from tls_helpers import make_pki

from aggsrv.sharding import ShardMap

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
GRPC_PORT = 50051  # every host has its own ports: fixed numbers never collide
DIST_PORT = 29500
CLIENTS = 8  # FedBuff's buffer: the 8th update flushes all 8 (a power of two: value / K exact)
# D = 1,000,003 (odd) in two tensors; the cut between the shards falls inside the first.
SHAPES = [("body.weight", (999, 1001)), ("head.bias", (4,))]
D = 999 * 1001 + 4

# The figures docs/sharding.md gives per shard and update: 4D/N + a header of about 200 B.
MODEL_HEADER_BYTES = 200
# What the link adds on top of the slice's 4 n bytes (measured on veth here: about 0.25%, i.e.
# Ethernet/IP/TCP headers once per offloaded 64 KiB segment, TLS records of 16 KiB, HTTP/2
# frames, the chunks' protobuf framing): a relative bound of 5% also holds without segmentation
# offload (a 1,448-byte TCP payload per 1,514-byte frame is 4.6%)...
RELATIVE_OVERHEAD = 0.05
# ... plus a fixed part per update: the call's HTTP/2 headers (path, bearer token), the
# UpdateHeader and the answer's ACKs, the shards' vote and comparison, rank 0's broadcast of the
# call's header (measured here: about 1-2 KB).
FIXED_OVERHEAD_BYTES = 8192


@dataclass
class Federation:
    """Two shard hosts and a client host, the shards' processes started on them."""

    net: Network
    shards: list[subprocess.Popen]
    logs: list[Path]
    ca: str
    tokens: dict[str, str]

    def log_tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.logs)


@pytest.fixture
def network():
    require_netns()
    with Network(["rank0", "rank1", "client"]) as net:
        yield net


def _issue_tokens(secret: Path, client_ids: list[str]) -> dict[str, str]:
    """Client tokens from `aggsrv token` (a new secret that the shards then share)."""
    out = subprocess.run(
        [PYTHON, "-m", "aggsrv.cli", "token", "--secret-file", str(secret), "--new-secret",
         *client_ids],
        capture_output=True, text=True, check=True, cwd=REPO, timeout=60,
    ).stdout  # fmt: skip
    tokens = dict(line.split(maxsplit=1) for line in out.splitlines() if line.strip())
    assert sorted(tokens) == sorted(client_ids), out
    return tokens


def _start_shards(net: Network, tmp_path: Path, gloo_ifname: str | None) -> Federation:
    """The two shards, with ``GLOO_SOCKET_IFNAME`` set to ``gloo_ifname`` (None: unset)."""
    hosts = [net["rank0"], net["rank1"]]
    pki = make_pki(tmp_path / "pki", server_ips=[h.address for h in hosts])
    secret = tmp_path / "auth" / "secret"
    secret.parent.mkdir(mode=0o700)
    tokens = _issue_tokens(secret, [f"c{k}" for k in range(CLIENTS)])
    settings = tmp_path / "shard.toml"
    settings.write_text(
        "rate_limit_per_second = 0.0\n"
        "shard_timeout_seconds = 20.0\n"
        "[strategy_config]\n"
        f"buffer_size = {CLIENTS}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    if gloo_ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = gloo_ifname
    shards, logs = [], []
    for rank, host in enumerate(hosts):
        argv = [
            PYTHON, "-m", "aggsrv.cli", "serve", "--shards", "2", "--rank", str(rank),
            "--dist-url", f"tcp://{hosts[0].address}:{DIST_PORT}",
            "--host", host.address, "--port", str(GRPC_PORT),
            "--shard-address", f"{host.address}:{GRPC_PORT}",
            "--state-dir", str(tmp_path / f"state{rank}"),
            "--auth", "hmac", "--auth-secret-file", str(secret),
            "--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key"),
            "--strategy", "fedbuff", "--device", "cpu", "--config", str(settings),
        ]  # fmt: skip
        logs.append(tmp_path / f"rank{rank}.log")
        with open(logs[-1], "w") as log:
            shards.append(
                host.popen(argv, stdout=subprocess.DEVNULL, stderr=log, cwd=REPO, env=env)
            )
    return Federation(net, shards, logs, pki.path("ca.pem"), tokens)


def _wait_listening(fed: Federation, limit: float = 40.0) -> None:
    """Until every shard has logged that it listens (after the group formed), or one exits."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for proc in fed.shards:
            if proc.poll() is not None:
                raise AssertionError(f"a shard exited with {proc.returncode}:\n{fed.log_tails()}")
        if all("aggsrv listening on" in p.read_text() for p in fed.logs):
            return
        time.sleep(0.1)
    raise AssertionError(f"the shards were not listening after {limit} s:\n{fed.log_tails()}")


class HostsClient:
    """tests/sharding/hosts_client.py on the client host, driven step by step."""

    def __init__(self, host: Host, spec: dict, tmp_path: Path) -> None:
        spec_path = tmp_path / "client.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path = tmp_path / "client.log"
        with open(self.log_path, "w") as log:
            self.proc = host.popen(
                [PYTHON, str(Path(__file__).with_name("hosts_client.py")), str(spec_path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
            )  # fmt: skip

    def expect(self, name: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=10)
            raise AssertionError(
                f"the client exited ({self.proc.returncode}) before {name}:\n"
                + self.log_path.read_text()[-4000:]
            )
        said = json.loads(line)
        assert said["step"] == name, said
        return said

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()


def _link_bytes(hosts: list[Host]) -> list[tuple[int, int]]:
    return [h.link_bytes() for h in hosts]


def _deltas(gen: torch.Generator, one_hot: bool) -> torch.Tensor:
    """K deltas whose FedBuff flush is known exactly. One-hot: a random value at a coordinate of
    each client's own, two of them beside the shards' cut. Dense: every element a nonzero
    multiple of 1/1024 in [-1, 1], so every sum of them in float64 is exact."""
    if not one_hot:
        magnitudes = torch.randint(1, 1025, (CLIENTS, D), generator=gen).float() / 1024
        signs = torch.randint(0, 2, (CLIENTS, D), generator=gen).float() * 2 - 1
        return magnitudes * signs
    cut = ShardMap.even(D, 2).bounds[1]
    coords = [cut - 1, cut, *random.sample(range(D), 3 * CLIENTS)]
    coords = list(dict.fromkeys(coords))[:CLIENTS]
    deltas = torch.zeros(CLIENTS, D)
    deltas[torch.arange(CLIENTS), torch.tensor(coords)] = torch.randn(CLIENTS, generator=gen)
    return deltas


def _push_deltas(
    net: Network, fed: Federation, tmp_path: Path, *, direct: bool, one_hot: bool
) -> list[tuple[float, float]]:
    """K clients on the client host each push a DELTA (:func:`_deltas`), to every shard
    (``direct``) or to rank 0 only; checks the outcomes and the joined model exactly. Per shard,
    the (bytes in, bytes out) of its link per update while the updates were pushed."""
    shard_hosts = [net["rank0"], net["rank1"]]
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    initial = torch.randn(D, generator=gen)
    deltas = _deltas(gen, one_hot)
    torch.save(initial, tmp_path / "initial.pt")
    torch.save(deltas, tmp_path / "deltas.pt")
    spec = {
        "address": f"{shard_hosts[0].address}:{GRPC_PORT}",
        "direct": direct,
        "ca": fed.ca,
        "tokens": fed.tokens,
        "shapes": SHAPES,
        "initial": str(tmp_path / "initial.pt"),
        "deltas": str(tmp_path / "deltas.pt"),
        "model_out": str(tmp_path / "model.pt"),
    }
    client = HostsClient(net["client"], spec, tmp_path)

    jobs = client.expect("jobs")
    assert jobs["bounds"] == (list(ShardMap.even(D, 2).bounds) if direct else None)
    assert jobs["base_versions"] == [0] * CLIENTS and jobs["weights_equal"]
    before = _link_bytes(shard_hosts)
    client.go()
    pushed = client.expect("pushed")
    after = _link_bytes(shard_hosts)
    client.go()
    assert pushed["outcomes"] == [["BUFFERED", 0]] * (CLIENTS - 1) + [["APPLIED", 1]]
    said = client.expect("model")
    assert said["version"] == 1
    addresses = [f"{h.address}:{GRPC_PORT}" for h in shard_hosts]
    assert said["shards"] == [[a, True, ""] for a in addresses], said["shards"]
    client.go()
    assert client.proc.wait(timeout=30) == 0

    # FedBuff's flush: x + (server_lr / M) * sum, in float64, rounded once to float32.
    expected = (initial.double() + deltas.double().sum(0) / CLIENTS).float()
    model = torch.load(tmp_path / "model.pt")
    assert torch.equal(model, expected), (model - expected).abs().max()
    return [
        ((rx1 - rx0) / CLIENTS, (tx1 - tx0) / CLIENTS)
        for (rx0, tx0), (rx1, tx1) in zip(before, after, strict=True)
    ]


def _within(measured: float, payload: int) -> bool:
    """At least the payload, at most the payload plus the stated overheads."""
    return payload <= measured <= payload * (1 + RELATIVE_OVERHEAD) + FIXED_OVERHEAD_BYTES


def _report(rank: int, measured_in: float, measured_out: float, payload_in: int) -> None:
    print(
        f"shard {rank}: per update in {measured_in:,.0f} B (payload {payload_in:,} B, "
        f"+{measured_in - payload_in:,.0f} B = {100 * (measured_in / payload_in - 1):.2f}%), "
        f"out {measured_out:,.0f} B"
    )


def test_sharded_federation_on_three_hosts_joins_the_exact_model(
    network: Network, tmp_path: Path
) -> None:
    """Shards on 10.231.0.2 and .3, the clients on .4: TLS, tokens, a state directory per shard,
    FedBuff over K one-hot deltas; the joined model is exact and each shard's link took 4D/N
    plus little per update."""
    # What an operator runs: no GLOO_SOCKET_IFNAME (the host name resolves to 127.0.0.1 here);
    # each shard finds the interface that routes to rank 0's --dist-url host.
    fed = _start_shards(network, tmp_path, gloo_ifname=None)
    _wait_listening(fed)
    measured = _push_deltas(network, fed, tmp_path, direct=True, one_hot=True)
    shard_map = ShardMap.even(D, 2)
    print(f"docs/sharding.md's 4D/N + 200 B: {4 * D / 2 + MODEL_HEADER_BYTES:,.0f} B")
    for rank, (rx, tx) in enumerate(measured):
        slice_bytes = 4 * shard_map.local_numel(rank)
        _report(rank, rx, tx, slice_bytes)
        # The slice crossed this shard's link once (not the whole update, not twice) ...
        assert _within(rx, slice_bytes), (rank, rx, slice_bytes)
        # ... and little went back: an answer, acknowledgements, the shards' collectives.
        assert _within(tx, 0), (rank, tx)


def test_a_client_that_reaches_rank0_only_goes_through_its_relay(
    network: Network, tmp_path: Path
) -> None:
    """The client host has no route to shard 1 (a prohibit route): with
    ``direct_to_shards=False`` rank 0 takes each whole update and forwards shard 1's slice, and
    the joined model is exact. Rank 0's link takes 4D in and 4D/N out per update. The deltas are
    dense: rank 0 forwards a slice in its smallest encoding, so one-hot ones would travel sparse
    (a few bytes) from rank 0 to shard 1."""
    client_host, rank1 = network["client"], network["rank1"]
    client_host.refuse_route_to(rank1)
    probe = client_host.run(PYTHON, "-c", _CONNECT, rank1.address, str(GRPC_PORT), "1")
    assert probe.stdout.strip() == "EACCES"
    fed = _start_shards(network, tmp_path, gloo_ifname="eth0")  # the operator's choice holds
    _wait_listening(fed)
    measured = _push_deltas(network, fed, tmp_path, direct=False, one_hot=False)
    slice1 = 4 * ShardMap.even(D, 2).local_numel(1)
    (rx0, tx0), (rx1, tx1) = measured
    _report(0, rx0, tx0, 4 * D)
    _report(1, rx1, tx1, slice1)
    assert _within(rx0, 4 * D), rx0  # the whole update, once
    assert _within(tx0, slice1), tx0  # shard 1's slice, forwarded once
    assert _within(rx1, slice1), rx1
    assert _within(tx1, 0), tx1


_CONNECT = """
import errno, socket, sys, time
address, port, tries = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for attempt in range(tries):  # a listener that is not up yet refuses: try again
    try:
        with socket.create_connection((address, port), timeout=2) as s:
            print(s.recv(2).decode() or "ok")
            break
    except OSError as exc:
        if exc.errno != errno.ECONNREFUSED or attempt == tries - 1:
            print(errno.errorcode.get(exc.errno, str(exc)))
            break
        time.sleep(0.05)
"""


def test_hosts_reach_each_other_and_nothing_else(network: Network) -> None:
    """The helper's promise: a host reaches the other hosts of its network; any other address
    is unreachable from it (no route), and the machine's own namespace gains no link."""

    def root_links() -> set[str]:
        out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True)
        return {link["ifname"] for link in json.loads(out.stdout)}

    server, client = network["rank0"], network["client"]
    listener = server.popen(
        [PYTHON, "-c", "import socket, sys; s = socket.create_server((sys.argv[1], 7000)); "
         "c, _ = s.accept(); c.sendall(b'ok')", server.address],
    )  # fmt: skip
    said = client.run(PYTHON, "-c", _CONNECT, server.address, "7000", "100").stdout
    assert said.strip() == "ok"
    said = client.run(PYTHON, "-c", _CONNECT, "192.0.2.1", "9", "1").stdout  # TEST-NET-1
    assert said.strip() == "ENETUNREACH"
    assert listener.wait(timeout=10) == 0
    before = root_links()
    with Network(["a"]) as other:  # a second network beside the first, its links its own
        assert other["a"].netns not in {h.netns for h in network.hosts.values()}
        assert other["a"].address == network["rank0"].address  # on a bridge of its own
        assert root_links() == before
