"""The coordinator: the learner host's control plane for remote rollout workers.

    worker agents ──register / pull / push / heartbeat (HTTPS off loopback, token)──► Coordinator ──take(P, t)──► learner
                         ▲                                                │   ▲
                         └──────────── snapshots (Broadcaster) ◄──────────┘   └ set_version(v) after each step

    every route: its body is validated first (schemas.py: types, finite bounded numbers, known keys), and a
            route changes nothing until it has (a bad body is a 400 naming the field, never a half-done change)
    pull:  dispatch prompt groups, while worth_dispatching (buffer.py): in flight + being scored + buffered (the
           ledger's open groups) <= (S+1)·P, and while the worker's credential holds less than its share (liveness.py)
    push:  claim (lock) -> validate (results.py) and score (task rewards in a pool of reward processes with a time
           limit, reward_pool.py; never trusted from a worker) outside the lock (intake.py) -> settle (lock): each
           group buffered, or dropped with its reason; a version the worker was never delivered is refused
    take:  waits for: P admissible groups in the buffer;  unblocked by: a push that completes the batch
    reaper: a worker silent for ``heartbeat_timeout_s`` is dead: its in-flight groups are counted lost and
            their prompts re-queued, so they are generated again elsewhere; a group past its deadline
            (liveness.py) is lost the same way, and its credential's share shrinks. An error in one pass is
            logged and counted, and the next pass runs: nothing stops liveness
    release: a worker whose generate or push failed hands its groups back at once (lost, with its reason)
    credentials: the run secret (the learner's own, the local pool's, admin routes) or a worker's own
            ``name:HMAC(secret, name)`` (credential.worker_credential), which acts only for the worker ids it
            registered; who sent a request is decided once, as it is admitted (gate.Gate.authorize: one credential
            a request), and routes read that (gate.Caller), never the headers; all the ids of one credential are one
            principal (registry.py): one share, one record of strikes, one verdict of the rollout checks, one
            bucket of registrations (bounds.py); ``POST /revoke`` (run secret only) refuses a name from then on and
            re-queues its work, all or nothing; ``GET /status`` shows a worker credential its own workers only
    eval:  (run.eval_on=workers) the learner asks for a version's evaluation; a run-secret worker's pull that finds
           one due gets the held-out rows instead of groups, and answers on POST /eval (evaluation.py)
    bodies: each route's limit is its largest honest body (bounds.py: a push sized from (S+1)·P groups of G
            completions of max_tokens), refused on its declared length before a byte is read

It runs as threads (an HTTP server and a reaper) of its own process (process.py; the learner's side:
echo2/learner/sources/coordinator_process.py), which answers the learner's ``take`` / ``set_version`` calls over a pipe; the learner
only blocks in ``take`` when the buffer is short, which is the idle time ``train/learner_idle_s`` reports.

Accounting (rollouts, G per group): dispatched = consumed + dropped[reason] + lost[reason] + in flight + buffered,
kept by the ledger (ledger.py), which journals every transition so that a restarted coordinator, or a learner
resumed from a checkpoint, carries on with the same books and data position.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import threading
import time
from collections import Counter
from typing import Any

from echo2.activation.planner import OnlinePlanner
from echo2.metrics import BROADCAST_BYTES, EVAL_ACCURACY, EVAL_TIME_S, EVAL_UNSCORED
from echo2.models.identity import mismatch
from echo2.settings import CoordinatorSettings
from echo2.coordinator import bounds, evaluation, intake, schemas, verdicts, views
from echo2.coordinator.on_change import OnChangeHook
from echo2.coordinator.prober import Prober
from echo2.coordinator.buffer import StalenessBuffer, worth_dispatching
from echo2.coordinator.gate import Gate
from echo2.coordinator.ledger import open_ledger
from echo2.coordinator.liveness import Liveness
from echo2.coordinator.registry import InFlight, Registry, WorkerInfo
from echo2.coordinator.reward_faults import RewardFaults
from echo2.scoring import encode_prompt
from echo2.coordinator.trust import Checks
from echo2.records import RolloutGroup
from echo2.net.http import BadRequest, JsonServer, Revoked, TooManyRequests, Unauthorized
from echo2.net.tls import credential_peer_name, is_loopback

log = logging.getLogger(__name__)

MAX_IDS_PER_CREDENTIAL = 16
"""Live worker ids one credential may hold at once (a box with 8 GPUs runs 8 agents): each id costs a registry
entry, heartbeats and a broadcast peer, so a credential cannot register without bound."""


CLOSE_WAIT_S = 15.0
"""How long close() waits for pushes being scored to settle (the reward pool, closed first, ends them at once; a
scorer in this process may take its own time)."""


class CannotServe(BadRequest):
    """A registering worker serves another model, or too short a context, or its credential is benched (HTTP
    409, the reason in the body: the agent exits with it)."""

    status = 409


class Coordinator:
    def __init__(self, dataset: Any, scorer: Any, tokenizer: Any, settings: CoordinatorSettings,
                 broadcaster: Any = None, encode: Any = None, eval_rows: list[dict] | None = None):
        """``scorer``: anything with ``score_many(groups)``, ``metrics()`` and ``close()`` (a scoring.Scorer, or a
        reward_pool.RewardPool); ``broadcaster``: a seams.Broadcaster, or None. The coordinator owns both: its
        ``close`` and ``abort`` close them. ``settings``: everything else (echo2/settings.py). A ``recover``ed
        coordinator starts from the journal instead of afresh; ``requires`` None: no check of what workers
        serve. ``encode(row)``: a row's prompt token ids (the task's ``prompt_ids``, with its chat template
        arguments; default: the prompt through the chat template as it is). ``eval_rows``: the task's held-out rows,
        when workers evaluate (run.eval_on=workers; evaluation.py)."""
        s = self.settings = settings
        staleness, group_size, journal, recover, version = (s.staleness, s.group_size, s.journal, s.recover,
                                                            s.version)
        self.requires = s.requires
        self.scorer, self.tokenizer, self.token = scorer, tokenizer, s.token
        self.encode = encode or (lambda row: encode_prompt(tokenizer, row["prompt"]))
        self.staleness, self.P, self.G = staleness, s.prompts_per_step, group_size
        self.sampling, self.vocab_size = s.sampling, s.vocab_size
        self.heartbeat_timeout_s, self.groups_per_pull = s.heartbeat_timeout_s, s.groups_per_pull
        self.long_poll_s = min(s.long_poll_s, s.heartbeat_timeout_s / 4)
        self.broadcaster, self.epoch = broadcaster, s.epoch
        # probes of published versions, computed here rather than in the learner's step (prober.py; started at the first)
        self.prober = Prober(s.probe_model) if s.probe_model else None
        self.liveness = Liveness(**dataclasses.asdict(s.liveness))
        self.checks = Checks(s.checks)
        self.lock = threading.Condition()
        self.buffer = StalenessBuffer(staleness)
        self.version = version
        self._tell_scorer(version)
        # Versions every worker holds without a delivery: a fresh run's initial weights (0), and after a coordinator
        # restart the versions the dead one may have delivered that are still admissible. A resumed learner is a
        # new epoch: its workers wait for its weights, delivered like any snapshot.
        self.initial_versions = ({0} if version == 0 else set(range(max(0, version - staleness), version + 1))
                                 if not (recover and "resume_offset" in recover) else set())
        # The step the learner's next batch is for: after a take at step t, t + μ (μ = s.steps_per_batch: its
        # optimizer steps per batch). Between a take at step t and set_version(t+1) the learner is mid-step; dispatch
        # must already judge for the next take, or it hands out work that is stale on arrival (measured: 21 % of
        # rollouts dropped at S=0 without this).
        self.steps_per_batch = s.steps_per_batch
        self.next_take = version
        self.last_taken: list[tuple] = []  # (group id, worker id, row) of the last batch: what the checks judge
        self.reg = Registry(self.liveness)
        self.dataset = dataset
        self.ledger = open_ledger(journal, recover, group_size, len(dataset), s.seed)
        self.ledger.compact_bytes = None if s.journal_compact_mb is None else int(s.journal_compact_mb * (1 << 20))
        self.registered = 0
        self.evals = (evaluation.WorkerEval(eval_rows, [self.encode(r) for r in eval_rows], s.episode is not None)
                      if eval_rows is not None else None)
        self.deadline_misses = self.reaper_errors = 0
        self.scoring = 0  # pushes claimed and not yet settled (close() waits for them, CLOSE_WAIT_S at most)
        self.closed = False
        activation, shape = s.activation, s.broadcast_shape
        self.activation = OnlinePlanner(activation, shape, staleness=staleness,
                                        rollouts_per_step=s.prompts_per_step * group_size / s.steps_per_batch)
        log.info("activation: %s solver, planned for a %s relay (fanout %d), a snapshot every %d steps",
                 activation.solver, shape.topology, shape.fanout, shape.interval)
        self.on_change = OnChangeHook(activation.on_change, run_dir=os.path.dirname(journal) if journal else None)
        self.gate = Gate(s.token, os.path.dirname(journal) if journal else None, fresh=not recover, tls_dir=s.tls_dir)
        trust = self.gate.trust
        self.tls, self.exposed = trust is not None, not is_loopback(s.host)
        self.registrations = bounds.Registrations()
        self.faults = RewardFaults()  # whose output made a reward hang or crash (reward_faults.py)
        limits = bounds.body_limits(staleness, self.P, self.G, int(self.sampling["max_tokens"]),
                                    len(self.evals.rows) if self.evals else 0)
        self.server = JsonServer(s.host, s.port, s.token, name="coordinator", tls=trust and trust.server,
                                 public=Gate.PUBLIC_ROUTES, authorize=self.gate.authorize, max_bytes=bounds.SMALL_BYTES,
                                 route_max_bytes=limits, principal_body_bytes=bounds.principal_body_bytes(limits),
                                 routes={
            **self.gate.routes(), "POST /revoke": self._revoke,
            "POST /register": self._register, "POST /pull": self._pull, "POST /push": self._push,
            "POST /heartbeat": self._heartbeat, "POST /leave": self._leave, "POST /release": self._release,
            "GET /status": self._status, **({"POST /eval": self._eval} if self.evals else {}),
        })
        self.reaper = threading.Thread(target=self._reap_loop, name="reaper", daemon=True)
        if broadcaster is not None:
            broadcaster.on_delivered = self._snapshot_delivered
            broadcaster.on_ordered = self._snapshot_ordered
            broadcaster.epoch = s.epoch  # in every manifest and order: a worker refuses another epoch's
            if trust is not None:
                broadcaster.use_tls(trust)

    def start(self) -> "Coordinator":
        self.server.start()
        self.reaper.start()
        log.info("coordinator on %s (S=%d, P=%d, G=%d)", self.url, self.staleness, self.P, self.G)
        return self

    @property
    def url(self) -> str:
        return self.server.url()

    @property
    def workers(self) -> dict[str, WorkerInfo]:
        return self.reg.workers

    @property
    def in_flight(self) -> dict[str, InFlight]:
        return self.reg.in_flight

    # ---------------------------------------------------------------- worker-facing routes

    def _worker(self, req: schemas.WorkerCall, headers) -> WorkerInfo:
        """The calling worker (its credential must be the one it registered with); notes it alive and, if it is
        one it may hold (delivered, initial or ordered), the version it claims. Holds the lock."""
        who = self.gate.caller(headers)  # as the request's admission established it
        worker = self.reg.workers.get(req.worker_id)
        if worker is None:
            raise BadRequest(f"unknown worker {req.worker_id!r}: register first")
        if not who.secret and worker.name != who.name:
            raise Unauthorized(f"worker {worker.worker_id} did not register with {who.name!r}'s credential")
        if req.version is not None and req.version > self.version:
            raise BadRequest(f"'version' {req.version} is ahead of the learner's {self.version}")
        worker.last_seen = time.monotonic()
        if req.version is not None and worker.may_hold(req.version):
            worker.version = req.version  # a claim of weights it was never handed is not believed
        return worker

    def _register(self, body: dict, headers) -> dict:
        req = schemas.parse(schemas.Register, body)
        if self.requires is not None and (why := mismatch(self.requires, body)):
            raise CannotServe(f"this worker cannot serve this run: {why}")  # registered never: no work, no id
        who = self.gate.caller(headers)
        caller = None if who.secret else who.name
        exposed = self.exposed and not who.secret  # the run secret's agents are the learner's own
        client = getattr(headers, "client", None)  # where it connects from: may it name private addresses?
        url = req.snapshot_url and schemas.snapshot_url(req.snapshot_url, tls=self.tls, exposed=exposed, client=client)
        relay = req.relay and schemas.relay_address(req.relay, exposed=exposed, client=client)
        with self.lock:
            if caller is not None and caller in self.gate.revoked:  # admitted before its revocation, read after it
                raise Revoked(f"the credential of worker {caller!r} was revoked")
            known = self.reg.principals.get(caller) if caller is not None else None
            if known is not None and self.liveness.benched(known.misses):
                raise CannotServe(f"the credential {caller!r} was benched after {known.misses} misses (deadlines "
                                  "or invalid results): it gets no more work in this run")
            if known is not None and len(known.ids) >= MAX_IDS_PER_CREDENTIAL:
                raise BadRequest(f"the credential {caller!r} already has {len(known.ids)} live workers "
                                 f"(at most {MAX_IDS_PER_CREDENTIAL}): leave with one first")
            if caller is not None and not self.registrations.allow(caller, time.monotonic()):
                raise TooManyRequests(f"the credential {caller!r} registers too often (bounds.REGISTER_BURST at "
                                      f"once, then one every {bounds.REGISTER_EVERY_S:.0f} s): again in "
                                      f"{self.registrations.wait_s(caller, time.monotonic()):.0f} s")
            wid = self.ledger.new_worker_id()
            principal = self.reg.principal(caller, wid)
            worker = WorkerInfo(wid, principal.key, url or None, req.engine, relay or None, caller,
                                version=max(self.initial_versions, default=-1), delivered=set(self.initial_versions),
                                usd_per_hour=req.usd_per_hour, down_mbit=req.down_mbit, up_mbit=req.up_mbit,
                                rtt_ms=req.rtt_ms)
            self.reg.add(worker)
            self.registered += 1
            self.activation.dirty = True
            if self.broadcaster is not None and worker.snapshot_url:
                # under the lock, as _revoke retires and re-keys under it: a revocation comes wholly before this
                # registration (refused above) or wholly after it (this peer dropped, the relay re-keyed), never
                # between, where the new peer would be handed the key that replaced the revoked one's
                try:
                    self.broadcaster.add_peer(worker.worker_id, worker.snapshot_url, worker.relay,
                                              credential_peer_name(caller))
                except Exception:
                    self._retire(worker.worker_id, "register_failed")
                    raise
        log.info("worker %s joined (%s engine, snapshots at %s%s)", worker.worker_id, worker.engine,
                 worker.snapshot_url, f", credential {caller!r}" if caller else "")
        return {"worker_id": worker.worker_id, "version": self.version, "epoch": self.epoch, "group_size": self.G,
                "sampling": self.sampling, "heartbeat_s": self.heartbeat_timeout_s / 4, "requires": self.requires,
                "episode": self.settings.episode}

    def _revoke(self, body: dict, _headers) -> dict:
        """Revoke worker ``name`` for the rest of the run: its requests are refused from now on, its buffered groups
        dropped (revoked, prompts re-queued), its workers retired (their in-flight groups lost: revoked, prompts
        re-queued) and dropped from the broadcast. All or nothing: written down first (gate.revoke); a revocation
        that cannot be (a full disk) changes nothing (507)."""
        name = schemas.parse(schemas.Revoke, body).name
        with self.lock:
            self.gate.revoke(name)  # raises before anything changes when it cannot be written down
            principal = self.reg.principals.get(name)
            retired = sorted(principal.ids) if principal is not None else []
            if principal is not None:  # what it pushed and the learner has not taken is not trained on
                verdicts.drop_buffered(self, principal.key, "revoked")
            for wid in retired:
                self._retire(wid, "revoked")
            if self.broadcaster is not None:
                self.broadcaster.rekey()  # a new relay key for the live workers: the revoked one is off the relay
            self.lock.notify_all()
        log.warning("worker credential %r revoked; retired %s", name, retired or "no live worker")
        return {"revoked": name, "retired": retired}

    def _heartbeat(self, body: dict, headers) -> dict:
        req = schemas.parse(schemas.Heartbeat, body)
        with self.lock:
            self._worker(req, headers)
        return {"version": self.version}

    def _pull(self, body: dict, headers) -> dict:
        """Hand out up to ``max_groups`` groups. A long poll: with nothing worth dispatching it waits (up to
        ``long_poll_s``) for the learner to take a batch or publish a version, instead of the worker sleeping."""
        req = schemas.parse(schemas.Pull, body)
        deadline = time.monotonic() + self.long_poll_s
        with self.lock:
            worker = self._worker(req, headers)
            want = min(req.max_groups or self.groups_per_pull, self.groups_per_pull)
            while True:
                job = self._eval_job(worker)
                work, why = self._dispatch(worker, want) if job is None else ([], "")
                remaining = deadline - time.monotonic()
                # A newer snapshot reached the worker: answer now so that it applies it and asks again.
                if work or job or self.closed or remaining <= 0 or worker.delivered_version > worker.version:
                    break
                t0 = time.monotonic()
                self.lock.wait(timeout=remaining)
                worker.last_seen = time.monotonic()
                worker.waited_s[why] = worker.waited_s.get(why, 0.0) + worker.last_seen - t0
            fresh_snapshot = worker.delivered_version > worker.version
        if job is not None:
            log.info("worker %s evaluates v%d on %d held-out rows (%s)", worker.worker_id, job["version"],
                     len(job["prompt_ids"]), job["job_id"])
            return {"work": [], "eval": job, "version": self.version, "wait_s": 0.0}
        return {"work": work, "version": self.version, "wait_s": 0.0 if work or fresh_snapshot else 0.1}

    def _eval_job(self, worker: WorkerInfo) -> dict | None:
        """The held-out rows for ``worker`` to evaluate, if an evaluation is due at a version it holds and it joined
        with the run secret (evaluation.py says why only those). Holds the lock."""
        if self.evals is None or worker.name is not None or worker.version < 0 or self.closed or \
                worker.worker_id not in self.reg.workers:
            return None
        rate = worker.rollouts_per_s or self.reg.fresh_rate()
        return self.evals.hand_out(worker.worker_id, worker.version,
                                   self.liveness.deadline_s(rate, len(self.evals.rows), 1), time.monotonic())

    def _eval(self, body: dict, headers) -> dict:
        """A worker's greedy completions of the held-out rows: parsed and judged outside the lock (evaluation.py);
        a bad answer is refused and the evaluation handed out again."""
        req = schemas.parse(schemas.EvalAnswer, body)
        with self.lock:
            worker = self._worker(req, headers)
            if worker.name is not None:
                raise Unauthorized("only workers that joined with the run secret evaluate")
            job = self.evals.claim(worker.worker_id, req.job_id)
        try:
            if req.version is None or req.version != worker.version or req.version < min(job.covers):
                raise BadRequest(f"evaluation {job.job_id}: 'version' {req.version} is not the version this worker "
                                 f"holds (v{worker.version}), at least v{min(job.covers)}")
            groups = evaluation.parse(job, self.evals.rows, self.evals.prompt_ids, req.results, req.version,
                                      int(self.sampling["max_tokens"]), self.vocab_size, self.evals.episodes)
            reasons = evaluation.judge(self.scorer, groups, self.evals.episodes)
        except BaseException as e:
            with self.lock:
                self.evals.give_back(job, "refused")
                self.lock.notify_all()
            log.warning("worker %s: evaluation %s refused, to be handed out again: %s", worker.worker_id, job.job_id, e)
            raise
        with self.lock:
            result = self.evals.finish(job, req.version, groups, reasons, time.monotonic())
        log.info("evaluation of v%d by worker %s: accuracy %.3f on %d rows (%d unscored) in %.1f s", req.version,
                 worker.worker_id, result[EVAL_ACCURACY], len(groups),
                 result[EVAL_UNSCORED], result[EVAL_TIME_S])
        return {"accepted": True, "version": self.version}

    def _dispatch(self, worker: WorkerInfo, want: int) -> tuple[list[dict], str]:
        """New groups for ``worker``, while worth it (buffer.worth_dispatching) and within its credential's share, and
        why it got no more (registry.WorkerInfo.waited_s names the reasons). Holds the lock. A group whose prompt
        cannot be built is lost (``dispatch_failed``), not half-dispatched."""
        work: list[dict] = []
        if not self.activation.is_active(worker.worker_id) or worker.version < 0 or worker.worker_id not in \
                self.reg.workers:
            # deactivated (until a re-plan turns it on), or it holds no weights it may generate with
            return work, "no_weights" if worker.version < 0 else "inactive"
        principal = self.reg.principals[worker.principal]
        room = self.reg.limit(principal, (self.staleness + 1) * self.P, self.groups_per_pull, self.activation.is_active)
        room -= principal.held
        why = "share"
        while len(work) < min(want, room) and not self.closed:
            # every group dispatched and not yet consumed, dropped or lost: in flight, being scored (out of flight,
            # not yet buffered) or buffered; the ledger's open groups are exactly those
            ahead = len(self.ledger.open)
            if not worth_dispatching(max(self.version, self.next_take), worker.version, ahead, self.P, self.staleness,
                                     self.steps_per_batch):
                why = "window"
                break
            gid, index = self.ledger.draw()
            try:
                row = self.dataset[index]
                ids = self.encode(row)
                if self.settings.episode:  # the row goes to the worker (its environment is reset from it): JSON
                    json.dumps(row)
            except Exception:
                log.exception("group %s: the prompt of row %d could not be built", gid, index)
                self.ledger.lose(gid, "dispatch_failed", requeue=False)
                why = "dispatch_failed"
                break
            self.reg.fly(gid, InFlight(worker.worker_id, worker.principal, row, ids, index))
            # a multi-turn task's environment is reset from the row (TRL's reset(**row), SkyRL's extras)
            work.append({"group_id": gid, "prompt_ids": ids, **({"row": row} if self.settings.episode else {})})
        if work:
            rate = worker.rollouts_per_s or self.reg.fresh_rate()
            due = time.monotonic() + self.liveness.deadline_s(rate, worker.held, self.G)
            for w in work:
                self.reg.in_flight[w["group_id"]].deadline = due
        return work, why

    def _push(self, body: dict, headers) -> dict:
        """Claim the results' groups (lock), parse and score them (no lock), settle each (lock): intake.py. Every
        claimed group ends buffered or dropped with a reason, whatever fails on the way."""
        req = schemas.parse(schemas.Push, body)
        with self.lock:
            worker = self._worker(req, headers)
            claimed, rejected = intake.claim(self.reg, self.ledger, worker, req.results)
            claimed_at = time.monotonic()
            self.scoring += 1
        try:
            outcomes = intake.score(self.scorer, claimed, self.G, int(self.sampling["max_tokens"]), self.vocab_size,
                                    episodes=self.settings.episode is not None, principal=worker.principal)
            with self.lock:
                accepted = intake.settle(self.reg, self.ledger, self.buffer, worker, outcomes, rejected,
                                         version=self.version, staleness=self.staleness, group_size=self.G,
                                         claimed_at=claimed_at, reported_rate=req.rollouts_per_s, faults=self.faults)
                if self.closed:  # settled after close() booked the buffer: nobody will take these now
                    self._drop_buffered("unconsumed_at_end")
                self.lock.notify_all()
        finally:
            with self.lock:
                intake.unclaim(self.reg, self.ledger, [gid for gid, _, _ in claimed])
                self.scoring -= 1
                self.lock.notify_all()
        return {"accepted": accepted, "rejected": rejected, "version": self.version}

    def _snapshot_delivered(self, worker_id: str, version: int) -> None:
        """The broadcaster handed ``version`` to the worker: from now on it may claim it."""
        self._note_snapshot(worker_id, "delivered", version)

    def _snapshot_ordered(self, worker_id: str, version: int) -> None:
        """The broadcaster is about to order ``version`` to the worker: it may apply it and push before the answer
        proving delivery lands (_snapshot_delivered); such a claim is dropped without a strike (intake.settle)."""
        self._note_snapshot(worker_id, "ordered", version)

    def _note_snapshot(self, worker_id: str, versions: str, version: int) -> None:
        """Add ``version`` to the worker's ``delivered`` or ``ordered`` set, forgetting those past the horizon."""
        with self.lock:
            worker = self.reg.workers.get(worker_id)
            if worker is not None:
                horizon = intake.delivery_horizon(self.version, self.staleness)
                setattr(worker, versions, {v for v in getattr(worker, versions) if v >= horizon} | {version})
                if versions == "delivered":
                    self.lock.notify_all()  # a long poll waiting with an older version is told to apply it

    def _leave(self, body: dict, headers) -> dict:
        req = schemas.parse(schemas.Leave, body)
        with self.lock:
            worker = self._worker(req, headers)
            self._retire(worker.worker_id, "worker_left")
        return {"ok": True}

    def _release(self, body: dict, headers) -> dict:
        """A worker hands back groups it cannot deliver: lost with its reason, prompts re-queued at once."""
        req = schemas.parse(schemas.Release, body)
        released, stray = [], 0
        with self.lock:
            worker = self._worker(req, headers)
            for gid in req.group_ids:
                flight = self.reg.in_flight.get(gid)
                if flight is None or flight.worker_id != worker.worker_id:
                    stray += 1  # already settled (e.g. its push did arrive)
                    continue
                self.reg.remember(gid, self.reg.land(gid), "released")
                self.ledger.lose(gid, req.reason)
                released.append(gid)
            self.ledger.refuse("release_not_in_flight", stray)
            self.lock.notify_all()  # room under the in-flight cap
        log.warning("worker %s handed back %d groups: %s", worker.worker_id, len(released), req.reason)
        return {"released": released}

    def _status(self, _body, headers) -> dict:
        who = self.gate.caller(headers)
        return self.status(None if who.secret else who.name)

    def status(self, name: str | None = None) -> dict[str, Any]:
        """A point-in-time view (also ``GET /status``): version, queue depths, live workers, who delivered what.
        ``name``: a worker credential's view, its own workers only (the roster is the run secret's to see)."""
        with self.lock:
            return views.status(self, name)

    # ---------------------------------------------------------------- liveness

    def _retire(self, worker_id: str, reason: str) -> None:
        """Remove a worker; its in-flight groups are lost (counted) and their prompts re-queued. Holds the lock."""
        if self.reg.remove(worker_id) is None:
            return
        self.ledger.retire(worker_id, reason)
        self.activation.dirty = True
        if self.evals is not None:
            self.evals.retire(worker_id)
        for gid in self.reg.held_by(worker_id):
            # remembered: a result for it that arrives later (from an agent retired as dead that comes back) is
            # refused as ``worker_gone``, not struck as a forgery
            self.reg.remember(gid, self.reg.land(gid), "worker_gone")
            self.ledger.lose(gid, reason)
        if self.broadcaster is not None:
            self.broadcaster.remove_peer(worker_id)
        log.log(logging.INFO if reason == "worker_left" else logging.WARNING, "worker %s retired: %s", worker_id, reason)

    def _reap_loop(self) -> None:
        """Every pass: the dead, the late, a re-plan; each in its own try, so that a failure in one (a planner
        bug, a hook that cannot start) is logged with its traceback and counted, and liveness goes on."""
        while not self.closed:
            time.sleep(min(1.0, self.heartbeat_timeout_s / 4))
            for step in (self._reap_dead, self._expire, self._replan):
                try:
                    with self.lock:
                        step(time.monotonic())
                except Exception:
                    self.reaper_errors += 1
                    log.exception("reaper: %s failed (error %d); the next pass runs as usual", step.__name__,
                                  self.reaper_errors)

    def _reap_dead(self, now: float) -> None:
        for w in [w for w in self.reg.workers.values() if now - w.last_seen > self.heartbeat_timeout_s]:
            self._retire(w.worker_id, "worker_dead")

    def _replan(self, now: float) -> None:
        self.on_change.reap()
        bcast = self.broadcaster.metrics() if self.broadcaster is not None else {}
        workers = list(self.reg.workers.values())
        change = self.activation.replan(workers, float(bcast.get(BROADCAST_BYTES, 0.0)), now)
        if change is not None:
            self.on_change(change, workers, self.activation.settings.solver)
            self.lock.notify_all()

    def _expire(self, now: float) -> None:
        """Groups past their deadline are lost and re-queued; each credential with late groups takes one miss.
        Holds the lock."""
        late: Counter = Counter()
        if self.evals is not None and (wid := self.evals.expire(now)) is not None:
            log.warning("worker %s did not answer its evaluation in time: handed out again", wid)  # no strike: ours
            self.lock.notify_all()
        for gid in [g for g, f in self.reg.in_flight.items() if f.deadline < now]:
            flight = self.reg.land(gid)
            self.reg.remember(gid, flight, "past_deadline")
            late[flight.principal] += 1
            self.ledger.lose(gid, "deadline")
        for key, n in late.items():
            principal = self.reg.principals[key]
            principal.misses += 1
            self.deadline_misses += 1
            benched = self.liveness.benched(principal.misses)
            log.warning("worker %s: %d groups past their deadline (miss %d of %d)%s", ",".join(sorted(principal.ids))
                        or key, n, principal.misses, self.liveness.strikes, "; it gets no more work" if benched else "")
        if late:
            self.lock.notify_all()

    # ---------------------------------------------------------------- learner-facing

    def set_version(self, version: int) -> None:
        """Called by the learner after every optimizer step."""
        with self.lock:
            self.version = version
            self._tell_scorer(version)
            self.activation.step_done(self.reg.workers, time.monotonic())
            self._evict_stale()
            self.lock.notify_all()  # long-polling workers may now be worth dispatching to

    def request_eval(self, version: int) -> None:
        """The learner published ``version`` and wants it evaluated on a worker (run.eval_on=workers)."""
        if self.evals is None:
            raise RuntimeError("this coordinator was started without held-out rows (run.eval_on=learner)")
        with self.lock:
            self.evals.request(version)
            self.lock.notify_all()  # a long-polling worker may take it now

    def evaluations(self) -> dict[str, Any]:
        """Workers' finished evaluations since the last call (oldest first), and the versions still wanted."""
        with self.lock:
            if self.evals is None:
                return {"results": [], "wanted": []}
            return {"results": self.evals.take_results(), "wanted": sorted(self.evals.wanted)}

    def _tell_scorer(self, version: int) -> None:
        """The reward functions' ``trainer_state.global_step``: the learner's version when a group is scored."""
        if hasattr(self.scorer, "set_step"):  # a test's stand-in scorer may have none
            self.scorer.set_step(version)

    def take(self, n: int, timeout_s: float | None = None) -> list[RolloutGroup]:
        """Block until ``n`` groups admissible at the current step are buffered; return them, oldest first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.lock:
            while True:
                self._evict_stale()
                got = self.buffer.take(n, self.version)
                if got is not None:
                    self.ledger.consumed([g.group_id for _, g in got])
                    self.last_taken = [(g.group_id, g.worker_id, g.row_index) for _, g in got]
                    self.next_take = self.version + self.steps_per_batch
                    self.activation.took(time.monotonic())
                    self.lock.notify_all()  # room under the in-flight cap: wake long-polling workers
                    return [g for _, g in got]
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no {n} admissible groups within {timeout_s} s "
                                       f"({len(self.buffer)} buffered, {len(self.reg.workers)} workers)")
                self.lock.wait(timeout=1.0 if remaining is None else min(remaining, 1.0))

    def check(self, stats: dict[str, tuple]) -> list[str]:
        """The learner's scores of the last batch's behaviour logprobs, ``{worker id: (tokens, Σ log-ratio,
        Σ |log-ratio|)}`` (trust.py), judged per credential (verdicts.py). Returns the worker ids whose groups in
        that batch the learner must not train on (booked: dropped, untrusted)."""
        with self.lock:
            bad = verdicts.judge(self, stats)
            self.lock.notify_all()
        return bad

    def _evict_stale(self) -> None:
        for group in self.buffer.evict_stale(self.version):
            self.ledger.drop(group.group_id, "stale", requeue=False)

    def mark(self, keep_from: int | None = None) -> int:
        """A point to resume from (the learner is between steps): the journal's length now, written and fsynced
        (raises if the journal cannot be written: a checkpoint must not record a point it does not reach).
        ``keep_from``: the oldest kept checkpoint's mark; the journal drops what precedes it once that is long."""
        with self.lock:
            return self.ledger.sync(keep_from)

    def metrics(self) -> dict[str, float]:
        with self.lock:
            out = views.metrics(self)
        out.update(self.scorer.metrics())
        if self.broadcaster is not None:
            out.update(self.broadcaster.metrics())
        return out

    def accounting(self) -> dict[str, Any]:
        """Every dispatched rollout is consumed, dropped (with reason) or lost (with reason)."""
        with self.lock:
            return {**self.ledger.accounting(), "requests_rejected": _nonzero(self.server.rejected)}

    def publish(self, version: int, snapshot: str | bytes, probe: dict | None = None,
                probe_dtype: str | None = None) -> None:
        """Hand snapshot ``version`` to the broadcaster: its bytes, or the path of the learner's memory file, mapped
        read-only (no copy; the memory stays while the map does). ``probe_dtype``: the probe's logprobs are left to
        this coordinator's probe process (prober.py), on a model held in that dtype (the learner's frozen weights'),
        computed on the broadcaster's thread before it signs the manifest."""
        if self.broadcaster is None:
            raise RuntimeError(f"snapshot v{version}: this coordinator has no broadcaster")
        if isinstance(snapshot, str):
            with open(snapshot, "rb") as f:
                snapshot = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if probe_dtype is not None:
            if self.prober is None or probe is None:
                raise ValueError(f"snapshot v{version}: its probe is left to the coordinator, which has no prober "
                                 "(CoordinatorSettings.probe_model) or no probe tokens")
            pending, prober = probe, self.prober
            probe = lambda blob: prober(blob, pending, probe_dtype)  # noqa: E731 - the broadcaster calls it
        self.broadcaster.publish(version, snapshot, probe)

    def abort(self) -> None:
        """Stop serving without settling the books: the learner died, and a resume will book what is open."""
        with self.lock:
            self.closed = True
            self.ledger.close()
            self.lock.notify_all()
        try:
            self.server.close()
        finally:
            self._close_parts()

    def _close_parts(self) -> None:
        """The broadcaster and the scorer (a reward pool's processes) end with the coordinator."""
        try:
            if self.prober is not None:  # first: a probe under way ends, and the broadcaster's thread with it
                self.prober.shutdown()
            if self.broadcaster is not None:
                self.broadcaster.close()
        finally:
            self.scorer.close()

    def close(self) -> dict[str, Any]:
        """Stop serving; what is still buffered or in flight is counted (dropped / lost at shutdown)."""
        with self.lock:
            self.closed = True
            self._drop_buffered("unconsumed_at_end")
            for gid in list(self.reg.in_flight):  # a push for it that races the shutdown is refused, not struck
                self.reg.remember(gid, self.reg.land(gid), "in_flight_at_end")
                self.ledger.lose(gid, "in_flight_at_end", requeue=False)
            self.lock.notify_all()
        try:
            self.server.close()
        finally:
            self._close_parts()
        with self.lock:  # pushes being scored end at once with the reward pool closed: their books first
            deadline = time.monotonic() + CLOSE_WAIT_S
            while self.scoring and time.monotonic() < deadline:
                self.lock.wait(timeout=0.1)
        accounting = self.accounting()
        self.ledger.close()
        return accounting

    def _drop_buffered(self, reason: str) -> None:
        """Every buffered group dropped with ``reason``, its prompt not re-queued. Holds the lock."""
        for _, group in self.buffer.groups:
            self.ledger.drop(group.group_id, reason, requeue=False)
        self.buffer.groups.clear()


def _nonzero(counter: Counter) -> dict[str, int]:
    return {k: v for k, v in counter.items() if v}
