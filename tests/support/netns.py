"""Hosts on a private network for tests: Linux network namespaces joined by one bridge
(tests/ is not a package: `from netns import Network`).

Each host is a namespace with ``lo`` up and one veth (``eth0``) whose peer is a port of a bridge
that lives in a namespace of its own, so nothing is added to the machine's own namespace and
deleting the namespaces removes every link. A host has an address in 10.231.0.0/24 and no other
route: its traffic can reach only its own loopback and the other hosts of the same network,
never another address. Parallel pytest-xdist workers never collide: every name carries the pid
of the process that made it (interface names are per namespace, so they need no prefix), and
each network has its own bridge, so equal addresses in two workers' networks never meet.

Needs root and `ip` (iproute2); :func:`require_netns` skips the test otherwise. Namespaces left
behind by a process that died (its pid gone) are removed when the next network is made.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = ["Host", "Network", "require_netns"]

PREFIX = "aggsrv-t"  # every namespace these helpers make is named PREFIX<pid>-<n>-<role>
SUBNET = "10.231.0"  # /24; hosts get .2, .3, ... in the order they are named
IFNAME = "eth0"  # each host's link to the bridge
_serial = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_inside(netns: str) -> None:
    """SIGKILL every process still running in ``netns`` (all of them started by these helpers:
    nothing else enters their namespaces), so that deleting it frees the namespace itself."""
    out = _ip("netns", "pids", netns, check=False).stdout
    for pid in out.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove_stale() -> list[str]:
    """Delete the namespaces of these helpers whose making process no longer runs (a test
    process killed before its cleanup), with whatever still runs inside them."""
    removed = []
    for name in _namespaces():
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            _kill_inside(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


def require_netns() -> None:
    """Skip the calling test unless network namespaces can be made here (root and iproute2)."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        pytest.skip("network namespaces need Linux")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (`ip netns add` as a normal user is refused)")
    if shutil.which("ip") is None:
        pytest.skip("network namespaces need `ip` (iproute2), which is not installed")
    probe = f"{PREFIX}{os.getpid()}-probe{next(_serial)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        pytest.skip(f"`ip netns add` is refused here: {made.stderr.strip()}")
    try:
        for link in (
            ["br0", "type", "bridge"],
            ["probe0", "type", "veth", "peer", "name", "probe1"],
        ):
            made = _ip("-n", probe, "link", "add", *link, check=False)
            if made.returncode != 0:
                pytest.skip(f"`ip link add {' '.join(link)}` is refused: {made.stderr.strip()}")
    finally:
        _ip("netns", "del", probe, check=False)


@dataclass
class Host:
    """One host: its namespace and its address on the network."""

    role: str
    netns: str
    address: str
    processes: list[subprocess.Popen] = field(default_factory=list)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside this host (`ip netns exec`); stopped when the network goes."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], **kwargs)
        self.processes.append(proc)
        return proc

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        """Run ``argv`` inside this host to its end (checked)."""
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], capture_output=True,
                              text=True, check=True, timeout=60)  # fmt: skip

    def link_bytes(self) -> tuple[int, int]:
        """(bytes received, bytes sent) by this host's link so far, Ethernet frames whole."""
        out = _ip("-n", self.netns, "-j", "-s", "link", "show", "dev", IFNAME).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def refuse_route_to(self, other: Host) -> None:
        """Make ``other`` unreachable from this host (a `prohibit` route: connects fail at
        once with EACCES, nothing leaves this host for it)."""
        _ip("-n", self.netns, "route", "add", "prohibit", f"{other.address}/32")


class Network:
    """Hosts (namespaces) on one bridge; a context manager that removes them all at its end,
    after killing any process still running inside them.

    ``with Network(["shard0", "shard1", "client"]) as net: net["shard0"].address``
    """

    def __init__(self, roles: Sequence[str]) -> None:
        if len(set(roles)) != len(roles) or not 0 < len(roles) <= 200:
            raise ValueError(f"roles must be distinct, 1 to 200 of them: {roles}")
        self.prefix = f"{PREFIX}{os.getpid()}-{next(_serial)}"
        self.bridge_netns = f"{self.prefix}-net"
        self.hosts = {
            role: Host(role, f"{self.prefix}-{role}", f"{SUBNET}.{i + 2}")
            for i, role in enumerate(roles)
        }

    def __getitem__(self, role: str) -> Host:
        return self.hosts[role]

    def __enter__(self) -> Network:
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        net = self.bridge_netns
        _ip("netns", "add", net)
        _ip("-n", net, "link", "set", "lo", "up")
        _ip("-n", net, "link", "add", "br0", "type", "bridge")
        _ip("-n", net, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts.values()):
            port = f"port{i}"
            _ip("netns", "add", host.netns)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            # Made in the bridge's namespace with its peer straight in the host's: no link
            # ever appears in the machine's own namespace.
            _ip("-n", net, "link", "add", port, "type", "veth", "peer", "name", IFNAME,
                "netns", host.netns)  # fmt: skip
            _ip("-n", net, "link", "set", port, "master", "br0")
            _ip("-n", net, "link", "set", port, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", IFNAME)
            _ip("-n", host.netns, "link", "set", IFNAME, "up")

    def close(self) -> None:
        """Kill what still runs in the hosts, then delete every namespace of this network."""
        for host in self.hosts.values():
            for proc in host.processes:
                if proc.poll() is None:
                    proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=10)
        mine = set(_namespaces())
        for name in [h.netns for h in self.hosts.values()] + [self.bridge_netns]:
            if name in mine:
                _kill_inside(name)  # what the processes above started in turn
                _ip("netns", "del", name, check=False)
