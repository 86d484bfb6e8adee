"""The status page's door: it answers only Host names it serves (an attacker's name pointed at
127.0.0.1, DNS rebinding, gets 421 and no status data), and every response carries the headers
that keep other origins from reading or framing it. Real HTTP round trips on loopback."""

from __future__ import annotations

import http.client
import io
import json
import logging
import socket
import tomllib

import pytest

from aggsrv.cli import main
from aggsrv.server.config import ServerConfig
from aggsrv.server.dashboard.web import DashboardServer, HostCheck

MARKER = "status-data-5f1e"  # in every status document here; never in a refusal
LISTED = "Status.Example.ORG"  # the operator's name, in their spelling

DOOR_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


@pytest.fixture(scope="module")
def page():
    server = DashboardServer(
        "127.0.0.1", 0, lambda: {"format": 1, "note": MARKER}, allowed_hosts=[LISTED]
    )
    yield server
    server.close()


def _request(
    port: int, host: str | list[str] | None, path: str = "/api/status", method: str = "GET"
) -> tuple[int, bytes, http.client.HTTPMessage]:
    """One request with exactly the Host header(s) given (None: no Host header at all)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for value in [host] if isinstance(host, str) else host or []:
            conn.putheader("Host", value)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.headers
    finally:
        conn.close()


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _assert_door_headers(headers) -> None:
    for name, value in DOOR_HEADERS.items():
        assert headers.get_all(name) == [value], (name, headers.get_all(name))
    assert not [k for k in headers if k.lower().startswith("access-control-")], dict(headers)


def test_a_rebinding_host_is_refused_without_status_data(page) -> None:
    port = page.port
    for path in ("/api/status", "/", "/dashboard.js", "/nowhere"):
        code, body, headers = _request(port, f"rebind.attacker.example:{port}", path)
        assert code == 421, (path, code)
        assert MARKER.encode() not in body and b"dashboard.js" not in body
        assert headers["Content-Type"].startswith("text/plain")
        text = body.decode()
        # Says what is served and which option adds a name, but does not show the rebinding
        # page (the one reader of this body) the operator's own names.
        assert "dashboard_allowed_hosts" in text and "--dashboard-allowed-host" in text
        assert "IP addresses" in text and "localhost" in text and "1 configured name" in text
        assert LISTED.lower() not in text.lower()
        _assert_door_headers(headers)
    code, body, headers = _request(port, "rebind.attacker.example", method="HEAD")
    assert code == 421 and body == b""
    _assert_door_headers(headers)


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1:{port}", "127.0.0.1", "localhost:{port}", "LocalHost", "localhost.",
     "[::1]:{port}", "[::1]", "10.1.2.3:8080", "[fe80::1%25eth0]:{port}"],
)  # fmt: skip
def test_addresses_and_localhost_are_answered(page, host: str) -> None:
    code, body, headers = _request(page.port, host.format(port=page.port))
    assert code == 200 and json.loads(body)["note"] == MARKER
    _assert_door_headers(headers)


@pytest.mark.parametrize(
    "host", ["status.example.org:{port}", "STATUS.EXAMPLE.ORG", "status.example.org."]
)
def test_a_listed_name_is_answered_in_any_case(page, host: str) -> None:
    code, body, _ = _request(page.port, host.format(port=page.port))
    assert code == 200 and json.loads(body)["note"] == MARKER


@pytest.mark.parametrize(
    "host",
    [None, "", " ", ["127.0.0.1", "127.0.0.1"], ["127.0.0.1", "rebind.attacker.example"],
     "::1", "[::1", "[::1]x", "[::1]:", "[not-an-address]", "127.0.0.1:", "127.0.0.1:99999",
     "127.0.0.1:80:80", "localhost:http", "local host", "localhost/", "user@localhost",
     "status.example.org.evil", "evil.status.example.org", "sub.localhost", "xn--.example..org",
     "127.0.0.1.rebind.attacker.example", "0x7f.0.0.1"],
)  # fmt: skip
def test_a_missing_repeated_or_malformed_host_is_refused(page, host) -> None:
    code, body, headers = _request(page.port, host)
    assert code == 421, host
    assert MARKER.encode() not in body
    _assert_door_headers(headers)


def test_every_response_carries_the_door_headers(page) -> None:
    port = page.port
    host = f"127.0.0.1:{port}"
    for path, want in (("/", 200), ("/index.html", 200), ("/dashboard.css", 200),
                       ("/api/status", 200), ("/etc/passwd", 404)):  # fmt: skip
        code, _, headers = _request(port, host, path)
        assert code == want, path
        _assert_door_headers(headers)
    for method in ("POST", "OPTIONS", "PUT"):  # http.server's own 501, no CORS preflight
        code, _, headers = _request(port, host, method=method)
        assert code == 501, method
        _assert_door_headers(headers)
    # http.server's answers to request lines it cannot parse carry them too.
    for request, want in ((b"GARBAGE\r\n\r\n", b" 400 "), (b"GET / HTTP/1.x\r\n\r\n", b" 400 "),
                          (b"GET / HTTP/9.9\r\nHost: 127.0.0.1\r\n\r\n", b" 505 ")):  # fmt: skip
        head, _, _ = _raw(port, request).partition(b"\r\n\r\n")
        status, *lines = head.decode("latin-1").split("\r\n")
        assert status.startswith("HTTP/1.0") and want.decode() in status + " ", status
        fields = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        _assert_door_headers(http.client.parse_headers(io.BytesIO(fields)))


def test_a_refused_host_is_warned_about_once(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="aggsrv.server.dashboard.web")
    page = DashboardServer("127.0.0.1", 0, lambda: {"note": MARKER}, [LISTED])  # a fresh log
    try:
        _warned_once(page, caplog)
    finally:
        page.close()


def _warned_once(page: DashboardServer, caplog) -> None:

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    for _ in range(5):  # a rebinding page polling
        assert _request(page.port, f"rebind.attacker.example:{page.port}")[0] == 421
    assert len(warnings()) == 1
    assert "rebind.attacker.example" in warnings()[0]
    assert "dashboard_allowed_hosts" in warnings()[0]
    assert "status.example.org" in warnings()[0]  # the operator's log shows the names
    assert _request(page.port, "other.attacker.example")[0] == 421
    assert len(warnings()) == 2
    many = [f"n{i}.attacker.example" for i in range(100)]
    for name in many:
        _request(page.port, name)
    assert len(warnings()) <= 32 + 2  # bounded, however many names are tried


def test_which_names_each_binding_serves() -> None:
    def served(bound: str, host: str, allowed=()) -> bool:
        return HostCheck(bound, allowed).accepts([host])

    assert served("127.0.0.1", "localhost:80") and served("::1", "localhost")
    assert served("0.0.0.0", "localhost") and served("", "localhost") and served("::", "localhost")
    assert not served("192.0.2.7", "localhost")  # not on loopback: not a name it serves
    assert served("192.0.2.7", "192.0.2.7:8080") and served("192.0.2.7", "[::1]")
    assert served("dash.internal", "DASH.internal:9000")  # the name it was bound to
    assert served("localhost", "localhost")
    assert not served("0.0.0.0", "dash.internal")
    assert served("0.0.0.0", "dash.internal", ["dash.internal"])
    assert not HostCheck("127.0.0.1").accepts(None) and not HostCheck("127.0.0.1").accepts([])
    with pytest.raises(ValueError, match="dashboard_allowed_hosts"):
        HostCheck("127.0.0.1", ["dash.internal:8080"])


# ------------------------------------------------------------------ the option, TOML and CLI


def test_the_option_loads_from_toml_and_is_checked(tmp_path) -> None:
    path = tmp_path / "server.toml"
    path.write_text('auth = "none"\ndashboard_allowed_hosts = ["status.example.org", "b.lan"]\n')
    assert ServerConfig.load(path).dashboard_allowed_hosts == ["status.example.org", "b.lan"]
    assert ServerConfig().dashboard_allowed_hosts == []
    for bad in ("status.example.org:8080", "http://status.example.org", "", "a b", "a..b"):
        with pytest.raises(ValueError, match="dashboard_allowed_hosts"):
            ServerConfig(auth="none", dashboard_allowed_hosts=[bad])
    with pytest.raises(ValueError, match="dashboard_allowed_hosts"):
        ServerConfig(auth="none", dashboard_allowed_hosts="status.example.org")


def test_the_cli_flag_reaches_the_printed_config(capsys, tmp_path) -> None:
    def printed(*argv: str) -> dict:
        assert main(["serve", "--auth", "none", *argv, "--print-config"]) == 0
        return tomllib.loads(capsys.readouterr().out)

    assert printed()["dashboard_allowed_hosts"] == []
    flags = [
        "--dashboard-allowed-host",
        "a.example",
        "--dashboard-allowed-host",
        "b.example, c.lan",
    ]
    hosts = printed(*flags)["dashboard_allowed_hosts"]
    assert hosts == ["a.example", "b.example", "c.lan"]
    path = tmp_path / "server.toml"
    path.write_text('dashboard_allowed_hosts = ["from.toml"]\n')
    assert printed("--config", str(path))["dashboard_allowed_hosts"] == ["from.toml"]
    flagged = printed("--config", str(path), "--dashboard-allowed-host", "x.example")
    assert flagged["dashboard_allowed_hosts"] == ["x.example"]  # the flag's list replaces it
    assert main(["serve", "--auth", "none", "--dashboard-allowed-host", "a:80"]) == 2
    assert "dashboard_allowed_hosts" in capsys.readouterr().err


def test_the_server_hands_the_option_to_its_page() -> None:
    from server_helpers import RunningServer

    srv = RunningServer(dashboard_port=0, dashboard_allowed_hosts=["status.example.org"])
    try:
        port = srv.server.dashboard_port
        code, body, _ = _request(port, f"status.example.org:{port}")
        assert code == 200 and json.loads(body)["format"] == 1
        assert _request(port, f"rebind.attacker.example:{port}")[0] == 421
        assert _request(port, f"localhost:{port}")[0] == 200
    finally:
        srv.stop()
