"""The relay over real TCP on loopback: integrity, trust, routing around dead peers, late joiners, topologies.

Sizes are shrunk (a few MB, 256 KiB chunks) so that every test takes seconds; the protocol is size-blind.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from echo2.broadcast import topology
from echo2.coordinator.broadcaster import RelayBroadcaster
from echo2.broadcast.framing import send_frame, tcp_rtt_s
from echo2.broadcast.manifest import (BadSnapshot, make_manifest, new_relay_key, serve_proof, signing_key,
                                      verify_key, verify_manifest)
from echo2.worker.peer import SnapshotReceiver
from echo2.broadcast.relay import Fetcher, RelayServer
from echo2.broadcast.store import Snapshot, Store
from echo2.lab import link


SECRET = "run-secret"
TOKEN = new_relay_key()  # the relay key of the moment, which every live worker holds
SIGNER, KEY = signing_key(SECRET), verify_key(SECRET)  # the learner's alone, and its public half
CHUNK = 256 << 10


def node(link=None):
    store = Store()
    server = RelayServer(store, TOKEN, link=link).start()
    return store, server, Fetcher(store, TOKEN, link=link, stall_timeout_s=2, manifest_key=KEY)


def origin_with(blob, version=1, link=None, signer=SIGNER):
    store, server, _ = node(link)
    store.put(Snapshot(make_manifest(signer, version, blob, CHUNK), blob))
    return store, server


def test_manifest_is_authenticated():
    blob = os.urandom(3 * CHUNK + 5)
    m = make_manifest(SIGNER, 7, blob, CHUNK)
    assert verify_manifest(KEY, m) is m and len(m["chunks"]) == 4
    with pytest.raises(BadSnapshot, match="not signed by this run's learner"):
        verify_manifest(verify_key("another-run"), m)
    forged = {**m, "chunks": m["chunks"][:3] + ["0" * 64]}
    with pytest.raises(BadSnapshot, match="not signed by this run's learner"):
        verify_manifest(KEY, forged)
    # a worker holds the relay key, not the learner's: what it signs (as the shared key once let it)
    by_a_worker = make_manifest(signing_key(TOKEN), 7, blob, CHUNK)
    with pytest.raises(BadSnapshot, match="not signed by this run's learner"):
        verify_manifest(KEY, by_a_worker)
    with pytest.raises(BadSnapshot, match="no key"):
        verify_manifest(None, m)
    with pytest.raises(BadSnapshot):
        verify_manifest(KEY, ["not", "a", "dict"])


def test_chain_delivers_identical_bytes_and_the_origin_uploads_once():
    blob = os.urandom(10 * CHUNK + 123)
    _, origin = origin_with(blob)
    a_store, a_server, a = node()
    _, b_server, b = node()
    _, _, c = node()
    got = {}
    # all three fetch at once: b and c are served by their parents while the parents are still receiving
    threads = [threading.Thread(target=lambda n, f, src: got.__setitem__(n, f.fetch(1, src)), args=args) for args in [
        ("a", a, [origin.addr]), ("b", b, [a_server.addr, origin.addr]), ("c", c, [b_server.addr, origin.addr])]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert {k: bytes(v.buf) for k, v in got.items()} == {k: blob for k in "abc"}
    assert all(s.complete and not s.bad for s in got.values())
    assert origin.served_bytes == len(blob)  # every byte left the learner once, whatever the chain's length
    assert a_server.served_bytes == b_server.served_bytes == len(blob)
    assert a_store.newest_complete().version == 1


def test_a_corrupted_chunk_is_detected_refetched_and_never_delivered():
    blob = os.urandom(6 * CHUNK)
    _, origin = origin_with(blob)
    bad = bytearray(blob)
    bad[2 * CHUNK + 17] ^= 0xFF  # a liar serves the right (signed) manifest with one flipped byte
    liar_store, liar = Store(), None
    liar_store.put(Snapshot(make_manifest(SIGNER, 1, blob, CHUNK), bytes(bad)))
    liar = RelayServer(liar_store, TOKEN).start()
    _, _, f = node()
    snap = f.fetch(1, [liar.addr, origin.addr])
    assert bytes(snap.buf) == blob and not snap.bad
    assert origin.served_bytes == CHUNK  # only the bad chunk came from the origin


def test_a_forged_manifest_or_a_wrong_token_is_refused():
    """A forger that holds the relay key (a hostile worker relaying) serves weights of its own under
    a manifest it signed: skipped for the next source. A fetcher without the key is refused everywhere."""
    blob = os.urandom(2 * CHUNK)
    _, forger = origin_with(os.urandom(2 * CHUNK), signer=signing_key(TOKEN))
    _, origin = origin_with(blob)
    _, _, f = node()
    assert bytes(f.fetch(1, [forger.addr, origin.addr]).buf) == blob  # forger skipped, origin served
    outsider = Fetcher(Store(), "not-the-run-token", stall_timeout_s=2, manifest_key=KEY)
    with pytest.raises(ConnectionError, match="no source"):
        outsider.fetch(1, [origin.addr])


def test_a_relay_peer_dying_mid_stream_is_routed_around_without_refetching():
    blob = os.urandom(16 * CHUNK)  # 4 MiB at 40 Mbit/s: ~0.8 s, time to kill the middle peer mid-stream
    _, origin = origin_with(blob, link=link.Link(up_mbit=40))
    _, a_server, a = node()
    b_store, _, b = node()
    ta = threading.Thread(target=lambda: a.fetch(1, [origin.addr]), daemon=True)
    ta.start()
    result = {}
    tb = threading.Thread(target=lambda: result.setdefault("b", b.fetch(1, [a_server.addr, origin.addr])))
    tb.start()
    deadline = time.monotonic() + 10
    while (b_store.get(1) is None or b_store.get(1).received < 4 * CHUNK) and time.monotonic() < deadline:
        time.sleep(0.01)
    held = b_store.get(1).received
    assert 0 < held < len(blob), "the kill must land mid-stream"
    a_server.close()  # the middle peer dies; b resumes from the origin at the byte it holds
    tb.join(timeout=30)
    assert bytes(result["b"].buf) == blob
    ta.join(timeout=30)
    # the origin sent a its copy and b only what b lacked when a died (plus what a had not yet forwarded)
    assert origin.served_bytes <= 2 * len(blob) - held + CHUNK


def test_broadcaster_rounds_late_joiner_and_one_to_many_cost():
    """Chain: three peers receive v1 and v2; a late joiner gets v2 from a peer; star costs the origin N copies."""
    got: dict[str, list[int]] = {}

    def receiver(name):
        return SnapshotReceiver.of_run(SECRET, lambda v, blob, _m, n=name: got.setdefault(n, []).append(v)).start()

    def wait(cond, timeout=20):
        deadline = time.monotonic() + timeout
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.02)
        return cond()

    blob = os.urandom(8 * CHUNK)
    for kind, copies in [("chain", 1), ("star", 3)]:
        got.clear()
        delivered = []
        bc = RelayBroadcaster(SECRET, topology=kind, chunk_mb=CHUNK / (1 << 20))
        bc.on_delivered = lambda peer, v: delivered.append((peer, v))
        peers = {n: receiver(n) for n in ("p0", "p1", "p2")}
        try:
            for n, r in peers.items():
                bc.add_peer(n, r.url, r.relay_addr)
            bc.publish(1, blob)
            assert wait(lambda: len(delivered) == 3), delivered
            assert bc.server.served_bytes == copies * len(blob), kind
            bc.publish(2, blob[::-1])
            assert wait(lambda: len(delivered) == 6)
            assert all(vs == [1, 2] for vs in got.values()) and len(got) == 3
            before = bc.server.served_bytes
            late = peers["late"] = receiver("late")
            bc.add_peer("late", late.url, late.relay_addr)
            assert wait(lambda: got.get("late") == [2])
            if kind == "chain":
                assert bc.server.served_bytes == before  # the joiner pulled from a peer holding v2
        finally:
            bc.close()
            for r in peers.values():
                r.close()


@pytest.mark.parametrize("kind, n, fanout, depth", [
    ("chain", 8, 2, 8), ("tree", 7, 2, 3), ("tree", 8, 2, 4), ("tree", 9, 3, 3), ("star", 8, 2, 1), ("chain", 0, 2, 0)])
def test_topology_table(kind, n, fanout, depth):
    peers = [topology.PeerLink(f"w{i}", rate_bytes_per_s=float(i)) for i in range(n)]
    plan = topology.plan(peers, kind, fanout)
    assert topology.depth(plan) == depth and set(plan) == {p.peer_id for p in peers}
    if n:
        assert plan[f"w{n - 1}"] == []  # the fastest peer pulls from the origin
    for pid, ancestors in plan.items():  # every source list walks up the tree: parent first
        for child, parent in zip([pid] + ancestors, ancestors):
            assert plan[child][0] == parent


@pytest.mark.parametrize("links, first", [
    ([("a", 100e6, 0.10), ("b", 50e6, 0.01)], "a"),   # twice the rate wins, whatever the RTT
    ([("a", 105e6, 0.10), ("b", 100e6, 0.01)], "b"),  # same rate class (within 10 %): the nearer peer first
    ([("a", 0.0, 0.01), ("b", 1e6, 0.20)], "b"),      # unmeasured peers go last
])
def test_topology_orders_by_measured_rate_then_rtt(links, first):
    peers = [topology.PeerLink(pid, rate, rtt) for pid, rate, rtt in links]
    assert topology.order(peers)[0].peer_id == first


def test_tcp_rtt_of_a_live_connection():
    srv = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(srv.getsockname()[:2])
    conn, _ = srv.accept()
    try:
        c.sendall(b"x" * 1000)
        conn.recv(1000)
        rtt = tcp_rtt_s(c)
        assert rtt is None if not hasattr(socket, "TCP_INFO") else 0 < rtt < 0.1  # loopback: microseconds
        assert tcp_rtt_s(None) is None
    finally:
        for s in (c, conn, srv):
            s.close()


def test_token_bucket_rate():
    """The link model's own arithmetic (not a timing assertion on the relay): 2 MB at 80 Mbit/s is 0.2 s."""
    tb = link.TokenBucket(80, burst_bytes=0)
    t0 = time.monotonic()
    for _ in range(20):
        tb.take(100_000)
    assert time.monotonic() - t0 >= 0.19



def test_the_lab_link_delays_and_paces_what_a_node_fetches():
    """The lab's link around a fetcher's connection (echo2/lab/link.py): behind a 0.3 s one-way latency no byte lands
    before 0.3 s, behind an 80 Mbit/s downlink 2 MiB take at least 0.15 s more (its burst is 0.2 MB), and the bytes
    are exact; a node with no link gets none of it (the relay's connections are the sockets themselves)."""
    blob = os.urandom(8 * CHUNK)
    _, origin = origin_with(blob)
    f = Fetcher(Store(), TOKEN, link=link.Link(down_mbit=80, latency_s=0.3), stall_timeout_s=2, manifest_key=KEY)
    t0 = time.monotonic()
    snap = f.fetch(1, [origin.addr])
    assert bytes(snap.buf) == blob
    assert snap.first_byte_at - t0 >= 0.3 and time.monotonic() - t0 >= 0.45
    plain = Fetcher(Store(), TOKEN, stall_timeout_s=2, manifest_key=KEY)
    plain.fetch(1, [origin.addr])
    assert all(isinstance(c, socket.socket) for c in plain.conns.values())
    f.close()
    plain.close()


def test_store_collects_old_versions_but_not_pinned_ones_and_never_waits_for_collected_ones():
    store = Store(keep=2)

    def snap(v):
        return Snapshot(make_manifest(SIGNER, v, b"x" * 10, CHUNK), b"x" * 10)

    store.put(snap(1))
    store.pin(1)  # being broadcast
    for v in (2, 3, 4):
        store.put(snap(v))
    assert sorted(v for v, _ in store.snaps) == [1, 3, 4]
    store.pin(1, False)
    assert sorted(v for v, _ in store.snaps) == [3, 4]
    t0 = time.monotonic()
    assert store.get(2, wait_s=5) is None and time.monotonic() - t0 < 1  # collected: no point waiting
    threading.Timer(0.2, lambda: store.put(snap(5))).start()
    assert store.get(5, wait_s=5).version == 5  # newer: worth waiting for (a parent still receiving it)


def test_a_stalled_relay_peer_is_routed_around():
    """A peer that stops sending mid-stream (SIGSTOP, a cut link) is dropped after the stall timeout; the
    fetch resumes from the next source at the byte it holds."""
    blob = os.urandom(8 * CHUNK)
    _, origin = origin_with(blob)

    class Staller(RelayServer):
        def _answer(self, conn, req, *_):
            snap = self.store.get(req["version"])
            send_frame(conn, {"manifest": snap.manifest, "proof": serve_proof(TOKEN, req["mac"])})
            conn.sendall(memoryview(snap.buf)[req["start"]:req["start"] + CHUNK + 100])
            time.sleep(30)  # then nothing

    s_store, _ = Store(), None
    s_store.put(Snapshot(make_manifest(SIGNER, 1, blob, CHUNK), blob))
    staller = Staller(s_store, TOKEN).start()
    store = Store()
    f = Fetcher(store, TOKEN, stall_timeout_s=1, manifest_key=KEY)
    t0 = time.monotonic()
    snap = f.fetch(1, [staller.addr, origin.addr])
    assert bytes(snap.buf) == blob and time.monotonic() - t0 < 10
    assert origin.served_bytes == len(blob) - (CHUNK + 100)  # resumed, nothing fetched twice
