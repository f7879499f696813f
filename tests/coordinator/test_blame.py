"""Blame in the broadcast (echo2/coordinator/blame.py, broadcast/suspects.py): a relay that serves poisoned chunks is
planned around from the next round, so the origin sends about one copy, not one per peer below it; a peer that blames
every source its order named pushes no honest peer back."""

from __future__ import annotations

import os
import time

import pytest

from conftest import holds_within
from echo2.broadcast.relay import RelayServer
from echo2.coordinator import blame
from echo2.coordinator.blame import Claim
from echo2.coordinator.broadcaster import RelayBroadcaster
from echo2.worker.peer import SnapshotReceiver

SECRET = "secret"
CHUNK = 64 << 10
A, B = ("10.0.0.1", 1), ("10.0.0.2", 2)


@pytest.mark.parametrize("failed, claims", [
    ([[*A, {"why": "bad_chunk", "chunk": 3}]], [Claim(A, "bad_chunk", 3)]),
    ([[*A, {"why": "silent", "at": 0}], [*B, {"why": "failed"}]], [Claim(A, "silent"), Claim(B, "failed")]),
    ([[*A, {"why": "slow"}]], []),  # not checkable by a probe: not believed
    ([["10.9.9.9", 9, {"why": "silent"}]], []),  # not a source its order named
    ([[*A]], []),  # no evidence (the old answer's shape)
    ([[*A, {"why": "bad_chunk", "chunk": -1}], [*A, {"why": "bad_chunk"}], "junk", [1, 2, {}]], []),
    ([[*A, {"why": "silent"}]] * 3, [Claim(A, "silent")]),  # once
    ("junk", []),
])
def test_claims(failed, claims):
    assert blame.claims(failed, {A, B}) == claims


def test_a_claim_counts_only_if_the_blamed_source_bears_it_out():
    own = bytes(range(256)) * 4  # 4 chunks of 256 bytes
    good = lambda lo, hi: own[lo:hi]  # noqa: E731
    bad = lambda lo, hi: bytes(hi - lo)  # noqa: E731

    def gone(lo, hi):
        raise ConnectionError("refused")

    chunk = Claim(A, "bad_chunk", 2)
    assert blame.probe_range(chunk, len(own), 256) == (512, 768)
    assert not blame.borne_out(chunk, good, own, 256)
    assert blame.borne_out(chunk, bad, own, 256) and blame.borne_out(chunk, gone, own, 256)
    assert not blame.borne_out(Claim(A, "bad_chunk", 9), bad, own, 256)  # no such chunk
    silent = Claim(A, "silent")
    assert blame.probe_range(silent, len(own), 256) == (0, 1)
    assert not blame.borne_out(silent, good, own, 256) and blame.borne_out(silent, gone, own, 256)


# ---------------------------------------------------------------------- in a broadcast


class Poisoned:
    """A connection through which the bytes of the snapshot (not the frames) go out corrupted."""

    def __init__(self, conn):
        self.conn = conn

    def sendall(self, data):
        if isinstance(data, memoryview):
            data = bytearray(data)
            data[::4096] = bytes(len(data[::4096]))  # a zero every 4 KiB: every chunk fails its digest
            data = bytes(b ^ 1 for b in data[:1]) + bytes(data[1:])
        self.conn.sendall(data)

    def __getattr__(self, name):
        return getattr(self.conn, name)


class Poisoner(RelayServer):
    """Fetches honestly (so it holds, proves and is measured like anyone), serves every chunk corrupted."""

    def _answer(self, conn, req, *rest):
        return super()._answer(Poisoned(conn), req, *rest)


def receivers(got: dict, *names: str, poisoner: str | None = None) -> dict[str, SnapshotReceiver]:
    out = {}
    for n in names:
        r = SnapshotReceiver.of_run(SECRET, lambda v, _b, _m, n=n: got.setdefault(n, []).append(v))
        if n == poisoner:
            r.relay_server.__class__ = Poisoner
        out[n] = r.start()
    return out


def chain(bc: RelayBroadcaster, peers: dict[str, SnapshotReceiver]) -> None:
    for n, r in peers.items():
        bc.add_peer(n, r.url, r.relay_addr)
    with bc.cond:
        for p in bc.peers.values():
            p.rate_bytes_per_s, p.rtt_s = 1e8, 1e-4  # one rate and RTT class: the chain goes by id, a first


def test_a_poisoning_relay_is_planned_around_and_the_origin_then_sends_one_copy():
    """a fetches honestly and serves every chunk corrupted to b, at the head of the chain a -> b -> c -> d. The
    bad bytes are never delivered (digests), but every peer below a repaired every chunk from the origin, every
    round, since a was never blamed. Now b says a served a bad chunk, the learner reads that chunk from a itself,
    finds it bad, and plans a last; the next round the origin sends about one copy. b and c forwarded a's bad bytes
    once (cut-through) and were blamed for it by their children: the learner reads their chunks, finds them good,
    and leaves them in place."""
    got: dict[str, list[int]] = {}
    peers = receivers(got, "a", "b", "c", "d", poisoner="a")
    bc = RelayBroadcaster(SECRET, topology="chain", chunk_mb=CHUNK / (1 << 20), sparse_delta=False)
    try:
        chain(bc, peers)
        size = 16 * CHUNK
        origin_bytes = []
        for v in (1, 2):
            before = bc.server.served_bytes
            bc.publish(v, os.urandom(size))
            assert holds_within(lambda: all(v in got.get(n, []) for n in peers), timeout=30), (v, got)
            origin_bytes.append((bc.server.served_bytes - before) / size)
            if v == 1:
                assert holds_within(lambda: bc.peers["a"].relay_failed_until > time.monotonic(), timeout=15)
        assert origin_bytes[0] > 2.5  # the poisoned round: repairs from the origin
        assert origin_bytes[1] < 1.5, origin_bytes  # a last, nothing poisoned: one copy
        assert all(bc.peers[n].relay_failed_until == 0 for n in "bcd")
    finally:
        bc.close()
        for r in peers.values():
            r.close()


class Accuser(SnapshotReceiver):
    """Fetches honestly, then says every source its order named failed it."""

    def _fetch(self, body, headers):
        out = super()._fetch(body, headers)
        return {**out, "failed_sources": [[*s, {"why": "silent", "at": 0}] for s in body["sources"]]}


def test_a_peer_blaming_every_source_its_order_named_pushes_no_honest_peer_back():
    got: dict[str, list[int]] = {}
    peers = receivers(got, "a", "b", "c")
    peers["z"] = Accuser.of_run(SECRET, lambda v, _b, _m: got.setdefault("z", []).append(v)).start()  # last
    bc = RelayBroadcaster(SECRET, topology="chain", chunk_mb=CHUNK / (1 << 20))
    try:
        chain(bc, peers)
        bc.publish(1, os.urandom(8 * CHUNK))
        assert holds_within(lambda: all(1 in got.get(n, []) for n in peers), timeout=30), got
        assert holds_within(lambda: len(bc.probed) >= 3, timeout=10)  # its claims about a, b and c were checked
        time.sleep(1.0)  # the probes' verdicts
        assert all(bc.peers[n].relay_failed_until == 0 for n in "abc")
    finally:
        bc.close()
        for r in peers.values():
            r.close()
