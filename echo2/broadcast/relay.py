"""The relay node: a server that streams snapshot bytes to its children and a fetcher that pulls from its parents.

    learner (origin) ══► peer a ══► peer b ══► peer c        chain: each peer pulls from its parent and serves
                                                               its children from the same buffer as bytes land

    Fetcher.fetch(v, sources) ──request [held, end)──► sources[0]'s RelayServer ──► frames + bytes (framing.py)
        │ into store.py's Snapshot, each chunk checked against the signed manifest (manifest.py) as it completes
        ├ source dies / refuses / stalls / too slow for the fetch's deadline: resume at the byte held, from the
        │ next source (grandparent, …, origin)
        └ chunks that failed their digest: re-fetched, origin first; handed on only when every chunk checks

Every node (the learner's origin and every worker) holds a ``Store`` of snapshot buffers and runs a
``RelayServer`` on it. A node fetches version v by asking its first source (its parent in the plan) for the byte
range it lacks; the source streams bytes as they *arrive at the source* (cut-through: a peer forwards while it
is still receiving, there is no store-and-forward per chunk), over one persistent TCP connection per source.
Backpressure is TCP's own: a slow child blocks only the thread serving it, never the parent's download.
A source that stalls (no byte for ``stall_timeout_s``), or, when the fetch has a deadline, whose rate would
finish it past that deadline, is dropped for this fetch (the last source, the origin, only for stalling), so a
dead or slow relay peer is routed around and nothing already received is fetched twice.

Stripes. An order may cut the snapshot into byte ranges, each with its own sources (topology.plan_stripes: each
stripe down its own tree). The fetcher then runs one lane per stripe, at once, each a thread with its own
connection per source and its own failover, all filling one buffer (a span each, store.py); a parent serves a
child's range as its own span fills, and a chunk across two stripes is checked once both hold it. A lane that no
source can serve fails the fetch and stops the others.

Keys. A request carries a MAC under the relay key (manifest.request_mac) and the key's id; the answer carries
``serve_proof`` under the same key, which the fetcher checks: a node that lost the key (a revoked worker) can
neither pull nor pass for a source. The key is replaced while nodes run (``use_key``): a request under a key this
node has yet to receive waits up to ``key_wait_s`` for it; one under a replaced key is refused at once.

Hostile or broken connections. The server holds at most ``max_conns`` connections, given out by
broadcast/relay_slots.py: a connection must complete its TLS handshake and a valid request within
``request_timeout_s`` (each request frame too, once its first byte is in); only one whose request showed the
learner's ticket for this source and a version held or still served here (``Fetcher.fetch(tickets=)``, from the
order; a collected version a late child is finishing counts: ``Store.serving``) may then idle
``idle_timeout_s`` until the next and is never evicted for a newcomer, others are evicted oldest first when the
server is full; a connection answered with an error is dropped; a child that stops reading for ``stall_timeout_s``
is dropped. A child still reading a version the store has collected is served on (a late one on a thin link finishes
what it started), but only for the newest ``store.MAX_RETAINED`` such versions: past that the oldest one's readers
are dropped, so that readers just fast enough never to stall cannot keep whole snapshots in memory. The fetcher
gives a source ``connect_timeout_s`` to accept and ``answer_timeout_s`` to answer (its manifest, or a frame saying
it still waits for it).

Transport. Off loopback both ends speak TLS (echo2/net/http.py): the server presents a certificate from the run's
CA, the fetcher verifies it against that CA alone (pinned when the worker joined). The handshake runs in the
connection's own thread, never in accept.

Link emulation is not here: tests and the benchmark without root pass ``link`` (echo2/lab/link.py), which wraps
each connection after its handshake (``link.serve(conn)``, ``link.fetch(conn)``); a run passes none.
"""

from __future__ import annotations

import hmac
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from echo2.broadcast.framing import PIECE_BYTES, drain, recv_exact, recv_frame, send_frame, tcp_rtt_s
from echo2.broadcast.manifest import (FULL, BadSnapshot, key_id, request_mac, serve_proof, source_tag,
                                      verify_manifest)
from echo2.broadcast.relay_slots import PER_ADDRESS, Slots, ticket_of
from echo2.broadcast.store import Snapshot, Store
from echo2.broadcast.suspects import SUSPECT_S, Suspects  # noqa: F401  (SUSPECT_S: the broadcaster's too)
from echo2.net.tls import PEER_NAME

log = logging.getLogger(__name__)

MAX_CONNS = 256
"""Connections one relay server serves at once, each a thread: a worker serves its children (a chain: one; a
tree: ``fanout``), late joiners and repairs, a few; the learner's origin serves every worker in one_to_many, so
the broadcaster raises its own cap to that. Past it a connection is closed as soon as it is accepted."""

REQUEST_TIMEOUT_S = 10.0
"""A new connection's TLS handshake and first valid request must come within this, and every request frame once
its first byte is in (a request is ~300 bytes): a silent or half-open connection holds a slot this long at most."""

IDLE_TIMEOUT_S = 900.0
"""A connection whose last request showed a ticket (relay_slots.py) may idle this long before its next: a fetcher keeps
its connection to each source from one snapshot to the next (κ learner steps apart), which spares a handshake and
TCP's slow start. Any other gets REQUEST_TIMEOUT_S."""

KEY_WAIT_S = 2.0
"""How long a request under a relay key this node has not received yet waits for it: the learner hands a new key
to every worker at once, and a child may ask its parent before the parent's copy arrives (within one round trip
from the learner); less than ANSWER_TIMEOUT_S, which the requester gives the answer."""

ANSWER_TIMEOUT_S = 3.0
"""A source must answer a request within this: with its manifest, or with a frame saying it is still waiting for
its own (sent every WAIT_BEAT_S). One that says nothing (gone, or never meant to answer) is left for the next."""

ORDER_WAIT_S = 5.0
"""How long a node asked for a version it is not fetching waits for its own order to fetch it (the learner sends a
parent's order and its child's at once) before it says it does not hold it: a node that was never ordered to
fetch it (or never obeys) does not keep the child waiting for manifest_wait_s."""

WAIT_BEAT_S = 1.0
"""While a source waits for its own manifest (its parent has not started sending), it tells the requester so this
often (a third of ANSWER_TIMEOUT_S)."""

CONNECT_TIMEOUT_S = 3.0
"""TCP and TLS handshakes with a source: a host that does not accept within this is skipped (two SYN retries)."""

SLOW_GRACE_S = 2.0
"""Time a source gets after its first byte before its rate is judged against the fetch's deadline (TCP's slow
start, a parent still filling its own buffer)."""

MAX_REQUEST_BYTES = 4096
"""The largest request frame a server reads (a request is a handful of integers and two digests)."""

REFUSAL_LOG_PERIOD_S = 10.0
"""At most one log line per this many seconds for refused requests and connections (with the count since): a
stranger's flood must not become a flood of log lines."""


class Superseded(ConnectionError):
    """A newer fetch on the same node took over: this one stops, keeping what it received."""


class SlowSource(ConnectionError):
    """A source whose rate would finish the fetch past its deadline."""


class Stopped(ConnectionError):
    """Another stripe of the same fetch failed from every source: this one stops too (the fetch has failed)."""


Lane = tuple[int, int, list[tuple[str, int]]]  # a stripe's [lo, hi) bytes (hi -1: to the end) and its sources


class RelayServer:
    """Serves byte ranges of the snapshots in ``store`` to holders of the relay key, as the bytes land there."""

    def __init__(self, store: Store, token: str | None, host: str = "127.0.0.1", port: int = 0, link: Any = None,
                 manifest_wait_s: float = 30.0, stall_timeout_s: float = 30.0, tls: Any = None,
                 max_conns: int = MAX_CONNS, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, key_wait_s: float = KEY_WAIT_S,
                 ticket_key: str | None = None, per_address: int = PER_ADDRESS):
        """``token``: the relay key (None: none yet, every request waits for one). ``tls``: an ``ssl.SSLContext``
        to serve with (None: plain TCP). ``link``: the lab's emulated link. ``ticket_key``: the learner's public key,
        which tickets are checked against (None: none is, and no connection earns a lasting slot). The rest: the
        module's constants and relay_slots.py's. Tickets are for this server's address (the bound one until its
        owner says how the learner's orders name it: ``advertise``)."""
        self.store, self.link, self.tls = store, link, tls
        self.token, self.past_keys = token, set()  # ids of the keys this node held before ``token``
        self.key_cond = threading.Condition()
        self.manifest_wait_s, self.stall_timeout_s = manifest_wait_s, stall_timeout_s
        self.request_timeout_s, self.idle_timeout_s = request_timeout_s, idle_timeout_s
        self.key_wait_s, self.ticket_key = key_wait_s, ticket_key
        self.slots = Slots(max_conns, per_address)
        self.sock = socket.create_server((host, port))
        self.addr = self.sock.getsockname()[:2]
        self.advertise(self.addr)
        self.closed = False
        self.conns: set[socket.socket] = set()
        self.sockets: dict[socket.socket, socket.socket] = {}  # accepted socket -> the one served (after TLS)
        self.conns_lock = threading.Lock()
        self.served_bytes = 0
        self.refused = 0  # requests refused (malformed frames, wrong key) and connections over the cap: a metric
        self.logged_at, self.logged_refused = -REFUSAL_LOG_PERIOD_S, 0
        self.thread = threading.Thread(target=self._accept, name="relay-accept", daemon=True)

    def start(self) -> "RelayServer":
        self.thread.start()
        return self

    def advertise(self, address: tuple[str, int]) -> None:
        """How the learner's orders name this server (its advertised host and port): the only tickets it takes are
        the ones made for that address (manifest.relay_ticket)."""
        self.own_tag = source_tag(address)

    def use_key(self, token: str) -> None:
        """Serve under relay key ``token`` from now on; requests under the previous one are refused."""
        with self.key_cond:
            if token == self.token:
                return
            if self.token:
                self.past_keys.add(key_id(self.token))
            self.token = token
            self.key_cond.notify_all()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            with self.conns_lock:
                held = self.store.serving()
                admitted, evicted = self.slots.admit(conn, peer[0], time.monotonic(), lambda v: v not in held)
                if admitted:
                    self.conns.add(conn)
                victims = [self.sockets.get(v, v) for v in evicted]
            for victim in victims:  # its thread sees the connection end, and frees what it held
                self.refused += 1
                _shut(victim)
            if not admitted:
                self.refused += 1
                self._log_refusal(f"a connection from {peer[0]}: {self.slots.max_conns} open, none evictable, or its "
                                  "address's share of unticketed ones taken")
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, "%s:%d" % peer[:2]), name="relay-serve",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, who: str) -> None:
        """Answer the requests of one connection (from ``who``, host:port) until it ends or is dropped."""
        plain = conn
        try:
            conn.settimeout(self.request_timeout_s)  # the TLS handshake, then the first request
            conn = self._open(conn)
            with self.conns_lock:
                if plain not in self.slots.slots:  # evicted during its handshake
                    return
                self.conns.discard(plain)
                self.conns.add(conn)
                self.sockets[plain] = conn
            while not self.closed:
                # a node whose request showed its ticket may keep its connection for the next snapshot; any other
                # has request_timeout_s to make one
                with self.conns_lock:
                    ticketed = self.slots.is_ticketed(plain)
                conn.settimeout(self.idle_timeout_s if ticketed else self.request_timeout_s)
                try:
                    req = recv_frame(conn, MAX_REQUEST_BYTES, within_s=self.request_timeout_s)
                except ConnectionError as e:
                    if str(e) != "connection closed":  # garbage, not a peer hanging up: say so, count it
                        self._refuse(conn, str(e))
                    return
                self._answer(conn, req, plain, who)
        except (OSError, ConnectionError):
            pass  # silent past its time, answered with an error, or the requester went away mid-answer
        finally:
            with self.conns_lock:
                self.conns.discard(plain)
                self.conns.discard(conn)
                self.sockets.pop(plain, None)
                self.slots.release(plain)
            conn.close()

    def _open(self, conn: socket.socket) -> socket.socket:
        """The connection as this server speaks on it: TLS after its handshake, then the lab's link if one is set."""
        if self.tls is not None:
            conn = self.tls.wrap_socket(conn, server_side=True)
        return self.link.serve(conn) if self.link is not None else conn

    def _answer(self, conn: socket.socket, req: dict, plain: socket.socket, who: str) -> None:
        """Serve one request; raises (the connection is dropped) after refusing it or answering it with an
        error."""
        v, base, start, end = req.get("version"), req.get("base"), req.get("start"), req.get("end")
        token = self._authentic(req) if all(type(x) is int for x in (v, base, start, end)) else None
        if token is None:
            self._refuse(conn, "unauthenticated or malformed request (no relay key, or a replaced one)")
            raise ConnectionError("refused a request")
        self._ticket(conn, req, plain)
        conn.settimeout(self.stall_timeout_s)  # from here on it sends: a requester that stops reading is dropped
        snap = self._manifest_of(conn, v, base)
        if snap is not None and end == -1:  # "to the end": the requester may not know the size yet
            end = snap.size
        stop = lambda: _shut(conn)  # noqa: E731
        if snap is None or not 0 <= start <= end <= snap.size or not self.store.reading(snap, stop):
            send_frame(conn, {"error": f"v{v} [{start}, {end}) not held here"})
            raise ConnectionError("answered with an error")
        try:
            send_frame(conn, {"manifest": snap.manifest, "proof": serve_proof(token, req["mac"])})
            self._stream(conn, snap, start, end)
        except (OSError, ConnectionError):
            if snap.collected:  # cut off by the store (its MAX_RETAINED): say who, since it may be an insider's doing
                self._log_refusal(f"to serve v{v} on to {who}: it was let go while being read (more than "
                                  "store.MAX_RETAINED old versions were being read, or the store was cleared)")
            raise
        finally:
            self.store.done_reading(snap, stop)

    def _stream(self, conn: socket.socket, snap: Snapshot, start: int, end: int) -> None:
        """Send ``snap``'s bytes [start, end) as they are filled here (cut-through)."""
        pos, mv = start, memoryview(snap.buf)
        try:
            while pos < end:
                filled = snap.wait_filled(pos, self.stall_timeout_s)  # in a striped fetch, the stripe's own bytes
                if snap.collected:  # let go for good (store.MAX_RETAINED): no reader may keep it in memory
                    raise ConnectionError(f"v{snap.version} was let go while being served")
                if snap.failed or filled <= pos:
                    raise ConnectionError(f"v{snap.version}: this node's own download stopped at {filled}")
                hi = min(filled, end, pos + PIECE_BYTES)
                self.served_bytes += hi - pos  # counted as handed to the socket (before, so a reader never lags)
                conn.sendall(mv[pos:hi])
                pos = hi
        finally:
            mv.release()  # at once: a traceback kept by a logger would keep the buffer otherwise

    def _ticket(self, conn: socket.socket, req: dict, plain: socket.socket) -> None:
        """The request's ticket earns its connection a lasting slot; none leaves it evictable (relay_slots.py)."""
        try:
            ticket = ticket_of(self.ticket_key, req, self.own_tag)
        except ValueError as e:
            self._refuse(conn, str(e))
            raise ConnectionError("refused a request") from None
        with self.conns_lock:
            self.slots.ticketed(plain, *ticket) if ticket else self.slots.unticketed(plain)

    def _authentic(self, req: dict) -> str | None:
        """The relay key the request's MAC verifies under, waiting up to ``key_wait_s`` if it names a key this
        node has yet to receive; None if it verifies under none."""
        v, base, start, end, mac, kid = (req.get(k) for k in ("version", "base", "start", "end", "mac", "key"))
        deadline = time.monotonic() + self.key_wait_s
        with self.key_cond:
            while True:
                token = self.token
                if token and hmac.compare_digest(request_mac(token, v, base, start, end).encode(), str(mac).encode()):
                    return token
                left = deadline - time.monotonic()
                known = (token and kid == key_id(token)) or kid in self.past_keys
                if known or not (isinstance(kid, str) and len(kid) == 16) or left <= 0:
                    return None
                self.key_cond.wait(left)

    def _manifest_of(self, conn: socket.socket, v: int, base: int) -> Snapshot | None:
        """The buffer of (v, base), waiting up to ``manifest_wait_s`` for one this node is fetching (its own parent
        may not have started sending; ORDER_WAIT_S for one it is not fetching yet), and telling the requester so
        every WAIT_BEAT_S."""
        start = time.monotonic()
        while True:
            left = start + self.manifest_wait_s - time.monotonic()
            snap = self.store.get(v, wait_s=max(0.0, min(WAIT_BEAT_S, left)), base=base)
            if snap is not None or left <= 0 or not self.store.may_arrive(v, base):
                return snap
            if not self.store.expects(v, base) and time.monotonic() - start >= ORDER_WAIT_S:
                return None
            send_frame(conn, {"wait": True})

    def _refuse(self, conn: socket.socket, why: str) -> None:
        """A clear error to the sender, a log line and a counter; then the connection is dropped."""
        self.refused += 1
        self._log_refusal(f"a request: {why}")
        try:
            send_frame(conn, {"error": why})
        except OSError:
            pass

    def _log_refusal(self, what: str) -> None:
        now = time.monotonic()
        if now - self.logged_at >= REFUSAL_LOG_PERIOD_S:
            since = self.refused - self.logged_refused
            log.warning("relay %s:%d refused %s%s", *self.addr, what, f" ({since} refusals since the last line)"
                        if since > 1 else "")
            self.logged_at, self.logged_refused = now, self.refused

    def close(self) -> None:
        self.closed = True
        _shut(self.sock)
        self.sock.close()
        with self.conns_lock:
            conns = list(self.conns)
        for c in conns:
            _shut(c)


def _shut(sock: socket.socket) -> None:
    """End a connection another thread may be blocked on (it then sees the end and cleans up). The socket's own
    ``shutdown``, not TLS's: ``SSLSocket.shutdown`` first forgets its TLS state, and a thread sending at that moment
    would fall back to plain ``sendall``, putting cleartext on the wire."""
    try:
        socket.socket.shutdown(getattr(sock, "_conn", sock), socket.SHUT_RDWR)  # _conn: under the lab's link
    except (OSError, TypeError):  # TypeError: not a socket (nothing to end)
        pass


# ---------------------------------------------------------------------- fetching


class Fetcher:
    """Pulls snapshots into a node's store from an ordered list of sources, keeping one connection per source."""

    def __init__(self, store: Store, token: str | None, link: Any = None, stall_timeout_s: float = 10.0,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, trust: Any = None, manifest_key: str | None = None,
                 answer_timeout_s: float = ANSWER_TIMEOUT_S, manifest_wait_s: float = 30.0):
        """``token``: the relay key (replaced by the learner's orders). ``manifest_key``: the learner's public key
        (manifest.verify_key), which every manifest must be signed for. ``trust``: a net.tls.Trust; sources are
        then reached over TLS verified against the run's CA. ``manifest_wait_s``: the longest a source may keep
        saying it waits for its own manifest. ``link``: the lab's emulated link (echo2/lab/link.py), never set in a
        run."""
        self.store, self.token, self.link, self.trust = store, token, link, trust
        self.manifest_key = manifest_key
        self.stall_timeout_s, self.connect_timeout_s = stall_timeout_s, connect_timeout_s
        self.answer_timeout_s, self.manifest_wait_s = answer_timeout_s, manifest_wait_s
        self.conns: dict[tuple[tuple[str, int], int], socket.socket] = {}  # (source, lane) -> connection
        self.suspects = Suspects()  # the sources tried last, and what the last fetch's failed sources did
        self.lock = threading.Lock()  # one fetch at a time per node
        self.made = threading.Lock()  # one lane makes a fetch's buffer; its siblings take that one
        self.gen_lock = threading.Lock()
        self.generation = 0  # bumped by each fetch: a running one that sees it change stops (Superseded)
        self.last_rtt_s: float | None = None  # TCP's smoothed RTT to the source of the last fetch (diagnostics)
        self.tickets: dict[tuple[str, int], str] = {}  # the running fetch's (its order's): each source is shown its own
        self.names: dict[tuple[str, int], str] = {}  # what each source's certificate must name (the order's word)
        self.conn_names: dict[tuple[tuple[str, int], int], str] = {}  # the name each open connection was checked for

    @property
    def last_failed(self) -> list[tuple[str, int]]:
        """The sources that failed the last fetch (told to the learner, with ``suspects.evidence``)."""
        return self.suspects.last_failed

    def fetch(self, version: int, sources: list[tuple[str, int]], base: int = FULL, epoch: str | None = None,
              deadline_s: float | None = None, stripes: list[Lane] | None = None,
              tickets: Iterable[Sequence] = ()) -> Snapshot:
        """Fetch ``version`` (or its delta against ``base``) of learner epoch ``epoch`` completely and verified,
        trying ``sources`` in order; raises if none can serve it. With ``stripes`` ([(lo, hi, sources)], byte ranges
        tiling the snapshot: topology.plan_stripes), each range is pulled at once from its own sources, in a thread
        of its own, and ``sources`` serve only repairs. With ``deadline_s``, a source (but a list's last) whose rate
        would finish its range past that many seconds from now is left for the next. A fetch started meanwhile on
        this node supersedes this one (it raises Superseded, keeping what arrived, from which the newer one
        resumes). ``tickets``: the order's ([host, port, ticket, name]: manifest.relay_tickets and the name the
        source's certificate must carry, with TLS), each ticket shown to its own source."""
        with self.gen_lock:
            self.generation += 1
            gen = self.generation
        with self.lock:
            self.tickets = {(host, port): ticket for host, port, ticket, *_ in tickets}
            self.names = {(host, port): name[0] for host, port, _, *name in tickets if name}
            deadline = None if deadline_s is None else time.monotonic() + deadline_s
            snap = self._held(version, base, epoch, gen)
            if snap is not None and snap.complete:
                return snap
            self.store.expect(version, base)
            lanes = [(lo, hi, list(srcs)) for lo, hi, srcs in stripes] if stripes else [(0, -1, list(sources))]
            if snap is not None and len(snap.spans) != len(lanes):
                # a partial copy laid out otherwise (an earlier order of this version): keep its bytes, and fill its
                # spans from the origin only, which holds all of it (this order's parents were planned for other
                # byte ranges, and one of them may be waiting for this node's own bytes)
                lanes = [(lo, hi, list(sources[-1:])) for lo, hi, _ in snap.spans]
            self.suspects.new_fetch()
            errors = self._lanes(lanes, version, base, epoch, gen, deadline)
            snap = self.store.get(version, base=base)
            unexpected = [e for e in errors if not isinstance(e, (OSError, BadSnapshot))]
            superseded = [e for e in errors if isinstance(e, Superseded)]
            if unexpected or superseded:
                raise (unexpected or superseded)[0]
            if errors or snap is None or snap.received < snap.size:
                if snap is not None:
                    self._fail(snap)
                tried = len({src for _, _, srcs in lanes for src in srcs})
                raise ConnectionError(f"v{version}: no source could serve it ({tried} tried)")
            self._repair(snap, self.suspects.ranked(sources[::-1]))  # origin first, those that failed last
            with snap.cond:
                snap.complete = True
                snap.cond.notify_all()
            return snap

    def _lanes(self, lanes: list[Lane], version: int, base: int, epoch: str | None, gen: int,
               deadline: float | None) -> list[BaseException]:
        """Run every lane (one stripe each) to its end, the first in this thread; the errors they ended with. A lane
        that no source could serve stops the others (the fetch has failed)."""
        errors: list[BaseException] = []
        stop = threading.Event()
        bounds = None if len(lanes) == 1 and lanes[0][1] == -1 else [(lo, hi) for lo, hi, _ in lanes]

        def run(j: int) -> None:
            try:
                self._lane(j, lanes[j][2], version, base, epoch, gen, deadline, bounds, stop)
            except BaseException as e:  # anything: the fetch must not return while a sibling lane still writes
                errors.append(e)
                if not stop.is_set() and not isinstance(e, Stopped):
                    stop.set()
                    self._interrupt(j)

        threads = [threading.Thread(target=run, args=(j,), name=f"fetch-stripe-{j}", daemon=True)
                   for j in range(1, len(lanes))]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        return errors

    def _interrupt(self, j: int) -> None:
        """Wake the lanes other than ``j`` from a blocking read (a failed fetch's siblings stop at once, not after a
        stall timeout): their connections are shut down, and they end Stopped."""
        for (_, k), conn in list(self.conns.items()):
            if k != j:
                _shut(conn)

    def _lane(self, j: int, sources: list[tuple[str, int]], version: int, base: int, epoch: str | None, gen: int,
              deadline: float | None, bounds: list[tuple[int, int]] | None, stop: threading.Event) -> None:
        """Fill span ``j`` from ``sources`` in order (those that failed lately last), moving on (and resuming at the
        byte held) when one fails."""
        for src in self.suspects.ranked(sources):
            snap = self.store.get(version, base=base)
            if snap is not None and snap.spans[j][2] >= snap.spans[j][1]:
                return
            if stop.is_set():
                raise Stopped(f"v{version}: another stripe failed")
            try:
                self._stream(src, j, bounds, version, base, epoch, gen, deadline if src != sources[-1] else None,
                             stop)
                self.last_rtt_s = tcp_rtt_s(self.conns.get((src, j)))
                return
            except (Superseded, Stopped):
                self._drop((src, j))  # its stream stopped mid-range: the connection cannot carry another request
                raise
            except (OSError, ConnectionError, BadSnapshot) as e:
                self._drop((src, j))
                if stop.is_set():  # a sibling lane failed and shut this one's connection: not this source's fault
                    raise Stopped(f"v{version}: another stripe failed") from None
                snap = self.store.get(version, base=base)  # what arrived is kept: resume from there
                why = ("slow" if isinstance(e, SlowSource) else "silent" if isinstance(e, socket.timeout)
                       else "bad_answer" if isinstance(e, BadSnapshot) else "failed")
                self.suspects.failed(src, {"why": why, "at": snap.spans[j][2] if snap else 0})
                log.warning("v%d%s from %s:%d failed at byte %s: %s; next source", version,
                            f" stripe {j}" if bounds else "", *src, snap.spans[j][2] if snap else 0, e)
        snap = self.store.get(version, base=base)
        if snap is None or snap.spans[j][2] < snap.spans[j][1]:
            raise ConnectionError(f"v{version}: no source could serve {f'stripe {j}' if bounds else 'it'}")

    def _held(self, version: int, base: int, epoch: str | None, gen: int) -> Snapshot | None:
        """What this node holds of (version, base) already, if it is of ``epoch`` (else it is dropped)."""
        if gen != self.generation:
            raise Superseded(f"v{version}: a newer fetch took over before this one started")
        snap = self.store.get(version, base=base)
        if snap is not None and snap.manifest.get("epoch") != epoch:
            self._fail(snap)
            return None
        return snap

    def _conn(self, key: tuple[tuple[str, int], int]) -> socket.socket:
        """The persistent connection to source ``key[0]`` for lane ``key[1]`` (two stripes from one source, as in a
        failover to the origin, each need their own stream)."""
        name = self.names.get(tuple(key[0]), PEER_NAME)
        if key in self.conns and self.conn_names.get(key) != name:  # checked for another worker's certificate
            self._drop(key)
        conn = self.conns.get(key)
        if conn is None:
            conn = socket.create_connection(key[0], timeout=self.connect_timeout_s)  # the TLS handshake too
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.trust is not None:
                conn = self.trust.connect(conn, name)
            self.conns[key] = conn = self.link.fetch(conn) if self.link is not None else conn
            self.conn_names[key] = name
        return conn

    def _drop(self, key: tuple[tuple[str, int], int]) -> None:
        self.conn_names.pop(key, None)
        conn = self.conns.pop(key, None)
        if conn is not None:
            conn.close()

    def _request(self, key, version: int, base: int, start: int, end: int, epoch: str | None,
                 deadline: float | None = None) -> tuple[socket.socket, dict]:
        """Ask source ``key[0]`` (on lane ``key[1]``'s connection) for bytes [start, end) of (version, base); its
        verified manifest, with the connection positioned at the first byte. A source still waiting for its own
        manifest is given up at ``deadline``."""
        for attempt in (1, 2):
            reused = key in self.conns
            conn, token = self._conn(key), self.token
            if not token:
                raise ConnectionError("no relay key yet (the learner's first order brings it)")
            mac = request_mac(token, version, base, start, end)
            try:
                frame = {"version": version, "base": base, "start": start, "end": end, "key": key_id(token), "mac": mac}
                ticket = self.tickets.get(tuple(key[0]))
                send_frame(conn, {**frame, "ticket": ticket} if ticket else frame)
                reply = self._reply(conn, deadline)
                break
            except socket.timeout:
                raise
            except (OSError, ConnectionError):
                self._drop(key)
                if not reused or attempt == 2:
                    raise
                # a persistent connection the source closed while it idled: once more, on a new one
        if "error" in reply:
            raise ConnectionError(reply["error"])
        if not hmac.compare_digest(str(reply.get("proof", "")).encode(), serve_proof(token, mac).encode()):
            raise BadSnapshot("the source does not hold the relay key (a revoked or stale node)")
        manifest = verify_manifest(self.manifest_key, reply.get("manifest"))
        if manifest.get("epoch") != epoch:
            raise BadSnapshot(f"v{manifest['version']} of learner epoch {manifest.get('epoch')!r}, not of the "
                              f"epoch this fetch is for ({epoch!r})")
        conn.settimeout(self.stall_timeout_s)
        return conn, manifest

    def _reply(self, conn: socket.socket, deadline: float | None) -> dict:
        """The source's answer to a request: its manifest or an error, skipping its 'still waiting' frames for up to
        ``manifest_wait_s`` (and not past ``deadline``)."""
        conn.settimeout(self.answer_timeout_s)
        until = time.monotonic() + self.manifest_wait_s
        until = until if deadline is None else min(until, deadline)
        while (reply := recv_frame(conn)).get("wait") is True:
            if time.monotonic() > until:
                raise SlowSource("still waiting for its own manifest, past this fetch's deadline")
        return reply

    def read(self, src: tuple[str, int], version: int, base: int, start: int, end: int, epoch: str | None,
             ticket: str | None = None, server_name: str | None = None) -> bytes:
        """Bytes [start, end) of (version, base) from ``src`` alone, on a connection of their own, dropped after
        (the learner's check of a relay a peer blames: blame.py)."""
        key = (src, -1)
        self.tickets = {tuple(src): ticket} if ticket else {}
        self.names = {tuple(src): server_name} if server_name else {}
        try:
            conn, _ = self._request(key, version, base, start, end, epoch)
            return recv_exact(conn, end - start)
        finally:
            self._drop(key)

    def _snapshot(self, manifest: dict, bounds: list[tuple[int, int]] | None) -> Snapshot:
        """The buffer for ``manifest``'s snapshot: the one a sibling lane made already, or a new one laid out in
        ``bounds`` (the order's stripes, which must tile it)."""
        with self.made:
            snap = self.store.get(manifest["version"], base=manifest["base"])
            if snap is None:
                try:
                    snap = self.store.put(Snapshot(manifest, bounds=bounds))
                except ValueError as e:
                    raise BadSnapshot(f"the order's stripes do not fit v{manifest['version']}: {e}") from None
            return snap

    def _stream(self, src, j: int, bounds: list[tuple[int, int]] | None, version: int, base: int,
                epoch: str | None, gen: int, deadline: float | None, stop: threading.Event) -> Snapshot:
        """Fill span ``j`` (bounds[j], or the whole snapshot) from ``src``, from the byte held on."""
        snap = self.store.get(version, base=base)
        start, end = (snap.spans[j][2], snap.spans[j][1]) if snap else bounds[j] if bounds else (0, -1)
        conn, manifest = self._request((src, j), version, base, start, end, epoch, deadline)
        if (manifest["version"], manifest["base"]) != (version, base):
            raise BadSnapshot(f"asked for v{version} (base {base}), got v{manifest['version']} "
                              f"(base {manifest['base']})")
        if snap is None:
            snap = self._snapshot(manifest, bounds)
        if manifest["root"] != snap.manifest["root"]:
            raise BadSnapshot(f"v{version} from {src}: a different snapshot than the one being received")
        mv, span, cb = memoryview(snap.buf), snap.spans[j], snap.chunk_bytes
        first_at, got, began = None, 0, span[2]  # from this source: its rate, judged against the deadline
        while span[2] < span[1]:
            if gen != self.generation:
                raise Superseded(f"v{version}: a newer fetch took over at byte {span[2]}")
            if stop.is_set():
                raise Stopped(f"v{version}: another stripe failed")
            pos = span[2]
            hi = min(span[1], pos + PIECE_BYTES)
            n = conn.recv_into(mv[pos:hi])
            if n == 0:
                raise ConnectionError("source closed the connection")
            if isinstance(conn, ssl.SSLSocket):
                n += drain(conn, mv[pos + n:hi])
            snap.arrived(n, j)
            if (pos + n) // cb > pos // cb or pos + n == span[1]:  # crossed a chunk boundary, or the span's end
                for bad in snap.check_chunks():
                    log.warning("v%d chunk %d from %s:%d failed its digest; will re-fetch", version, bad, *src)
                    if began <= bad * cb and min((bad + 1) * cb, snap.size) <= pos + n:  # all of it from src
                        self.suspects.bad_chunk(src, bad, gen)
            now, got = time.monotonic(), got + n
            first_at = first_at or now
            if (deadline is not None and now - first_at >= SLOW_GRACE_S
                    and now + (span[1] - span[2]) * (now - first_at) / got > deadline):
                raise SlowSource(f"{got / (now - first_at) / 1e6:.2f} MB/s from it would finish past the deadline")
        return snap

    def _repair(self, snap: Snapshot, sources: list[tuple[str, int]]) -> None:
        """Digest what is left and re-fetch every chunk that failed, origin first."""
        snap.check_chunks()
        for i in sorted(snap.bad):
            lo = i * snap.chunk_bytes
            hi = min(lo + snap.chunk_bytes, snap.size)
            for src in sources:
                try:
                    conn, manifest = self._request((src, 0), snap.version, snap.key[1], lo, hi,
                                                   snap.manifest.get("epoch"))
                    if manifest["root"] != snap.manifest["root"]:
                        raise BadSnapshot("a different snapshot")
                    snap.buf[lo:hi] = recv_exact(conn, hi - lo)
                except (OSError, ConnectionError, BadSnapshot) as e:
                    self._drop((src, 0))
                    log.warning("re-fetch of chunk %d from %s:%d failed: %s", i, *src, e)
                    continue
                if snap.chunk_ok(i):
                    snap.bad.discard(i)
                    break
        if snap.bad:
            self._fail(snap)
            raise BadSnapshot(f"v{snap.version}: chunks {sorted(snap.bad)} failed their digest from every source")

    def _fail(self, snap: Snapshot) -> None:
        with snap.cond:
            snap.failed = True
            snap.cond.notify_all()
        with self.store.cond:
            if self.store.snaps.get(snap.key) is snap:
                del self.store.snaps[snap.key]

    def close(self) -> None:
        for src in list(self.conns):
            self._drop(src)
