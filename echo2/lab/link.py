"""The in-process link model: a node's emulated access link for tests and benchmarks without root.

    RelayServer ── link.serve(conn) ──► Paced: every send, in slices of SLICE_S of link time, first takes its
                                        bytes from the uplink bucket
    Fetcher     ── link.fetch(conn) ──► Delayed: a thread reads the connection through the downlink bucket and
                                        holds each piece for the one-way latency before the relay sees it

The relay takes a ``link`` by keyword and wraps each connection with it after the TLS handshake; production code
passes none, so nothing here runs in a run. Debt-based token buckets plus a one-way latency: optimistic next to
real links (no slow start, no header overhead); the namespace testbed (testbed.py) is what the broadcast figures
use. Measurements: docs/design.md §5.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from echo2.broadcast.framing import PIECE_BYTES  # the most the delay thread reads at once, as the relay does


SLICE_S = 0.010
"""Link time one paced send may take at most. A real link delivers a send as packets over its duration, so the
next hop can forward the first bytes before the last arrive; a send paced whole lands at once when its time is
up, and every relay hop waits for the whole of it once the burst is spent: 256 KiB (the relay's piece) is 2 ms
at 1 Gbit/s but 0.2 s at 10 Mbit/s, so a scaled-down run (same M/B at a tenth of the rate) paid ten times the
per-hop wait. Slices of fixed link time, within the bucket's burst (BURST_S), keep that wait the same at every
rate.
A parent sharing its uplink among s children still sends each a slice in turn: up to (s − 1) slices per hop that
a real link, interleaving packets, does not add. 10 ms, not less, for the CPU: 16 relaying processes at 10 Mbit/s
took 0.26 / 0.32 / 0.61 of a core with 20 / 10 / 4 ms slices, for the same times (1.67-1.69 s)."""


BURST_S = 0.020
"""Link time a bucket may send at once after an idle spell (and the most a slice may be)."""


class TokenBucket:
    """Debt-based: charge first, then sleep off the debt, so late wake-ups lose no rate (wan-testbed.md §3)."""

    def __init__(self, mbit: float, burst_bytes: int | None = None):
        self.rate = mbit * 1e6 / 8
        self.slice_bytes = max(4096, int(self.rate * SLICE_S))
        # 20 ms of link time at any rate (and at least a slice), so that a run scaled down in rate bursts as far
        # ahead of M/B as the full-rate one (a 64 KiB floor was 52 ms at 10 Mbit/s, 2 ms at 1 Gbit/s)
        self.burst = burst_bytes if burst_bytes is not None else max(int(self.rate * BURST_S), self.slice_bytes)
        self.tokens, self.t = float(self.burst), time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate) - n
            self.t = now
            debt = -self.tokens
        if debt > 0:
            time.sleep(debt / self.rate)


@dataclass
class Link:
    """A node's emulated access link: uplink and downlink caps (None: unshaped) and a one-way latency."""

    up_mbit: float | None = None
    down_mbit: float | None = None
    latency_s: float = 0.0
    up: TokenBucket | None = field(init=False, default=None)
    down: TokenBucket | None = field(init=False, default=None)

    def __post_init__(self):
        self.up = TokenBucket(self.up_mbit) if self.up_mbit else None
        self.down = TokenBucket(self.down_mbit) if self.down_mbit else None

    def serve(self, conn):
        """A connection this node serves on: its sends go through the uplink."""
        return Paced(conn, self.up) if self.up else conn

    def fetch(self, conn):
        """A connection this node fetches on: what it receives comes through the downlink, ``latency_s`` late."""
        return Delayed(conn, self.down, self.latency_s) if self.down or self.latency_s else conn


class Paced:
    """A connection whose ``sendall`` is paced by a token bucket, slice by slice (SLICE_S); everything else is the
    connection's own."""

    def __init__(self, conn, bucket: TokenBucket):
        self._conn, self._bucket = conn, bucket

    def sendall(self, data) -> None:
        view, step = memoryview(data), self._bucket.slice_bytes
        for lo in range(0, len(view), step):
            part = view[lo:lo + step]
            self._bucket.take(len(part))
            self._conn.sendall(part)

    def __getattr__(self, name):
        return getattr(self._conn, name)


class Delayed:
    """A connection whose received bytes surface ``latency_s`` after they crossed the downlink bucket.

    A thread reads the connection; it waits for data with ``select`` and reads and sends under one lock, since a
    TLS connection may not be used by two threads at once. ``settimeout`` bounds a reader's wait for bytes."""

    def __init__(self, conn, bucket: TokenBucket | None, latency_s: float):
        self._conn, self._bucket, self._latency_s = conn, bucket, latency_s
        self._timeout = conn.gettimeout()
        conn.settimeout(None)
        self._held: deque[tuple[float, bytes]] = deque()  # (time it surfaces, bytes), in order
        self._ended, self._error = False, None  # the thread stopped; how, if not at a clean end of stream
        self._io, self._cond = threading.Lock(), threading.Condition()
        threading.Thread(target=self._pump, name="link-downlink", daemon=True).start()

    def _pump(self) -> None:
        error = None
        try:
            while data := self._read():
                if self._bucket:
                    self._bucket.take(len(data))
                with self._cond:
                    self._held.append((time.monotonic() + self._latency_s, data))
                    self._cond.notify_all()
        except Exception as e:  # however the connection ended, a reader sees it after the bytes held
            error = e if isinstance(e, OSError) else ConnectionError(e)
        with self._cond:
            self._ended, self._error = True, error
            self._cond.notify_all()

    def _read(self) -> bytes:
        """The next bytes. Over TLS, read without blocking under the lock: a readable TLS socket may hold only a
        handshake record (a session ticket), and a blocking read would then keep the lock from the fetcher's next
        request. A plain socket may be read and written from two threads at once: one blocking read, no lock (a
        third of the syscalls; the bench's CPU at 64 relaying processes is what this saves)."""
        if not isinstance(self._conn, ssl.SSLSocket):
            return self._conn.recv(PIECE_BYTES)
        while True:
            if not getattr(self._conn, "pending", lambda: 0)():  # TLS may hold decrypted bytes already
                select.select([self._conn], [], [])
            with self._io:
                self._conn.setblocking(False)
                try:
                    return self._conn.recv(PIECE_BYTES)
                except (ssl.SSLWantReadError, BlockingIOError):
                    continue
                finally:
                    self._conn.setblocking(True)

    def recv_into(self, view, nbytes: int = 0) -> int:
        want = nbytes or len(view)
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        with self._cond:
            while not (self._held and self._held[0][0] <= time.monotonic()):
                if not self._held and self._ended:
                    if self._error is not None:
                        raise self._error
                    return 0
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise socket.timeout("timed out")
                times = [t for t in (self._held[0][0] if self._held else None, deadline) if t is not None]
                self._cond.wait(min(times) - now if times else None)
            got, now = 0, time.monotonic()
            while self._held and self._held[0][0] <= now and got < want:
                due, data = self._held.popleft()
                n = min(len(data), want - got)
                view[got:got + n] = data[:n]
                got += n
                if n < len(data):
                    self._held.appendleft((due, data[n:]))
            return got

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        return bytes(buf[:self.recv_into(buf)])

    def sendall(self, data) -> None:
        with self._io:
            self._conn.sendall(data)

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def close(self) -> None:
        try:
            self._conn.shutdown(socket.SHUT_RDWR)  # wakes the thread
        except OSError:
            pass
        self._conn.close()

    def __getattr__(self, name):
        return getattr(self._conn, name)
