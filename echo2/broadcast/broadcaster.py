"""The learner's broadcaster: publishes snapshots through the relay (relay.py) along a planned topology.

    publish(v, bytes) ─► (its thread) signed manifest; sparse delta against v' if smaller (delta.py)
                      ─► round: plan (topology.py) over the peers lacking v: those holding v' get the delta,
                         the rest the full snapshot, each group along its own tree
                      ─► POST /fetch {v, base, sources} to each, in parallel
                      ◄─ each answers once it holds v, verified (a delta is applied, then checked against
                         the full snapshot's signed chunk digests)
                      └─ on_delivered(peer, v)  (the coordinator wakes it)

``topology=chain|tree`` is the peer-assisted pipelined broadcast (``broadcast=pipelined``); ``topology=star`` is
one-to-many (``broadcast=one_to_many``), the baseline: every peer pulls from the learner. Same code, same
protocol, so the two are compared on equal terms.

It runs in a background thread of the coordinator's process: ``publish`` only hands the bytes over (digesting
and delta-encoding happen in the thread, never in the caller); a version published while a round is running is
sent when that round ends, and intermediate versions nobody received are skipped (latest wins). A peer that
failed a round is retried after ``retry_s`` (with the full snapshot if a delta was what failed); a late joiner
is sent the latest version, from a peer that already holds it where there is one.

It is built from the run secret (``secret``), from which it derives the broadcast plane's shared key (what peers
check requests with) and the manifest-signing key, which never leaves the learner's processes.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from echo2.broadcast import delta
from echo2.broadcast import topology as topo
from echo2.broadcast.manifest import FULL, make_manifest, signing_key
from echo2.broadcast.relay import RelayServer
from echo2.broadcast.store import Snapshot, Store
from echo2.transport import PEER_NAME, Client, reachable_host, relay_key

log = logging.getLogger(__name__)


@dataclass
class Peer:
    client: Client
    relay: tuple[str, int]
    rate_bytes_per_s: float = 0.0  # measured by its last fetch
    rtt_s: float = 0.0  # TCP's smoothed RTT to its source in its last fetch (0: unknown)
    delivered: int = -1
    retry_at: float = 0.0
    needs_full: bool = False  # its last delta failed (e.g. it no longer holds the base)


class RelayBroadcaster:
    def __init__(self, secret: str, topology: str = "chain", fanout: int = 2, chunk_mb: float = 4.0,
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None, timeout_s: float = 600.0,
                 retry_s: float = 5.0, sparse_delta: bool = True, link: Any = None):
        if topology not in topo.KINDS:
            raise ValueError(f"broadcast.sender.topology={topology!r}: expected one of {topo.KINDS}")
        # the broadcast plane's shared key (peers' routes, byte requests), and the manifest-signing key that only
        # the learner holds: both derived from the run secret, which never leaves the learner's processes
        self.token, self.signer = relay_key(secret), signing_key(secret)
        self.kind, self.fanout = topology, fanout
        self.chunk_bytes = max(1, int(chunk_mb * (1 << 20)))
        self.timeout_s, self.retry_s, self.sparse_delta = timeout_s, retry_s, sparse_delta
        self.on_delivered = None  # set by the coordinator: called (peer, version) after each delivery
        self.store = Store(keep=2)
        self.server = RelayServer(self.store, self.token, host, port, link=link).start()  # link: the lab's, for tests
        # Bound to every interface (0.0.0.0), it is reached at this machine's name unless told otherwise.
        self.origin = (advertise_host or reachable_host(self.server.addr[0]), self.server.addr[1])
        self.peers: dict[str, Peer] = {}
        self.latest: int | None = None
        self.full_manifest: dict | None = None  # of the latest version
        self.delta_base: int | None = None  # the latest version also exists as a delta against this version
        self.incoming: tuple[int, bytes, float] | None = None  # published, not yet digested
        self.published_at: dict[int, float] = {}
        self.cond = threading.Condition()
        self.closed = False
        self.last_time_s = 0.0
        self.last_bytes = 0
        self.last_prepare_s = 0.0
        self.last_delta_ratio = 1.0
        self.failures = 0
        self.rounds = 0
        self.last_results: dict[str, dict] = {}  # peer -> its answer in the last round (diagnostics, benchmarks)
        self.trust = None  # set by use_tls
        self.thread = threading.Thread(target=self._loop, name="broadcast", daemon=True)
        self.thread.start()

    def use_tls(self, trust) -> None:
        """Serve the origin over TLS and reach peers' snapshot routes verified against the run's CA (called by the
        coordinator before any peer is added)."""
        self.trust = trust
        self.server.tls = trust.server

    # ------------------------------------------------------------------ the Broadcaster protocol

    def publish(self, version: int, blob: bytes, probe: dict | None = None) -> None:
        with self.cond:
            self.incoming = (version, blob, probe, time.monotonic())
            self.cond.notify_all()

    def _prepare(self, version: int, blob: bytes, probe: dict | None = None) -> None:
        """Digest and sign the snapshot; encode a delta against the previous one when that is smaller."""
        t0 = time.perf_counter()
        prev = self.store.newest_complete()
        manifest = make_manifest(self.signer, version, blob, self.chunk_bytes, probe=probe)
        self.store.put(Snapshot(manifest, blob))
        base, ratio = None, 1.0
        if self.sparse_delta and prev is not None and prev.version < version:
            kind, payload = delta.choose(blob, prev.buf, prev.version, delta.word_bytes_of(blob))
            if kind == "delta":
                dm = make_manifest(self.signer, version, payload, self.chunk_bytes, base=prev.version)
                self.store.put(Snapshot(dm, payload))
                base, ratio = prev.version, len(payload) / max(len(blob), 1)
        with self.cond:
            self.latest, self.full_manifest, self.delta_base = version, manifest, base
            self.last_prepare_s, self.last_delta_ratio = time.perf_counter() - t0, ratio
            self.cond.notify_all()

    def add_peer(self, peer_id: str, url: str, relay_addr: str | None = None) -> None:
        if not relay_addr:
            log.warning("peer %s has no relay address; it will get no snapshots", peer_id)
            return
        host, _, port = relay_addr.rpartition(":")
        with self.cond:
            client = Client(url, self.token, self.timeout_s, ca_file=self.trust and self.trust.ca_file,
                            server_name=PEER_NAME)
            self.peers[peer_id] = Peer(client, (host, int(port)))
            self.cond.notify_all()

    def remove_peer(self, peer_id: str) -> None:
        with self.cond:
            peer = self.peers.pop(peer_id, None)
        if peer:
            peer.client.close()

    def metrics(self) -> dict[str, float]:
        return {"broadcast/time_s": self.last_time_s, "broadcast/bytes": float(self.last_bytes),
                "broadcast/failures": float(self.failures), "broadcast/rounds": float(self.rounds),
                "broadcast/origin_bytes": float(self.server.served_bytes),
                "broadcast/refused": float(self.server.refused),
                "broadcast/delta_ratio": self.last_delta_ratio, "broadcast/prepare_s": self.last_prepare_s}

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
                self.cond.wait_for(lambda: self.closed or self.incoming is not None or (
                    self.latest is not None and self._due()), timeout=self.retry_s)
                if self.closed:
                    return
                incoming, self.incoming = self.incoming, None
            if incoming is not None:
                version, blob, probe, published_at = incoming
                self.published_at = {version: published_at}
                self._prepare(version, blob, probe)
                continue  # a newer publish may already be waiting: digest that first (latest wins)
            with self.cond:
                if self.latest is None or not self._due():
                    continue
                version, base = self.latest, self.delta_base
                holders = [p.relay for p in self.peers.values() if p.delivered == version]
                groups: dict[int, list[topo.PeerLink]] = {}
                for pid in self._due():
                    p = self.peers[pid]
                    kind = base if base is not None and p.delivered == base and not p.needs_full else FULL
                    groups.setdefault(kind, []).append(topo.PeerLink(pid, p.rate_bytes_per_s, p.rtt_s))
                self.store.pin(version)  # a newer publish must not collect what this round is sending
            try:
                self._round(version, {b: topo.plan(links, self.kind, self.fanout) for b, links in groups.items()},
                            holders)
            finally:
                self.store.pin(version, False)

    def _round(self, version: int, plans: dict[int, dict[str, list[str]]], holders: list[tuple[str, int]]) -> None:
        """One version to every due peer: per object (full, or delta against a base) its own plan."""
        full = self.store.get(version)
        if full is None:
            return
        started = self.published_at.get(version, time.monotonic())
        jobs = [(pid, base, ancestors) for base, plan in plans.items() for pid, ancestors in plan.items()]

        def one(pid: str, base: int, ancestors: list[str]) -> tuple[str, int, dict | Exception]:
            with self.cond:
                peer = self.peers.get(pid)
                ups = [self.peers[a].relay for a in ancestors if a in self.peers]
            if peer is None:
                return pid, base, RuntimeError("left")
            # a full snapshot can also come from peers that already hold it; a delta only along its own plan
            sources = ups + (holders[:2] if base == FULL else []) + [self.origin]
            body = {"version": version, "base": base, "sources": [list(a) for a in sources]}
            if base != FULL:
                body["full_manifest"] = full.manifest
            try:
                return pid, base, peer.client.post("/fetch", body, timeout_s=self.timeout_s)
            except Exception as e:  # a dead peer must not stop the others; the registry will drop it
                return pid, base, e

        sent = 0
        pool = ThreadPoolExecutor(max_workers=max(1, len(jobs)))
        futures = {pool.submit(one, *job): job[0] for job in jobs}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            with self.cond:
                gone = {f for f in pending if futures[f] not in self.peers}
            if gone and gone == pending:
                # Only peers the coordinator has since removed (dead, cut off) are left: their requests may hang
                # until timeout_s; the round is over for everyone else, so the next version can go out.
                log.warning("v%d: round closed without %s (removed mid-round)", version,
                            sorted(futures[f] for f in gone))
                pending = set()
            for future in done:
                pid, base, result = future.result()
                with self.cond:
                    peer = self.peers.get(pid)
                    if peer is None:
                        continue
                    if isinstance(result, Exception):
                        self.failures += 1
                        peer.retry_at = time.monotonic() + self.retry_s
                        peer.needs_full = base != FULL
                        log.warning("snapshot v%d (%s) to %s failed: %s", version,
                                    "full" if base == FULL else f"delta vs v{base}", pid, result)
                        continue
                    peer.delivered = max(peer.delivered, version)
                    peer.needs_full = False
                    self.last_results[pid] = {**result, "base": base, "depth": len(plans[base][pid])}
                    peer.rate_bytes_per_s = float(result.get("bytes_per_s", 0.0))
                    rtt = result.get("rtt_s")
                    if isinstance(rtt, (int, float)) and 0 < rtt < 60:  # a peer's report: bounded, or ignored
                        peer.rtt_s = float(rtt)
                    obj = self.store.get(version, base=base)
                    sent = max(sent, obj.size if obj else 0)
                if self.on_delivered is not None:
                    self.on_delivered(pid, version)
        pool.shutdown(wait=False)  # abandoned requests end by themselves (their timeout, or the peer's reply)
        self.rounds += 1
        self.last_time_s, self.last_bytes = time.monotonic() - started, sent
        log.debug("v%d: round over %d peers (%s) in %.3f s", version, len(jobs), self.kind, self.last_time_s)
