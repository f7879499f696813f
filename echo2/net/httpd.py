"""The HTTP machinery under net.http.JsonServer: uvicorn's HTTP/1.1 protocol, hardened for a port strangers reach.

    accept ─► connection cap ─► TLS handshake ─► request line + headers ─► the app, on the event loop: credential,
    route, declared length ─► body ─► handler thread ─► response ─► kept alive ─► next request
    (handshake and headers within header_timeout_s, at most max_header_bytes; body: no silence over
    body_timeout_s; kept alive: idle at most keep_alive_s; the handler: no limit, it may be a long poll)

One event loop in one daemon thread parses every connection (uvicorn's httptools protocol, uvloop when installed);
route handlers, which are ordinary blocking functions that take locks, run in a pool of daemon threads, so a slow
handler (a long poll, a snapshot download) holds one thread, never the loop. What uvicorn alone does not do, and a
public port needs, is added here:

- a watchdog per connection: a client that sends half its headers (or nothing) is dropped after
  ``header_timeout_s``; a body must keep arriving (no silence over ``body_timeout_s``) and keep up a minimum rate
  (``min_body_rate_bytes_per_s``: each byte buys the body that much more time, so a trickle cannot push its
  deadline out for ever); an idle kept-alive connection is closed after ``keep_alive_s`` once authenticated, after
  ``header_timeout_s`` before. No timer runs while a handler works: a long poll is not a stall.
- connection slots (echo2/net/slots.py), counted from accept (TLS handshakes in progress included), never above
  what the process's file limit allows: capped per address, per worker credential and in all, with room kept for
  authenticated connections (an anonymous one may be cut to make room for a newcomer); one refused is answered
  503 (cut, on a TLS port) and closed at once.
- the TLS handshake, run per accepted connection (loop.connect_accepted_socket: same context, same pinning as
  ever) under ``header_timeout_s``.
- a bound on the request line and headers (``max_header_bytes``): llhttp itself has none.

uvicorn.Server is not used: its lifecycle (signal handlers, lifespan, a 0.1 s polling tick) is made for a process
that is a server, while these servers live in threads of a coordinator, a learner or a worker agent;
BackgroundServer below is the part of it that applies, and its ``close`` ends requests still in progress after a
short grace (the http.server it replaces dropped them at once).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import resource
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from echo2.net.slots import Slot, SlotLimits, Slots

try:
    import uvloop
except ImportError:  # pragma: no cover - vLLM installs it; asyncio's own loop serves the same, slower
    uvloop = None

log = logging.getLogger(__name__)
# uvicorn's own lines ("Invalid HTTP request received.") repeat what on_reject counts and logs with the client's
# address; its errors (an exception escaping the app) still show. Also spares it a TRACE check per connection.
_protocol_log = logging.getLogger(__name__ + ".protocol")
_protocol_log.setLevel(logging.ERROR)

# What a refused connection is told before it is closed: HTTP/1.1 lets a server answer before the request.
_REFUSED_BODY = b'{"error": "too many open connections"}'
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
           b"connection: close\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY))


@dataclass(frozen=True)
class Limits:
    """What one client may hold of a server. The defaults fit a coordinator of ~1,000 workers over a WAN."""

    header_timeout_s: float = 10.0
    """From connecting (or the first byte of a request on a kept-alive connection) to the end of its headers; also
    the TLS handshake's limit. One WAN round trip carries a request's headers: 10 s is generous."""
    body_timeout_s: float = 30.0
    """Longest silence while a body arrives, and the time a body gets before ``min_body_rate_bytes_per_s`` counts."""
    min_body_rate_bytes_per_s: float = 1024.0
    """Each byte of a body buys it 1/rate s more: a body is dropped once it is further behind this rate than
    ``body_timeout_s`` (Apache mod_reqtimeout's MinRate). 1 KiB/s is below the slowest link a worker may declare
    (10 kbit/s): an honest upload never comes near it, while one byte every few seconds is dropped within
    ``body_timeout_s``."""
    keep_alive_s: float = 60.0
    """An idle kept-alive connection is closed after this: well above a worker's heartbeat period, so an active
    worker keeps its connection (a close racing a new request would cost it a failed request). A connection that
    has not authenticated gets ``header_timeout_s`` instead: an outsider holds no idle slot for a minute."""
    max_connections: int = 4096
    """Open connections (idle kept-alive ones included); one more is refused. ~2 per worker (its agent's client and
    the broadcaster's calls), with room for the idle and half-open connections of strangers."""
    anonymous_share: float = 0.5
    """Of max_connections, the most that connections not yet authenticated may hold (slots.py): the rest is kept for
    authenticated workers. Past it, the oldest anonymous connection is cut for a newcomer."""
    max_anonymous_per_address: int = 16
    """Connections not yet authenticated from one address (an IPv6 /64): a NAT'd site's workers reconnecting at once
    each hold one for about a round trip."""
    max_connections_per_address: int = 512
    """All connections from one address: a NAT'd cluster of a few hundred workers behind one address fits."""
    max_connections_per_principal: int = 64
    """Authenticated connections of one worker credential, from any address: 4 for each of the 16 worker ids a
    credential may hold (coordinator.MAX_IDS_PER_CREDENTIAL)."""
    exempt_addresses: frozenset[str] = frozenset({"127.0.0.1", "::1"})
    """Not capped per address (still counted in all): the learner host itself, where its local agents connect."""
    max_header_bytes: int = 64 << 10
    """Request line plus headers. Ours are a few hundred bytes."""
    max_threads: int = 4096
    """Handler threads, started on demand and retired after a minute idle. Each request being handled holds one
    (the coordinator's /pull is a long poll), so fewer than connections would let long polls starve the rest."""
    close_grace_s: float = 1.0
    """``close`` lets responses in progress finish for this long, then drops their connections."""


class HandlerPool:
    """Daemon threads that run route handlers off the event loop: started on demand up to ``max_threads``, retired
    after ``idle_s`` without work. Daemon threads, unlike concurrent.futures' (joined at interpreter exit), let a
    process exit while a handler still waits (a snapshot download, a long poll), as http.server's threads did."""

    def __init__(self, name: str, max_threads: int, idle_s: float = 60.0):
        self.name, self.max_threads, self.idle_s = name, max_threads, idle_s
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.threads = self.idle = 0  # idle: waiting threads no queued job is promised to
        self.closed = False

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` (which must not raise) in a handler thread: an idle one, a new one, or the next one free."""
        with self.lock:
            if self.closed:
                raise RuntimeError(f"{self.name}: handler pool closed")
            grow = not self.idle and self.threads < self.max_threads
            if self.idle:
                self.idle -= 1
            elif grow:
                self.threads += 1
        self.jobs.put(job)
        if grow:
            threading.Thread(target=self._work, name=f"{self.name}-handler", daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self.lock:
                    if self.idle:  # more waiting threads than queued jobs: this one may go
                        self.idle -= 1
                        self.threads -= 1
                        return
                continue  # a job was promised to a waiting thread: stay for it
            if job is None:
                with self.lock:
                    self.threads -= 1
                return
            job()
            with self.lock:
                self.idle += 1

    def close(self) -> None:
        """Idle threads exit now, busy ones when their handler returns (jobs queued before still run)."""
        with self.lock:
            self.closed, n = True, self.threads
        for _ in range(n):
            self.jobs.put(None)


class HeadersTooLarge(Exception):
    """Raised from a parser callback: the request line and headers exceed Limits.max_header_bytes."""


class _Protocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol plus the watchdog and the header bound (module docstring). The watchdog is one
    timer per connection, moved only when a deadline comes earlier than it is set for (a new request on a
    kept-alive connection); later deadlines are picked up when it fires, so a request costs about one timer, not
    one per event."""

    def __init__(self, limits: Limits, on_reject: Callable[[str, str], None], slot: Slot, slots: Slots,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.logger = _protocol_log
        self.limits, self.on_reject, self.slot, self.slots = limits, on_reject, slot, slots
        self.phase = "header"  # header | body | busy (a handler runs) | idle (kept alive between requests)
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self.header_bytes = 0
        self.body_start = 0.0  # when the body phase began (loop time)
        self.body_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.slot.cut = transport.abort  # a newcomer may need this slot (slots.Slots.admit)
        self._watch(self.loop.time() + self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.slots.release(self.slot)
        super().connection_lost(exc)

    def _admitted(self, principal: str | None) -> str | None:
        """Called by the app (on the loop) once a request on this connection passed its credential check: the slot
        counts as authenticated, under ``principal``; returns the kind of refusal when that principal holds its cap."""
        return self.slots.authenticate(self.slot, principal)

    # parser events (httptools calls them from data_received)
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["echo2.admitted"] = self._admitted  # type: ignore[typeddict-unknown-key]
        self.header_bytes = 0
        if self.phase == "idle":
            self.phase = "header"
            self._watch(self.loop.time() + self.limits.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._count_header(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        pipelined = self.cycle is not None and not self.cycle.response_complete
        super().on_headers_complete()
        if pipelined:  # reading is paused until the request before it is answered: nothing to time
            self.phase, self.deadline = "busy", None
        else:
            self.phase = "body"
            self.body_start, self.body_bytes = self.loop.time(), 0
            self._watch(self.body_start + self.limits.body_timeout_s)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self.phase == "body":
            # no silence over body_timeout_s, and never further behind the minimum rate than that; both only grow
            # (the timer picks a later deadline up when it fires)
            self.body_bytes += len(body)
            lim = self.limits
            self.deadline = min(self.loop.time() + lim.body_timeout_s,
                                self.body_start + lim.body_timeout_s + self.body_bytes / lim.min_body_rate_bytes_per_s)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.phase == "body":
            self.phase, self.deadline = "busy", None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if self.pipeline or (cycle is not None and not cycle.response_complete):  # a pipelined request started
            self.phase = "body" if cycle is not None and cycle.more_body else "busy"
            self.body_start, self.body_bytes = self.loop.time(), 0
            self._watch(self.loop.time() + self.limits.body_timeout_s if self.phase == "body" else None)
        else:
            self.phase = "idle"
            idle_s = self.limits.keep_alive_s if self.slot.authenticated else self.limits.header_timeout_s
            self._watch(self.loop.time() + idle_s)

    def _count_header(self, n: int) -> None:
        self.header_bytes += n
        if self.header_bytes > self.limits.max_header_bytes:
            raise HeadersTooLarge  # the parser stops; uvicorn answers 400 (send_400_response) and closes

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what its parser refuses (a malformed request line or header, a negative length)."""
        too_large = self.header_bytes > self.limits.max_header_bytes
        self.on_reject("HeadersTooLarge" if too_large else "MalformedRequest", self.client[0] if self.client else "?")
        super().send_400_response(msg)

    def _watch(self, deadline: float | None) -> None:
        self.deadline = deadline
        if deadline is not None and (self.timer is None or deadline < self.timer_at):
            if self.timer is not None:
                self.timer.cancel()
            self.timer, self.timer_at = self.loop.call_at(deadline, self._check), deadline

    def _check(self) -> None:
        self.timer = None
        if self.deadline is None:  # a handler runs: re-armed when its response is complete
            return
        if self.loop.time() < self.deadline:
            self.timer, self.timer_at = self.loop.call_at(self.deadline, self._check), self.deadline
            return
        if self.phase in ("header", "body") and not self.transport.is_closing():
            self.on_reject("HeaderTimeout" if self.phase == "header" else "BodyTimeout",
                           self.client[0] if self.client else "?")
        self.transport.abort()  # not close(): a peer that reads nothing would hold a closing socket forever


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted coordinator rebinds its port at once
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


FD_RESERVE = 256
"""Open files kept for everything else a process does (logs, checkpoints, its clients' sockets)."""


def connection_cap(wanted: int) -> int:
    """``wanted`` connections, if this process may open that many files (plus FD_RESERVE): its soft limit is raised
    towards the hard one when needed (as vLLM's server does; a common soft default is 1024), else the cap is
    lowered to fit (a refused connection is better than accept() failing with EMFILE for everyone)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):  # not allowed here: keep the limit, lower the cap
            pass
    return wanted if soft == resource.RLIM_INFINITY else min(wanted, max(8, soft - FD_RESERVE))


class BackgroundServer:
    """An ASGI ``app`` served on ``host:port`` by one event loop in a daemon thread. The socket is bound here, so
    that ``address`` is known before ``start``."""

    def __init__(self, app: Any, host: str, port: int, name: str, limits: Limits, tls: ssl.SSLContext | None,
                 on_reject: Callable[[str, str], None]):
        self.name, self.limits, self.tls, self.on_reject = name, limits, tls, on_reject
        cap = connection_cap(limits.max_connections)
        if cap < limits.max_connections:
            log.warning("%s: at most %d connections (the open-file limit), not %d", name, cap, limits.max_connections)
        self.conn_limits = replace(limits, max_connections=cap)
        self.slots = Slots(SlotLimits(cap, limits.anonymous_share, limits.max_anonymous_per_address,
                                      limits.max_connections_per_address, limits.max_connections_per_principal,
                                      limits.exempt_addresses))
        # uvicorn's Config only as the protocol reads it: no logging setup, no proxy headers, no websockets
        self.config = uvicorn.Config(app, http=_Protocol, ws="none", lifespan="off", log_config=None,
                                     access_log=False, proxy_headers=False, server_header=False, date_header=False,
                                     timeout_keep_alive=max(1, int(limits.keep_alive_s)), interface="asgi3")
        self.config.load()
        self.state = ServerState()
        self.opening: set[asyncio.Task] = set()  # _open tasks: accepted connections being set up (TLS handshakes)
        self.sock = _bind(host, port, backlog=2048)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop: asyncio.Event | None = None
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()
        self.started.wait(30)
        if self.error is not None or not self.started.is_set():
            raise RuntimeError(f"{self.name}: the server did not start") from self.error

    def close(self) -> None:
        if self.thread.is_alive() and self.loop is not None and self.stop is not None:
            try:
                self.loop.call_soon_threadsafe(self.stop.set)
            except RuntimeError:  # the loop has just ended
                pass
            self.thread.join(self.limits.close_grace_s + 10)
        self.sock.close()


    def _run(self) -> None:
        loop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # the thread's boundary: start() reports it
            self.error = e
            log.exception("%s: server stopped", self.name)
        finally:
            self.started.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        acceptor = self.loop.create_task(self._accept())
        self.started.set()
        await self.stop.wait()
        acceptor.cancel()
        for task in list(self.opening):  # TLS handshakes in progress
            task.cancel()
        for conn in list(self.state.connections):
            conn.shutdown()  # idle: closed now; busy: closed once its response is sent
        deadline = self.loop.time() + self.limits.close_grace_s
        while self.state.tasks and self.loop.time() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.state.connections):
            conn.transport.abort()
        tasks = [acceptor, *self.opening, *self.state.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self) -> None:
        """Accept connections, each holding a slot from this moment (a TLS handshake in progress holds a file
        descriptor as much as an open connection does): slots.py decides whether it may, and whom it displaces."""
        while True:
            try:
                sock, peer = await self._accept_one()
            except OSError as e:  # EMFILE and the like: let connections close, then go on
                log.warning("%s: accept failed: %s", self.name, e)
                await asyncio.sleep(0.1)
                continue
            slot, refusal, cut = self.slots.admit(peer[0])
            for old in cut:  # the oldest anonymous connections, for room
                self.on_reject("AnonymousCut", old.address)
                old.cut()
            if slot is None:
                self.on_reject(refusal, peer[0])
                _refuse(sock, plain=self.tls is None)
                continue
            # Headers and body go out as separate writes; with Nagle + delayed ACK each small response would stall
            # ~40 ms (measured: 0.16 s of learner idle per step over loopback).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            started = [False]  # _open sets it; a task cancelled before it ran never saw its socket
            task = self.loop.create_task(self._open(sock, peer, slot, started))
            slot.cut = task.cancel  # until the protocol takes over (its transport then)
            self.opening.add(task)
            task.add_done_callback(self.opening.discard)
            task.add_done_callback(functools.partial(self._never_opened, sock, slot, started))

    async def _accept_one(self) -> tuple[socket.socket, Any]:
        """The next connection. Not loop.sock_accept: when this task is cancelled (the server closes) just as a
        connection was accepted, sock_accept's result is dropped and that socket stays open until it is collected;
        here the accept itself is synchronous, and only the wait for one is cancelled."""
        fd = self.sock.fileno()
        while True:
            try:
                sock, peer = self.sock.accept()
                sock.setblocking(False)
                return sock, peer
            except BlockingIOError:
                ready = self.loop.create_future()
                self.loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
                try:
                    await ready
                finally:
                    self.loop.remove_reader(fd)

    def _never_opened(self, sock: socket.socket, slot: Slot, started: list[bool], _task: asyncio.Task) -> None:
        """An _open task cut (for a newcomer, or by the server's close) before it ran: its socket is closed and its
        slot released here, or the connection would stay open until the task is collected."""
        if not started[0]:
            self.slots.release(slot)
            sock.close()

    async def _open(self, sock: socket.socket, peer: Any, slot: Slot, started: list[bool]) -> None:
        """Serve HTTP on an accepted socket, over TLS after a handshake of at most ``header_timeout_s``. Its slot is
        released when the protocol's connection is lost, or here when it never gets one: never twice (idempotent),
        never not at all."""
        started[0] = True

        def protocol() -> asyncio.Protocol:
            return _Protocol(self.conn_limits, self.on_reject, slot, self.slots, config=self.config,
                             server_state=self.state, app_state={})

        try:
            await self.loop.connect_accepted_socket(
                protocol, sock, ssl=self.tls,
                ssl_handshake_timeout=self.limits.header_timeout_s if self.tls is not None else None)
        except OSError as e:  # ssl.SSLError; ConnectionAbortedError when it timed out; a peer gone
            sock.close()
            self.slots.release(slot)
            timed_out = isinstance(e, ConnectionAbortedError) and "longer than" in str(e)
            if timed_out or isinstance(e, ssl.SSLError):
                self.on_reject("HandshakeTimeout" if timed_out else "HandshakeFailed", peer[0])
        except asyncio.CancelledError:  # cut for a newcomer, or the server closes: the loop closes the transport
            self.slots.release(slot)  # (and the socket it owns now; closing it here too could close a reused fd)
            # Over TLS the transport's close waits for a TLS shutdown the silent peer never answers (uvloop): end
            # the TCP connection now. Safe: while the fd is open (the loop detaches the socket when it closes it)
            # it is this connection's; shutdown leaves the descriptor to the loop.
            if sock.fileno() != -1:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            raise


def _refuse(sock: socket.socket, plain: bool) -> None:
    """A connection over the cap: told so (over TLS nothing can be said before a handshake we will not spend) and
    closed."""
    if plain:
        try:
            sock.send(REFUSED)  # non-blocking, one small segment: it fits an empty send buffer
        except OSError:
            pass
    sock.close()
