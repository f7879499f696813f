"""Sparse deltas: lossless on any input, chosen only when smaller, and carried by the relay end to end."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import holds_within
from echo2.broadcast import delta
from echo2.coordinator.broadcaster import RelayBroadcaster
from echo2.worker.peer import SnapshotReceiver

TOKEN = "run-secret"


@settings(max_examples=200, deadline=None)
@given(words=st.integers(0, 3000), word_bytes=st.sampled_from([1, 2, 4]), frac=st.floats(0, 1), seed=st.integers())
def test_delta_is_lossless(words, word_bytes, frac, seed):
    rng = np.random.default_rng(seed % 2**32)
    base = rng.integers(0, 256, words * word_bytes, dtype=np.uint8).tobytes()
    new = bytearray(base)
    for i in rng.choice(len(new), size=int(frac * len(new)), replace=False) if len(new) else []:
        new[i] = (new[i] + 1) % 256
    d = delta.encode(bytes(new), base, 7, word_bytes)
    assert delta.apply(base, d) == bytes(new) and delta.base_version(d) == 7
    kind, payload = delta.choose(bytes(new), base, 7, word_bytes)
    assert (kind == "delta") == (len(d) < len(new)) and (payload == d if kind == "delta" else payload == new)


def test_bad_deltas_are_refused():
    base = bytes(64)
    d = delta.encode(b"\1" + bytes(63), base, 3, 2)
    with pytest.raises(ValueError, match="truncated"):
        delta.apply(base, d[:-1])
    with pytest.raises(ValueError, match="does not fit"):
        delta.apply(bytes(32), d)
    with pytest.raises(ValueError):
        delta.encode(bytes(10), bytes(12), 0)


def test_word_size_from_the_safetensors_header():
    import torch

    from echo2.broadcast import snapshot

    assert delta.word_bytes_of(snapshot.encode({"w": torch.zeros(3, dtype=torch.bfloat16)})) == 2
    assert delta.word_bytes_of(snapshot.encode({"w": torch.zeros(3)})) == 4
    assert delta.word_bytes_of(b"garbage!") == 1


def test_relay_sends_a_delta_to_peers_holding_the_base_and_full_to_others():
    chunk = 64 << 10
    v1 = os.urandom(40 * chunk)
    v2 = bytearray(v1)
    for i in range(0, len(v2), 9973 * 2):  # ~1 in 10k words changed: what a small RL step does to bf16 weights
        v2[i] ^= 1
    v2 = bytes(v2)
    got: dict[str, list[tuple[int, bytes]]] = {}
    delivered = []
    peers = {n: SnapshotReceiver.of_run(TOKEN, lambda v, b, _m, n=n: got.setdefault(n, []).append((v, bytes(b)))).start()
             for n in ("p0", "p1", "p2")}
    bc = RelayBroadcaster(TOKEN, topology="chain", chunk_mb=chunk / (1 << 20))
    bc.on_delivered = lambda peer, v: delivered.append((peer, v))
    try:
        for n, r in peers.items():
            bc.add_peer(n, r.url, r.relay_addr)
        bc.publish(1, v1)
        assert holds_within(lambda: len(delivered) == 3)
        origin_v1 = bc.server.served_bytes
        assert origin_v1 == len(v1)
        # p2 loses its copy of v1 (a restart): it cannot apply a delta, and must get v2 whole
        peers["p2"].store.snaps.clear()
        bc.publish(2, v2)
        assert holds_within(lambda: len(delivered) >= 6 or bc.failures > 0)
        assert holds_within(lambda: len(delivered) == 6, 30)
        assert all(vs[-1] == (2, v2) for vs in got.values())  # rebuilt bit for bit, then checked against v2's digests
        assert 0 < bc.last_delta_ratio < 0.05
        sent_v2 = bc.server.served_bytes - origin_v1
        assert sent_v2 < 2 * len(v2)  # the delta once, and p2's full copy (retried after its delta failed)
        assert bc.failures == 1  # p2's delta attempt, then full
        late = peers["late"] = SnapshotReceiver.of_run(TOKEN, lambda v, b, _m: got.setdefault("late", []).append((v, bytes(b))))
        late.start()
        bc.add_peer("late", late.url, late.relay_addr)
        assert holds_within(lambda: got.get("late") == [(2, v2)])  # no base: full, from a peer that holds v2
    finally:
        bc.close()
        for r in peers.values():
            r.close()
