"""The learner's broadcaster: publishes snapshots through the relay (relay.py) along a planned topology.

    publish(v, bytes) ─► origin store (signed manifest) ─► round: plan (topology.py) over the peers lacking v
                                                          ─► POST /fetch {v, sources} to each, in parallel
                                                          ◄─ each answers once it holds v, verified
                                                          └─ on_delivered(peer, v)  (the coordinator wakes it)

``topology=chain|tree`` is the peer-assisted pipelined broadcast (``broadcast=pipelined``); ``topology=star`` is
one-to-many (``broadcast=one_to_many``), the baseline: every peer pulls from the learner. Same code, same
protocol, so the two are compared on equal terms.

It runs in a background thread of the coordinator's process: ``publish`` returns at once; a version published
while a round is running is sent when that round ends, and intermediate versions nobody received are skipped
(latest wins). A peer that failed a round is retried after ``retry_s``; a late joiner is sent the latest
version, from a peer that already holds it where there is one.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from echo2.broadcast import relay
from echo2.broadcast import topology as topo
from echo2.rollout.wire import Client

log = logging.getLogger(__name__)


@dataclass
class Peer:
    client: Client
    relay: tuple[str, int]
    rate_bytes_per_s: float = 0.0  # measured by its last fetch
    delivered: int = -1
    retry_at: float = 0.0


class RelayBroadcaster:
    def __init__(self, token: str, topology: str = "chain", fanout: int = 2, chunk_mb: float = 4.0,
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None, timeout_s: float = 600.0,
                 retry_s: float = 5.0, uplink_mbit: float | None = None, latency_ms: float = 0.0):
        if topology not in topo.KINDS:
            raise ValueError(f"broadcast.sender.topology={topology!r}: expected one of {topo.KINDS}")
        self.token, self.kind, self.fanout = token, topology, fanout
        self.chunk_bytes = max(1, int(chunk_mb * (1 << 20)))
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.on_delivered = None  # set by the coordinator: called (peer, version) after each delivery
        self.store = relay.Store(keep=2)
        self.server = relay.RelayServer(self.store, token, host, port,
                                        link=relay.Link(up_mbit=uplink_mbit, latency_s=latency_ms / 1e3)).start()
        self.origin = (advertise_host or self.server.addr[0], self.server.addr[1])
        self.peers: dict[str, Peer] = {}
        self.latest: int | None = None
        self.published_at: dict[int, float] = {}
        self.cond = threading.Condition()
        self.closed = False
        self.last_time_s = 0.0
        self.last_bytes = 0
        self.failures = 0
        self.rounds = 0
        self.thread = threading.Thread(target=self._loop, name="broadcast", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the Broadcaster protocol

    def publish(self, version: int, blob: bytes) -> None:
        manifest = relay.make_manifest(self.token, version, blob, self.chunk_bytes)
        self.store.put(relay.Snapshot(manifest, blob))
        with self.cond:
            self.latest = version
            self.published_at = {version: time.monotonic()}
            self.cond.notify_all()

    def add_peer(self, peer_id: str, url: str, relay_addr: str | None = None) -> None:
        if not relay_addr:
            log.warning("peer %s has no relay address; it will get no snapshots", peer_id)
            return
        host, _, port = relay_addr.rpartition(":")
        with self.cond:
            self.peers[peer_id] = Peer(Client(url, self.token, self.timeout_s), (host, int(port)))
            self.cond.notify_all()

    def remove_peer(self, peer_id: str) -> None:
        with self.cond:
            peer = self.peers.pop(peer_id, None)
        if peer:
            peer.client.close()

    def metrics(self) -> dict[str, float]:
        return {"broadcast/time_s": self.last_time_s, "broadcast/bytes": float(self.last_bytes),
                "broadcast/failures": float(self.failures), "broadcast/rounds": float(self.rounds),
                "broadcast/origin_bytes": float(self.server.served_bytes)}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=5)
        self.server.close()
        for p in self.peers.values():
            p.client.close()

    # ------------------------------------------------------------------ rounds

    def _due(self) -> list[str]:
        now = time.monotonic()
        return [pid for pid, p in self.peers.items() if p.delivered < self.latest and p.retry_at <= now]

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.closed or (self.latest is not None and self._due()),
                                   timeout=self.retry_s)
                if self.closed:
                    return
                if self.latest is None or not self._due():
                    continue
                version, due = self.latest, self._due()
                holders = [p.relay for p in self.peers.values() if p.delivered == version]
                links = [topo.PeerLink(pid, self.peers[pid].rate_bytes_per_s) for pid in due]
                self.store.pin(version)  # a newer publish must not collect what this round is sending
            try:
                self._round(version, topo.plan(links, self.kind, self.fanout), holders)
            finally:
                self.store.pin(version, False)

    def _round(self, version: int, plan: dict[str, list[str]], holders: list[tuple[str, int]]) -> None:
        snap = self.store.get(version)
        if snap is None:
            return
        started = self.published_at.get(version, time.monotonic())

        def sources(pid: str) -> list[list]:
            with self.cond:
                ups = [self.peers[a].relay for a in plan[pid] if a in self.peers]
            return [list(a) for a in ups + holders[:2] + [self.origin]]

        def one(pid: str) -> tuple[str, dict | Exception]:
            peer = self.peers.get(pid)
            if peer is None:
                return pid, RuntimeError("left")
            try:
                return pid, peer.client.post("/fetch", {"version": version, "sources": sources(pid)},
                                             timeout_s=self.timeout_s)
            except Exception as e:  # a dead peer must not stop the others; the registry will drop it
                return pid, e

        with ThreadPoolExecutor(max_workers=max(1, len(plan))) as pool:
            for future in as_completed([pool.submit(one, pid) for pid in plan]):
                pid, result = future.result()
                with self.cond:
                    peer = self.peers.get(pid)
                    if peer is None:
                        continue
                    if isinstance(result, Exception):
                        self.failures += 1
                        peer.retry_at = time.monotonic() + self.retry_s
                        log.warning("snapshot v%d to %s failed: %s", version, pid, result)
                        continue
                    peer.delivered = max(peer.delivered, version)
                    peer.rate_bytes_per_s = float(result.get("bytes_per_s", 0.0))
                if self.on_delivered is not None:
                    self.on_delivered(pid, version)
        self.rounds += 1
        self.last_time_s, self.last_bytes = time.monotonic() - started, snap.size
        log.debug("v%d: round over %d peers (%s) in %.3f s", version, len(plan), self.kind, self.last_time_s)
