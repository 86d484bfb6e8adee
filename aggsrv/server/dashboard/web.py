"""The status page's HTTP endpoint (``--dashboard-port``): the page, its script and style, and
``/api/status``, on a thread of its own (stdlib ``http.server``), read-only.

Like the Prometheus endpoint it has no authentication and binds ``dashboard_host`` (default
127.0.0.1): expose it beyond the machine only behind a proxy that authenticates.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
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


def _static(name: str) -> bytes:
    return resources.files("aggsrv.server.dashboard").joinpath("static", name).read_bytes()


class DashboardServer:
    """Serves the page and ``document()`` as JSON until :meth:`close`."""

    def __init__(self, host: str, port: int, document: Callable[[], dict[str, Any]]) -> None:
        files = {path: (_static(name), kind) for path, (name, kind) in _STATIC.items()}

        class Handler(BaseHTTPRequestHandler):
            server_version = "aggsrv-dashboard"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._answer(head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                self._answer(head=True)

            def _answer(self, head: bool) -> None:
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
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                # The page loads its own script and style only, and no page may frame it.
                self.send_header(
                    "Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'"
                )
                self.end_headers()
                if not head:
                    self.wfile.write(body)

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
