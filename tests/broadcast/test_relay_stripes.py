"""The striped relay (topology stripes) over real TCP on loopback: every stripe of a snapshot down its own tree,
with what the chain has: identical bytes, each byte uploaded about once, chunks checked across stripe boundaries
and re-fetched when bad, failover up each stripe's own tree, deadlines per stripe, deltas, signed orders.

Sizes are shrunk (a few MB, 64 KiB chunks, stripes cut off chunk boundaries where it tests the straddling
chunks), so that every test takes seconds.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from conftest import holds_within
from echo2.broadcast import topology
from echo2.coordinator.broadcaster import RelayBroadcaster
from echo2.broadcast.framing import send_frame
from echo2.broadcast.manifest import make_manifest, order_credential, serve_proof, signing_key, verify_key
from echo2.worker.peer import SnapshotReceiver
from echo2.broadcast.relay import Fetcher, RelayServer, Superseded
from echo2.broadcast.store import Snapshot, Store
from echo2.lab import link
from echo2.net.http import Client, RemoteError

SECRET = "stripes-secret"
TOKEN = "5a" * 32
SIGNER, KEY = signing_key(SECRET), verify_key(SECRET)
CHUNK = 64 << 10


class Node:
    """A relay node as a worker runs one: a store, a server on it, a fetcher into it."""

    def __init__(self, link_=None, stall_timeout_s=2.0):
        self.store = Store()
        self.server = RelayServer(self.store, TOKEN, link=link_).start()
        self.fetcher = Fetcher(self.store, TOKEN, link=link_, stall_timeout_s=stall_timeout_s, manifest_key=KEY)

    def close(self):
        self.fetcher.close()
        self.server.close()


def origin_with(blob: bytes, version: int = 1, cls=RelayServer, link_=None) -> RelayServer:
    store = Store()
    store.put(Snapshot(make_manifest(SIGNER, version, blob, CHUNK), blob))
    return cls(store, TOKEN, link=link_).start()


def fetch_all(jobs):
    """Run fetches at once (name -> callable); their results or exceptions by name."""
    out: dict = {}

    def run(name, fn):
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[name] = e

    threads = [threading.Thread(target=run, args=job) for job in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def striped_orders(nodes: dict[str, Node], origin, size: int, stripes: int, align: int = 1):
    """Each node's stripes as the broadcaster would order them: topology.plan_stripes over the nodes (in name
    order: equal rates), each lane its ancestors' relays then the origin."""
    plan = topology.plan_stripes([topology.PeerLink(n) for n in sorted(nodes)], stripes)
    bounds = topology.stripe_bounds(size, stripes, align)
    return plan, {n: [(lo, hi, [nodes[a].server.addr for a in lane] + [origin.addr])
                      for (lo, hi), lane in zip(bounds, plan[n])] for n in nodes}


@pytest.mark.parametrize("stripes, align", [(2, CHUNK), (3, 1)])  # on chunk boundaries, and across chunks
def test_stripes_deliver_identical_bytes_and_every_node_uploads_each_byte_once(stripes, align):
    blob = os.urandom(40 * CHUNK + 777)
    origin = origin_with(blob)
    nodes = {f"n{i}": Node() for i in range(7)}  # 7 mod 2 = 1, 7 mod 3 = 1: every node inner in one tree
    try:
        _, orders = striped_orders(nodes, origin, len(blob), stripes, align)
        got = fetch_all({n: (lambda n=n: nodes[n].fetcher.fetch(1, [origin.addr], stripes=orders[n]))
                         for n in nodes})
        assert {n: bytes(s.buf) for n, s in got.items()} == {n: blob for n in nodes}, got
        assert all(s.complete and not s.bad and s.checked == len(s.manifest["chunks"]) for s in got.values())
        assert origin.served_bytes == len(blob)  # one copy leaves the learner, split over the s roots
        widest = max(hi - lo for lo, hi, _ in orders["n0"])
        assert all(node.server.served_bytes <= stripes * widest for node in nodes.values())  # s children at most
        assert sum(node.server.served_bytes for node in nodes.values()) == (len(nodes) - 1) * len(blob)
    finally:
        origin.close()
        for node in nodes.values():
            node.close()


def test_a_corrupted_chunk_across_a_stripe_boundary_is_refetched_and_never_delivered():
    """A liar on stripe 1 flips a byte in the chunk that straddles the boundary between stripes 0 and 1: the
    chunk is checked once both stripes hold it, fails, and is re-fetched from the origin alone."""
    blob = os.urandom(8 * CHUNK)
    bounds = [(0, 4 * CHUNK - 100), (4 * CHUNK - 100, 8 * CHUNK)]  # chunk 3 straddles
    origin = origin_with(blob)
    bad = bytearray(blob)
    bad[4 * CHUNK - 50] ^= 0xFF  # in chunk 3, on stripe 1's side
    liar_store = Store()
    liar_store.put(Snapshot(make_manifest(SIGNER, 1, blob, CHUNK), bytes(bad)))
    liar = RelayServer(liar_store, TOKEN).start()
    node = Node()
    try:
        stripes = [(*bounds[0], [origin.addr]), (*bounds[1], [liar.addr, origin.addr])]
        snap = node.fetcher.fetch(1, [origin.addr], stripes=stripes)
        assert bytes(snap.buf) == blob and not snap.bad
        assert origin.served_bytes == bounds[0][1] + CHUNK  # stripe 0, then the bad chunk once
        assert liar.served_bytes == bounds[1][1] - bounds[1][0]
    finally:
        node.close()
        liar.close()
        origin.close()


def test_a_stripe_parent_dying_mid_stream_is_routed_around_up_its_own_tree():
    """Stripe 1's parent dies mid-stream: that stripe resumes from its next source (the origin) at the byte held;
    stripe 0, from a live parent, goes on untouched; nothing is fetched twice."""
    blob = os.urandom(32 * CHUNK)  # 2 MiB; the origin paced at 20 Mbit/s: ~0.8 s, time to kill mid-stream
    origin = origin_with(blob, link_=link.Link(up_mbit=20))
    a, b, c = Node(), Node(), Node()
    half = len(blob) // 2
    try:
        # a and b pull one stripe each from the origin and relay it to c
        jobs = {"a": lambda: a.fetcher.fetch(1, [origin.addr], stripes=[(0, half, [origin.addr]),
                                                                         (half, len(blob), [origin.addr])]),
                "b": lambda: b.fetcher.fetch(1, [origin.addr], stripes=[(0, half, [origin.addr]),
                                                                        (half, len(blob), [origin.addr])])}
        result: dict = {}
        threads = [threading.Thread(target=lambda n=n, fn=fn: result.setdefault(n, fn()), daemon=True)
                   for n, fn in jobs.items()]
        for t in threads:
            t.start()
        tc = threading.Thread(target=lambda: result.setdefault("c", c.fetcher.fetch(1, [origin.addr], stripes=[
            (0, half, [a.server.addr, origin.addr]), (half, len(blob), [b.server.addr, origin.addr])])))
        tc.start()
        assert holds_within(lambda: c.store.get(1) is not None and c.store.get(1).spans[1][2] - half > 2 * CHUNK, 10)
        held = c.store.get(1).spans[1][2] - half
        assert held < half, "the kill must land mid-stream"
        b.server.close()
        tc.join(timeout=30)
        assert bytes(result["c"].buf) == blob
        assert a.server.served_bytes == half  # stripe 0 came from a alone
        for t in threads:
            t.join(timeout=30)
        # the origin sent a and b their copies and c only what c lacked of stripe 1 when b died
        assert origin.served_bytes <= 2 * len(blob) + (half - held)
    finally:
        for n in (a, b, c):
            n.close()
        origin.close()


class Trickler(RelayServer):
    """A parent that sends the range asked of it at 20 KB/s: never silent long enough for a stall timeout."""

    def _answer(self, conn, req, *_):
        snap = self.store.get(req["version"])
        end = snap.size if req["end"] == -1 else req["end"]
        send_frame(conn, {"manifest": snap.manifest, "proof": serve_proof(self.token, req["mac"])})
        for i in range(req["start"], end, 4096):
            conn.sendall(memoryview(snap.buf)[i:min(i + 4096, end)])
            time.sleep(0.2)


def test_a_stripe_source_too_slow_for_the_deadline_is_left_for_the_next():
    blob = os.urandom(16 * CHUNK)
    origin, slow = origin_with(blob), origin_with(blob, cls=Trickler)
    node = Node(stall_timeout_s=5)
    half = len(blob) // 2
    try:
        t0 = time.monotonic()
        snap = node.fetcher.fetch(1, [origin.addr], deadline_s=4,
                                  stripes=[(0, half, [origin.addr]), (half, len(blob), [slow.addr, origin.addr])])
        assert bytes(snap.buf) == blob and time.monotonic() - t0 < 6
        assert 0 < len(blob) - origin.served_bytes < CHUNK  # resumed: the trickled bytes were not fetched again
    finally:
        node.close()
        slow.close()
        origin.close()


def test_stripes_that_do_not_tile_the_snapshot_fail_the_fetch_clearly():
    blob = os.urandom(4 * CHUNK)
    origin = origin_with(blob)
    node = Node()
    try:
        with pytest.raises(ConnectionError, match="no source"):
            node.fetcher.fetch(1, [origin.addr], stripes=[(0, CHUNK, [origin.addr]), (CHUNK, 2 * CHUNK,
                                                                                     [origin.addr])])
        assert node.store.get(1) is None  # nothing half-made is kept or served
    finally:
        node.close()
        origin.close()


def test_a_newer_fetch_supersedes_every_stripe_of_an_older_one():
    blob = os.urandom(32 * CHUNK)
    origin = origin_with(blob, link_=link.Link(up_mbit=10))  # 2 MiB at 10 Mbit/s: 1.7 s
    other = origin_with(os.urandom(CHUNK), version=2)
    node = Node()
    half = len(blob) // 2
    try:
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("v1", fetch_all({"x": lambda: node.fetcher.fetch(
            1, [origin.addr], stripes=[(0, half, [origin.addr]), (half, len(blob), [origin.addr])])})["x"]))
        t.start()
        assert holds_within(lambda: node.store.get(1) is not None and node.store.get(1).received > CHUNK, 10)
        assert bytes(node.fetcher.fetch(2, [other.addr]).buf) == bytes(other.store.get(2).buf)
        t.join(timeout=10)
        assert isinstance(out["v1"], Superseded), out
        assert node.store.get(1) is not None  # what arrived is kept for a resumed fetch
    finally:
        node.close()
        other.close()
        origin.close()


class Mute(RelayServer):
    """A parent that answers with the manifest, then sends nothing (until the test releases it)."""

    release = threading.Event()
    asked = 0

    def _answer(self, conn, req, *_):
        type(self).asked += 1
        snap = self.store.get(req["version"])
        send_frame(conn, {"manifest": snap.manifest, "proof": serve_proof(self.token, req["mac"])})
        self.release.wait(30)
        raise ConnectionError("released")


class Dier(RelayServer):
    """A parent that sends one piece of the range asked of it, then hangs up."""

    def _answer(self, conn, req, *_):
        snap = self.store.get(req["version"])
        send_frame(conn, {"manifest": snap.manifest, "proof": serve_proof(self.token, req["mac"])})
        conn.sendall(memoryview(snap.buf)[req["start"]:req["start"] + 4096])
        time.sleep(0.5)  # the sibling stripe is blocked reading its mute parent by now
        raise ConnectionError("hung up")


def test_a_failed_stripe_stops_its_siblings_at_once_and_blames_only_its_own_source():
    """Stripe 0's only source hangs up mid-stream: the fetch fails within a second or so, not after the other
    stripe's stall timeout (its parent is mute, 10 s here), and only the source that failed is reported (the mute
    one was cut off by this node, not by its own fault)."""
    blob = os.urandom(16 * CHUNK)
    dier, mute = origin_with(blob, cls=Dier), origin_with(blob, cls=Mute)
    node = Node(stall_timeout_s=10)
    half = len(blob) // 2
    Mute.release.clear()
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="no source"):
            node.fetcher.fetch(1, [mute.addr], stripes=[(0, half, [dier.addr]), (half, len(blob), [mute.addr])])
        assert time.monotonic() - t0 < 4, "the sibling stripe waited out its stall timeout"
        assert node.fetcher.last_failed == [dier.addr]
        assert node.fetcher.suspects.ranked([mute.addr, dier.addr]) == [mute.addr, dier.addr]  # the mute one not suspect
    finally:
        Mute.release.set()
        node.close()
        dier.close()
        mute.close()


def test_a_partial_copy_laid_out_otherwise_is_finished_from_the_origin_alone():
    """A node holds part of v1 from an unstriped fetch that a newer one superseded; v1's next order comes in two
    stripes, whose parents were planned for that layout (one of them might wait for this node's own bytes): the
    held bytes are kept and the rest comes from the origin, not from the stripes' parents."""
    blob = os.urandom(32 * CHUNK)
    origin = origin_with(blob, link_=link.Link(up_mbit=10))  # 2 MiB at 10 Mbit/s: 1.7 s
    other = origin_with(os.urandom(CHUNK), version=2)
    mute = origin_with(blob, cls=Mute)
    Mute.release.clear()
    Mute.asked = 0
    node = Node(stall_timeout_s=10)
    half = len(blob) // 2
    try:
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("v1", fetch_all({"x": lambda: node.fetcher.fetch(
            1, [origin.addr])})["x"]))
        t.start()
        assert holds_within(lambda: node.store.get(1) is not None and node.store.get(1).received > CHUNK, 10)
        node.fetcher.fetch(2, [other.addr])
        t.join(timeout=10)
        assert isinstance(out["v1"], Superseded), out
        held, served = node.store.get(1).received, origin.served_bytes
        t0 = time.monotonic()
        snap = node.fetcher.fetch(1, [mute.addr, origin.addr], stripes=[(0, half, [mute.addr, origin.addr]),
                                                                        (half, len(blob), [mute.addr, origin.addr])])
        assert bytes(snap.buf) == blob and time.monotonic() - t0 < 8
        assert Mute.asked == 0 and not node.fetcher.last_failed
        assert origin.served_bytes - served <= len(blob) - held + CHUNK  # the held bytes were not fetched again
    finally:
        Mute.release.set()
        node.close()
        other.close()
        mute.close()
        origin.close()


# ---------------------------------------------------------------------- the broadcaster's rounds


def receivers(got: dict, *names: str) -> dict[str, SnapshotReceiver]:
    return {n: SnapshotReceiver.of_run(SECRET, lambda v, b, _m, n=n: got.setdefault(n, []).append((v, bytes(b))))
            .start() for n in names}


def test_broadcaster_stripes_full_snapshots_deltas_and_a_late_joiner():
    """topology=stripes: 5 peers in 2 stripes receive v1 (full) and v2 (a sparse delta, striped too), each byte
    leaving the learner once; a late joiner (alone: a chain of one) gets v2 from a peer holding it."""
    got: dict[str, list] = {}
    peers = receivers(got, *(f"p{i}" for i in range(5)))
    bc = RelayBroadcaster(SECRET, topology="stripes", fanout=2, chunk_mb=CHUNK / (1 << 20))
    try:
        for n, r in peers.items():
            bc.add_peer(n, r.url, r.relay_addr)
        v1 = bytearray(os.urandom(64 * CHUNK))
        bc.publish(1, bytes(v1))
        assert holds_within(lambda: all(len(got.get(n, [])) == 1 for n in peers)), got
        assert all(got[n] == [(1, bytes(v1))] for n in peers)
        assert bc.last_layout == topology.Layout("stripes", 2) and bc.server.served_bytes == len(v1)
        v2 = bytearray(v1)
        for i in range(0, len(v2), 64):  # one bf16 word in 32 changes: a delta of ~1/5 the size
            v2[i] ^= 0x01
        before = bc.server.served_bytes
        bc.publish(2, bytes(v2))
        assert holds_within(lambda: all(len(got.get(n, [])) == 2 for n in peers)), got
        assert all(got[n][1] == (2, bytes(v2)) for n in peers)
        assert bc.last_delta_ratio < 0.5 and bc.last_layout == topology.Layout("stripes", 2)
        delta_bytes = bc.store.get(2, base=1).size
        assert bc.server.served_bytes - before == delta_bytes  # the delta, once, in stripes
        # a peer's answer lands here a moment after its receiver handed v2 on: wait for every answer to v2
        assert holds_within(lambda: all(bc.last_results.get(n, {}).get("version") == 2 for n in peers)), bc.last_results
        assert all(r["base"] == 1 for r in bc.last_results.values())
        before = bc.server.served_bytes
        peers.update(receivers(got, "late"))
        bc.add_peer("late", peers["late"].url, peers["late"].relay_addr)
        assert holds_within(lambda: [v for v, _ in got.get("late", [])] == [2])
        assert got["late"][0][1] == bytes(v2) and bc.server.served_bytes == before
    finally:
        bc.close()
        for r in peers.values():
            r.close()


def test_a_peers_stripes_are_signed_with_its_order():
    """The stripes are part of the order the learner signs: a worker that changes them (to send a peer after
    sources of its choosing, or to cut its ranges) is refused on the body's digest; malformed stripes are a 400."""
    got: dict[str, list] = {}
    r = receivers(got, "r")["r"]
    blob = os.urandom(4 * CHUNK)
    origin = origin_with(blob)
    try:
        body = {"epoch": None, "key": TOKEN, "version": 1, "base": -1, "sources": [list(origin.addr)],
                "deadline_s": 10.0, "challenge": "0" * 32,
                "stripes": [[0, 2 * CHUNK, [list(origin.addr)]], [2 * CHUNK, 4 * CHUNK, [list(origin.addr)]]]}
        credential = order_credential(SIGNER, r.url, 50, body)
        forged = {**body, "stripes": [[0, 4 * CHUNK, [list(origin.addr)]]]}
        with pytest.raises(RemoteError, match="not the one") as e:
            Client(r.url, credential).post("/fetch", forged)
        assert e.value.status == 401 and not got
        for seq, stripes in enumerate([[[0, 5, [list(origin.addr)]], [6, 9, [list(origin.addr)]]],  # a gap
                                       [[1, 5, [list(origin.addr)]]],  # not from byte 0
                                       [[0, 5, []]],  # no sources
                                       [[0, 5, [list(origin.addr)]]] * 17], start=60):  # too many
            bad = {**body, "stripes": stripes}
            with pytest.raises(RemoteError, match="'stripes' must be") as e:
                Client(r.url, order_credential(SIGNER, r.url, seq, bad)).post("/fetch", bad)
            assert e.value.status == 400
        out = Client(r.url, order_credential(SIGNER, r.url, 100, body)).post("/fetch", body)
        assert out["ok"] and got["r"] == [(1, blob)]
    finally:
        r.close()
        origin.close()


def test_a_forged_manifest_on_one_stripe_is_skipped_for_the_next_source():
    blob = os.urandom(8 * CHUNK)
    origin = origin_with(blob)
    forger_store = Store()
    forger_store.put(Snapshot(make_manifest(signing_key(TOKEN), 1, os.urandom(8 * CHUNK), CHUNK)))
    forger = RelayServer(forger_store, TOKEN).start()
    node = Node()
    try:
        snap = node.fetcher.fetch(1, [origin.addr], stripes=[(0, 4 * CHUNK, [origin.addr]),
                                                             (4 * CHUNK, 8 * CHUNK, [forger.addr, origin.addr])])
        assert bytes(snap.buf) == blob and origin.served_bytes == len(blob)
    finally:
        node.close()
        forger.close()
        origin.close()


def test_a_snapshot_laid_out_in_stripes_rejects_a_tiling_with_holes():
    m = make_manifest(SIGNER, 1, b"x" * 100, 16)
    with pytest.raises(ValueError, match="do not tile"):
        Snapshot(m, bounds=[(0, 40), (50, 100)])
    with pytest.raises(ValueError, match="do not tile"):
        Snapshot(m, bounds=[(0, 40)])


# ---------------------------------------------------------------------- the lab's link and bench


def test_the_lab_link_paces_in_slices_of_link_time():
    """A paced send goes out slice by slice (link.SLICE_S of link time each), as a real link delivers packets over
    its duration: a relay hop then forwards the first bytes of a send before its last arrive, at any rate."""
    sent: list[int] = []

    class Sink:
        def sendall(self, data):
            sent.append(len(data))

    bucket = link.TokenBucket(4, burst_bytes=0)  # 4 Mbit/s: 10 ms are 5,000 bytes
    t0 = time.monotonic()
    link.Paced(Sink(), bucket).sendall(b"x" * 50_000)
    assert sum(sent) == 50_000 and max(sent) == bucket.slice_bytes == 5000
    assert time.monotonic() - t0 >= 0.095  # 50 kB at 4 Mbit/s: 100 ms, whatever the slicing
    assert link.TokenBucket(1000).slice_bytes == 1_250_000  # at 1 Gbit/s a relay piece (256 KiB) goes whole


@pytest.mark.e2e
@pytest.mark.slow
def test_the_bench_runs_the_layout_auto_picks_and_reports_the_model_beside_it():
    """``python -m echo2.lab.bench --mode pipelined`` runs what broadcast=pipelined runs (topology auto): at an 80
    ms RTT (the in-process link delays the control path too, so the learner measures it) 5 peers go in stripes,
    the learner uploads each byte once, and the JSON holds the pipeline's own term beside the time."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    out = subprocess.run([sys.executable, "-m", "echo2.lab.bench", "--mode", "pipelined", "--workers", "5",
                          "--size-mb", "2", "--link-mbit", "20", "--rtt-ms", "80", "--reps", "1", "--testbed",
                          "inproc", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["layout"].startswith("stripes(") and r["origin_bytes_per_version"] == r["size_bytes"]
    assert r["added_s"] < r["chain_added_s"] and r["mww_s"] >= 0.8
    assert r["ratio"] > 0.99 and len(r["hops"]) == 5
