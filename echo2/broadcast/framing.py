"""The relay's byte stream: length-prefixed JSON frames for requests and replies, raw bytes for snapshot data.

    fetcher ── frame {version, base, start, end, mac} ──► server
            ◄── frame {manifest} | {error} ───────────────
            ◄── bytes [start, end), PIECE_BYTES per send ─  (as they land at the server: cut-through)

Nothing is unpickled: a frame is a JSON object of at most MAX_FRAME_BYTES; anything else closes the connection
with a ConnectionError that says what was wrong. A reader may give a frame a time limit once its first byte is in
(``within_s``), so that a sender trickling a frame byte by byte holds nothing for long. Also here: reading what
TLS holds without waiting (``drain``), and the kernel's RTT estimate of a connection (``tcp_rtt_s``, diagnostics).
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import time

MAX_FRAME_BYTES = 4 << 20
PIECE_BYTES = 256 << 10  # the most one send / recv call moves: the granularity of cut-through and pacing


def send_frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def recv_exact(sock: socket.socket, n: int, what: str = "bytes", deadline: float | None = None) -> bytes:
    """``n`` bytes; by ``deadline`` (time.monotonic()) if given, else as the socket's own timeout allows per read
    (the socket's timeout is left changed)."""
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"{what} not complete in time: {len(out)} of {n} bytes")
            sock.settimeout(left)
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError(f"truncated {what}: {len(out)} of {n} bytes" if out else "connection closed")
        out += got
    return bytes(out)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES, within_s: float | None = None) -> dict:
    """The next frame. Its first byte is waited for as the socket's timeout allows (an idle persistent connection);
    with ``within_s`` the rest must follow within that many seconds."""
    first = sock.recv(4)
    if not first:
        raise ConnectionError("connection closed")
    deadline = None if within_s is None else time.monotonic() + within_s
    try:
        head = first + recv_exact(sock, 4 - len(first), "frame header", deadline)
    except ConnectionError:
        raise ConnectionError(f"truncated frame header: {len(first)} of 4 bytes") from None
    (n,) = struct.unpack("!I", head)
    if n > max_bytes:
        raise ConnectionError(f"frame of {n} bytes is over the {max_bytes} limit")
    try:
        obj = json.loads(recv_exact(sock, n, "frame", deadline) if n else b"")
    except ConnectionError as e:
        raise ConnectionError(f"truncated frame ({e})" if str(e) == "connection closed" else str(e)) from None
    except ValueError as e:
        raise ConnectionError(f"malformed frame: {e}") from None
    if not isinstance(obj, dict):
        raise ConnectionError("a frame must be a JSON object")
    return obj


def drain(conn: ssl.SSLSocket, view: memoryview) -> int:
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
