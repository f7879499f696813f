"""The HTTP layer under every server of the run (net.http.JsonServer on echo2/net/httpd.py), against hostile and broken
clients: a body is never read before its sender is authenticated, stalled or half-sent requests are dropped on a
timer, connections are capped, bad bodies and failing handlers are answered, and the server goes on serving."""

from __future__ import annotations

import http.client
import json
import os
import select
import socket
import threading
import time

import pydantic
import pytest
import requests

from conftest import closed_by_server, wait_until
from echo2.net.httpd import Limits
from echo2.net.http import Client, JsonServer
from echo2.net.tls import LEARNER_NAME, RunCA

TOKEN = "t0k"
AUTH = f"Authorization: Bearer {TOKEN}\r\n".encode()
FAST = Limits(header_timeout_s=1.0, body_timeout_s=1.0)  # shrunk from 10 s / 30 s so that a test waits ~1 s


class Echo(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    n: int = pydantic.Field(ge=0)


def _boom(_body, _headers):
    raise RuntimeError("a bug in the route")


ROUTES = {"POST /echo": lambda body, _h: body, "POST /boom": _boom,  # /echo returns a dict, or a schema's model
          "GET /who": lambda _b, h: {"auth": h.get("Authorization")}}


@pytest.fixture
def serve():
    servers = []

    def make(routes=None, **kwargs) -> JsonServer:
        servers.append(JsonServer("127.0.0.1", 0, TOKEN, routes or ROUTES, **kwargs).start())
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def honest(server: JsonServer, timeout_s: float = 2.0) -> float:
    """Seconds an authenticated request took (it fails the test if not answered within ``timeout_s``)."""
    t0 = time.perf_counter()
    r = requests.post(server.url() + "/echo", json={"n": 1}, headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=timeout_s)
    assert r.status_code == 200 and r.json() == {"n": 1}
    return time.perf_counter() - t0


def status_of(sock: socket.socket, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """The status and body of the next response on a raw socket."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


@pytest.mark.parametrize("length", [-1, 400 << 20])
def test_a_body_without_a_credential_is_never_read(serve, length):
    """No token, Content-Length -1 (read to EOF by http.server) or 400 MiB: answered at once, the body unread, the
    server's memory flat. A negative length is not HTTP: the parser refuses it (400) before any route sees it."""
    server = serve()
    before = rss_bytes()
    sock = socket.create_connection(server.address)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length)
    sock.setblocking(False)
    chunk, sent, answer, t0 = b"x" * (1 << 20), 0, b"", time.monotonic()
    while sent < 64 << 20 and b"\r\n\r\n" not in answer and time.monotonic() - t0 < 5:  # stream the body it declared
        readable, writable, _ = select.select([sock], [sock], [], 1.0)
        try:
            if readable:
                answer += sock.recv(65536) or b"\r\n\r\n"
            elif writable:
                sent += sock.send(chunk)
        except ConnectionError:
            break
    assert answer.startswith(b"HTTP/1.1 401" if length > 0 else b"HTTP/1.1 400"), answer[:80]
    assert time.monotonic() - t0 < 1.0 and sent < 16 << 20
    assert rss_bytes() - before < 16 << 20
    sock.close()
    honest(server)


def test_half_sent_headers_neither_block_honest_requests_nor_stay(serve):
    """130 connections that send half their headers and stall: honest requests are answered meanwhile, and every
    stalled connection is dropped after the header timeout."""
    server = serve(limits=FAST)
    stalled, latencies = [], []

    def attacker():
        for _ in range(33):
            s = socket.create_connection(server.address, timeout=5)
            s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthoriz")
            stalled.append(s)

    attackers = [threading.Thread(target=attacker) for _ in range(4)]
    for t in attackers:
        t.start()
    while any(t.is_alive() for t in attackers) or len(latencies) < 5:
        latencies.append(honest(server))
    for t in attackers:
        t.join()
    assert len(stalled) == 132 and latencies
    latencies.append(honest(server))  # with all 132 held
    assert max(latencies) < 1.0, latencies
    assert all(closed_by_server(s, FAST.header_timeout_s + 2) for s in stalled)
    assert server.rejected["HeaderTimeout"] >= 132
    honest(server)


def test_a_body_that_stalls_midway_is_dropped(serve):
    server = serve(limits=FAST)
    sock = socket.create_connection(server.address)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: 1000\r\n\r\n{\"n\": 1" + b" " * 93)
    t0 = time.monotonic()
    honest(server)
    assert closed_by_server(sock, FAST.body_timeout_s + 2)
    assert FAST.body_timeout_s * 0.8 < time.monotonic() - t0 < FAST.body_timeout_s + 2
    assert server.rejected["BodyTimeout"] == 1
    honest(server)


def test_silent_tls_connections_count_against_the_cap_and_are_dropped(serve, tmp_path):
    """TCP connections to a TLS port that never send a ClientHello hold a slot (counted from accept, not from the end
    of a handshake), so a flood of them cannot hold file descriptors unseen. They are anonymous: at most half the cap
    (Limits.anonymous_share), and when that is full a newcomer cuts the oldest of them rather than being refused. The
    authenticated connection is never cut; each silent one is dropped after the header timeout."""
    ca = RunCA(str(tmp_path / "ca"))
    server = serve(limits=Limits(header_timeout_s=1.0, max_connections=4), tls=ca.trust().server)
    client = Client(server.url(), TOKEN, ca_file=ca.ca_file, server_name=LEARNER_NAME)
    assert client.post("/echo", {"n": 1}) == {"n": 1}  # the pinned client's connection: authenticated
    silent = [socket.create_connection(server.address) for _ in range(3)]  # the third cuts the first
    time.sleep(0.3)
    over = socket.create_connection(server.address)  # cuts the second
    assert closed_by_server(silent[0], 0.5) and closed_by_server(silent[1], 0.5)
    assert server.rejected["AnonymousCut"] == 2 and not server.rejected["TooManyConnections"]
    assert client.post("/echo", {"n": 2}) == {"n": 2}  # admitted: its kept-alive connection goes on
    assert closed_by_server(silent[2], 3) and closed_by_server(over, 3)
    # counted once the aborted handshake's error reaches the server's task, which may be just after the close
    wait_until(lambda: server.rejected["HandshakeTimeout"] == 2, timeout_s=2, what="2 handshake timeouts counted")
    fresh = Client(server.url(), TOKEN, ca_file=ca.ca_file, server_name=LEARNER_NAME)
    assert fresh.post("/echo", {"n": 3}) == {"n": 3}
    client.close()
    fresh.close()


def test_connections_beyond_the_cap_are_refused_and_admitted_ones_go_on(serve):
    """Only when every slot holds an authenticated connection is a newcomer refused (503), and the admitted ones
    go on."""
    server = serve(limits=Limits(max_connections=8))
    admitted = [http.client.HTTPConnection(*server.address, timeout=2) for _ in range(8)]
    for c in admitted:
        c.request("POST", "/echo", body=b'{"n": 1}', headers={"Authorization": f"Bearer {TOKEN}"})
        assert c.getresponse().read() == b'{"n": 1}'
    extra = socket.create_connection(server.address)
    status, body = status_of(extra)
    assert status == 503 and "too many" in json.loads(body)["error"]
    assert closed_by_server(extra, 2)
    for c in admitted:  # on their own kept-alive connections, not blocked by the refused one
        sock = c.sock
        c.request("POST", "/echo", body=b'{"n": 2}', headers={"Authorization": f"Bearer {TOKEN}"})
        assert c.getresponse().read() == b'{"n": 2}' and c.sock is sock
    assert server.rejected["TooManyConnections"] >= 1
    for c in admitted:
        c.close()
    time.sleep(0.3)
    honest(server)  # slots free again


def test_bad_bodies_and_handler_errors_are_answered_and_the_server_goes_on(serve):
    server = serve(routes={**ROUTES, "POST /kind": lambda body, _h: {"kind": type(body).__name__}},
                   schemas={"POST /echo": Echo, "POST /kind": Echo})
    conn = http.client.HTTPConnection(*server.address, timeout=2)

    def post(path: str, body: bytes) -> tuple[int, dict]:
        conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {TOKEN}"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())

    status, reply = post("/echo", b"{not json")
    assert status == 400 and "malformed JSON" in reply["error"]
    status, reply = post("/echo", b'{"n": -1}')
    assert status == 400 and reply["error"].startswith("n: ") and "greater than or equal to 0" in reply["error"]
    status, reply = post("/echo", b'{"n": "1", "extra": 2}')
    assert status == 400 and "n: " in reply["error"] and "extra: " in reply["error"]
    status, reply = post("/echo", b"[1, 2]")
    assert status == 400
    status, reply = post("/boom", b"{}")
    assert status == 500 and "a bug in the route" in reply["error"]
    assert post("/echo", b'{"n": 3}') == (200, {"n": 3})  # same connection, still served
    assert post("/kind", b'{"n": 3}') == (200, {"kind": "Echo"})  # the route gets the schema's model
    assert server.rejected["BadRequest"] == 4


def test_framing_limits_are_enforced_before_the_body_is_read(serve):
    """Over the route's limit: 413 at once (the body not sent yet); a chunked body is cut off at the limit; a POST
    with no length: 411; headers past the bound: 400. Each connection is closed; the server goes on."""
    server = serve(route_max_bytes={"POST /echo": 1000})
    declared = socket.create_connection(server.address)
    declared.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: 5000\r\n\r\n")
    assert status_of(declared)[0] == 413
    chunked = socket.create_connection(server.address)
    chunked.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Transfer-Encoding: chunked\r\n\r\n"
                    + b"%x\r\n%s\r\n" % (600, b" " * 600) * 3)
    assert status_of(chunked)[0] == 413
    no_length = socket.create_connection(server.address)
    no_length.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
    assert status_of(no_length)[0] == 411
    huge = socket.create_connection(server.address)
    huge.sendall(b"GET /who HTTP/1.1\r\nHost: x\r\n" + AUTH + b"X-Pad: " + b"p" * (100 << 10) + b"\r\n\r\n")
    assert status_of(huge)[0] == 400
    for s in (declared, chunked, no_length, huge):
        assert closed_by_server(s, 2)
    assert {k: server.rejected[k] for k in ("TooLarge", "LengthRequired", "HeadersTooLarge")} == {
        "TooLarge": 2, "LengthRequired": 1, "HeadersTooLarge": 1}
    honest(server)


def test_keep_alive_and_case_insensitive_headers(serve):
    server = serve()
    conn = http.client.HTTPConnection(*server.address, timeout=2)
    socks = set()
    for _ in range(20):
        conn.request("GET", "/who", headers={"authorization": f"Bearer {TOKEN}"})
        assert json.loads(conn.getresponse().read()) == {"auth": f"Bearer {TOKEN}"}
        socks.add(id(conn.sock))
    assert len(socks) == 1  # one connection for all 20


def test_a_slow_handler_does_not_stall_the_others(serve):
    release = threading.Event()
    server = serve(routes={**ROUTES, "POST /slow": lambda _b, _h: {"ok": release.wait(10)}})
    slow = threading.Thread(target=lambda: Client(server.url(), TOKEN).post("/slow", {}))
    slow.start()
    time.sleep(0.2)
    assert honest(server) < 0.5
    release.set()
    slow.join(5)
    assert not slow.is_alive()


def test_close_ends_kept_alive_connections_and_leaks_no_thread_or_socket(tmp_path):
    """Over TLS, with a kept-alive connection and one stuck before its handshake: close is prompt and leaves no
    thread and no file descriptor behind (the event loop's own process-wide pipe is made by a first server)."""
    JsonServer("127.0.0.1", 0, TOKEN, ROUTES).start().close()
    ca = RunCA(str(tmp_path / "ca"))
    tls = ca.trust().server
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    server = JsonServer("127.0.0.1", 0, TOKEN, ROUTES, tls=tls).start()
    client = Client(server.url(), TOKEN, ca_file=ca.ca_file, server_name=LEARNER_NAME)
    assert client.post("/echo", {"n": 1}) == {"n": 1}
    silent = socket.create_connection(server.address)
    t0 = time.monotonic()
    server.close()
    assert time.monotonic() - t0 < 1.0
    assert closed_by_server(silent, 2)
    with pytest.raises(requests.exceptions.ConnectionError):  # its kept-alive connection was closed, no new one
        client.post("/echo", {"n": 2}, timeout_s=2)
    client.close()
    silent.close()
    deadline = time.monotonic() + 3
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == threads
    assert len(os.listdir("/proc/self/fd")) == fds


# ---------------------------------------------------------------------- one credential, no body where none belongs


def from_address(server: JsonServer, host: str, timeout_s: float = 5.0) -> socket.socket:
    """A connection from another loopback address: a client on another host, as the server sees it."""
    return socket.create_connection(server.address, timeout=timeout_s, source_address=(host, 0))


def test_two_authorization_headers_are_refused_before_the_body(serve):
    """A request carries one credential: one read here and another there (the admission check took the last, the
    route the first) let a worker credential pass for the run secret. Two are refused (400) whichever is first,
    before a byte of the body is read, and the route sees only the identity admission established."""
    seen = []
    server = serve(routes={**ROUTES, "POST /id": lambda _b, h: seen.append(h.identity) or {"ok": True}},
                   authorize=lambda route, cred: {"t0k": "secret", "w": "worker"}.get(cred) or _refuse_cred())
    for first, second in (("junk", TOKEN), (TOKEN, "junk"), (TOKEN, "w"), ("w", TOKEN)):
        sock = socket.create_connection(server.address)
        sock.sendall(b"POST /id HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Length: 100000\r\n\r\n" % (first.encode(), second.encode()))
        status, body = status_of(sock)
        assert status == 400 and "Authorization" in json.loads(body)["error"], (first, second, body)
        assert closed_by_server(sock, 2)
    assert seen == [] and server.rejected["BadRequest"] == 4
    r = requests.post(server.url() + "/id", json={}, headers={"Authorization": "Bearer w"}, timeout=5)
    assert r.status_code == 200 and seen == ["worker"]


def _refuse_cred():
    from echo2.net.http import Unauthorized

    raise Unauthorized("wrong token")


@pytest.mark.parametrize("head", [b"GET /ca HTTP/1.1\r\nHost: x\r\nContent-Length: 16777216\r\n\r\n",
                                  b"GET /ca HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
                                  b"POST /ca HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n",
                                  b"GET /who HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: 50000\r\n\r\n"])
def test_a_public_route_or_a_get_takes_no_body(serve, head):
    """GET /ca is open to anyone (a joining worker fetches the run's CA): a body there was read (up to 64 MiB) and
    parsed before the route ran. A public route, and any GET, with a declared or chunked body is refused on its
    headers: the answer comes without a byte of the body sent (a server that read it would still be waiting)."""
    server = serve(routes={**ROUTES, "GET /ca": lambda _b, _h: {"ca": "pem"}, "POST /ca": lambda _b, _h: {}},
                   public=frozenset({"GET /ca", "POST /ca"}))
    sock = socket.create_connection(server.address)
    sock.sendall(head)
    status, body = status_of(sock)
    assert status == 400 and "takes no body" in json.loads(body)["error"]
    assert closed_by_server(sock, 2)
    assert requests.get(server.url() + "/ca", timeout=5).json() == {"ca": "pem"}  # without a body: served


def test_a_trickled_body_cannot_push_its_deadline_out(serve):
    """A byte every 0.3 s never leaves the body silent for body_timeout_s (1 s), which used to keep the connection
    (and its slot) for as long as the trickle went on. Each byte now buys only 1/min_body_rate s: the body falls
    behind the minimum rate and is dropped about body_timeout_s after it began."""
    server = serve(limits=Limits(body_timeout_s=1.0, min_body_rate_bytes_per_s=1000.0))
    sock = socket.create_connection(server.address)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + AUTH + b"Content-Length: 1000\r\n\r\n{")
    t0, dropped = time.monotonic(), False
    while time.monotonic() - t0 < 6:
        time.sleep(0.3)
        try:
            sock.sendall(b" ")
        except OSError:
            dropped = True
            break
        if closed_by_server(sock, 0.01):
            dropped = True
            break
    assert dropped and time.monotonic() - t0 < 4, time.monotonic() - t0
    assert server.rejected["BodyTimeout"] == 1
    honest(server)


def test_one_address_cannot_hold_the_slots_others_need(serve):
    """An outsider at one address holds anonymous connections (half-sent headers, renewed as they are dropped): it
    gets max_anonymous_per_address of them, and a client at another address is served all along. With a global cap
    only, it took the whole cap and every honest request got 503."""
    server = serve(limits=Limits(max_connections=8, max_anonymous_per_address=3, header_timeout_s=2.0))
    held = []
    for _ in range(10):
        s = from_address(server, "127.0.0.2")
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthoriz")
        held.append(s)
    time.sleep(0.3)
    assert sum(closed_by_server(s, 0.2) for s in held) == 7  # 3 kept, 7 refused at once
    assert server.rejected["TooManyFromAddress"] == 7
    for _ in range(3):  # another host: served, over a fresh connection each time
        c = http.client.HTTPConnection(*server.address, timeout=2, source_address=("127.0.0.3", 0))
        c.request("POST", "/echo", body=b'{"n": 1}', headers={"Authorization": f"Bearer {TOKEN}"})
        assert c.getresponse().status == 200
        c.close()


def test_an_anonymous_connection_is_not_kept_idle(serve):
    """After an answer to a public route, a connection that never authenticated is closed after header_timeout_s,
    not kept for keep_alive_s: an outsider holds no idle slot with GET /ca."""
    server = serve(routes={**ROUTES, "GET /ca": lambda _b, _h: {"ca": "pem"}}, public=frozenset({"GET /ca"}),
                   limits=Limits(header_timeout_s=0.5, keep_alive_s=30.0))
    anonymous = http.client.HTTPConnection(*server.address, timeout=2)
    anonymous.request("GET", "/ca")
    assert anonymous.getresponse().read() == b'{"ca": "pem"}'
    worker = http.client.HTTPConnection(*server.address, timeout=2)
    worker.request("POST", "/echo", body=b'{"n": 1}', headers={"Authorization": f"Bearer {TOKEN}"})
    worker.getresponse().read()
    assert closed_by_server(anonymous.sock, 2)
    assert not closed_by_server(worker.sock, 1.0)  # authenticated: kept alive


def test_one_credential_holds_its_share_of_connections(serve):
    """Authenticated connections are counted per credential (an identity's ``connection_key``): past
    max_connections_per_principal the request is refused (503) and its connection closed; others are not affected."""
    from types import SimpleNamespace

    server = serve(limits=Limits(max_connections_per_principal=2),
                   authorize=lambda _r, cred: SimpleNamespace(connection_key=cred or None))

    def post(cred: str) -> int:
        c = http.client.HTTPConnection(*server.address, timeout=2)
        c.request("POST", "/echo", body=b'{"n": 1}', headers={"Authorization": f"Bearer {cred}"})
        conns.append(c)
        return c.getresponse().status

    conns: list = []
    assert [post("box17") for _ in range(3)] == [200, 200, 503]
    assert post("other") == 200
    assert server.rejected["Unavailable"] == 1
    conns[0].close()
    time.sleep(0.2)
    assert post("box17") == 200


def test_json_nested_past_the_recursion_limit_is_a_400(serve):
    server = serve()
    r = requests.post(server.url() + "/echo", data=b"[" * 100_000 + b"]" * 100_000,
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]
    honest(server)
