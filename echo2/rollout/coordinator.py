"""The coordinator: the learner host's control plane for remote rollout workers.

    worker agents ──register / pull / push / heartbeat (HTTPS off loopback, token)──► Coordinator ──take(P, t)──► learner
                         ▲                                                │   ▲
                         └──────────── snapshots (Broadcaster) ◄──────────┘   └ set_version(v) after each step

    pull:  dispatch prompt groups, while worth_dispatching (buffer.py): in flight + buffered <= (S+1)·P
    push:  validate (results.py) -> score (task rewards, here, never trusted from a worker) -> admit to the buffer
    take:  waits for: P admissible groups in the buffer;  unblocked by: a push that completes the batch
    reaper: a worker silent for ``heartbeat_timeout_s`` is dead: its in-flight groups are counted lost and
            their prompts re-queued, so they are generated again elsewhere; a group past its deadline
            (liveness.py) is lost the same way, and its worker's share shrinks
    release: a worker whose generate or push failed hands its groups back at once (lost, with its reason)
    credentials: the run secret (the learner's own, the local pool's, admin routes) or a worker's own
            ``name:HMAC(secret, name)`` (transport.worker_credential), which acts only for the worker ids it
            registered; ``POST /revoke`` (run secret only) refuses a name from then on and re-queues its work

It runs as threads (an HTTP server and a reaper) of its own process (service.py), which answers the learner's
``take`` / ``set_version`` calls over a pipe; the learner only blocks in ``take`` when the buffer is short, which
is the idle time ``train/learner_idle_s`` reports.

Accounting (rollouts, G per group): dispatched = consumed + dropped[reason] + lost[reason] + in flight + buffered,
kept by the ledger (ledger.py), which journals every transition so that a restarted coordinator, or a learner
resumed from a checkpoint, carries on with the same books and data position.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from echo2.activation.planner import OnlinePlanner
from echo2.activation.settings import ActivationSettings, BroadcastShape
from echo2.models.identity import mismatch
from echo2.rollout.activation import OnChangeHook
from echo2.rollout.buffer import StalenessBuffer, worth_dispatching
from echo2.rollout.gate import Gate
from echo2.rollout.ledger import Ledger
from echo2.rollout.liveness import Liveness
from echo2.rollout.trust import Checks
from echo2.rollout.scoring import Scorer, encode_prompt
from echo2.rollout.results import integer, nonneg, parse_result
from echo2.rollout.types import RolloutGroup
from echo2.transport import BadRequest, JsonServer, Unauthorized

log = logging.getLogger(__name__)


class CannotServe(BadRequest):
    """A registering worker serves another model, or too short a context (HTTP 409, the reason in the body)."""

    status = 409


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
    misses: int = 0  # reaper passes in which its groups were past their deadline, less on-time pushes
    name: str | None = None  # the worker credential it registered with (None: the run secret)


@dataclass
class InFlight:
    worker_id: str
    row: dict[str, Any]
    prompt_ids: list[int]
    row_index: int
    deadline: float = math.inf  # time.monotonic() after which the group is lost


class Coordinator:
    def __init__(self, dataset: Any, scorer: Scorer, tokenizer: Any, *, token: str, staleness: int,
                 prompts_per_step: int, group_size: int, sampling: dict[str, Any], vocab_size: int,
                 host: str = "127.0.0.1", port: int = 0, heartbeat_timeout_s: float = 30.0,
                 groups_per_pull: int = 4, long_poll_s: float = 2.0, seed: int = 0, broadcaster: Any = None,
                 activation: ActivationSettings | None = None, broadcast_shape: BroadcastShape | None = None,
                 journal: str | None = None, recover: dict | None = None, version: int = 0,
                 liveness: dict | None = None, tls_dir: str | None = None, epoch: str | None = None,
                 checks: dict | None = None, requires: dict | None = None):
        """``journal``: file for the ledger's journal (None: none). ``recover``: start from it instead of afresh:
        ``{"restart": True}`` after a coordinator died, ``{"resume_offset": N}`` for a learner resumed from a
        checkpoint taken at journal length N; ``version``: the learner's version then. ``liveness``: Liveness's
        fields (deadlines, per-worker share, strikes). ``tls_dir``: the run CA's directory (transport.RunCA); set,
        every server of the rollout plane speaks TLS and workers get their certificates here. ``epoch``: names the
        learner process (a resumed learner is a new epoch); told to workers at registration, so that one holding
        another epoch's weights waits for this one's instead of generating with them. ``requires``: what a worker
        must serve, ``{"model": identity, "max_model_len": tokens}`` (echo2/models/identity.py); None: no check."""
        self.requires = requires
        self.scorer, self.tokenizer, self.token = scorer, tokenizer, token
        self.S, self.P, self.G = staleness, prompts_per_step, group_size
        self.sampling, self.vocab_size = sampling, vocab_size
        self.heartbeat_timeout_s, self.groups_per_pull = heartbeat_timeout_s, groups_per_pull
        self.long_poll_s = min(long_poll_s, heartbeat_timeout_s / 4)
        self.broadcaster, self.epoch = broadcaster, epoch
        self.liveness = Liveness(**(liveness or {}))
        self.checks = Checks(**(checks or {}))
        self.lock = threading.Condition()
        self.buffer = StalenessBuffer(staleness)
        self.version = version
        # Batches handed to the learner: the next batch taken is for step ``batches_taken``. Between a take at
        # step t and set_version(t+1) the learner is mid-step; dispatch must already judge for step t+1, or it
        # hands out work that is stale on arrival (measured: 21 % of rollouts dropped at S=0 without this).
        self.batches_taken = version
        self.workers: dict[str, WorkerInfo] = {}
        self.in_flight: dict[str, InFlight] = {}
        self.dataset = dataset
        self.ledger = _ledger(journal, recover, group_size, len(dataset), seed)
        self.registered = 0
        self.deadline_misses = 0
        self.closed = False
        activation, shape = activation or ActivationSettings(), broadcast_shape or BroadcastShape()
        self.activation = OnlinePlanner(activation, shape, staleness=staleness,
                                        rollouts_per_step=prompts_per_step * group_size)
        log.info("activation: %s solver, planned for a %s relay (fanout %d), a snapshot every %d steps",
                 activation.solver, shape.topology, shape.fanout, shape.interval)
        self.on_change = OnChangeHook(activation.on_change, run_dir=os.path.dirname(journal) if journal else None)
        self.gate = Gate(token, os.path.dirname(journal) if journal else None, fresh=not recover, tls_dir=tls_dir)
        trust = self.gate.trust
        self.server = JsonServer(host, port, token, name="coordinator", tls=trust and trust.server,
                                 public=Gate.PUBLIC_ROUTES, authorize=self.gate.authorize, routes={
            **self.gate.routes(), "POST /revoke": self._revoke,
            "POST /register": self._register, "POST /pull": self._pull, "POST /push": self._push,
            "POST /heartbeat": self._heartbeat, "POST /leave": self._leave, "POST /release": self._release,
            "GET /status": self._status,
        })
        self.reaper = threading.Thread(target=self._reap_loop, name="reaper", daemon=True)
        if broadcaster is not None:
            broadcaster.on_delivered = self._snapshot_delivered
            if trust is not None:
                broadcaster.use_tls(trust)

    def start(self) -> "Coordinator":
        self.server.start()
        self.reaper.start()
        log.info("coordinator on %s (S=%d, P=%d, G=%d)", self.url, self.S, self.P, self.G)
        return self

    @property
    def url(self) -> str:
        return self.server.url()

    # ---------------------------------------------------------------- worker-facing routes

    def _worker(self, body: dict, headers) -> WorkerInfo:
        worker = self.workers.get(str(body.get("worker_id")))
        if worker is None:
            raise BadRequest(f"unknown worker {body.get('worker_id')!r}: register first")
        caller = self.gate.caller(headers)
        if caller is not None and worker.name != caller:
            raise Unauthorized(f"worker {worker.worker_id} did not register with {caller!r}'s credential")
        worker.last_seen = time.monotonic()
        if "version" in body:
            worker.version = integer(body, "version", 0, self.version)
        return worker

    def _register(self, body: dict, headers) -> dict:
        if self.requires is not None and (why := mismatch(self.requires, body)):
            raise CannotServe(f"this worker cannot serve this run: {why}")  # registered never: no work, no id
        with self.lock:
            relay_addr = body.get("relay")
            if relay_addr is not None and not (isinstance(relay_addr, str) and relay_addr.rpartition(":")[2].isdigit()):
                raise BadRequest("'relay' must be 'host:port'")
            worker = WorkerInfo(self.ledger.new_worker_id(), body.get("snapshot_url"), str(body.get("engine", "?")),
                                relay_addr, **{k: nonneg(body, k, default) for k, default in (
                                    ("usd_per_hour", 0.0), ("down_mbit", 1000.0), ("up_mbit", 1000.0),
                                    ("rtt_ms", 0.0))})
            worker.name = self.gate.caller(headers)
            self.workers[worker.worker_id] = worker
            self.registered += 1
            self.activation.dirty = True
        if self.broadcaster is not None and worker.snapshot_url:
            self.broadcaster.add_peer(worker.worker_id, worker.snapshot_url, worker.relay)
        log.info("worker %s joined (%s engine, snapshots at %s)", worker.worker_id, worker.engine,
                 worker.snapshot_url)
        return {"worker_id": worker.worker_id, "version": self.version, "epoch": self.epoch, "group_size": self.G,
                "sampling": self.sampling, "heartbeat_s": self.heartbeat_timeout_s / 4, "requires": self.requires}

    def _revoke(self, body: dict, _headers) -> dict:
        """Revoke worker ``name`` for the rest of the run: its requests are refused from now on, its workers are
        retired (their in-flight groups lost: revoked, prompts re-queued) and dropped from the broadcast."""
        with self.lock:
            name = self.gate.revoke(body.get("name"))
            retired = [w.worker_id for w in self.workers.values() if w.name == name]
            for wid in retired:
                self._retire(wid, "revoked")
            self.lock.notify_all()
        log.warning("worker credential %r revoked; retired %s", name, retired or "no live worker")
        return {"revoked": name, "retired": retired}

    def _heartbeat(self, body: dict, headers) -> dict:
        with self.lock:
            self._worker(body, headers)
        return {"version": self.version}

    def _pull(self, body: dict, headers) -> dict:
        """Hand out up to ``max_groups`` groups. A long poll: with nothing worth dispatching it waits (up to
        ``long_poll_s``) for the learner to take a batch or publish a version, instead of the worker sleeping."""
        deadline = time.monotonic() + self.long_poll_s
        with self.lock:
            worker = self._worker(body, headers)
            want = min(integer(body, "max_groups", 1, 1024), self.groups_per_pull)
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
        held = sum(1 for f in self.in_flight.values() if f.worker_id == worker.worker_id)
        limit = self.liveness.worker_limit((self.S + 1) * self.P, worker.misses)
        while len(work) < want and held + len(work) < limit and not self.closed:
            ahead = len(self.buffer) + len(self.in_flight)
            next_step = max(self.version, self.batches_taken)
            if not worth_dispatching(next_step, worker.version, ahead, self.P, self.S):
                break
            gid, index = self.ledger.draw()
            row = self.dataset[index]
            ids = encode_prompt(self.tokenizer, row["prompt"])
            self.in_flight[gid] = InFlight(worker.worker_id, row, ids, index)
            work.append({"group_id": gid, "prompt_ids": ids})
        if work:
            due = time.monotonic() + self.liveness.deadline_s(worker.rollouts_per_s, held + len(work), self.G)
            for w in work:
                self.in_flight[w["group_id"]].deadline = due
        return work

    def _push(self, body: dict, headers) -> dict:
        results = body.get("results")
        if not isinstance(results, list):
            raise BadRequest("'results' must be a list")
        accepted, rejected = [], []
        with self.lock:
            worker = self._worker(body, headers)
            claimed = []
            for res in results:
                gid = str(res.get("group_id")) if isinstance(res, dict) else None
                flight = self.in_flight.get(gid)
                if flight is None or flight.worker_id != worker.worker_id:
                    # a replay, a duplicate, a result the reaper already gave up on, or work never dispatched
                    rejected.append({"group_id": gid, "reason": "not_in_flight_for_this_worker"})
                    self.ledger.refuse("not_in_flight_for_this_worker")
                    log.warning("worker %s: result for group %s refused: not in flight for it", worker.worker_id, gid)
                    continue
                claimed.append((gid, self.in_flight.pop(gid), res))
        scored = []
        for gid, flight, res in claimed:  # parse and score outside the lock
            try:
                rollouts = parse_result(res, flight.prompt_ids, self.G, int(self.sampling["max_tokens"]),
                                        self.vocab_size)
                group = RolloutGroup(row=flight.row, rollouts=rollouts, group_id=gid, row_index=flight.row_index,
                                     worker_id=flight.worker_id)
                self.scorer.score(group)
                scored.append((gid, flight, group))
            except BadRequest as e:
                rejected.append({"group_id": gid, "reason": str(e)})
                with self.lock:  # the rollouts were generated but are unusable; the prompt goes back
                    self.ledger.drop(gid, "invalid", requeue=True)
                log.warning("worker %s: group %s rejected: %s", worker.worker_id, gid, e)
        with self.lock:
            if scored and worker.misses and not self.liveness.benched(worker.misses):
                worker.misses -= 1  # on time again: one halving of its share back
            for gid, flight, group in scored:
                self.ledger.received(gid, worker.worker_id)
                if self.buffer.admit(group, group.version, self.version):
                    accepted.append(gid)
                else:  # generated by weights the learner has not published: a lying or broken worker
                    self.ledger.drop(gid, "future_version", requeue=True)
                    rejected.append({"group_id": gid, "reason": "future_version"})
            rate = body.get("rollouts_per_s")
            if isinstance(rate, (int, float)) and math.isfinite(rate) and rate >= 0:  # a report, not a trust
                worker.rollouts_per_s = float(rate)
            self.lock.notify_all()
        return {"accepted": accepted, "rejected": rejected, "version": self.version}

    def _snapshot_delivered(self, worker_id: str, version: int) -> None:
        with self.lock:
            worker = self.workers.get(worker_id)
            if worker is not None:
                worker.delivered_version = max(worker.delivered_version, version)
                self.lock.notify_all()

    def _leave(self, body: dict, headers) -> dict:
        with self.lock:
            worker = self._worker(body, headers)
            self._retire(worker.worker_id, "worker_left")
        return {"ok": True}

    RELEASE_REASONS = ("generate_failed", "push_failed")

    def _release(self, body: dict, headers) -> dict:
        """A worker hands back groups it cannot deliver: lost with its reason, prompts re-queued at once."""
        reason, gids = body.get("reason"), body.get("group_ids")
        if reason not in self.RELEASE_REASONS:
            raise BadRequest(f"'reason' must be one of {self.RELEASE_REASONS}, got {reason!r}")
        if not isinstance(gids, list) or not all(isinstance(g, str) for g in gids):
            raise BadRequest("'group_ids' must be a list of strings")
        released = []
        with self.lock:
            worker = self._worker(body, headers)
            for gid in gids:
                flight = self.in_flight.get(gid)
                if flight is None or flight.worker_id != worker.worker_id:
                    self.ledger.refuse("release_not_in_flight")  # already settled (e.g. its push did arrive)
                    continue
                del self.in_flight[gid]
                self.ledger.lose(gid, reason)
                released.append(gid)
            self.lock.notify_all()  # room under the in-flight cap
        log.warning("worker %s handed back %d groups: %s", worker.worker_id, len(released), reason)
        return {"released": released}

    def _status(self, _body, _headers) -> dict:
        return self.status()

    def status(self) -> dict[str, Any]:
        """A point-in-time view (also ``GET /status``): version, queue depths, live workers, who delivered what."""
        with self.lock:
            return {"version": self.version, "buffered_groups": len(self.buffer),
                    "in_flight_groups": len(self.in_flight), "workers": sorted(self.workers),
                    "registered": self.registered, "by_worker": dict(self.ledger.by_worker),
                    "held": dict(Counter(f.worker_id for f in self.in_flight.values())),
                    "benched": sorted(w.worker_id for w in self.workers.values()
                                      if self.liveness.benched(w.misses))}

    # ---------------------------------------------------------------- liveness

    def _retire(self, worker_id: str, reason: str) -> None:
        """Remove a worker; its in-flight groups are lost (counted) and their prompts re-queued. Holds the lock."""
        self.workers.pop(worker_id, None)
        self.ledger.retire(worker_id, reason)
        self.activation.dirty = True
        for gid in [g for g, f in self.in_flight.items() if f.worker_id == worker_id]:
            del self.in_flight[gid]
            self.ledger.lose(gid, reason)
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
                self.on_change.reap()
                self._expire(now)
                bcast = self.broadcaster.metrics() if self.broadcaster is not None else {}
                workers = list(self.workers.values())
                change = self.activation.replan(workers, float(bcast.get("broadcast/bytes", 0.0)), now)
                if change is not None:
                    self.on_change(change, workers, self.activation.settings.solver)
                    self.lock.notify_all()

    def _expire(self, now: float) -> None:
        """Groups past their deadline are lost and re-queued; each of their workers takes one miss. Holds the lock."""
        late = Counter()
        for gid in [g for g, f in self.in_flight.items() if f.deadline < now]:
            late[self.in_flight.pop(gid).worker_id] += 1
            self.ledger.lose(gid, "deadline")
        for wid, n in late.items():
            worker = self.workers.get(wid)
            if worker is None:
                continue
            worker.misses += 1
            self.deadline_misses += 1
            benched = self.liveness.benched(worker.misses)
            log.warning("worker %s: %d groups past their deadline (miss %d of %d)%s", wid, n, worker.misses,
                        self.liveness.strikes, "; it gets no more work" if benched else "")
        if late:
            self.lock.notify_all()

    # ---------------------------------------------------------------- learner-facing

    def set_version(self, version: int) -> None:
        """Called by the learner after every optimizer step."""
        with self.lock:
            self.version = version
            self.activation.step_done(self.workers, time.monotonic())
            self._evict_stale()
            self.lock.notify_all()  # long-polling workers may now be worth dispatching to

    def take(self, n: int, timeout_s: float | None = None) -> list[RolloutGroup]:
        """Block until ``n`` groups admissible at the current step are buffered; return them, oldest first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.lock:
            while True:
                self._evict_stale()
                got = self.buffer.take(n, self.version)
                if got is not None:
                    self.ledger.consumed([g.group_id for _, g in got])
                    self.batches_taken += 1
                    self.activation.took(time.monotonic())
                    self.lock.notify_all()  # room under the in-flight cap: wake long-polling workers
                    return [g for _, g in got]
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no {n} admissible groups within {timeout_s} s "
                                       f"({len(self.buffer)} buffered, {len(self.workers)} workers)")
                self.lock.wait(timeout=1.0 if remaining is None else min(remaining, 1.0))

    def check(self, stats: dict[str, tuple[int, float]]) -> None:
        """The learner's scores of workers' behaviour logprobs (trust.py): flag, or retire an implausible worker,
        dropping its buffered groups (``untrusted``, prompts re-queued) and revoking its credential."""
        with self.lock:
            flagged, retire = self.checks.update(stats)
            for wid in flagged:
                log.warning("worker %s flagged: mean log-ratio %.2f against the learner's logprobs", wid,
                            self.checks.mean(wid))
            for wid in retire:
                worker = self.workers.get(wid)
                if worker is None:
                    continue
                keep = []
                for x, group in self.buffer.groups:
                    if group.worker_id == wid:
                        self.ledger.drop(group.group_id, "untrusted", requeue=True)
                    else:
                        keep.append((x, group))
                self.buffer.groups = deque(keep)
                if worker.name is not None:
                    self.gate.revoke(worker.name)  # else it would come back under a new id
                self._retire(wid, "untrusted")
                log.warning("worker %s retired as untrusted (mean log-ratio %.2f over %d tokens)", wid,
                            self.checks.mean(wid), self.checks.tokens[wid])
            self.lock.notify_all()

    def _evict_stale(self) -> None:
        for group in self.buffer.evict_stale(self.version):
            self.ledger.drop(group.group_id, "stale", requeue=False)

    def mark(self) -> int:
        """A point to resume from (the learner is between steps): the journal's length now."""
        with self.lock:
            return self.ledger.position()

    def metrics(self) -> dict[str, float]:
        with self.lock:
            led = self.ledger
            out = {"buffer/groups": float(len(self.buffer)), "buffer/in_flight_groups": float(len(self.in_flight)),
                   "buffer/dropped_stale": float(led.dropped["stale"]),
                   "rollout/dispatched": float(led.rollouts["dispatched"]),
                   "rollout/received": float(led.rollouts["received"]),
                   "rollout/dropped": float(sum(led.dropped.values())),
                   "rollout/lost": float(sum(led.lost.values())), "rollout/workers": float(len(self.workers)),
                   "rollout/rejected_requests": float(sum(self.server.rejected.values())),
                   "rollout/refused_results": float(sum(led.refused.values())),
                   "rollout/lost_deadline": float(led.lost["deadline"]),
                   "rollout/flagged_workers": float(len(self.checks.flagged)),
                   "rollout/dropped_untrusted": float(led.dropped["untrusted"]),
                   "rollout/deadline_misses": float(self.deadline_misses),
                   "rollout/benched_workers": float(sum(self.liveness.benched(w.misses)
                                                        for w in self.workers.values()))}
            for w in self.workers.values():
                out[f"rollout/throughput/{w.worker_id}"] = w.rollouts_per_s
            for wid in self.checks.tokens:  # rollout checks: each worker's mean log-ratio so far
                out[f"rollout/check_log_ratio/{wid}"] = self.checks.mean(wid)
            out.update(self.activation.metrics(self.workers))
        return out

    def accounting(self) -> dict[str, Any]:
        """Every dispatched rollout is consumed, dropped (with reason) or lost (with reason)."""
        with self.lock:
            return {**self.ledger.accounting(), "requests_rejected": _nonzero(self.server.rejected)}

    def abort(self) -> None:
        """Stop serving without settling the books: the learner died, and a resume will book what is open."""
        with self.lock:
            self.closed = True
            self.ledger.close()
            self.lock.notify_all()
        self.server.close()

    def close(self) -> dict[str, Any]:
        """Stop serving; what is still buffered or in flight is counted (dropped / lost at shutdown)."""
        with self.lock:
            self.closed = True
            for _, group in self.buffer.groups:
                self.ledger.drop(group.group_id, "unconsumed_at_end", requeue=False)
            self.buffer.groups.clear()
            for gid in self.in_flight:
                self.ledger.lose(gid, "in_flight_at_end", requeue=False)
            self.in_flight.clear()
            self.lock.notify_all()
        self.server.close()
        accounting = self.accounting()
        self.ledger.close()
        return accounting


def _nonzero(counter: Counter) -> dict[str, int]:
    return {k: v for k, v in counter.items() if v}


def _ledger(journal: str | None, recover: dict | None, group_size: int, n_rows: int, seed: int) -> Ledger:
    if recover and journal is None:
        raise ValueError("recovering the coordinator needs its journal")
    if recover and recover.get("restart"):
        led = Ledger.after_coordinator_restart(journal, group_size, n_rows, seed)
        log.warning("coordinator restarted from %s: %s", journal, led.accounting())
        return led
    if recover:
        led = Ledger.after_learner_resume(journal, int(recover["resume_offset"]), group_size, n_rows, seed)
        log.info("coordinator resumed from %s at byte %d: %s", journal, recover["resume_offset"], led.accounting())
        return led
    led = Ledger(group_size, n_rows, seed)
    if journal is not None:
        if os.path.exists(journal):
            os.unlink(journal)  # a fresh run in a used directory: the old journal is not this run's
        led.open_journal(journal)
    return led
