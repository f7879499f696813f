"""The coordinator: the learner host's control plane for remote rollout workers.

    worker agents ──register / pull / push / heartbeat (HTTP, token)──► Coordinator ──take(P, t)──► learner
                         ▲                                                │   ▲
                         └──────────── snapshots (Broadcaster) ◄──────────┘   └ set_version(v) after each step

    pull:  dispatch prompt groups, while worth_dispatching (buffer.py): in flight + buffered <= (S+1)·P
    push:  validate -> score (task rewards, here, never trusted from a worker) -> admit to the buffer
    take:  waits for: P admissible groups in the buffer;  unblocked by: a push that completes the batch
    reaper: a worker silent for ``heartbeat_timeout_s`` is dead: its in-flight groups are counted lost and
            their prompts re-queued, so they are generated again elsewhere

It runs as threads (an HTTP server and a reaper) of its own process (service.py), which answers the learner's
``take`` / ``set_version`` calls over a pipe; the learner only blocks in ``take`` when the buffer is short, which
is the idle time ``train/learner_idle_s`` reports.

Accounting (rollouts, G per group): dispatched = consumed + dropped[reason] + lost[reason] + in flight + buffered.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from echo2.rollout.activation import Activation
from echo2.rollout.buffer import StalenessBuffer, worth_dispatching
from echo2.rollout.scoring import Scorer, encode_prompt
from echo2.rollout.types import Completion, Rollout, RolloutGroup
from echo2.rollout.wire import BadRequest, JsonServer

log = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    worker_id: str
    snapshot_url: str | None
    engine: str
    relay: str | None = None  # host:port of its relay node (snapshots are pulled from and served by it)
    version: int = 0
    delivered_version: int = 0  # newest snapshot the broadcaster has handed to this worker
    last_seen: float = field(default_factory=time.monotonic)
    rollouts_per_s: float = 0.0  # measured by the worker over its last batch
    usd_per_hour: float = 0.0  # declared at registration (what activation and cost accounting use)
    down_mbit: float = 1000.0
    up_mbit: float = 1000.0
    rtt_ms: float = 0.0


@dataclass
class InFlight:
    worker_id: str
    row: dict[str, Any]
    prompt_ids: list[int]


class Coordinator:
    def __init__(self, dataset: Any, scorer: Scorer, tokenizer: Any, *, token: str, staleness: int,
                 prompts_per_step: int, group_size: int, sampling: dict[str, Any], vocab_size: int,
                 host: str = "127.0.0.1", port: int = 0, heartbeat_timeout_s: float = 30.0,
                 groups_per_pull: int = 4, long_poll_s: float = 2.0, seed: int = 0, broadcaster: Any = None,
                 activation: dict | None = None):
        self.scorer, self.tokenizer, self.token = scorer, tokenizer, token
        self.S, self.P, self.G = staleness, prompts_per_step, group_size
        self.sampling, self.vocab_size = sampling, vocab_size
        self.heartbeat_timeout_s, self.groups_per_pull = heartbeat_timeout_s, groups_per_pull
        self.long_poll_s = min(long_poll_s, heartbeat_timeout_s / 4)
        self.broadcaster = broadcaster
        self.lock = threading.Condition()
        self.buffer = StalenessBuffer(staleness)
        self.version = 0
        # Batches handed to the learner: the next batch taken is for step ``batches_taken``. Between a take at
        # step t and set_version(t+1) the learner is mid-step; dispatch must already judge for step t+1, or it
        # hands out work that is stale on arrival (measured: 21 % of rollouts dropped at S=0 without this).
        self.batches_taken = 0
        self.workers: dict[str, WorkerInfo] = {}
        self.in_flight: dict[str, InFlight] = {}
        self.requeued: deque[dict[str, Any]] = deque()
        self.rows = self._row_stream(dataset, seed)
        self.group_ids = (f"g{i}" for i in itertools.count())
        self.worker_ids = (f"w{i}" for i in itertools.count())
        self.rollouts = Counter()  # dispatched, received
        self.by_worker = Counter()  # worker id -> rollouts received from it (kept after it leaves)
        self.dropped = Counter()  # reason -> rollouts
        self.lost = Counter()  # reason -> rollouts
        self.retired = Counter()  # reason -> workers
        self.registered = 0
        self.closed = False
        self.activation = Activation(activation or {}, staleness, prompts_per_step * group_size)
        self.server = JsonServer(host, port, token, name="coordinator", routes={
            "POST /register": self._register, "POST /pull": self._pull, "POST /push": self._push,
            "POST /heartbeat": self._heartbeat, "POST /leave": self._leave, "GET /status": self._status,
        })
        self.reaper = threading.Thread(target=self._reap_loop, name="reaper", daemon=True)
        if broadcaster is not None:
            broadcaster.on_delivered = self._snapshot_delivered

    def start(self) -> "Coordinator":
        self.server.start()
        self.reaper.start()
        log.info("coordinator on %s (S=%d, P=%d, G=%d)", self.url, self.S, self.P, self.G)
        return self

    @property
    def url(self) -> str:
        return self.server.url()

    @staticmethod
    def _row_stream(dataset: Any, seed: int):
        """Rows in a fresh seeded shuffle each epoch, forever."""
        rng = random.Random(seed)
        for epoch in itertools.count():
            order = list(range(len(dataset)))
            rng.shuffle(order)
            for i in order:
                yield dataset[i]

    # ---------------------------------------------------------------- worker-facing routes

    def _worker(self, body: dict) -> WorkerInfo:
        worker = self.workers.get(str(body.get("worker_id")))
        if worker is None:
            raise BadRequest(f"unknown worker {body.get('worker_id')!r}: register first")
        worker.last_seen = time.monotonic()
        if "version" in body:
            worker.version = _int(body, "version", 0, self.version)
        return worker

    def _register(self, body: dict, _headers) -> dict:
        with self.lock:
            relay_addr = body.get("relay")
            if relay_addr is not None and not (isinstance(relay_addr, str) and relay_addr.rpartition(":")[2].isdigit()):
                raise BadRequest("'relay' must be 'host:port'")
            worker = WorkerInfo(next(self.worker_ids), body.get("snapshot_url"), str(body.get("engine", "?")),
                                relay_addr, **{k: _nonneg(body, k, default) for k, default in (
                                    ("usd_per_hour", 0.0), ("down_mbit", 1000.0), ("up_mbit", 1000.0),
                                    ("rtt_ms", 0.0))})
            self.workers[worker.worker_id] = worker
            self.registered += 1
            self.activation.dirty = True
        if self.broadcaster is not None and worker.snapshot_url:
            self.broadcaster.add_peer(worker.worker_id, worker.snapshot_url, worker.relay)
        log.info("worker %s joined (%s engine, snapshots at %s)", worker.worker_id, worker.engine,
                 worker.snapshot_url)
        return {"worker_id": worker.worker_id, "version": self.version, "group_size": self.G,
                "sampling": self.sampling, "heartbeat_s": self.heartbeat_timeout_s / 4}

    def _heartbeat(self, body: dict, _headers) -> dict:
        with self.lock:
            self._worker(body)
        return {"version": self.version}

    def _pull(self, body: dict, _headers) -> dict:
        """Hand out up to ``max_groups`` groups. A long poll: with nothing worth dispatching it waits (up to
        ``long_poll_s``) for the learner to take a batch or publish a version, instead of the worker sleeping."""
        deadline = time.monotonic() + self.long_poll_s
        with self.lock:
            worker = self._worker(body)
            want = min(_int(body, "max_groups", 1, 1024), self.groups_per_pull)
            while True:
                work = self._dispatch(worker, want)
                remaining = deadline - time.monotonic()
                # A newer snapshot reached the worker: answer now so that it applies it and asks again.
                if work or self.closed or remaining <= 0 or worker.delivered_version > worker.version:
                    break
                self.lock.wait(timeout=remaining)
                worker.last_seen = time.monotonic()
            fresh_snapshot = worker.delivered_version > worker.version
        return {"work": work, "version": self.version, "wait_s": 0.0 if work or fresh_snapshot else 0.1}

    def _dispatch(self, worker: WorkerInfo, want: int) -> list[dict]:
        """New groups for ``worker``, while worth it (buffer.worth_dispatching). Holds the lock."""
        work = []
        if not self.activation.is_active(worker.worker_id):
            return work  # deactivated: no work until a re-plan turns it on again
        while len(work) < want and not self.closed:
            ahead = len(self.buffer) + len(self.in_flight)
            next_step = max(self.version, self.batches_taken)
            if not worth_dispatching(next_step, worker.version, ahead, self.P, self.S):
                break
            row = self.requeued.popleft() if self.requeued else next(self.rows)
            gid = next(self.group_ids)
            ids = encode_prompt(self.tokenizer, row["prompt"])
            self.in_flight[gid] = InFlight(worker.worker_id, row, ids)
            self.rollouts["dispatched"] += self.G
            work.append({"group_id": gid, "prompt_ids": ids})
        return work

    def _push(self, body: dict, _headers) -> dict:
        results = body.get("results")
        if not isinstance(results, list):
            raise BadRequest("'results' must be a list")
        accepted, rejected = [], []
        with self.lock:
            worker = self._worker(body)
            claimed = []
            for res in results:
                gid = str(res.get("group_id")) if isinstance(res, dict) else None
                flight = self.in_flight.get(gid)
                if flight is None or flight.worker_id != worker.worker_id:
                    rejected.append({"group_id": gid, "reason": "not_in_flight_for_this_worker"})
                    continue
                claimed.append((gid, self.in_flight.pop(gid), res))
        scored = []
        for gid, flight, res in claimed:  # parse and score outside the lock
            try:
                group = self._parse_group(flight, res)
                self.scorer.score(group)
                scored.append((gid, flight, group))
            except BadRequest as e:
                rejected.append({"group_id": gid, "reason": str(e)})
                with self.lock:  # the rollouts were generated but are unusable; the prompt goes back
                    self.dropped["invalid"] += self.G
                    self.requeued.append(flight.row)
                log.warning("worker %s: group %s rejected: %s", worker.worker_id, gid, e)
        with self.lock:
            for gid, flight, group in scored:
                self.rollouts["received"] += self.G
                self.by_worker[worker.worker_id] += self.G
                if self.buffer.admit(group, group.version, self.version):
                    accepted.append(gid)
                else:  # generated by weights the learner has not published: a lying or broken worker
                    self.dropped["future_version"] += self.G
                    self.requeued.append(flight.row)
                    rejected.append({"group_id": gid, "reason": "future_version"})
            rate = body.get("rollouts_per_s")
            if isinstance(rate, (int, float)) and math.isfinite(rate) and rate >= 0:  # a report, not a trust
                worker.rollouts_per_s = float(rate)
            self.lock.notify_all()
        return {"accepted": accepted, "rejected": rejected, "version": self.version}

    def _parse_group(self, flight: InFlight, res: dict) -> RolloutGroup:
        version = _int(res, "version", 0, 1 << 40)
        comps = res.get("completions")
        if not isinstance(comps, list) or len(comps) != self.G:
            raise BadRequest(f"expected {self.G} completions")
        max_tokens = int(self.sampling["max_tokens"])
        rollouts = []
        for c in comps:
            if not isinstance(c, dict):
                raise BadRequest("a completion must be an object")
            ids, lps = c.get("token_ids"), c.get("logprobs")
            if not isinstance(ids, list) or not isinstance(lps, list) or not 1 <= len(ids) <= max_tokens:
                raise BadRequest(f"token_ids/logprobs must be lists of 1..{max_tokens}")
            if len(ids) != len(lps):
                raise BadRequest("token_ids and logprobs differ in length")
            if not all(type(t) is int and 0 <= t < self.vocab_size for t in ids):
                raise BadRequest(f"token id outside the vocabulary [0, {self.vocab_size})")
            if not all(isinstance(x, (int, float)) and math.isfinite(x) and x <= 1e-4 for x in lps):
                raise BadRequest("logprobs must be finite and <= 0")
            finish = c.get("finish_reason")
            if finish not in ("stop", "length"):
                raise BadRequest(f"finish_reason {finish!r}")
            comp = Completion(ids, [float(x) for x in lps], finish)
            rollouts.append(Rollout(prompt_ids=flight.prompt_ids, completion=comp, version=version))
        return RolloutGroup(row=flight.row, rollouts=rollouts)

    def _snapshot_delivered(self, worker_id: str, version: int) -> None:
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is not None:
                worker.delivered_version = max(worker.delivered_version, version)
                self.lock.notify_all()

    def _leave(self, body: dict, _headers) -> dict:
        with self.lock:
            worker = self._worker(body)
            self._retire(worker.worker_id, "worker_left")
        return {"ok": True}

    def _status(self, _body, _headers) -> dict:
        return self.status()

    def status(self) -> dict[str, Any]:
        """A point-in-time view (also ``GET /status``): version, queue depths, live workers, who delivered what."""
        with self.lock:
            return {"version": self.version, "buffered_groups": len(self.buffer),
                    "in_flight_groups": len(self.in_flight), "workers": sorted(self.workers),
                    "registered": self.registered, "by_worker": dict(self.by_worker)}

    # ---------------------------------------------------------------- liveness

    def _retire(self, worker_id: str, reason: str) -> None:
        """Remove a worker; its in-flight groups are lost (counted) and their prompts re-queued. Holds the lock."""
        self.workers.pop(worker_id, None)
        self.retired[reason] += 1
        self.activation.dirty = True
        for gid in [g for g, f in self.in_flight.items() if f.worker_id == worker_id]:
            flight = self.in_flight.pop(gid)
            self.lost[reason] += self.G
            self.requeued.append(flight.row)
        if self.broadcaster is not None:
            self.broadcaster.remove_peer(worker_id)
        log.log(logging.INFO if reason == "worker_left" else logging.WARNING, "worker %s retired: %s", worker_id, reason)

    def _reap_loop(self) -> None:
        while not self.closed:
            time.sleep(min(1.0, self.heartbeat_timeout_s / 4))
            with self.lock:
                now = time.monotonic()
                for w in [w for w in self.workers.values() if now - w.last_seen > self.heartbeat_timeout_s]:
                    self._retire(w.worker_id, "worker_dead")
                bcast = self.broadcaster.metrics() if self.broadcaster is not None else {}
                if self.activation.replan(list(self.workers.values()), bcast, now):
                    self.lock.notify_all()

    # ---------------------------------------------------------------- learner-facing

    def set_version(self, version: int) -> None:
        """Called by the learner after every optimizer step."""
        with self.lock:
            self.version = version
            self.activation.step_done(self.workers, time.monotonic())
            self.dropped["stale"] += self.buffer.evict_stale(version) * self.G
            self.lock.notify_all()  # long-polling workers may now be worth dispatching to

    def take(self, n: int, timeout_s: float | None = None) -> list[RolloutGroup]:
        """Block until ``n`` groups admissible at the current step are buffered; return them, oldest first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.lock:
            while True:
                self.dropped["stale"] += self.buffer.evict_stale(self.version) * self.G
                got = self.buffer.take(n, self.version)
                if got is not None:
                    self.rollouts["consumed"] += n * self.G
                    self.batches_taken += 1
                    self.activation.took(time.monotonic())
                    self.lock.notify_all()  # room under the in-flight cap: wake long-polling workers
                    return [g for _, g in got]
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no {n} admissible groups within {timeout_s} s "
                                       f"({len(self.buffer)} buffered, {len(self.workers)} workers)")
                self.lock.wait(timeout=1.0 if remaining is None else min(remaining, 1.0))

    def metrics(self) -> dict[str, float]:
        with self.lock:
            out = {"buffer/groups": float(len(self.buffer)), "buffer/in_flight_groups": float(len(self.in_flight)),
                   "buffer/dropped_stale": float(self.dropped["stale"]),
                   "rollout/dispatched": float(self.rollouts["dispatched"]),
                   "rollout/received": float(self.rollouts["received"]),
                   "rollout/lost": float(sum(self.lost.values())), "rollout/workers": float(len(self.workers)),
                   "rollout/rejected_requests": float(sum(self.server.rejected.values()))}
            for w in self.workers.values():
                out[f"rollout/throughput/{w.worker_id}"] = w.rollouts_per_s
            out.update(self.activation.metrics(self.workers))
        return out

    def accounting(self) -> dict[str, Any]:
        """Every dispatched rollout is consumed, dropped (with reason) or lost (with reason)."""
        with self.lock:
            return {"dispatched": self.rollouts["dispatched"], "received": self.rollouts["received"],
                    "consumed": self.rollouts["consumed"], "dropped": _nonzero(self.dropped),
                    "lost": _nonzero(self.lost),
                    "in_flight": len(self.in_flight) * self.G, "buffered": len(self.buffer) * self.G,
                    "by_worker": dict(self.by_worker), "workers_retired": _nonzero(self.retired)}

    def close(self) -> dict[str, Any]:
        """Stop serving; what is still buffered or in flight is counted (dropped / lost at shutdown)."""
        with self.lock:
            self.closed = True
            self.dropped["unconsumed_at_end"] += len(self.buffer) * self.G
            self.buffer.groups.clear()
            self.lost["in_flight_at_end"] += len(self.in_flight) * self.G
            self.in_flight.clear()
            self.lock.notify_all()
        self.server.close()
        return self.accounting()


def _int(body: dict, key: str, lo: int, hi: int) -> int:
    value = body.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise BadRequest(f"{key!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _nonneg(body: dict, key: str, default: float) -> float:
    value = body.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise BadRequest(f"{key!r} must be a finite number >= 0, got {value!r}")
    return float(value)


def _nonzero(counter: Counter) -> dict[str, int]:
    return {k: v for k, v in counter.items() if v}
