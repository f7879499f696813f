"""HTTP + JSON for every server and client of the run, judged on the headers before a byte of the body is read.

Every request carries one credential (``Authorization: Bearer ...``; two are refused), compared in constant time
and checked on the headers, before a byte of the body is read; who it names is established there, once, and handed
to the route (``RequestHeaders.identity``), never parsed again. Bodies are JSON (never pickle), optionally validated by a pydantic
schema per route, except snapshot uploads, which are raw bytes whose authenticity is checked by the receiver. A bad
request gets a 4xx with ``{"error": ...}``, a log line, and a counter; the server goes on. Servers (JsonServer)
run on uvicorn's HTTP protocol with timeouts and a connection cap (echo2/net/httpd.py: a port strangers can reach);
clients (Client) are requests sessions that keep their connection alive. Off loopback both speak TLS pinned to
the run's CA (echo2/net/tls.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import ssl
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import pydantic
import requests
from starlette.datastructures import Headers

from echo2.net.httpd import BackgroundServer, HandlerPool, Limits

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 64 << 20
REJECT_LOG_PERIOD_S = 10.0
WILDCARDS = ("0.0.0.0", "::", "")


def reachable_host(host: str) -> str:
    """The name others reach a server at: this machine's name for a wildcard bind, else the host as given."""
    return socket.getfqdn() if host in WILDCARDS else host


class BadRequest(Exception):
    """Raised by a route: the sender gets HTTP 400 with this message."""

    status = 400


class Unauthorized(BadRequest):
    status = 401


class Revoked(Unauthorized):
    """A worker credential revoked during the run (counted apart from wrong credentials)."""

    status = 403


Route = Callable[[Any, Mapping[str, str]], Any]  # (dict, a schema's model, or bytes for a raw route; headers)


class NotFound(BadRequest):
    status = 404


class LengthRequired(BadRequest):
    status = 411


class TooLarge(BadRequest):
    status = 413


class TooManyRequests(BadRequest):
    status = 429


class Unavailable(BadRequest):
    status = 503


class RequestHeaders(Headers):
    """A request's headers (read-only, lookups ignore case) and what its admission established: ``identity``, what
    ``authorize`` returned for its one credential (None on a public route), and ``client``, the sender's address."""

    def __init__(self, raw: list[tuple[bytes, bytes]], identity: Any = None, client: str = "?"):
        super().__init__(raw=raw)
        self.identity, self.client = identity, client


class JsonServer:
    """``routes`` maps ``"POST /path"`` to ``fn(body, headers) -> jsonable``; ``raw`` routes get bytes.

    A request is judged on its headers before a byte of its body is read: its one credential (two Authorization
    headers: 400; ``authorize``, which runs on the server's event loop, so it must be quick and never wait on a lock
    a route holds, returns who it names: the route gets that as ``headers.identity``, and an identity with a
    ``connection_key`` has the connection counted under it, httpd.Limits.max_connections_per_principal), the route,
    the declared length (over the route's limit: 413; a POST with neither Content-Length nor chunked encoding: 411;
    any body on a public route or a GET: 400); a refusal there is answered at once and the connection closed, its
    body unread. Then the body is read (a
    chunked one is cut off at the limit; a stalled one dropped, see httpd.Limits) and the route runs in a handler
    thread, never on the event loop. A BadRequest is its status with ``{"error": ...}``, any other exception a
    500; the server goes on. ``headers`` is a read-only mapping whose lookups ignore case.

    ``schemas``: optional ``{route: pydantic model}``; such a route's JSON body is parsed and validated by it (a
    violation is a 400 naming each bad field) and the route gets the model instance, not a dict; a route may
    return a model too. ``route_max_bytes``: per-route body limits, ``max_bytes`` for the others. ``limits``:
    timeouts and caps per connection (httpd.Limits). ``rejected`` counts refusals by kind: a BadRequest
    subclass's name, or what the connection layer refused (TooManyConnections, TooManyFromAddress,
    TooManyForCredential, AnonymousCut, HeaderTimeout, BodyTimeout, HeadersTooLarge, MalformedRequest)."""

    def __init__(self, host: str, port: int, token: str, routes: dict[str, Route], raw: frozenset[str] = frozenset(),
                 max_bytes: int = MAX_JSON_BYTES, name: str = "server", tls: ssl.SSLContext | None = None,
                 public: frozenset[str] = frozenset(), authorize: Callable[[str, str], Any] | None = None,
                 schemas: dict[str, type[pydantic.BaseModel]] | None = None,
                 route_max_bytes: dict[str, int] | None = None, limits: Limits | None = None,
                 principal_body_bytes: int | None = None):
        """``tls``: serve HTTPS with this context. ``public``: routes answered without a credential (and without a
        body). ``authorize(route, credential)``: raises Unauthorized, or returns the caller's identity; default: the
        credential must be ``token``. ``principal_body_bytes``: the most body bytes the requests of one principal (an
        identity's ``connection_key``: a worker credential) may hold at once, from admission until answered, counted
        by their declared length (a chunked body: its route's limit); past it a request is refused unread (503: a
        worker tries again later, as when the server is busy): each body is bounded by its route's limit, and this
        bounds their sum over a credential's many connections."""
        self.principal_body_bytes, self.body_bytes_held = principal_body_bytes, Counter()  # on the loop's thread
        self.token, self.routes, self.raw, self.max_bytes, self.name = token, routes, raw, max_bytes, name
        self.tls, self.public, self.authorize = tls, public, authorize or self._token_only
        self.schemas, self.route_max_bytes = dict(schemas or {}), dict(route_max_bytes or {})
        self.limits = limits or Limits()
        self.rejected: Counter = Counter()  # written on the event loop's thread only
        self.logged: dict[str, float] = {}  # kind of refusal -> when it was last logged (monotonic s)
        self.logged_count: dict[str, int] = {}  # kind -> rejected[kind] when it was last logged
        self.pool = HandlerPool(name, self.limits.max_threads)
        self.server = BackgroundServer(self._asgi, host, port, name, self.limits, tls, self._reject)

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def url(self, host: str | None = None) -> str:
        h, p = self.address
        return f"{'https' if self.tls else 'http'}://{host or h}:{p}"

    def start(self) -> "JsonServer":
        self.server.start()
        return self

    def close(self) -> None:
        """Stop accepting, close kept-alive connections, let responses in progress finish (httpd.Limits
        .close_grace_s), then drop what is left; handler threads end when their route returns."""
        self.server.close()
        self.pool.close()

    def _token_only(self, _route: str, credential: str) -> str:
        if not hmac.compare_digest(credential.encode(), self.token.encode()):
            raise Unauthorized("missing or wrong token")
        return "token"

    def _reject(self, kind: str, client: str, what: str = "the connection", why: str = "") -> None:
        """Count a refusal made on the event loop (before any route ran) and log it, at most one line per kind per
        REJECT_LOG_PERIOD_S: a stranger's flood of bad connections must not become a flood of log lines."""
        self.rejected[kind] += 1
        now = time.monotonic()
        if now - self.logged.get(kind, -REJECT_LOG_PERIOD_S) >= REJECT_LOG_PERIOD_S:
            since = self.rejected[kind] - self.logged_count.get(kind, 0)
            more = f" ({since} of this kind since the last line)" if since > 1 else ""
            log.warning("%s: rejected %s from %s: %s%s", self.name, what, client, why or kind, more)
            self.logged[kind], self.logged_count[kind] = now, self.rejected[kind]

    async def _asgi(self, scope: dict, receive: Callable, send: Callable) -> None:
        """One request, on the event loop: judged on its headers, body read, route run in a handler thread."""
        if scope["type"] != "http":
            return
        key = f"{scope['method']} {scope['path']}"
        client = scope["client"][0] if scope.get("client") else "?"
        held = None  # (principal, bytes) this request holds of its principal's body budget
        try:
            try:
                route, limit, identity = self._admit(key, scope["method"], scope["headers"])
                principal = getattr(identity, "connection_key", None)
                if key not in self.public and "echo2.admitted" in scope:  # the connection holds an authenticated slot
                    refusal = scope["echo2.admitted"](principal)
                    if refusal is not None:
                        raise Unavailable(f"{refusal}: this credential holds too many connections")
                if principal is not None and self.principal_body_bytes is not None and limit:
                    if self.body_bytes_held[principal] + limit > self.principal_body_bytes:
                        raise Unavailable(f"this credential's requests already hold "
                                          f"{self.body_bytes_held[principal]} body bytes (at most "
                                          f"{self.principal_body_bytes} at once)")
                    self.body_bytes_held[principal] += limit
                    held = principal, limit
                data = await _read_body(receive, limit)
            except BadRequest as e:  # the body is (partly) unread: answer and close rather than read on
                self._reject(type(e).__name__, client, key, str(e))
                await _respond(send, e.status, json.dumps({"error": str(e)}).encode(), close=True)
                return
            except Exception as e:  # a bug in ``authorize``: tell the sender, keep serving
                log.exception("%s: error admitting %s", self.name, key)
                await _respond(send, 500, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode(), close=True)
                return
            if data is None:  # the client went away (or was dropped by the body timeout)
                return
            await self._answer(key, route, data, scope, identity, client, send)
        finally:
            if held is not None:
                self.body_bytes_held[held[0]] -= held[1]
                if not self.body_bytes_held[held[0]]:
                    del self.body_bytes_held[held[0]]

    async def _answer(self, key: str, route: Route, data: bytes, scope: dict, identity: Any, client: str,
                      send: Callable) -> None:
        """Run the route in a handler thread and send its answer."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def job() -> None:
            result = self._handle(key, route, data, RequestHeaders(scope["headers"], identity, client), client)
            try:
                loop.call_soon_threadsafe(_settle, done, result)
            except RuntimeError:  # the server closed while the route ran: nobody waits for its answer
                pass

        self.pool.submit(job)
        try:
            status, out, refusal = await done
        except asyncio.CancelledError:  # close(): the connection is already dropped
            return
        if refusal is not None:
            self.rejected[refusal] += 1
        await _respond(send, status, out)

    def _admit(self, key: str, method: str, headers: list[tuple[bytes, bytes]]) -> tuple[Route, int, Any]:
        """What is decided on the headers alone: the credential, the route and the declared length. Returns the
        route, the most body bytes to read and the caller's identity (what ``authorize`` returned; None on a public
        route). Identity is established here only: a request carrying two credentials is refused, not read one way
        here and another way in the route."""
        auth: list[str] = []
        length = chunked = None
        for name, value in headers:
            if name == b"authorization":
                auth.append(value.decode("latin-1"))
            elif name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                chunked = value
        if len(auth) > 1:
            raise BadRequest(f"{len(auth)} Authorization headers: a request carries one credential")
        identity = None
        if key not in self.public:
            credential = auth[0].removeprefix("Bearer ") if auth and auth[0].startswith("Bearer ") else ""
            identity = self.authorize(key, credential)
        route = self.routes.get(key)
        if route is None:
            raise NotFound(f"no route {key}")
        declared = int(length) if length is not None else 0  # the HTTP parser refused a negative one (400) already
        if key in self.public or method in ("GET", "HEAD"):  # no body: none is read, parsed or held
            if declared or chunked is not None:
                raise BadRequest(f"{key} takes no body")
            return route, 0, identity
        limit = self.route_max_bytes.get(key, self.max_bytes)
        if length is not None:
            if declared > limit:
                raise TooLarge(f"body of {declared} bytes exceeds the {limit}-byte limit")
            return route, declared, identity  # the HTTP parser reads no more than the declared length
        if chunked is None and method == "POST":
            raise LengthRequired("a POST needs Content-Length (or chunked encoding)")
        return route, limit, identity

    def _handle(self, key: str, route: Route, data: bytes, headers: RequestHeaders,
                client: str) -> tuple[int, bytes, str | None]:
        """In a handler thread: decode, run the route, encode. Returns (status, JSON bytes, kind of refusal)."""
        try:
            body = data if key in self.raw else self._decode(key, data)
            return 200, json.dumps(route(body, headers), default=_jsonable).encode(), None
        except BadRequest as e:
            log.warning("%s: rejected %s from %s: %s", self.name, key, client, e)
            return e.status, json.dumps({"error": str(e)}).encode(), type(e).__name__
        except Exception as e:  # a bug on our side: tell the sender, keep serving
            log.exception("%s: error in %s", self.name, key)
            return 500, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode(), None

    def _decode(self, key: str, data: bytes) -> dict[str, Any] | pydantic.BaseModel:
        schema = self.schemas.get(key)
        if schema is not None:
            try:
                return schema.model_validate_json(data or b"{}")
            except pydantic.ValidationError as e:
                raise BadRequest(_readable(e)) from None
        try:
            body = json.loads(data or b"{}")
        except ValueError as e:
            raise BadRequest(f"malformed JSON: {e}") from None
        except RecursionError:  # nesting deeper than the interpreter's recursion limit: a stranger's, never ours
            raise BadRequest("malformed JSON: nested too deeply") from None
        if not isinstance(body, dict):
            raise BadRequest("JSON body must be an object")
        return body


async def _read_body(receive: Callable, limit: int) -> bytes | None:
    """The body, at most ``limit`` bytes (the declared length was checked; this bounds a chunked one too); None if
    the client went away first."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"body exceeds the {limit}-byte limit")
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _respond(send: Callable, status: int, out: bytes, close: bool = False) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": out})


def _settle(future: asyncio.Future, result: Any) -> None:
    if not future.done():  # cancelled by close()
        future.set_result(result)


def _jsonable(value: Any) -> Any:
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(mode="json")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _readable(e: pydantic.ValidationError) -> str:
    """A schema violation as one line a worker's operator can act on: ``field.sub: message; ...``."""
    errors = e.errors(include_url=False, include_input=False)
    if errors and errors[0]["type"] == "json_invalid":
        return f"malformed JSON: {errors[0]['msg'].removeprefix('Invalid JSON: ')}"
    parts = [f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in errors[:5]]
    return "; ".join(parts) + (f" (and {len(errors) - 5} more)" if len(errors) > 5 else "")


class Client:
    """A persistent-connection client for one server. An ``https`` URL needs ``ca_file`` (the run's pinned CA) and
    ``server_name``, the name the server's certificate must carry (LEARNER_NAME or PEER_NAME), whatever address
    the URL names."""

    def __init__(self, base_url: str, token: str, timeout_s: float = 30.0, ca_file: str | None = None,
                 server_name: str | None = None):
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        if self.base_url.startswith("https://"):
            if not (ca_file and server_name):
                raise ValueError(f"{base_url}: an https URL needs the run's CA (join with --ca-hash)")
            # per request, not on the session: REQUESTS_CA_BUNDLE in the environment would override the session's
            self.verify: str | bool = ca_file
            self.session.mount("https://", _PinnedName(server_name))
        else:
            self.verify = True

    def post(self, path: str, body: dict | None = None, data: bytes | None = None,
             headers: dict | None = None, timeout_s: float | None = None) -> Any:
        r = self.session.post(self.base_url + path, json=body if data is None else None, data=data,
                              headers=headers, timeout=timeout_s or self.timeout_s, verify=self.verify)
        if r.status_code != 200:
            raise RemoteError(r.status_code, _error_text(r))
        return r.json()

    def close(self) -> None:
        self.session.close()


class _PinnedName(requests.adapters.HTTPAdapter):
    """Verify the server's certificate for a fixed name instead of the URL's host: run certificates name a role
    (learner or peer), not an address, so workers behind NAT or renamed hosts need no new certificate."""

    def __init__(self, server_name: str):
        self.server_name = server_name
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        kwargs.update(server_hostname=self.server_name, assert_hostname=self.server_name)
        super().init_poolmanager(*args, **kwargs)


class RemoteError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def _error_text(r: requests.Response) -> str:
    try:
        return r.json().get("error", r.text)
    except ValueError:
        return r.text[:500]
