"""A worker's end of the broadcast: a relay node (store, server, fetcher) and the route the broadcaster calls.

    broadcaster ──POST /fetch {v, base, sources}──► SnapshotReceiver ──pull v (or its delta vs base) from
                                                        │   sources[0], else the next ──► ...
                                                        │  serves its own children from the same buffer meanwhile
                                                        └─ on_snapshot(v, buffer, manifest) once every chunk of
                                                           the full snapshot checks; answers {seconds, bytes_per_s}

The worker agent owns one (and so does ``python -m echo2.lab.bench``, which measures exactly this code).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from echo2.broadcast import delta
from echo2.broadcast.manifest import FULL, BadSnapshot, verify_key, verify_manifest
from echo2.broadcast.relay import Fetcher, RelayServer
from echo2.broadcast.store import Snapshot, Store
from echo2.transport import BadRequest, JsonServer, relay_key

log = logging.getLogger(__name__)


class SnapshotReceiver:
    def __init__(self, token: str, on_snapshot: Callable[[int, Any, dict], None], host: str = "127.0.0.1",
                 advertise_host: str | None = None, link: Any = None, stall_timeout_s: float = 10.0,
                 control_port: int = 0, relay_port: int = 0, trust: Any = None, manifest_key: str | None = None):
        """``token``: the broadcast plane's shared key (transport.relay_key) and ``manifest_key`` the learner's
        public key (manifest.verify_key); a worker's agent learns both when it joins (``use_key``). ``trust`` (a
        transport.Trust): serve and fetch over TLS pinned to the run's CA. ``link``: the lab's emulated access link
        (echo2/lab/link.py) for its server and fetcher; a worker has none."""
        self.token, self.on_snapshot = token, on_snapshot
        self.store = Store(keep=2)
        server_tls = trust.server if trust is not None else None
        self.relay_server = RelayServer(self.store, token, host, relay_port, link=link,
                                              stall_timeout_s=max(30.0, stall_timeout_s), tls=server_tls)
        self.fetcher = Fetcher(self.store, token, link=link, stall_timeout_s=stall_timeout_s, trust=trust,
                               manifest_key=manifest_key)
        self.control = JsonServer(host, control_port, token, routes={"POST /fetch": self._fetch},
                                  name="snapshots", tls=server_tls)
        self.url = self.control.url(advertise_host)
        self.relay_addr = f"{advertise_host or self.relay_server.addr[0]}:{self.relay_server.addr[1]}"

    @classmethod
    def of_run(cls, run_secret: str, on_snapshot: Callable[[int, Any, dict], None], **kwargs) -> "SnapshotReceiver":
        """A receiver holding what a worker of the run with this secret gets when it joins (the lab, tests)."""
        return cls(relay_key(run_secret), on_snapshot, manifest_key=verify_key(run_secret), **kwargs)

    def use_key(self, key: str, manifest_key: str) -> None:
        """Take the broadcast plane's key and the learner's public key (given by the coordinator when the worker
        joins) before serving."""
        self.token = self.relay_server.token = self.fetcher.token = self.control.token = key
        self.fetcher.manifest_key = manifest_key

    def start(self) -> "SnapshotReceiver":
        self.relay_server.start()
        self.control.start()
        return self

    def _fetch(self, body: dict, _headers) -> dict:
        version, base, sources = body.get("version"), body.get("base", FULL), body.get("sources")
        if type(version) is not int or version < 0 or type(base) is not int or base >= version:
            raise BadRequest("'version' must be a non-negative integer and 'base' an older one (or -1)")
        if not isinstance(sources, list) or not sources or not all(
                isinstance(s, list) and len(s) == 2 and isinstance(s[0], str) and type(s[1]) is int for s in sources):
            raise BadRequest("'sources' must be a non-empty list of [host, port]")
        sources = [tuple(s) for s in sources]
        t0 = time.perf_counter()
        try:
            if base == FULL:
                snap = self.fetcher.fetch(version, sources)
                wire_bytes = snap.size
            else:
                snap, wire_bytes = self._fetch_delta(version, base, sources, body.get("full_manifest"))
        except (ConnectionError, OSError, BadSnapshot, ValueError) as e:
            raise BadRequest(f"v{version}: {e}") from None
        seconds = time.perf_counter() - t0
        # A bytes-like buffer (a MemoryFile as received here) that the relay keeps serving: never written again,
        # so the callback may keep a reference rather than a copy. The manifest is verified (signed by the learner).
        self.on_snapshot(version, snap.buf, snap.manifest)
        return {"ok": True, "version": version, "seconds": seconds, "bytes_per_s": wire_bytes / max(seconds, 1e-9),
                "first_byte_at": snap.first_byte_at, "done_at": time.monotonic(),  # monotonic: same host only
                "rtt_s": self.fetcher.last_rtt_s}

    def _fetch_delta(self, version: int, base: int, sources, full_manifest) -> tuple[Snapshot, int]:
        """Pull the delta of ``version`` against ``base`` (held here), apply it, and check the result against the
        full snapshot's signed chunk digests before anyone may use or relay it as ``version``."""
        held = self.store.get(base)
        if held is None or not held.complete:
            raise BadSnapshot(f"base v{base} is not held here")
        manifest = verify_manifest(self.fetcher.manifest_key, full_manifest)
        if (manifest["version"], manifest["base"]) != (version, FULL):
            raise BadSnapshot("full_manifest is not the full snapshot of this version")
        d = self.fetcher.fetch(version, sources, base=base)
        full = Snapshot(manifest)
        full.buf[:] = delta.apply(held.buf, d.buf)
        full.received = full.size
        if full.check_chunks() or full.checked != len(manifest["chunks"]):
            raise BadSnapshot(f"v{version} rebuilt from the delta against v{base} fails its digests")
        full.complete = True
        self.store.put(full)
        return full, d.size

    def close(self) -> None:
        self.control.close()
        self.relay_server.close()
        self.fetcher.close()
