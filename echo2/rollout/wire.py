"""HTTP + JSON between processes: a small threaded server with token auth and size limits, and a client.

Every request carries the run's token (``Authorization: Bearer ...``), compared in constant time. Bodies are
JSON (never pickle) except snapshot uploads, which are raw bytes whose authenticity is checked by the receiver.
A bad request gets a 4xx with ``{"error": ...}``, a log line, and a counter; the server goes on.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import requests

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 64 << 20


class BadRequest(Exception):
    """Raised by a route: the sender gets HTTP 400 with this message."""

    status = 400


class Unauthorized(BadRequest):
    status = 401


Route = Callable[[dict[str, Any] | bytes, dict[str, str]], Any]


class JsonServer:
    """``routes`` maps ``"POST /path"`` to ``fn(body, headers) -> jsonable``; ``raw`` routes get bytes."""

    def __init__(self, host: str, port: int, token: str, routes: dict[str, Route], raw: frozenset[str] = frozenset(),
                 max_bytes: int = MAX_JSON_BYTES, name: str = "server"):
        self.token, self.routes, self.raw, self.max_bytes, self.name = token, routes, raw, max_bytes, name
        self.rejected: Counter = Counter()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                # Headers and body go out as separate writes; with Nagle + delayed ACK each small
                # request would stall ~40 ms (measured: 0.16 s of learner idle per step over loopback).
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, fmt, *args):  # quiet: errors are logged by _handle
                pass

            def do_POST(self):
                server._handle(self, "POST")

            def do_GET(self):
                server._handle(self, "GET")

        self.httpd = _Server((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name=name, daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self.httpd.server_address[:2]

    def url(self, host: str | None = None) -> str:
        h, p = self.address
        return f"http://{host or h}:{p}"

    def start(self) -> "JsonServer":
        self.thread.start()
        return self

    def close(self) -> None:
        if self.thread.is_alive():  # shutdown() waits for serve_forever, which never ran if not started
            self.httpd.shutdown()
        self.httpd.server_close()

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        key = f"{method} {h.path.split('?')[0]}"
        status, payload = 200, None
        try:
            length = int(h.headers.get("Content-Length") or 0)
            if length > self.max_bytes:
                raise BadRequest(f"body of {length} bytes exceeds the {self.max_bytes}-byte limit")
            data = h.rfile.read(length) if length else b""
            auth = h.headers.get("Authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {self.token}".encode()):
                raise Unauthorized("missing or wrong token")
            route = self.routes.get(key)
            if route is None:
                status, payload = 404, {"error": f"no route {key}"}
            else:
                if key in self.raw:
                    body: dict | bytes = data
                else:
                    try:
                        body = json.loads(data or b"{}")
                    except ValueError as e:
                        raise BadRequest(f"malformed JSON: {e}") from None
                    if not isinstance(body, dict):
                        raise BadRequest("JSON body must be an object")
                payload = route(body, dict(h.headers))
        except BadRequest as e:
            status, payload = e.status, {"error": str(e)}
            self.rejected[type(e).__name__] += 1
            log.warning("%s: rejected %s from %s: %s", self.name, key, h.client_address[0], e)
        except Exception as e:  # a bug on our side: tell the sender, keep serving
            status, payload = 500, {"error": f"{type(e).__name__}: {e}"}
            log.exception("%s: error in %s", self.name, key)
        out = json.dumps(payload).encode()
        try:
            h.send_response(status)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(out)))
            h.end_headers()
            h.wfile.write(out)
        except (BrokenPipeError, ConnectionResetError):
            pass


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A peer that vanishes mid-request (a killed worker) is one log line, not a traceback on stderr."""
        import sys

        log.warning("connection from %s dropped: %s", client_address[0], sys.exc_info()[1])


class Client:
    """A persistent-connection client for one server."""

    def __init__(self, base_url: str, token: str, timeout_s: float = 30.0):
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"

    def post(self, path: str, body: dict | None = None, data: bytes | None = None,
             headers: dict | None = None, timeout_s: float | None = None) -> Any:
        r = self.session.post(self.base_url + path, json=body if data is None else None, data=data,
                              headers=headers, timeout=timeout_s or self.timeout_s)
        if r.status_code != 200:
            raise RemoteError(r.status_code, _error_text(r))
        return r.json()

    def close(self) -> None:
        self.session.close()


class RemoteError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def _error_text(r: requests.Response) -> str:
    try:
        return r.json().get("error", r.text)
    except ValueError:
        return r.text[:500]
