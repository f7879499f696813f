"""One-to-many push: the learner uploads every snapshot to every worker itself, one after another.

The baseline of DESIGN §3: with N workers behind one learner uplink of B bytes/s, the last worker holds
snapshot v after about N·M/B. It runs in a background thread: ``publish`` returns at once, and if a newer
snapshot arrives while one is being sent, the rest of the old round is skipped (latest wins).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from echo2.broadcast import snapshot
from echo2.rollout.wire import Client

log = logging.getLogger(__name__)


class OneToManyBroadcaster:
    def __init__(self, token: str, timeout_s: float = 120.0):
        self.token, self.timeout_s = token, timeout_s
        self.on_delivered = None  # set by the coordinator: called (peer, version) after each delivery
        self.peers: dict[str, Client] = {}
        self.latest: tuple[int, bytes, str] | None = None  # version, blob, digest
        self.delivered: dict[str, int] = {}  # peer -> version it holds
        self.cond = threading.Condition()
        self.closed = False
        self.last_time_s = 0.0
        self.last_bytes = 0
        self.failures = 0
        self.thread = threading.Thread(target=self._loop, name="broadcast", daemon=True)

    def _ensure_started(self) -> None:
        if not self.thread.is_alive() and not self.closed:
            self.thread.start()

    def publish(self, version: int, state_dict: dict[str, Any]) -> None:
        blob = snapshot.encode(state_dict)
        with self.cond:
            self.latest = (version, blob, snapshot.sign(self.token, version, blob))
            self._ensure_started()
            self.cond.notify_all()

    def add_peer(self, peer_id: str, url: str) -> None:
        with self.cond:
            self.peers[peer_id] = Client(url, self.token, self.timeout_s)
            self.delivered.pop(peer_id, None)
            self._ensure_started()
            self.cond.notify_all()

    def remove_peer(self, peer_id: str) -> None:
        with self.cond:
            client = self.peers.pop(peer_id, None)
            self.delivered.pop(peer_id, None)
        if client:
            client.close()

    def _pending(self) -> list[tuple[str, Client]]:
        version = self.latest[0]
        return [(p, c) for p, c in self.peers.items() if self.delivered.get(p, -1) < version]

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.closed or (self.latest is not None and self._pending()))
                if self.closed:
                    return
                version, blob, digest = self.latest
                round_start = time.perf_counter()
            while True:
                with self.cond:
                    if self.closed or self.latest[0] != version:
                        break  # superseded: start over with the newest snapshot
                    todo = self._pending()
                if not todo:
                    self.last_time_s, self.last_bytes = time.perf_counter() - round_start, len(blob)
                    break
                peer, client = todo[0]
                try:
                    client.post("/snapshot", data=blob, timeout_s=self.timeout_s,
                                headers={snapshot.VERSION_HEADER: str(version), snapshot.DIGEST_HEADER: digest})
                    with self.cond:
                        self.delivered[peer] = version
                    if self.on_delivered is not None:
                        self.on_delivered(peer, version)
                except Exception as e:  # a dead peer must not stop the others; the registry will drop it
                    self.failures += 1
                    log.warning("snapshot v%d to %s failed: %s", version, peer, e)
                    with self.cond:
                        self.delivered[peer] = version  # do not retry this version; a later one may reach it

    def metrics(self) -> dict[str, float]:
        return {"broadcast/time_s": self.last_time_s, "broadcast/bytes": float(self.last_bytes),
                "broadcast/failures": float(self.failures)}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        for c in self.peers.values():
            c.close()
