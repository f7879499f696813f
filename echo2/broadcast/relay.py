"""The relay node: a server that streams snapshot bytes to its children and a fetcher that pulls from its parents.

    learner (origin) ══► peer a ══► peer b ══► peer c        chain: each peer pulls from its parent and serves
                                                               its children from the same buffer as bytes land

    Fetcher.fetch(v, sources) ──request [held, end)──► sources[0]'s RelayServer ──► frames + bytes (framing.py)
        │ into store.py's Snapshot, each chunk checked against the signed manifest (manifest.py) as it completes
        ├ source dies / refuses / stalls: resume at the byte held, from the next source (grandparent, …, origin)
        └ chunks that failed their digest: re-fetched, origin first; handed on only when every chunk checks

Every node (the learner's origin and every worker) holds a ``Store`` of snapshot buffers and runs a
``RelayServer`` on it. A node fetches version v by asking its first source (its parent in the plan) for the byte
range it lacks; the source streams bytes as they *arrive at the source* (cut-through: a peer forwards while it
is still receiving, there is no store-and-forward per chunk), over one persistent TCP connection per source.
Backpressure is TCP's own: a slow child blocks only the thread serving it, never the parent's download.
A source that stalls (no byte for ``stall_timeout_s``) is dropped for this fetch, so a dead relay peer is routed
around and nothing already received is fetched twice.

Transport. Off loopback both ends speak TLS (echo2/transport.py): the server presents a certificate from the run's
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
from typing import Any

from echo2.broadcast.framing import PIECE_BYTES, drain, recv_exact, recv_frame, send_frame, tcp_rtt_s
from echo2.broadcast.manifest import FULL, BadSnapshot, request_mac, verify_manifest
from echo2.broadcast.store import Snapshot, Store

log = logging.getLogger(__name__)


class RelayServer:
    """Serves byte ranges of the snapshots in ``store`` to token holders, as the bytes land there."""

    def __init__(self, store: Store, token: str, host: str = "127.0.0.1", port: int = 0, link: Any = None,
                 manifest_wait_s: float = 30.0, stall_timeout_s: float = 30.0, tls: Any = None):
        """``tls``: an ``ssl.SSLContext`` to serve with (None: plain TCP). ``link``: the lab's emulated link."""
        self.store, self.token, self.link, self.tls = store, token, link, tls
        self.manifest_wait_s, self.stall_timeout_s = manifest_wait_s, stall_timeout_s
        self.sock = socket.create_server((host, port))
        self.addr = self.sock.getsockname()[:2]
        self.closed = False
        self.conns: set[socket.socket] = set()
        self.served_bytes = 0
        self.refused = 0  # requests refused: malformed frames, wrong token (a counter for metrics)
        self.thread = threading.Thread(target=self._accept, name="relay-accept", daemon=True)

    def start(self) -> "RelayServer":
        self.thread.start()
        return self

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="relay-serve", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            plain, conn = conn, self._open(conn)
            self.conns.discard(plain)
            self.conns.add(conn)
            while not self.closed:
                try:
                    req = recv_frame(conn)  # persistent: one request after another
                except ConnectionError as e:
                    if str(e) != "connection closed":  # garbage, not a peer hanging up: say so, count it
                        self._refuse(conn, str(e))
                    return
                self._answer(conn, req)
        except (OSError, ConnectionError):
            pass  # the requester went away mid-answer; its fetch will move on
        finally:
            self.conns.discard(conn)
            conn.close()

    def _open(self, conn: socket.socket) -> socket.socket:
        """The connection as this server speaks on it: TLS after its handshake, then the lab's link if one is set."""
        if self.tls is not None:
            conn.settimeout(30)
            conn = self.tls.wrap_socket(conn, server_side=True)
            conn.settimeout(None)
        return self.link.serve(conn) if self.link is not None else conn

    def _answer(self, conn: socket.socket, req: dict) -> None:
        v, base, start, end = req.get("version"), req.get("base"), req.get("start"), req.get("end")
        if not all(type(x) is int for x in (v, base, start, end)) or not hmac.compare_digest(
                request_mac(self.token, v, base, start, end), str(req.get("mac", ""))):
            self._refuse(conn, "unauthenticated or malformed request")
            raise ConnectionError("refused a request")
        snap = self.store.get(v, wait_s=self.manifest_wait_s, base=base)
        if snap is not None and end == -1:  # "to the end": the requester may not know the size yet
            end = snap.size
        if snap is None or not 0 <= start <= end <= snap.size:
            send_frame(conn, {"error": f"v{v} [{start}, {end}) not held here"})
            return
        send_frame(conn, {"manifest": snap.manifest})
        pos, mv = start, memoryview(snap.buf)
        while pos < end:
            received = snap.wait_received(pos, self.stall_timeout_s)
            if snap.failed or received <= pos:
                raise ConnectionError(f"v{v}: this node's own download stopped at {received}")
            hi = min(received, end, pos + PIECE_BYTES)
            self.served_bytes += hi - pos  # counted as handed to the socket (before, so a reader never lags)
            conn.sendall(mv[pos:hi])
            pos = hi

    def _refuse(self, conn: socket.socket, why: str) -> None:
        """A clear error to the sender, a log line and a counter; then the connection is dropped."""
        self.refused += 1
        log.warning("relay %s:%d refused a request: %s", *self.addr, why)
        try:
            send_frame(conn, {"error": why})
        except OSError:
            pass

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for c in list(self.conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# ---------------------------------------------------------------------- fetching


class Fetcher:
    """Pulls snapshots into a node's store from an ordered list of sources, keeping one connection per source."""

    def __init__(self, store: Store, token: str, link: Any = None, stall_timeout_s: float = 10.0,
                 connect_timeout_s: float = 10.0, trust: Any = None, manifest_key: str | None = None):
        """``manifest_key``: the learner's public key (manifest.verify_key), which every manifest must be signed
        for. ``trust``: a transport.Trust; sources are then reached over TLS verified against the run's CA.
        ``link``: the lab's emulated link (echo2/lab/link.py), never set in a run."""
        self.store, self.token, self.link, self.trust = store, token, link, trust
        self.manifest_key = manifest_key
        self.stall_timeout_s, self.connect_timeout_s = stall_timeout_s, connect_timeout_s
        self.conns: dict[tuple[str, int], socket.socket] = {}
        self.lock = threading.Lock()  # one fetch at a time per node
        self.last_rtt_s: float | None = None  # TCP's smoothed RTT to the source of the last fetch (topology order)

    def fetch(self, version: int, sources: list[tuple[str, int]], base: int = FULL) -> Snapshot:
        """Fetch ``version`` (or its delta against ``base``) completely and verified, trying ``sources`` in order;
        raises if none can serve it."""
        with self.lock:
            snap = self.store.get(version, base=base)
            if snap is not None and snap.complete:
                return snap
            dead: set[tuple[str, int]] = set()
            for src in sources:
                if snap is not None and snap.received == snap.size:
                    break
                try:
                    snap = self._stream(src, version, base, snap)
                    self.last_rtt_s = tcp_rtt_s(self.conns.get(src))
                except (OSError, ConnectionError, BadSnapshot) as e:
                    dead.add(src)
                    self._drop(src)
                    snap = self.store.get(version, base=base)  # what arrived is kept: resume from there
                    log.warning("v%d from %s:%d failed at byte %s: %s; next source", version, *src,
                                snap.received if snap else 0, e)
            if snap is None or snap.received < snap.size:
                if snap is not None:
                    self._fail(snap)
                raise ConnectionError(f"v{version}: no source could serve it ({len(sources)} tried)")
            self._repair(snap, [s for s in reversed(sources) if s not in dead] + sorted(dead))
            with snap.cond:
                snap.complete = True
                snap.cond.notify_all()
            return snap

    def _conn(self, src: tuple[str, int]) -> socket.socket:
        conn = self.conns.get(src)
        if conn is None:
            conn = socket.create_connection(src, timeout=self.connect_timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.trust is not None:
                conn = self.trust.connect(conn)
            self.conns[src] = conn = self.link.fetch(conn) if self.link is not None else conn
        conn.settimeout(self.stall_timeout_s)
        return conn

    def _drop(self, src: tuple[str, int]) -> None:
        conn = self.conns.pop(src, None)
        if conn is not None:
            conn.close()

    def _request(self, src, version: int, base: int, start: int, end: int) -> tuple[socket.socket, dict]:
        conn = self._conn(src)
        send_frame(conn, {"version": version, "base": base, "start": start, "end": end,
                          "mac": request_mac(self.token, version, base, start, end)})
        reply = recv_frame(conn)
        if "error" in reply:
            raise ConnectionError(reply["error"])
        return conn, verify_manifest(self.manifest_key, reply.get("manifest"))

    def _stream(self, src, version: int, base: int, snap: Snapshot | None) -> Snapshot:
        conn, manifest = self._request(src, version, base, snap.received if snap else 0, -1)
        if (manifest["version"], manifest["base"]) != (version, base):
            raise BadSnapshot(f"asked for v{version} (base {base}), got v{manifest['version']} "
                              f"(base {manifest['base']})")
        if snap is None:
            snap = self.store.put(Snapshot(manifest))
        elif manifest["root"] != snap.manifest["root"]:
            raise BadSnapshot(f"v{version} from {src}: a different snapshot than the one being received")
        mv = memoryview(snap.buf)
        while snap.received < snap.size:
            hi = min(snap.size, snap.received + PIECE_BYTES)
            n = conn.recv_into(mv[snap.received:hi])
            if n == 0:
                raise ConnectionError("source closed the connection")
            if isinstance(conn, ssl.SSLSocket):
                n += drain(conn, mv[snap.received + n:hi])
            snap.arrived(n)
            if snap.received % snap.chunk_bytes < n or snap.received == snap.size:  # crossed a chunk boundary
                for bad in snap.check_chunks():
                    log.warning("v%d chunk %d from %s:%d failed its digest; will re-fetch", version, bad, *src)
        return snap

    def _repair(self, snap: Snapshot, sources: list[tuple[str, int]]) -> None:
        """Digest what is left and re-fetch every chunk that failed, origin first."""
        snap.check_chunks()
        for i in sorted(snap.bad):
            lo = i * snap.chunk_bytes
            hi = min(lo + snap.chunk_bytes, snap.size)
            for src in sources:
                try:
                    conn, manifest = self._request(src, snap.version, snap.key[1], lo, hi)
                    if manifest["root"] != snap.manifest["root"]:
                        raise BadSnapshot("a different snapshot")
                    snap.buf[lo:hi] = recv_exact(conn, hi - lo)
                except (OSError, ConnectionError, BadSnapshot) as e:
                    self._drop(src)
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

