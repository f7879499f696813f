"""A worker's end of the broadcast: a relay node (store, server, fetcher) and the routes the broadcaster calls.

    broadcaster ──POST /fetch {epoch, key, v, base, sources, [stripes], deadline_s, challenge, tickets}──► receiver
                  (signed by the learner, for this node)      │  pull v (or its delta vs base) from sources[0],
                                                              │  else the next ──► ... (with stripes: each byte
                                                              │  range from its own sources, all at once)
                                                              │  serves its own children from the same buffer
                                                              └─ on_snapshot(v, buffer, manifest) once every chunk
                                                                 of the full snapshot checks; answers {proof, ...}
    broadcaster ──POST /key {epoch, key}──► the relay key, at once (on joining, and after a revocation)

Only the learner orders: each order's credential (``Authorization: Bearer order.<seq>.<digest>.<sig>``,
manifest.order_credential) is the learner's Ed25519 signature over this node's control URL, a sequence number
and the body's digest, checked before the body is read. An order not newer than the last one taken is refused
(a replay), so a worker, live or revoked, can neither send another worker after sources that never answer nor
hand it a key (an order that crossed a newer one on the way is still taken, if of the same epoch, but its key is
not). Each order carries the relay key of the moment (the learner replaces it when it revokes a worker)
and the learner's epoch: an order from a new epoch (a resumed learner) empties the store, and every manifest
fetched under an order must be of the order's epoch. The answer proves the node holds the snapshot (a hash of a
slice the learner chose, manifest.possession_proof), so the learner believes no claim it cannot check.

The worker agent owns one (and so does ``python -m echo2.lab.bench``, which measures exactly this code).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from echo2.broadcast import delta
from echo2.broadcast.manifest import (FULL, MAX_SOURCES, BadSnapshot, check_order, order_digest, possession_proof,
                                      verify_key, verify_manifest)
from echo2.broadcast.relay import Fetcher, RelayServer, Superseded
from echo2.broadcast.relay_slots import MAX_TICKET_CHARS
from echo2.broadcast.store import Snapshot, Store
from echo2.net.http import BadRequest, JsonServer, Unauthorized

log = logging.getLogger(__name__)

MAX_STRIPES = 16
"""Stripes one order may name (topology.MAX_STRIPES is what the broadcaster plans; a few more are accepted)."""

MAX_TICKETS = MAX_SOURCES * (MAX_STRIPES + 1)
"""Tickets one order may carry: one for each source it names, in its sources and in its stripes."""

MAX_NAME_CHARS = 253
"""The longest name a source's certificate may be asked to carry (a DNS name's limit)."""


class SnapshotReceiver:
    def __init__(self, token: str | None, on_snapshot: Callable[[int, Any, dict], None], host: str = "127.0.0.1",
                 advertise_host: str | None = None, link: Any = None, stall_timeout_s: float = 10.0,
                 control_port: int = 0, relay_port: int = 0, trust: Any = None, manifest_key: str | None = None):
        """``manifest_key``: the learner's public key (manifest.verify_key), which its orders and manifests are
        checked against; a worker's agent learns it when it joins (``trust_learner``). ``token``: a relay key to
        start with (None: none until the learner's first order brings it). ``trust`` (a net.tls.Trust): serve and
        fetch over TLS pinned to the run's CA. ``link``: the lab's emulated access link (echo2/lab/link.py) for its
        server and fetcher; a worker has none."""
        self.on_snapshot = on_snapshot
        self.store = Store(keep=2)
        server_tls = trust.server if trust is not None else None
        self.relay_server = RelayServer(self.store, token, host, relay_port, link=link,
                                        stall_timeout_s=max(30.0, stall_timeout_s), tls=server_tls,
                                        ticket_key=manifest_key)
        self.fetcher = Fetcher(self.store, token, link=link, stall_timeout_s=stall_timeout_s, trust=trust,
                               manifest_key=manifest_key)
        self.control = JsonServer(host, control_port, "", routes={"POST /fetch": self._fetch, "POST /key": self._key},
                                  name="snapshots", tls=server_tls, authorize=self._authorize)
        self.url = self.control.url(advertise_host)
        relay = (advertise_host or self.relay_server.addr[0], self.relay_server.addr[1])
        self.relay_server.advertise(relay)  # the learner's orders, and so the tickets for it, name it so
        self.relay_addr = f"{relay[0]}:{relay[1]}"
        self.orders = threading.Lock()
        self.last: dict[str, int] = {}  # route -> seq of the newest order taken there (older ones are replays)
        self.key_seq = 0  # seq of the newest order of all: its relay key and epoch are this node's
        self.epoch: str | None = None

    @classmethod
    def of_run(cls, run_secret: str, on_snapshot: Callable[[int, Any, dict], None], **kwargs) -> "SnapshotReceiver":
        """A receiver holding what a worker of the run with this secret gets when it joins (the lab, tests)."""
        return cls(None, on_snapshot, manifest_key=verify_key(run_secret), **kwargs)

    def trust_learner(self, manifest_key: str) -> None:
        """Take the learner's public key (given by the coordinator when the worker joins) before serving."""
        self.fetcher.manifest_key = self.relay_server.ticket_key = manifest_key

    @property
    def token(self) -> str | None:
        """The relay key this node holds now."""
        return self.fetcher.token

    def start(self) -> "SnapshotReceiver":
        self.relay_server.start()
        self.control.start()
        return self

    # ------------------------------------------------------------------ the learner's orders

    def _authorize(self, route: str, credential: str) -> None:
        """Before the body is read: an order credential of this run's learner, for this node, newer than the last
        order of its kind taken."""
        seq, _ = self._credential(credential)
        if seq <= self.last.get(route, 0):
            raise Unauthorized(f"order {seq} is not newer than the last one taken: a replay")

    def _credential(self, credential: str) -> tuple[int, str]:
        try:
            return check_order(self.fetcher.manifest_key, self.url, credential)
        except BadSnapshot as e:
            raise Unauthorized(str(e)) from None

    def _take(self, route: str, body: dict, headers) -> str | None:
        """Take the order ``body`` (checked against its credential); returns its epoch. The newest order of all
        sets the relay key and the epoch; an older one (it crossed a newer on the way) must be of that epoch."""
        seq, digest = self._credential(_one_credential(headers))
        if digest != order_digest(body):
            raise Unauthorized("the order's body is not the one its credential signs")
        key, epoch = body.get("key"), body.get("epoch")
        if not (isinstance(key, str) and len(key) == 64) or not (epoch is None or isinstance(epoch, str)):
            raise BadRequest("an order carries the relay key (64 hex) and the learner's epoch")
        with self.orders:
            if seq <= self.last.get(route, 0):
                raise Unauthorized(f"order {seq} is not newer than the last one taken: a replay")
            if seq < self.key_seq and epoch != self.epoch:
                raise Unauthorized(f"an order of an older learner epoch ({epoch!r}, now {self.epoch!r})")
            self.last[route] = seq
            if seq > self.key_seq:
                self.key_seq = seq
                if epoch != self.epoch:
                    if self.epoch is not None:
                        log.warning("learner epoch %s follows %s: dropping the snapshots held", epoch, self.epoch)
                    self.epoch = epoch
                    self.store.clear()  # another learner process's versions are neither served nor kept
                self.fetcher.token = key
                self.relay_server.use_key(key)
        return epoch

    def _key(self, body: dict, headers) -> dict:
        self._take("POST /key", body, headers)
        return {"ok": True}

    def _fetch(self, body: dict, headers) -> dict:
        epoch = self._take("POST /fetch", body, headers)
        version, base, sources = body.get("version"), body.get("base", FULL), body.get("sources")
        deadline_s, challenge = body.get("deadline_s"), body.get("challenge")
        if type(version) is not int or version < 0 or type(base) is not int or base >= version:
            raise BadRequest("'version' must be a non-negative integer and 'base' an older one (or -1)")
        if not _addresses(sources):
            raise BadRequest(f"'sources' must be a list of 1 to {MAX_SOURCES} [host, port]")
        stripes = _stripes(body.get("stripes"))
        if not (deadline_s is None or isinstance(deadline_s, (int, float)) and deadline_s > 0):
            raise BadRequest("'deadline_s' must be a positive number")
        if not (isinstance(challenge, str) and len(challenge) == 32):
            raise BadRequest("'challenge' must be 32 hex digits")
        tickets = _tickets(body.get("tickets", []))
        sources = [tuple(s) for s in sources]
        t0 = time.perf_counter()
        try:
            if base == FULL:
                snap = self.fetcher.fetch(version, sources, epoch=epoch, deadline_s=deadline_s, stripes=stripes,
                                          tickets=tickets)
                wire_bytes = snap.size
            else:
                snap, wire_bytes = self._fetch_delta(version, base, sources, body.get("full_manifest"), epoch,
                                                     deadline_s, stripes, tickets)
        except (ConnectionError, OSError, BadSnapshot, ValueError) as e:
            if not isinstance(e, Superseded):  # a newer order goes on with it: children may still wait for it
                self.store.abandon(version, base)
            raise BadRequest(f"v{version}: {e}") from None
        seconds = time.perf_counter() - t0
        # A bytes-like buffer (a MemoryFile as received here) that the relay keeps serving: never written again,
        # so the callback may keep a reference rather than a copy. The manifest is verified (signed by the learner).
        self.on_snapshot(version, snap.buf, snap.manifest)
        # seconds, rates and times are this node's own word: diagnostics (the lab's benchmark), never the plan's
        return {"ok": True, "version": version, "proof": possession_proof(challenge, snap.buf), "seconds": seconds,
                "bytes_per_s": wire_bytes / max(seconds, 1e-9), "first_byte_at": snap.first_byte_at,
                "done_at": time.monotonic(),  # monotonic: same host only
                "rtt_s": self.fetcher.last_rtt_s,
                # the learner checks these claims and plans around the sources they bear out (coordinator/blame.py)
                "failed_sources": [[*src, self.fetcher.suspects.evidence.get(src, {})]
                                   for src in self.fetcher.last_failed]}

    def _fetch_delta(self, version: int, base: int, sources, full_manifest, epoch: str | None,
                     deadline_s: float | None, stripes=None, tickets=()) -> tuple[Snapshot, int]:
        """Pull the delta of ``version`` against ``base`` (held here), apply it, and check the result against the
        full snapshot's signed chunk digests before anyone may use or relay it as ``version``."""
        held = self.store.get(base)
        if held is None or not held.complete:
            raise BadSnapshot(f"base v{base} is not held here")
        manifest = verify_manifest(self.fetcher.manifest_key, full_manifest)
        if (manifest["version"], manifest["base"], manifest.get("epoch")) != (version, FULL, epoch):
            raise BadSnapshot("full_manifest is not the full snapshot of this version and epoch")
        d = self.fetcher.fetch(version, sources, base=base, epoch=epoch, deadline_s=deadline_s, stripes=stripes,
                               tickets=tickets)
        full = Snapshot(manifest)
        full.buf[:] = delta.apply(held.buf, d.buf)
        full.fill()
        if full.check_chunks() or full.checked != len(manifest["chunks"]):
            raise BadSnapshot(f"v{version} rebuilt from the delta against v{base} fails its digests")
        full.complete = True
        self.store.put(full)
        return full, d.size

    def close(self) -> None:
        self.control.close()
        self.relay_server.close()
        self.fetcher.close()


def _one_credential(headers) -> str:
    """The credential of a request's one ``Authorization`` header. A request with two is refused: the server judged
    one of them before the body was read, and the order must be checked against that one, not the other."""
    values = headers.getlist("authorization") if hasattr(headers, "getlist") else [
        v for k, v in headers.items() if k.lower() == "authorization"]
    if len(values) != 1:
        raise Unauthorized(f"{len(values)} Authorization headers: an order carries exactly one")
    return values[0].removeprefix("Bearer ")


def _addresses(sources) -> bool:
    """Whether ``sources`` is a list of 1 to MAX_SOURCES [host, port]."""
    return isinstance(sources, list) and 0 < len(sources) <= MAX_SOURCES and all(
        isinstance(s, list) and len(s) == 2 and isinstance(s[0], str) and type(s[1]) is int for s in sources)


def _tickets(tickets) -> list:
    """An order's tickets, [host, port, ticket, name] for each source it names: the ticket (checked by its source)
    and the name the source's certificate must carry (its credential's, the learner's for the origin)."""
    ok = isinstance(tickets, list) and len(tickets) <= MAX_TICKETS and all(
        isinstance(t, list) and len(t) == 4 and isinstance(t[0], str) and type(t[1]) is int and isinstance(t[2], str)
        and len(t[2]) <= MAX_TICKET_CHARS and isinstance(t[3], str) and 0 < len(t[3]) <= MAX_NAME_CHARS
        for t in tickets)
    if not ok:
        raise BadRequest(f"'tickets' must be a list of at most {MAX_TICKETS} [host, port, ticket, name], each ticket "
                         f"at most {MAX_TICKET_CHARS} characters and each name {MAX_NAME_CHARS}")
    return tickets


def _stripes(stripes) -> list | None:
    """An order's stripes as the fetcher takes them ([(lo, hi, sources)], contiguous from byte 0; whether they end
    at the snapshot's size is checked against its manifest), or None for an order without."""
    if stripes is None:
        return None
    ok = isinstance(stripes, list) and 0 < len(stripes) <= MAX_STRIPES and all(
        isinstance(s, list) and len(s) == 3 and type(s[0]) is int and type(s[1]) is int and _addresses(s[2])
        for s in stripes)
    if not ok or stripes[0][0] != 0 or any(lo > hi for lo, hi, _ in stripes) or any(
            a[1] != b[0] for a, b in zip(stripes, stripes[1:])):
        raise BadRequest(f"'stripes' must be a list of 1 to {MAX_STRIPES} [lo, hi, sources], contiguous from 0")
    return [(lo, hi, [tuple(a) for a in srcs]) for lo, hi, srcs in stripes]
