"""Who holds what in the coordinator: registered worker ids, the credential each acts for, the groups in flight.

    credential "box17" ──► Principal (misses, valid pushes, groups held: one share of the in-flight cap)
                              ├── worker id w3 ──► WorkerInfo (links, price, measured rate, versions delivered)
                              └── worker id w9 ──► ...
    run secret ──► one Principal per worker id (the learner's own agents: trusted, each judged alone)

A principal is what the liveness policy (liveness.py) and the rollout checks (trust.py) judge: one per worker
credential (``name:HMAC``), however many worker ids it registers, so that registering again (or twice) gets
neither a second share nor a clean record. It outlives its ids: benching and strikes stick to it for the run.

Pure state and policy, no lock: the coordinator holds its lock around every call. Groups in flight are added and
removed only through ``fly`` and ``land``, which keep each principal's and worker's count of held groups, so that
the dispatcher's share check costs nothing per pull.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from echo2.coordinator.liveness import Liveness

log = logging.getLogger(__name__)

RETIRED_MEMORY = 1 << 16
"""Retired worker ids remembered with their principal (``owner``): groups a retired worker pushed may still be
buffered or judged by the rollout checks; past this many retirements the oldest are forgotten, so that a credential
registering and leaving in a loop (which coordinator.bounds.Registrations slows down) cannot grow the registry."""
SETTLED_MEMORY = 1 << 16
"""Groups that left flight (claimed by a push, lost to their deadline, handed back, lost with their retired worker
or at shutdown) remembered with their principal: a late result (its miss is counted already), a repeated push (a
retry after a lost reply), one from an agent retired as dead that comes back, or one racing the shutdown is
refused without a strike."""


@dataclass
class WorkerInfo:
    worker_id: str
    principal: str  # Principal.key
    snapshot_url: str | None
    engine: str
    relay: str | None = None  # host:port of its relay node (snapshots are pulled from and served by it)
    name: str | None = None  # the worker credential it registered with (None: the run secret)
    version: int = -1  # newest version it claimed that it may hold (-1: none yet)
    # versions the broadcaster handed it, and the run's initial ones (those older than the delivery horizon,
    # intake.delivery_horizon, are forgotten: stale anyway)
    delivered: set = field(default_factory=set)
    # versions the broadcaster has ordered it to fetch: it may hold one (apply it, generate, push) before its answer
    # proving delivery reaches the coordinator; such a claim is dropped but not struck (a strike for it benched
    # honest workers of a loaded box within seconds: their tiny model's batch took less than the answer's way back)
    ordered: set = field(default_factory=set)
    last_seen: float = field(default_factory=time.monotonic)
    rollouts_per_s: float = 0.0  # measured here, from its valid pushes (0: none yet); the planner's and deadlines'
    reported_rollouts_per_s: float = 0.0  # what it says of itself: diagnostics only
    usd_per_hour: float = 0.0  # declared at registration (what activation and cost accounting use)
    down_mbit: float = 1000.0
    up_mbit: float = 1000.0
    rtt_ms: float = 0.0
    held: int = 0  # groups in flight at it
    # seconds its pulls waited with nothing handed out, by why (coordinator._dispatch): "window" (anything more would
    # be stale before the learner reached it), "share" (its credential's share is held), "inactive", "no_weights",
    # "dispatch_failed" (a row's prompt could not be built)
    waited_s: dict = field(default_factory=dict)

    def may_hold(self, version: int) -> bool:
        """Whether it may hold ``version``: delivered, initial, or ordered to it."""
        return version in self.delivered or version in self.ordered

    @property
    def delivered_version(self) -> int:
        """The newest snapshot it may hold (-1: none)."""
        return max(self.delivered, default=-1)


@dataclass
class Principal:
    key: str
    name: str | None  # the credential's worker name (None: the run secret)
    misses: int = 0  # deadline passes and invalid pushes, less on-time valid pushes
    valid_pushes: int = 0
    held: int = 0  # groups in flight at all its ids
    ids: set = field(default_factory=set)  # its live worker ids


@dataclass
class InFlight:
    worker_id: str
    principal: str
    row: dict[str, Any]
    prompt_ids: list[int]
    row_index: int
    dispatched_at: float = field(default_factory=time.monotonic)
    deadline: float = math.inf  # time.monotonic() after which the group is lost


class Registry:
    """The state, and the liveness policy (liveness.py) applied to it: limits, fresh workers' rate, strikes."""

    def __init__(self, liveness: Liveness):
        self.liveness = liveness
        self.invalid_strikes = 0  # misses for invalid pushes (deadline misses are the coordinator's count)
        self.workers: dict[str, WorkerInfo] = {}
        self.principals: dict[str, Principal] = {}
        self.in_flight: dict[str, InFlight] = {}
        self.settled: OrderedDict[str, tuple[str, str]] = OrderedDict()  # group id -> (principal, refusal reason)
        self.principal_of: dict[str, str] = {}  # every live worker id -> its principal
        self.retired_of: OrderedDict[str, str] = OrderedDict()  # the last RETIRED_MEMORY retired ids -> principal

    @staticmethod
    def key(name: str | None, worker_id: str) -> str:
        """A worker credential's principal is its name; a run-secret worker is its own (``#w3``)."""
        return name if name is not None else f"#{worker_id}"

    def principal(self, name: str | None, worker_id: str) -> Principal:
        key = self.key(name, worker_id)
        if key not in self.principals:
            self.principals[key] = Principal(key, name)
        return self.principals[key]

    def add(self, worker: WorkerInfo) -> None:
        self.workers[worker.worker_id] = worker
        self.principals[worker.principal].ids.add(worker.worker_id)
        self.principal_of[worker.worker_id] = worker.principal

    def remove(self, worker_id: str) -> WorkerInfo | None:
        worker = self.workers.pop(worker_id, None)
        if worker is not None:
            self.principals[worker.principal].ids.discard(worker_id)
            self.retired_of[worker_id] = self.principal_of.pop(worker_id, worker.principal)
            while len(self.retired_of) > RETIRED_MEMORY:
                self.retired_of.popitem(last=False)
        return worker

    def owner(self, worker_id: str) -> str | None:
        """The principal of a live worker id, or of one retired not too long ago (RETIRED_MEMORY); None: unknown."""
        return self.principal_of.get(worker_id) or self.retired_of.get(worker_id)

    def of(self, worker_id: str) -> Principal | None:
        key = self.owner(worker_id)
        return self.principals.get(key) if key is not None else None

    # ------------------------------------------------------------------ the policy, applied

    def limit(self, principal: Principal, cap_groups: int, groups_per_pull: int, is_active) -> int:
        """Groups ``principal`` may hold: its share of the cap (liveness.py), one pull's worth until it has pushed
        valid results. ``is_active(worker id)``: whether activation lets a worker work."""
        limit = self.liveness.worker_limit(cap_groups, principal.misses, self._contenders(is_active))
        return limit if principal.valid_pushes else min(limit, groups_per_pull)

    def _contenders(self, is_active) -> int:
        """Principals that can get work now (live, active, not benched), counted up to where the share stops
        growing (liveness.crowd; 0: that many or more)."""
        crowd, seen = self.liveness.crowd(), set()
        for w in self.workers.values():
            if w.principal not in seen and is_active(w.worker_id) and not self.benched(w):
                seen.add(w.principal)
                if len(seen) >= crowd:
                    return 0
        return len(seen)

    def fresh_rate(self) -> float:
        """The rate a worker with no measured rate gets deadlines for: the slowest measured one (0: none yet)."""
        return min((w.rollouts_per_s for w in self.workers.values() if w.rollouts_per_s > 0), default=0.0)

    def benched(self, worker: WorkerInfo) -> bool:
        return self.liveness.benched(self.principals[worker.principal].misses)

    def strike(self, worker: WorkerInfo, why: str) -> None:
        """A miss for an invalid push (liveness.py): halves the credential's share; at ``strikes``, benched."""
        self.strike_principal(worker.principal, why, worker.worker_id)

    def strike_principal(self, key: str, why: str, worker_id: str | None = None) -> None:
        principal = self.principals.get(key)
        if principal is None:
            return
        principal.misses += 1
        self.invalid_strikes += 1
        log.warning("worker %s (%s): a strike for %s (miss %d of %d)%s",
                    worker_id or ",".join(sorted(principal.ids)) or key, principal.key, why, principal.misses,
                    self.liveness.strikes, "; it gets no more work" if self.liveness.benched(principal.misses) else "")

    # ------------------------------------------------------------------ groups in flight

    def fly(self, gid: str, flight: InFlight) -> None:
        self.in_flight[gid] = flight
        self._count(flight, +1)

    def land(self, gid: str) -> InFlight:
        flight = self.in_flight.pop(gid)
        self._count(flight, -1)
        return flight

    def held_by(self, worker_id: str) -> list[str]:
        return [g for g, f in self.in_flight.items() if f.worker_id == worker_id]

    def remember(self, gid: str, flight: InFlight, reason: str) -> None:
        """Remember (bounded) why a group left flight, so that a result for it later is told apart from a forgery:
        ``past_deadline`` (lost to its deadline), ``duplicate`` (its result was claimed already)."""
        self.settled[gid] = (flight.principal, reason)
        while len(self.settled) > SETTLED_MEMORY:
            self.settled.popitem(last=False)

    def refusal(self, gid: str | None, principal: str) -> str:
        """Why a result for ``gid`` from ``principal`` is refused: its own late or repeated result, or one for a
        group that was never in flight for it (``not_in_flight_for_this_worker``: a strike)."""
        known = self.settled.get(gid) if gid is not None else None
        return known[1] if known is not None and known[0] == principal else "not_in_flight_for_this_worker"

    def _count(self, flight: InFlight, n: int) -> None:
        principal = self.principals.get(flight.principal)
        if principal is not None:
            principal.held += n
        worker = self.workers.get(flight.worker_id)
        if worker is not None:
            worker.held += n
