"""The relay transport: snapshots streamed byte by byte from the learner through a tree of peers (docs/design.md §2).

    learner (origin) ══► peer a ══► peer b ══► peer c        chain: each peer pulls from its parent and serves
                                                               its children from the same buffer as bytes land

Every node (the learner's origin and every worker) holds a ``Store`` of snapshot buffers and runs a
``RelayServer`` on it. A node fetches version v by asking its first source (its parent in the plan) for the byte
range it lacks; the source streams bytes as they *arrive at the source* (cut-through: a peer forwards while it
is still receiving, there is no store-and-forward per chunk), over one persistent TCP connection per source.
Backpressure is TCP's own: a slow child blocks only the thread serving it, never the parent's download.

Integrity and trust. The learner signs a manifest: version, size, chunk size, the sha256 of every chunk, and
the root (sha256 over the chunk digests, i.e. the whole-snapshot digest), HMAC-SHA256 under the run's token.
A node checks each chunk as it completes; a chunk that fails is re-fetched from the next source (the origin
last), and a snapshot is handed to the engine only when every chunk checks. Requests carry an HMAC too: only
token holders can pull weights. Frames are length-prefixed JSON; bytes are raw; nothing is unpickled.

Failures. A source that dies, refuses, or stalls (no byte for ``stall_timeout_s``) is dropped for this fetch;
the node resumes from the byte it holds at the next source in its list (grandparent, ..., origin), so a dead
relay peer is routed around and nothing already received is fetched twice.

Transport. Off loopback both ends speak TLS (echo2/transport.py): the server presents a certificate from the run's
CA, the fetcher verifies it against that CA alone (pinned when the worker joined). The handshake runs in the
connection's own thread, never in accept.

Link model. For tests without root a ``Link`` (link.py: token buckets on a node's uplink and downlink plus a
one-way latency) can be put on every node; the namespace testbed (testbed.py) shapes real links instead.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import ssl
import struct
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from echo2.broadcast.link import Link
from echo2.broadcast.snapshot import MemoryFile

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
MAX_FRAME_BYTES = 4 << 20
FULL = -1  # the ``base`` of a whole snapshot (a delta's base is the version it applies to)
PIECE_BYTES = 256 << 10  # the most one send / recv call moves: the granularity of cut-through and pacing


class BadSnapshot(Exception):
    """A manifest or chunk that fails authentication; never applied."""


# ---------------------------------------------------------------------- manifest


def _mac(token: str, payload: dict[str, Any]) -> str:
    msg = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def make_manifest(token: str, version: int, blob: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES,
                  base: int = FULL, probe: dict | None = None) -> dict:
    """``base``: FULL for a whole snapshot, else the version a sparse delta (delta.py) is taken against.
    ``probe``: the learner's logprobs of fixed tokens under this version (``{"token_ids", "logprobs", "dtype"}``),
    signed with the rest, which a worker compares with its engine's after applying the snapshot."""
    mv = memoryview(blob)
    # Chunks are digested in parallel (hashlib releases the GIL on big buffers): one core did 500 MB in 0.64 s,
    # all of it before the first byte could leave the learner.
    spans = [mv[i:i + chunk_bytes] for i in range(0, len(mv), chunk_bytes)]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, max(1, len(spans)))) as pool:
        chunks = list(pool.map(lambda span: hashlib.sha256(span).hexdigest(), spans))
    root = hashlib.sha256("".join(chunks).encode()).hexdigest()
    body = {"version": version, "base": base, "size": len(mv), "chunk_bytes": chunk_bytes, "chunks": chunks,
            "root": root, "probe": probe}
    return {**body, "mac": _mac(token, body)}


def verify_manifest(token: str, manifest: Any) -> dict:
    if not isinstance(manifest, dict):
        raise BadSnapshot("manifest is not an object")
    body = {k: manifest.get(k) for k in ("version", "base", "size", "chunk_bytes", "chunks", "root", "probe")}
    if not hmac.compare_digest(_mac(token, body), str(manifest.get("mac", ""))):
        raise BadSnapshot(f"manifest of v{body['version']}: signature does not match")
    size, cb, chunks = body["size"], body["chunk_bytes"], body["chunks"]
    ints = (body["version"], body["base"], size, cb)
    if not all(type(x) is int for x in ints) or size < 0 or cb <= 0 or len(chunks) != -(-size // cb):
        raise BadSnapshot("manifest sizes are inconsistent")
    if hashlib.sha256("".join(chunks).encode()).hexdigest() != body["root"]:
        raise BadSnapshot("manifest root does not match its chunk digests")
    return manifest


# ---------------------------------------------------------------------- one snapshot on one node


class Snapshot:
    """A snapshot buffer that fills while it is served. ``received``: bytes in the buffer; ``visible``: bytes
    past the emulated latency (what this node may forward or check); ``bad``: chunks that failed their digest."""

    def __init__(self, manifest: dict, blob: bytes | None = None):
        self.manifest, self.version, self.size = manifest, manifest["version"], manifest["size"]
        self.key = (self.version, manifest["base"])  # the full snapshot v, or the delta of v against a base
        self.chunk_bytes = manifest["chunk_bytes"]
        # A complete snapshot is served from the caller's bytes (no copy); an arriving one gets a memory file, zero
        # pages the kernel provides as bytes land: a bytearray would be zeroed up front (measured: ~0.3 s per relay
        # hop for 200 MB, added to every hop's first byte, since children wait for the parent's buffer). A worker's
        # vLLM engine maps the same file to apply it (snapshot.MemoryFile): no copy of the snapshot in between.
        self.buf = blob if blob is not None else (MemoryFile(self.size) if self.size else bytearray())
        self.received = self.visible = self.size if blob is not None else 0
        self.checked = len(manifest["chunks"]) if blob is not None else 0  # chunks digested so far, in order
        self.bad: set[int] = set()
        self.complete = blob is not None
        self.failed = False
        self.due: deque[tuple[float, int]] = deque()  # (time visible, received) under an emulated latency
        self.first_byte_at: float | None = None  # time.monotonic() of the first byte received (diagnostics)
        self.cond = threading.Condition()

    def arrived(self, n: int, latency_s: float) -> None:
        with self.cond:
            if self.first_byte_at is None:
                self.first_byte_at = time.monotonic()
            self.received += n
            if latency_s:
                self.due.append((time.monotonic() + latency_s, self.received))
            else:
                self.visible = self.received
            self.cond.notify_all()

    def wait_visible(self, pos: int, timeout_s: float) -> int:
        """Bytes visible once more than ``pos`` are (or the timeout passes, or the fetch failed)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                now = time.monotonic()
                while self.due and self.due[0][0] <= now:
                    self.visible = max(self.visible, self.due.popleft()[1])
                if self.visible > pos or self.failed or now >= deadline:
                    return self.visible
                wake = self.due[0][0] - now if self.due else deadline - now
                self.cond.wait(min(wake, deadline - now))

    def check_chunks(self) -> list[int]:
        """Digest every newly visible whole chunk; returns those that failed (also added to ``bad``)."""
        failed = []
        chunks = self.manifest["chunks"]
        while self.checked < len(chunks):
            lo = self.checked * self.chunk_bytes
            hi = min(lo + self.chunk_bytes, self.size)
            if self.visible < hi:
                break
            if not self.chunk_ok(self.checked):
                failed.append(self.checked)
            self.checked += 1
        self.bad.update(failed)
        return failed

    def chunk_ok(self, i: int) -> bool:
        lo = i * self.chunk_bytes
        return hashlib.sha256(memoryview(self.buf)[lo:lo + self.chunk_bytes]).hexdigest() == self.manifest["chunks"][i]


class Store:
    """The snapshots a node holds, by (version, base): the newest ``keep`` versions' objects (full or delta);
    older ones are dropped (garbage-collected) unless pinned."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.snaps: dict[tuple[int, int], Snapshot] = {}
        self.pinned: set[int] = set()  # versions still being broadcast: never collected
        self.cond = threading.Condition()

    def put(self, snap: Snapshot) -> Snapshot:
        with self.cond:
            self.snaps[snap.key] = snap
            self._collect()
            self.cond.notify_all()
        return snap

    def clear(self) -> None:
        """Forget every snapshot (a worker re-joining a learner that may have resumed from a checkpoint: what it
        holds may be the dead run's versions, which must be neither served nor kept over the resumed ones)."""
        with self.cond:
            self.snaps.clear()
            self.cond.notify_all()

    def pin(self, version: int, pinned: bool = True) -> None:
        with self.cond:
            (self.pinned.add if pinned else self.pinned.discard)(version)
            self._collect()

    def _collect(self) -> None:
        keep = set(sorted({v for v, _ in self.snaps})[-self.keep:]) | self.pinned
        for key in [k for k in self.snaps if k[0] not in keep]:
            del self.snaps[key]

    def get(self, version: int, wait_s: float = 0.0, base: int = FULL) -> Snapshot | None:
        """The buffer of ``version``, waiting up to ``wait_s`` for its manifest to arrive here (only for a version
        newer than any held: an older one missing here was collected and will not come back)."""
        with self.cond:
            key = (version, base)
            self.cond.wait_for(lambda: key in self.snaps or (self.snaps and version < max(self.snaps)[0]),
                               timeout=wait_s)
            return self.snaps.get(key)

    def newest_complete(self) -> Snapshot | None:
        with self.cond:
            done = [s for s in self.snaps.values() if s.complete and s.key[1] == FULL]
            return max(done, key=lambda s: s.version) if done else None


# ---------------------------------------------------------------------- framing


def send_frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def recv_exact(sock: socket.socket, n: int, what: str = "bytes") -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError(f"truncated {what}: {len(out)} of {n} bytes" if out else "connection closed")
        out += got
    return bytes(out)


def recv_frame(sock: socket.socket) -> dict:
    (n,) = struct.unpack("!I", recv_exact(sock, 4, "frame header"))
    if n > MAX_FRAME_BYTES:
        raise ConnectionError(f"frame of {n} bytes is over the {MAX_FRAME_BYTES} limit")
    try:
        obj = json.loads(recv_exact(sock, n, "frame") if n else b"")
    except ConnectionError as e:
        raise ConnectionError(f"truncated frame ({e})" if str(e) == "connection closed" else str(e)) from None
    except ValueError as e:
        raise ConnectionError(f"malformed frame: {e}") from None
    if not isinstance(obj, dict):
        raise ConnectionError("a frame must be a JSON object")
    return obj


def request_mac(token: str, version: int, base: int, start: int, end: int) -> str:
    return _mac(token, {"version": version, "base": base, "start": start, "end": end})


def _drain(conn: ssl.SSLSocket, view: memoryview) -> int:
    """Take what TLS can hand over now without waiting. It returns one 16 KiB record per call, and waking this
    node's readers (its own children in the relay) per record is a large part of TLS's cost at 1 Gbit/s."""
    got, timeout = 0, conn.gettimeout()
    conn.setblocking(False)
    try:
        while got < len(view):
            try:
                m = conn.recv_into(view[got:])
            except (ssl.SSLWantReadError, BlockingIOError):
                break
            if m == 0:
                break
            got += m
    finally:
        conn.settimeout(timeout)  # the stall timeout of the next wait
    return got


def tcp_rtt_s(sock: socket.socket | None) -> float | None:
    """The kernel's smoothed RTT estimate of a connection (Linux TCP_INFO ``tcpi_rtt``, microseconds at byte 68),
    or None where it is not available."""
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except OSError:
        return None
    return struct.unpack_from("I", info, 68)[0] / 1e6 if len(info) >= 72 else None


# ---------------------------------------------------------------------- serving


class RelayServer:
    """Serves byte ranges of the snapshots in ``store`` to token holders, as the bytes become visible."""

    def __init__(self, store: Store, token: str, host: str = "127.0.0.1", port: int = 0, link: Link | None = None,
                 manifest_wait_s: float = 30.0, stall_timeout_s: float = 30.0, tls: Any = None):
        """``tls``: an ``ssl.SSLContext`` to serve with (None: plain TCP)."""
        self.store, self.token, self.link, self.tls = store, token, link or Link(), tls
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
            if self.tls is not None:
                plain = conn
                conn.settimeout(30)
                conn = self.tls.wrap_socket(conn, server_side=True)
                conn.settimeout(None)
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
            visible = snap.wait_visible(pos, self.stall_timeout_s)
            if snap.failed or visible <= pos:
                raise ConnectionError(f"v{v}: this node's own download stopped at {visible}")
            hi = min(visible, end, pos + PIECE_BYTES)
            if self.link.up:
                self.link.up.take(hi - pos)
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

    def __init__(self, store: Store, token: str, link: Link | None = None, stall_timeout_s: float = 10.0,
                 connect_timeout_s: float = 10.0, trust: Any = None):
        """``trust``: a transport.Trust; sources are then reached over TLS verified against the run's CA."""
        self.store, self.token, self.link, self.trust = store, token, link or Link(), trust
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
            self.conns[src] = conn
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
        return conn, verify_manifest(self.token, reply.get("manifest"))

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
                n += _drain(conn, mv[snap.received + n:hi])
            if self.link.down:
                self.link.down.take(n)
            snap.arrived(n, self.link.latency_s)
            if snap.received % snap.chunk_bytes < n or snap.received == snap.size:  # crossed a chunk boundary
                for bad in snap.check_chunks():
                    log.warning("v%d chunk %d from %s:%d failed its digest; will re-fetch", version, bad, *src)
        return snap

    def _repair(self, snap: Snapshot, sources: list[tuple[str, int]]) -> None:
        """Wait out the latency, digest what is left, and re-fetch every chunk that failed, origin first."""
        snap.wait_visible(snap.size - 1, self.link.latency_s + 5.0)
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

