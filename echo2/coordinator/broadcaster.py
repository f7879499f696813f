"""The relay's origin, in the coordinator process: publishes the learner's snapshots through the relay
(broadcast/relay.py) along a planned topology.

    publish(v, bytes) ─► (its thread) signed manifest; sparse delta against v' if smaller (broadcast/delta.py)
                      ─► round: plan (broadcast/topology.py) over the idle peers lacking v: those holding v' get the
                         delta, the rest the full snapshot, each group along its own layout (chain, tree, stripes)
                      ─► POST /fetch {epoch, key, v, base, sources, [stripes], deadline_s, challenge, tickets} to
                         each, in parallel, each signed for that peer alone (manifest.order_credential)
                      ◄─ each answers once it holds v, verified (a delta is applied, then checked against the full
                         snapshot's signed chunk digests), with a proof that it does (manifest.possession_proof)
                      └─ on_delivered(peer, v)  (the coordinator wakes it)

``topology=auto|chain|tree|stripes`` is the peer-assisted pipelined broadcast (``broadcast=pipelined`` runs
``auto``: each round the chain, or the snapshot cut into stripes that travel down trees of depth log N, whichever
topology.choose predicts faster for that round's peers, their RTT and rate); ``topology=star`` is one-to-many
(``broadcast=one_to_many``), the baseline: every peer pulls from the learner. Same code, same protocol, so they
are compared on equal terms.

It runs in a background thread of the coordinator's process: ``publish`` only hands the bytes over (digesting
and delta-encoding happen in the thread, never in the caller); a version published while a round is running is
sent when that round ends, and intermediate versions nobody received are skipped (latest wins). A peer that
failed a round is retried after ``retry_s`` (with the full snapshot if a delta was what failed); a late joiner
is sent the latest version, from a peer that already holds it where there is one.

Deadlines. A round waits for each peer until its deadline, ``deadline_floor_s + deadline_slack · bytes / rate``,
never past ``timeout_s``; ``rate`` is measured here, from the peer's order to its proven answer, and taken no
lower than the pool's median (a slow peer, or one slow on purpose, is never waited for past what the typical
peer needs; an unmeasured one gets the median, or ``timeout_s`` while no peer is measured). The round then closes
without the late ones: they go on in the background, their answers still count when they come, and they are sent
the newest version once done (a busy peer gets no second order). Each order also tells the peer its own deadline
(from its own rate), by which its fetcher leaves a source too slow to meet it for the next (broadcast/relay.py): a slow
peer does not hold up its successors.

Who goes where. Peers are ordered by the rates measured here and the RTT of their quickest answer to a key order
(broadcast/topology.py), never by what a peer reports of itself; a new or failed peer has no rate and goes last, where it
has no successor in a chain and none but leaves below it in a tree. So does, for a while (relay.SUSPECT_S), a peer
whose relay a successor says failed it, once the learner has checked the claim by asking that relay itself
(coordinator/blame.py: only sources the order named, a chunk that really is bad there, a relay that really does
not answer): one that fetches well but never serves, or serves bad chunks, would otherwise keep its place (its
children then fetch everything from the origin, one-to-many in disguise), and one that lies about its sources
would push honest peers back. In stripes (``auto`` at
large N or RTT), every stripe has its own tree and each peer is an inner node of one of them: an order names per
stripe its byte range and its ancestors in that stripe's tree, then the holders and the origin, and the peer pulls
all stripes at once.

Keys. It is built from the run secret (``secret``), from which it derives the manifest-signing key, which never
leaves the learner's processes. The relay key is random: made at start, handed to each peer when it joins and in
every order, and replaced by ``rekey`` (called when a worker credential is revoked), after which a revoked worker
can neither pull from a peer nor pass for a source.
"""

from __future__ import annotations

import logging
import secrets
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from echo2.broadcast import delta
from echo2.broadcast import topology as topo
from echo2.broadcast.manifest import (FULL, MAX_SOURCES, make_manifest, manifest_digest, new_relay_key,
                                      order_credential, possession_proof, relay_ticket, relay_tickets, signing_key,
                                      verify_key)
from echo2.broadcast.relay import MAX_CONNS, SUSPECT_S, Fetcher, RelayServer
from echo2.broadcast.store import Snapshot, Store
from echo2.coordinator import blame
from echo2.coordinator.order_seq import OrderSequence
from echo2.metrics import (BROADCAST_BYTES, BROADCAST_DELTA_RATIO, BROADCAST_FAILURES, BROADCAST_LATE,
                           BROADCAST_ORIGIN_BYTES, BROADCAST_PREPARE_S, BROADCAST_PROBE_FAILURES, BROADCAST_PROBE_S,
                           BROADCAST_REFUSED, BROADCAST_ROUNDS, BROADCAST_STRIPES, BROADCAST_TIME_S)
from echo2.net.http import Client, reachable_host
from echo2.net.tls import LEARNER_NAME, PEER_NAME

log = logging.getLogger(__name__)

DEADLINE_FLOOR_S = 10.0
"""Least time a round waits for a peer: TLS handshakes, a few round trips along the chain and a parent's wait for
its own first bytes dominate a small snapshot's transfer."""

DEADLINE_SLACK = 3.0
"""A peer's deadline is this many times its expected transfer time (bytes / measured rate): a rate drifts with
cross traffic, and in a chain every peer moves at the slowest link before it."""

MAX_ANCESTORS = 4
"""Ancestors an order names as sources before the holders and the origin: in a long chain, falling back more
than a few hops up gains nothing over the origin, and every dead source costs the fetcher a timeout."""

RATE_MIN_BYTES = 1 << 20
"""A transfer smaller than this measures round trips and handshakes more than bandwidth (a small delta): it leaves
the peer's measured rate as it was."""

MIN_ALIGNED_CHUNKS = 8
"""Chunks per stripe from which stripes are cut on chunk boundaries (at worst one chunk, 1/8, longer than another)."""

KEY_TIMEOUT_S = 10.0
"""A key order (a small request answered at once) that takes longer has failed; the peer's next order carries
the key anyway."""


@dataclass
class Order:
    """One fetch order in flight: what a peer was asked for, and by when."""

    version: int
    base: int
    wire_bytes: int
    sent_at: float
    deadline_s: float  # the peer's own: bytes over its measured rate (its fetcher judges sources by it)
    proof: str  # the answer that proves it holds the snapshot
    depth: int
    sources: tuple = ()  # the relay addresses it was told to pull from


@dataclass
class Peer:
    client: Client
    url: str
    relay: tuple[str, int]
    rate_bytes_per_s: float = 0.0  # measured here: bytes over the time from its order to its proven answer
    rtt_s: float = 0.0  # measured here: its quickest answer to a key order (0: none yet)
    delivered: int = -1
    retry_at: float = 0.0
    needs_full: bool = False  # its last delta failed (e.g. it no longer holds the base)
    busy: Order | None = None  # the order it is carrying out
    relay_failed_until: float = 0.0  # a peer it was a source for says its relay failed it: planned last until then
    server_name: str = PEER_NAME  # what its certificates must name (its credential's): for its orders and its fetchers


Source = tuple[tuple[str, int], str]  # a relay source's address and the name its certificate must carry


class RelayBroadcaster:
    def __init__(self, secret: str, topology: str = "auto", fanout: int = topo.FANOUT, chunk_mb: float = 4.0,
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None, timeout_s: float = 600.0,
                 retry_s: float = 5.0, sparse_delta: bool = True, link: Any = None,
                 deadline_floor_s: float = DEADLINE_FLOOR_S, deadline_slack: float = DEADLINE_SLACK,
                 state_dir: str | None = None):
        """``state_dir``: where the order sequence's high-water mark is kept (the run directory; order_seq.py)."""
        if topology not in topo.KINDS:
            raise ValueError(f"broadcast.sender.topology={topology!r}: expected one of {topo.KINDS}")
        # the manifest- and order-signing key that only the learner holds (derived from the run secret, which never
        # leaves the learner's processes), and the relay key, random, replaced on each revocation
        self.signer, self.token = signing_key(secret), new_relay_key()
        self.epoch: str | None = None  # set by the coordinator: the learner process's epoch, in every manifest
        self.kind, self.fanout = topology, fanout
        self.chunk_bytes = max(1, int(chunk_mb * (1 << 20)))
        self.timeout_s, self.retry_s, self.sparse_delta = timeout_s, retry_s, sparse_delta
        self.deadline_floor_s, self.deadline_slack = deadline_floor_s, deadline_slack
        self.on_delivered = None  # set by the coordinator: called (peer, version) after each delivery
        self.on_ordered = None  # set by the coordinator: called (peer, version) before each order is sent
        self.store = Store(keep=2)
        self.public_key = verify_key(secret)  # what peers check manifests, orders and tickets against
        self.server = RelayServer(self.store, self.token, host, port, link=link,  # link: the lab's, for tests
                                  ticket_key=self.public_key).start()
        # Bound to every interface (0.0.0.0), it is reached at this machine's name unless told otherwise.
        self.origin = (advertise_host or reachable_host(self.server.addr[0]), self.server.addr[1])
        self.server.advertise(self.origin)  # what its tickets name (orders name the origin so)
        self.peers: dict[str, Peer] = {}
        self.latest: int | None = None
        self.full_manifest: dict | None = None  # of the latest version
        self.delta_base: int | None = None  # the latest version also exists as a delta against this version
        self.incoming: tuple[int, bytes, float] | None = None  # published, not yet digested
        self.published_at: dict[int, float] = {}
        self.cond = threading.Condition()
        self.closed = False
        self.seqs = OrderSequence(state_dir)  # the orders' numbers (order_seq.py)
        self.last_time_s = 0.0
        self.last_bytes = 0
        self.last_prepare_s = 0.0
        self.last_probe_s = 0.0  # computing the last version's probe here (a callable probe: the coordinator's prober)
        self.probe_failures = 0
        self.last_delta_ratio = 1.0
        self.last_layout: topo.Layout | None = None  # the last round's (logged when it changes; metrics)
        self.failures = 0
        self.late = 0  # peers a round closed without (past their deadline)
        self.rounds = 0
        self.last_results: dict[str, dict] = {}  # peer -> its answer in the last round (diagnostics, benchmarks)
        self.trust = None  # set by use_tls
        self.probed: set[tuple] = set()  # (relay, version, base) whose blame was checked (once a version)
        self.keys = ThreadPoolExecutor(max_workers=16, thread_name_prefix="broadcast-key")  # key orders
        self.checks = ThreadPoolExecutor(max_workers=4, thread_name_prefix="broadcast-blame")  # blame.py's probes
        self.thread = threading.Thread(target=self._loop, name="broadcast", daemon=True)
        self.thread.start()

    def use_tls(self, trust) -> None:
        """Serve the origin over TLS and reach peers' snapshot routes verified against the run's CA (called by the
        coordinator before any peer is added)."""
        self.trust = trust
        self.server.tls = trust.server

    # ------------------------------------------------------------------ the Broadcaster protocol

    def publish(self, version: int, blob: bytes, probe: dict | Callable[[bytes], dict] | None = None) -> None:
        with self.cond:
            self.incoming = (version, blob, probe, time.monotonic())
            self.cond.notify_all()

    def _prepare(self, version: int, blob: bytes, probe: dict | Callable[[bytes], dict] | None = None) -> None:
        """Digest and sign the snapshot; encode a delta against the previous one when that is smaller. A callable
        ``probe`` computes the probe from the bytes first (the coordinator's prober); if it fails, the version is
        not published (counted; the next one is)."""
        if callable(probe):
            t_probe = time.perf_counter()
            try:
                probe = probe(blob)
            except Exception as e:
                self.probe_failures += 1
                log.error("v%d: its probe failed (%s: %s): not published; workers get the next version", version,
                          type(e).__name__, e)
                return
            self.last_probe_s = time.perf_counter() - t_probe
        t0 = time.perf_counter()
        prev = self.store.newest_complete()
        manifest = make_manifest(self.signer, version, blob, self.chunk_bytes, probe=probe, epoch=self.epoch)
        self.store.put(Snapshot(manifest, blob))
        base, ratio = None, 1.0
        if self.sparse_delta and prev is not None and prev.version < version:
            kind, payload = delta.choose(blob, prev.buf, prev.version, delta.word_bytes_of(blob))
            if kind == "delta":
                dm = make_manifest(self.signer, version, payload, self.chunk_bytes, base=prev.version,
                                   epoch=self.epoch)
                self.store.put(Snapshot(dm, payload))
                base, ratio = prev.version, len(payload) / max(len(blob), 1)
        with self.cond:
            self.latest, self.full_manifest, self.delta_base = version, manifest, base
            self.last_prepare_s, self.last_delta_ratio = time.perf_counter() - t0, ratio
            self.cond.notify_all()

    def add_peer(self, peer_id: str, url: str, relay_addr: str | None = None, server_name: str | None = None) -> None:
        """``server_name``: what the peer's certificate must name before it is sent an order (with TLS): its
        credential's name (net.tls.credential_peer_name) where the coordinator knows it; else the role, PEER_NAME."""
        if not relay_addr:
            log.warning("peer %s has no relay address; it will get no snapshots", peer_id)
            return
        host, _, port = relay_addr.rpartition(":")
        with self.cond:
            name = server_name or PEER_NAME
            client = Client(url, "", self.timeout_s, ca_file=self.trust and self.trust.ca_file, server_name=name)
            self.peers[peer_id] = Peer(client, url.rstrip("/"), (host, int(port)), server_name=name)  # orders name it so
            self.server.slots.max_conns = max(MAX_CONNS, 2 * len(self.peers))  # one_to_many: all pull from here
            self.cond.notify_all()
        self._send_key(peer_id)  # the relay key now, before its first order (and a first RTT measurement)

    def remove_peer(self, peer_id: str) -> None:
        with self.cond:
            peer = self.peers.pop(peer_id, None)
            self.cond.notify_all()
        if peer:
            peer.client.close()

    def rekey(self) -> None:
        """A worker credential was revoked (its workers removed first): a new relay key, handed to every live peer
        now; from then on a node holding only the old one can neither pull from a peer nor serve one."""
        with self.cond:
            self.token = new_relay_key()
            self.server.use_key(self.token)
            peers = list(self.peers)
        log.warning("relay key replaced after a revocation; handing it to %d peers", len(peers))
        for pid in peers:
            self._send_key(pid)

    def metrics(self) -> dict[str, float]:
        return {BROADCAST_TIME_S: self.last_time_s, BROADCAST_BYTES: float(self.last_bytes),
                BROADCAST_FAILURES: float(self.failures), BROADCAST_ROUNDS: float(self.rounds),
                BROADCAST_LATE: float(self.late),
                BROADCAST_ORIGIN_BYTES: float(self.server.served_bytes),
                BROADCAST_REFUSED: float(self.server.refused),
                BROADCAST_DELTA_RATIO: self.last_delta_ratio, BROADCAST_PREPARE_S: self.last_prepare_s,
                BROADCAST_PROBE_S: self.last_probe_s, BROADCAST_PROBE_FAILURES: float(self.probe_failures),
                BROADCAST_STRIPES: float(self.last_layout.stripes if self.last_layout else 1)}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=5)
        self.keys.shutdown(wait=False, cancel_futures=True)
        self.checks.shutdown(wait=False, cancel_futures=True)
        self.server.close()
        for p in list(self.peers.values()):
            p.client.close()

    # ------------------------------------------------------------------ orders

    def _credential(self, url: str, body: dict, full_digest: str | None = None) -> str:
        """The learner's signature on ``body`` for the peer at ``url``. Holds the lock. Sequence numbers increase
        across restarts and clock steps (order_seq.py)."""
        return order_credential(self.signer, url, self.seqs.next(), body, full_digest)

    def _send_key(self, peer_id: str) -> None:
        with self.cond:
            peer = self.peers.get(peer_id)
            if peer is None or self.closed:
                return
            body = {"epoch": self.epoch, "key": self.token}
            credential = self._credential(peer.url, body)

        def send():
            t0 = time.monotonic()
            try:
                peer.client.post("/key", body, headers={"Authorization": f"Bearer {credential}"},
                                 timeout_s=KEY_TIMEOUT_S)
            except Exception as e:  # its next order carries the key
                log.warning("relay key to %s failed: %s", peer_id, e)
                return
            rtt_s = time.monotonic() - t0
            with self.cond:
                peer.rtt_s = min(peer.rtt_s or rtt_s, rtt_s)

        try:
            self.keys.submit(send)
        except RuntimeError:  # closed meanwhile
            pass

    def _order(self, pid: str, version: int, base: int, lanes: list[list[str]], holders: list[Source],
               full: Snapshot, full_digest: str) -> tuple[Peer, dict, str, Order] | None:
        """The order for peer ``pid`` (None if it left), marking it busy with it. ``lanes``: its ancestors per
        stripe (one lane: not striped)."""
        with self.cond:
            peer = self.peers.get(pid)
            if peer is None:
                return None
            # a full snapshot can also come from peers that already hold it; a delta only along its own plan. Each
            # source with the name its certificate must carry: its own worker's credential's, not whoever else
            # registered the same address (its first naming here wins: the order's tickets are keyed by address)
            named = (holders[:2] if base == FULL else []) + [(self.origin, LEARNER_NAME)]
            ancestry = [[self.peers[a] for a in ancestors[:MAX_ANCESTORS] if a in self.peers] for ancestors in lanes]
            names: dict[tuple[str, int], str] = {}
            for addr, name in [(p.relay, p.server_name) for lane in ancestry for p in lane] + named:
                names.setdefault(addr, name)
            extra = [addr for addr, _ in named]
            per_lane = [[p.relay for p in lane] + extra for lane in ancestry]
            obj = self.store.get(version, base=base)
            wire_bytes = obj.size if obj is not None else full.size
            deadline_s = self._deadline_s(wire_bytes, peer.rate_bytes_per_s)
            challenge = secrets.token_hex(16)
            if len(lanes) == 1:
                sources, stripes = per_lane[0], None
            else:  # every stripe's parent, then the holders and the origin: the sources of repairs
                parents = list(dict.fromkeys(lane[0] for lane in per_lane if lane[0] not in extra))
                sources = parents[:MAX_SOURCES - len(extra)] + extra
                bounds = topo.stripe_bounds(wire_bytes, len(lanes), _align(wire_bytes, self.chunk_bytes, len(lanes)))
                stripes = [[lo, hi, [list(a) for a in lane]] for (lo, hi), lane in zip(bounds, per_lane)]
            every_source = tuple(dict.fromkeys(tuple(a) for lane in [sources, *per_lane] for a in lane))
            body = {"epoch": self.epoch, "key": self.token, "version": version, "base": base,
                    "sources": [list(a) for a in sources], "deadline_s": deadline_s, "challenge": challenge,
                    # each source gives it a lasting connection slot for this version (broadcast/relay_slots.py)
                    "tickets": [[*t, names[tuple(t[:2])]]
                                for t in relay_tickets(self.signer, pid, version, base, len(lanes), every_source)]}
            if stripes is not None:
                body["stripes"] = stripes
            if base != FULL:
                body["full_manifest"] = full.manifest
            order = Order(version, base, wire_bytes, time.monotonic(), deadline_s,
                          possession_proof(challenge, full.buf), max(len(a) for a in lanes), every_source)
            peer.busy = order
            return peer, body, self._credential(peer.url, body, full_digest), order

    def _send(self, pid: str, peer: Peer, body: dict, credential: str, order: Order) -> None:
        if self.on_ordered is not None:  # before the peer can hold it: it may use it before its answer lands here
            self.on_ordered(pid, order.version)
        try:
            result = peer.client.post("/fetch", body, headers={"Authorization": f"Bearer {credential}"},
                                      timeout_s=self.timeout_s)
        except Exception as e:  # a dead peer must not stop the others; the registry will drop it
            result = e
        self._settle(pid, peer, order, result)

    def _settle(self, pid: str, peer: Peer, order: Order, result: dict | Exception) -> None:
        """A peer's answer to ``order``, in its round or after it closed: delivered (proven), or failed."""
        now = time.monotonic()
        with self.cond:
            if self.peers.get(pid) is not peer or peer.busy is not order:
                return  # removed (or joined again) since
            peer.busy = None
            self.cond.notify_all()
            if not isinstance(result, Exception) and result.get("proof") != order.proof:
                result = RuntimeError("its answer does not prove it holds the snapshot")
            if isinstance(result, Exception):
                self.failures += 1
                peer.retry_at = now + self.retry_s
                peer.needs_full = order.base != FULL
                peer.rate_bytes_per_s = 0.0  # unmeasured again: last in the next plan
                log.warning("snapshot v%d (%s) to %s failed: %s", order.version,
                            "full" if order.base == FULL else f"delta vs v{order.base}", pid, result)
                return
            peer.delivered = max(peer.delivered, order.version)
            peer.needs_full = False
            self._blame(pid, order, result.get("failed_sources"), now)
            if order.wire_bytes >= RATE_MIN_BYTES or not peer.rate_bytes_per_s:
                peer.rate_bytes_per_s = order.wire_bytes / max(now - order.sent_at, 1e-3)
            self.last_results[pid] = {**result, "base": order.base, "depth": order.depth}
        if self.on_delivered is not None:
            self.on_delivered(pid, order.version)

    def _blame(self, pid: str, order: Order, failed: Any, now: float) -> None:
        """Check, in the background, what ``pid`` says its sources did (blame.py); a peer whose relay bears the claim
        out goes last in the plans for SUSPECT_S. Holds the lock."""
        for claim in blame.claims(failed, set(order.sources)):
            other_id = next((o for o, p in self.peers.items() if p.relay == claim.source and o != pid), None)
            key = (claim.source, order.version, order.base)
            if other_id is None or self.peers[other_id].relay_failed_until > now or key in self.probed:
                continue
            self.probed = {k for k in self.probed if k[1] >= order.version - 1} | {key}
            try:
                self.checks.submit(self._check_claim, pid, other_id, claim, order.version, order.base)
            except RuntimeError:  # closed meanwhile
                return

    def _check_claim(self, pid: str, other_id: str, claim: blame.Claim, version: int, base: int) -> None:
        """Ask ``other_id``'s relay for what ``pid`` says it served badly or not at all, and blame it if so."""
        own = self.store.get(version, base=base)
        if own is None:  # collected since: nothing to compare with
            return
        other = self.peers.get(other_id)
        if other is None:  # it left meanwhile: nothing to check it against
            return
        fetcher = Fetcher(Store(), self.token, trust=self.trust, manifest_key=self.public_key)
        ticket = relay_ticket(self.signer, "origin", version, base, 1, claim.source)
        read = lambda lo, hi: fetcher.read(claim.source, version, base, lo, hi, self.epoch, ticket,  # noqa: E731
                                           other.server_name)
        try:
            borne_out = blame.borne_out(claim, read, own.buf, own.chunk_bytes)
        finally:
            fetcher.close()
        if not borne_out:
            log.warning("peer %s says %s's relay %s; it serves the learner correctly: not blamed", pid, other_id,
                        claim.why)
            return
        with self.cond:
            other = self.peers.get(other_id)
            if other is not None:
                other.relay_failed_until = time.monotonic() + SUSPECT_S
        log.warning("peer %s says %s's relay %s, and it does: %s goes last for %.0f s", pid, other_id, claim.why,
                    other_id, SUSPECT_S)

    # ------------------------------------------------------------------ rounds

    def _deadline_s(self, wire_bytes: int, rate_bytes_per_s: float) -> float:
        """floor + slack · bytes / rate, at most timeout_s (also for no rate at all)."""
        if rate_bytes_per_s <= 0:
            return self.timeout_s
        return min(self.timeout_s, self.deadline_floor_s + self.deadline_slack * wire_bytes / rate_bytes_per_s)

    def _waited_until(self, order: Order, peer: Peer) -> float:
        """When the round stops waiting for ``peer``: its rate, but no lower than the pool's median. Holds the
        lock."""
        rates = [p.rate_bytes_per_s for p in self.peers.values() if p.rate_bytes_per_s > 0 and p is not peer]
        pool = statistics.median(rates) if rates else 0.0
        return order.sent_at + self._deadline_s(order.wire_bytes, max(pool, peer.rate_bytes_per_s))

    def _due(self) -> list[str]:
        now = time.monotonic()
        return [pid for pid, p in self.peers.items()
                if p.delivered < self.latest and p.retry_at <= now and p.busy is None]

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
                version, base, now = self.latest, self.delta_base, time.monotonic()
                holders = [(p.relay, p.server_name) for p in self.peers.values()
                           if p.delivered == version and p.relay_failed_until <= now]
                groups: dict[int, list[topo.PeerLink]] = {}
                for pid in self._due():
                    p = self.peers[pid]
                    kind = base if base is not None and p.delivered == base and not p.needs_full else FULL
                    rate = p.rate_bytes_per_s if p.relay_failed_until <= now else 0.0  # 0: placed last
                    groups.setdefault(kind, []).append(topo.PeerLink(pid, rate, p.rtt_s))
                self.store.pin(version)  # a newer publish must not collect what this round is sending
            try:
                self._round(version, {b: self._plan(version, b, links) for b, links in groups.items()}, holders)
            finally:
                self.store.pin(version, False)

    def _plan(self, version: int, base: int, links: list[topo.PeerLink]) -> dict[str, list[list[str]]]:
        """Who pulls (version, base) from whom in this round, per stripe (topology.plan_lanes), in the layout the
        topology names; for ``auto``, topology.choose's pick from the peers' median RTT (halved: the one-way
        latency; the learner's RTT to them stands for theirs to each other) and median measured rate."""
        obj = self.store.get(version, base=base)
        size = obj.size if obj is not None else 0
        rtts = [p.rtt_s for p in links if p.rtt_s > 0]
        rates = [p.rate_bytes_per_s for p in links if p.rate_bytes_per_s > 0]
        layout = topo.layout(self.kind, self.fanout, len(links), statistics.median(rtts) / 2 if rtts else 0.0,
                             statistics.median(rates) if rates else 0.0, size)
        if layout != self.last_layout:
            log.info("v%d: %d peers by %s%s", version, len(links), layout.kind,
                     f" ({layout.fanout} stripes)" if layout.kind == "stripes" else "")
            self.last_layout = layout
        return topo.plan_lanes(links, layout)

    def _round(self, version: int, plans: dict[int, dict[str, list[list[str]]]],
               holders: list[Source]) -> None:
        """One version to every due peer: per object (full, or delta against a base) its own plan. Returns once
        every peer answered or is past its deadline."""
        full = self.store.get(version)
        if full is None:
            return
        started = self.published_at.get(version, time.monotonic())
        jobs = [(pid, base, lanes) for base, plan in plans.items() for pid, lanes in plan.items()]
        pool = ThreadPoolExecutor(max_workers=max(1, len(jobs)), thread_name_prefix="broadcast-order")
        sent: list[tuple[str, Peer, Order]] = []
        full_digest = manifest_digest(full.manifest)  # once, not once per delta order
        for pid, base, lanes in jobs:
            ordered = self._order(pid, version, base, lanes, holders, full, full_digest)
            if ordered is not None:
                pool.submit(self._send, pid, *ordered)
                sent.append((pid, ordered[0], ordered[3]))
        pool.shutdown(wait=False)  # the late ones' answers still come (their timeout, or the peer's reply)
        open_: list[tuple[str, float]] = []
        with self.cond:
            while not self.closed:
                open_ = [(pid, self._waited_until(o, p)) for pid, p, o in sent
                         if self.peers.get(pid) is p and p.busy is o]
                now = time.monotonic()
                if all(until <= now for _, until in open_):
                    break
                self.cond.wait(timeout=min(until for _, until in open_ if until > now) - now)
            late = sorted(pid for pid, _ in open_)
            self.late += len(late)
            sent_bytes = max((o.wire_bytes for pid, p, o in sent if p.delivered >= version), default=0)
        if late:
            log.warning("v%d: round closed without %s, past their deadlines (they go on, and get the newest "
                        "version when done)", version, late)
        self.rounds += 1
        self.last_time_s, self.last_bytes = time.monotonic() - started, sent_bytes
        log.debug("v%d: round over %d peers (%s) in %.3f s", version, len(jobs), self.kind, self.last_time_s)


def _align(size_bytes: int, chunk_bytes: int, stripes: int) -> int:
    """Stripe boundaries on chunk boundaries where each stripe then spans MIN_ALIGNED_CHUNKS chunks or more (a
    chunk is checked as soon as its one stripe has it, and the stripes stay within a chunk of equal); else on
    4 KiB, and the chunks across a boundary are checked once both stripes have them (store.Snapshot)."""
    return chunk_bytes if size_bytes >= MIN_ALIGNED_CHUNKS * stripes * chunk_bytes else 4096
