"""The status page's HTTP endpoint (``--dashboard-port``): the page, its script and style, and
``/api/status``, on a thread of its own (stdlib ``http.server``), read-only.

Like the Prometheus endpoint it has no authentication and binds ``dashboard_host`` (default
127.0.0.1): expose it beyond the machine only behind a proxy that authenticates.

Binding loopback keeps other machines out, but not other web sites: a page on an attacker's
domain whose name they then point at 127.0.0.1 (DNS rebinding) makes the operator's browser send
``Host: attacker.example:PORT`` here, and the same-origin policy lets that page read the answer.
So every request's ``Host`` is checked (:class:`HostCheck`) before anything is answered:

- an IP literal (``127.0.0.1``, ``[::1]``, with or without a port) is accepted: rebinding needs
  a host *name* the attacker controls, and a page whose origin is an address can only be one
  served from that address;
- ``localhost`` is accepted when the page listens on loopback (a loopback address, or a wildcard
  address such as 0.0.0.0, which includes it): only a browser that went to ``localhost`` itself
  sends it, and no attacker's page has that origin;
- the name the page binds, when ``dashboard_host`` is a name rather than an address: the operator
  chose it;
- any other name only if the operator lists it in ``dashboard_allowed_hosts``
  (``--dashboard-allowed-host NAME``), e.g. the name a reverse proxy forwards.

Names compare case-insensitively, without the port and without one trailing dot. A missing
``Host`` (HTTP/1.1 requires one), a repeated one, or one that is none of the above in shape is
refused too. The refusal is 421 Misdirected Request, which says exactly this ("this server does
not serve that authority") where 403 would suggest the client lacks a permission; its plain-text
body names the kinds of names served and the option, but not the listed names themselves: the
one party that can read it from a script is the rebinding page. The server's log has the names.

Every response, refusals and errors included, also carries headers that keep other origins from
reading, framing or being told about it (:data:`SECURITY_HEADERS`); none allows cross-origin
access (no ``Access-Control-Allow-*``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import threading
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

log = logging.getLogger(__name__)

_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


# Sent with every response: the page loads its own script and style only; no other origin may
# frame it, embed it as a resource, share its browsing context, or learn its address.
SECURITY_HEADERS = (
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'"),
    ("Cross-Origin-Resource-Policy", "same-origin"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
)

# A host name as a Host header carries it (RFC 1123 labels; "_" as some internal names have),
# lowercased, with an optional trailing dot.
_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*\.?")
_PORT = re.compile(r"[0-9]{1,5}")
_LOGGED_NAMES = 32  # distinct refused Host values warned about; later ones are logged at debug


def host_name_wanted(name: str) -> str | None:
    """None when ``name`` can be an entry of ``dashboard_allowed_hosts``, else what an entry
    must be (for "each entry must be ..., got NAME")."""
    if not name:
        return "a host name, not empty"
    if ":" in name or "/" in name:
        return "a bare host name, without scheme or port (e.g. status.example.org)"
    if len(name) > 254 or not _NAME.fullmatch(name.lower()):
        return "a host name (letters, digits, '-' and '_', dot-separated)"
    return None


def _parse_host(value: str) -> tuple[str, str] | None:
    """A Host header as ("ip", address) or ("name", lowercased name without a trailing dot);
    None when it is malformed (empty, a bad port, an unbracketed IPv6 address, stray bytes)."""
    value = value.strip(" \t")
    if value.startswith("["):  # [IPv6] or [IPv6]:port
        end = value.find("]")
        rest = value[end + 1 :] if end > 0 else ""
        if end < 0 or (rest and not (rest[0] == ":" and _valid_port(rest[1:]))):
            return None
        try:
            return "ip", str(ipaddress.IPv6Address(value[1:end]))
        except ValueError:
            return None
    host, colon, port = value.partition(":")
    if colon and not _valid_port(port):
        return None  # also a second colon: an IPv6 address must be bracketed
    try:
        return "ip", str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    name = host.lower()
    if len(name) > 254 or not _NAME.fullmatch(name):
        return None
    return "name", name.removesuffix(".")


def _valid_port(text: str) -> bool:
    return bool(_PORT.fullmatch(text)) and int(text) <= 65535


def _covers_loopback(bound: str) -> bool:
    """Whether a server bound to ``bound`` answers on loopback (a wildcard address does)."""
    if bound == "" or bound.lower().removesuffix(".") == "localhost":
        return True
    try:
        address = ipaddress.ip_address(bound.strip("[]"))
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


class HostCheck:
    """Which ``Host`` headers the page answers (the rule in this module's docstring)."""

    def __init__(self, bound: str, allowed: Iterable[str] = ()) -> None:
        allowed = list(allowed)
        for name in allowed:
            wanted = host_name_wanted(name)
            if wanted:
                raise ValueError(
                    f"dashboard_allowed_hosts: each entry must be {wanted}, got {name!r}"
                )
        names = {name.lower().removesuffix(".") for name in allowed}
        if _covers_loopback(bound):
            names.add("localhost")
        parsed = _parse_host(bound) if bound else None
        if parsed is not None and parsed[0] == "name":
            names.add(parsed[1])  # the name the operator bound the page to
        self.names = frozenset(names)
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def accepts(self, values: list[str] | None) -> bool:
        """``values``: every Host header of the request (none, or more than one, is refused)."""
        if not values or len(values) != 1:
            return False
        parsed = _parse_host(values[0])
        return parsed is not None and (parsed[0] == "ip" or parsed[1] in self.names)

    def refusal(self) -> bytes:
        """The refused request's body: what is served and where to add a name. The operator's
        own names are counted, not shown (a rebinding page can read this body)."""
        served = ["IP addresses"]
        if "localhost" in self.names:
            served.append("localhost")
        others = len(self.names - {"localhost"})
        if others:
            served.append(f"{others} configured name{'s' if others > 1 else ''}")
        what = ", ".join(served[:-1]) + " and " + served[-1] if len(served) > 1 else served[0]
        return (
            "421 Misdirected Request: this status page does not serve that host name.\n"
            f"It answers {what}. To serve another name (e.g. the one a reverse "
            "proxy forwards), add it to dashboard_allowed_hosts (--dashboard-allowed-host NAME).\n"
        ).encode()

    def log_refusal(self, values: list[str] | None, client: str) -> None:
        """A warning the first time a Host value is refused (for a bounded number of distinct
        values), debug after that, so a page polling every 2 s does not flood the log."""
        shown = "(none)" if not values else ", ".join(repr(v[:100]) for v in values[:3])
        with self._lock:
            first = shown not in self._logged and len(self._logged) < _LOGGED_NAMES
            if first:
                self._logged.add(shown)
        (log.warning if first else log.debug)(
            "dashboard: refused a request from %s with Host %s: the page serves IP addresses "
            "and %s; add the name to dashboard_allowed_hosts (--dashboard-allowed-host) if it "
            "is yours (DNS rebinding if it is not; later refusals of it at debug level)",
            client, shown, ", ".join(sorted(self.names)) or "no names",
        )  # fmt: skip


def _static(name: str) -> bytes:
    return resources.files("aggsrv.server.dashboard").joinpath("static", name).read_bytes()


class DashboardServer:
    """Serves the page and ``document()`` as JSON until :meth:`close`, to requests whose
    ``Host`` is an IP address, ``localhost`` (on loopback), or a name of ``allowed_hosts``."""

    def __init__(
        self,
        host: str,
        port: int,
        document: Callable[[], dict[str, Any]],
        allowed_hosts: Iterable[str] = (),
    ) -> None:
        files = {path: (_static(name), kind) for path, (name, kind) in _STATIC.items()}

        hosts = HostCheck(host, allowed_hosts)
        self.hosts = hosts

        class Handler(BaseHTTPRequestHandler):
            server_version = "aggsrv-dashboard"
            # http.server's own errors (a malformed request, a method it lacks) as plain text.
            error_content_type = "text/plain; charset=utf-8"
            error_message_format = "%(code)d %(message)s\n"
            # A request line too malformed to name a version is answered as HTTP/1.0, with a
            # status line and the headers below, not as a bare HTTP/0.9 body.
            default_request_version = "HTTP/1.0"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._answer(head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                self._answer(head=True)

            def _answer(self, head: bool) -> None:
                values = self.headers.get_all("Host")
                if not hosts.accepts(values):
                    hosts.log_refusal(values, self.client_address[0])
                    body = hosts.refusal()
                    self._send(
                        HTTPStatus.MISDIRECTED_REQUEST, body, "text/plain; charset=utf-8", head
                    )
                    return
                path = self.path.split("?", 1)[0]
                if path == "/api/status":
                    try:
                        body = json.dumps(document(), allow_nan=False).encode()
                    except Exception as exc:  # a bug must not take the page's thread down
                        log.exception("dashboard: the status document failed")
                        self._send(HTTPStatus.INTERNAL_SERVER_ERROR, b"", "text/plain", head)
                        del exc
                        return
                    self._send(HTTPStatus.OK, body, "application/json", head)
                elif path in files:
                    body, kind = files[path]
                    self._send(HTTPStatus.OK, body, kind, head)
                else:
                    self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain", head)

            def _send(self, status: HTTPStatus, body: bytes, kind: str, head: bool) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def send_response_only(self, code: int, message: str | None = None) -> None:
                self._code = code
                super().send_response_only(code, message)

            def end_headers(self) -> None:
                # Here, not in _send, so http.server's own error answers carry them too (an
                # interim 100 Continue has no body to protect).
                if getattr(self, "_code", 200) >= 200:
                    for name, value in SECURITY_HEADERS:
                        self.send_header(name, value)
                super().end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("dashboard: " + format, *args)

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self.port: int = self._http.server_address[1]
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="aggsrv-dashboard", daemon=True
        )
        self._thread.start()
        log.info("status page on http://%s:%d/", host, self.port)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)
