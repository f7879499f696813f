"""The asynchronous source: rollouts from remote worker agents, each at most S versions stale (docs/design.md §1).

    learner step t:  collect() ── coordinator.take(P) ──► P scored groups, every one with t − x ≤ S
                     ...loss, optimizer step...
                     on_version(t+1) ── coordinator.set_version(t+1)  (evicts what became too stale)
                                     └─ every κ steps: weights.write(memory file) → coordinator.publish(t+1, probe)
                                        (returns at once; probe: the policy's logprobs of fixed tokens, which every
                                        worker reproduces with its engine before it claims version t+1; computed by
                                        the learner, or from the snapshot beside the coordinator: ``probe_on``)

With several learner processes only rank 0 holds this source (echo2/learner/distributed.py hands each rank its
slice and runs the snapshot's gather on every rank); nothing here knows how many learner processes there are.

The coordinator and the broadcaster run in a process of their own (coordinator_process.py; its code: echo2/coordinator/), so
serving workers takes neither the learner's GIL nor its core. The learner never generates and never waits for a
broadcast; it waits only when fewer than P admissible groups are buffered (``train/learner_idle_s``). Prompts come
from the task's training set in the coordinator's own seeded order, so the rows TRL's sampler hands to ``collect``
are unused.

Restarts. If the coordinator process dies, the next call starts a new one on the same port from the ledger's journal
(echo2/coordinator/ledger.py: what was in flight or buffered is counted lost / dropped, ``coordinator_restart``, and
its prompts re-queued), republishes the current weights, and repeats the call; workers reconnect by themselves
(echo2/worker/agent.py). At most ``coordinator_restarts`` times within ``restart_window_s`` (a crash loop is an
error). A learner resumed from a checkpoint starts its coordinator from the journal length the checkpoint recorded
(``resume``), with the data position of then.

Evaluation on workers (``run.eval_on=workers``, parts.worker_eval_every_steps): each evaluated version is published
(whatever κ says) and then asked of the coordinator, which hands the held-out rows to a worker of the operator's
(echo2/coordinator/evaluation.py); ``evaluations`` collects what came back, every step, and ``wait_for_evaluations``
the last one at the end. What was asked and not answered is asked again of a restarted coordinator.

TLS (``tls``): ``auto`` turns it on when the coordinator or the learner's relay origin listens on a non-loopback
address; the run's CA lives in ``<run dir>/tls`` (kept across coordinator restarts and learner resumes, so a
worker's pinned fingerprint holds for the whole run), and the join command printed at start carries its
fingerprint. ``off`` is the explicit, logged opt-out; ``on`` forces it (tests on loopback).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from echo2.activation.settings import ActivationSettings, BroadcastShape, detached
from echo2.metrics import ROLLOUT_COORDINATOR_RESTARTS
from echo2.models.identity import model_identity
from echo2.models.probe import probe_tokens
from echo2.net import rendezvous
from echo2.records import RolloutGroup
from echo2.learner.evaluate import eval_due
from echo2.learner.sources.coordinator_process import CoordinatorDied, CoordinatorProcess
from echo2.scoring import longest_prompt
from echo2.tasks.base import Task
from echo2.tasks.dataset import DatasetTask
from echo2.seams import RunParts, RunStopped, Weights
from echo2.settings import CheckSettings, CoordinatorSettings, LivenessSettings
from echo2.net.tls import RunCA, is_loopback

log = logging.getLogger(__name__)

T = TypeVar("T")

PROBE_ON = ("auto", "learner", "coordinator")
"""Where each published version's probe is computed (``probe_on``): ``learner``, a forward in its step; ``coordinator``,
from the snapshot in a process beside the coordinator (echo2/coordinator/prober.py), on the CPU; ``auto``, the
coordinator for a LoRA adapter trained on the CPU (there the forward is nearly all of the adapter's publish: 0.31 s of
a 4.2 s SmolLM2-135M step), the learner otherwise: on a GPU the forward of 33 tokens is a small part of any step,
while the probe process would hold the base once more in host memory and compute on the CPU (0.9 s a version on one
core at Qwen3-0.6B's shape), and a full snapshot would be copied to it whole."""

WAIT_SLICE_S = 2.0
"""Longest single wait on the coordinator: how late a stop request (SIGTERM) or a progress line can be."""


def run_needs(task: Any, tokenizer: Any, model_path: str, max_tokens: int) -> dict[str, Any]:
    """What every worker must serve (checked at registration): the learner's model (name and digest) and a
    context of the longest training prompt plus the task's completion length (``max_tokens``), in tokens."""
    t0 = time.perf_counter()
    rows = task.train_dataset()
    default = type(task).prompt_ids in (Task.prompt_ids, DatasetTask.prompt_ids) and task.episode_spec() is None
    if default and not task.chat_template_kwargs:
        longest = longest_prompt(tokenizer, list(rows["prompt"]))  # the default encoding: plain strings in a batch
    else:  # the task's own (its chat template arguments, its tools)
        longest = max((len(task.prompt_ids(tokenizer, row)) for row in rows), default=0)
    need = {"model": model_identity(model_path, tokenizer), "max_model_len": longest + max_tokens}
    log.info("workers must serve %s (digest %s) with a context of >= %d tokens (measured in %.1f s)",
             need["model"]["name"], need["model"]["digest"], need["max_model_len"], time.perf_counter() - t0)
    return need


class AsyncRolloutSource:
    needs_policy = False  # remote: the learner never lends it the policy
    max_staleness = None  # any S
    single_process = False  # several learner processes: rank 0 holds it (echo2/learner/distributed.py)

    # The coordinator's own settings default to CoordinatorSettings's (echo2/settings.py): one place for each.
    def __init__(self, parts: RunParts, *, host: str = CoordinatorSettings.host, port: int = CoordinatorSettings.port,
                 heartbeat_timeout_s: float = CoordinatorSettings.heartbeat_timeout_s, take_timeout_s: float = 900.0,
                 groups_per_pull: int = CoordinatorSettings.groups_per_pull, coordinator_cores: list[int] | None = None,
                 coordinator_restarts: int = 3, restart_window_s: float = 600.0, min_workers: int = 0,
                 wait_log_s: float = 30.0, liveness: LivenessSettings = LivenessSettings(), tls: str = "auto",
                 check_every_steps: int = 0, check_max_abs_log_ratio: float = CheckSettings.max_abs_log_ratio,
                 check_evidence_nats: float = CheckSettings.evidence_nats,
                 reward_processes: int = CoordinatorSettings.reward_processes,
                 reward_timeout_s: float = CoordinatorSettings.reward_timeout_s,
                 reward_memory_mb: int = CoordinatorSettings.reward_memory_mb,
                 reward_cpu_s: float = CoordinatorSettings.reward_cpu_s,
                 journal_compact_mb: float | None = CoordinatorSettings.journal_compact_mb, probe_on: str = "auto"):
        """``parts``: the run's parts (seams.RunParts): the ``task`` and ``tokenizer`` the coordinator scores with,
        the ``sampling`` workers use, the ``model_path`` and ``token`` they join with, the ``broadcaster``'s config
        (built in the coordinator's process), the worker ``pool``, the planner's ``activation`` settings and
        ``broadcast_shape``, and ``resume``: what ``checkpoint()`` returned, when the learner resumes from one. The
        rest are conf/rollout/async.yaml's options (each default is written here only: the config's schema is read
        from this signature)."""
        task, tokenizer, run_dir, token, resume = parts.task, parts.tokenizer, parts.run_dir, parts.token, parts.resume
        sampling, model_path, publish_interval = parts.sampling, parts.model_path, parts.publish_interval
        staleness, prompts_per_step, seed = parts.staleness, parts.prompts_per_step, parts.seed
        broadcaster, pool, activation, broadcast_shape = (parts.broadcaster, parts.pool, parts.activation,
                                                          parts.broadcast_shape)
        if not broadcaster:
            raise ValueError("broadcast.sender: a source fed by remote workers needs a broadcaster (no snapshot would "
                             "ever reach them)")
        if publish_interval < 1:
            raise ValueError(f"broadcast.interval={publish_interval}: must be >= 1")
        s = sampling
        self.task, self.tokenizer, self.run_dir, self.token = task, tokenizer, run_dir, token
        self.broadcaster, self.publish_interval = broadcaster, publish_interval
        self.take_timeout_s, self.cores = take_timeout_s, coordinator_cores
        self.max_restarts, self.restart_window_s = coordinator_restarts, restart_window_s
        self.restart_times: list[float] = []
        self.restarts = 0
        self.pool = pool
        self.version = resume["version"] if resume else 0
        self.weights: Weights | None = None  # the live weights, kept to republish after a coordinator restart
        self.republish = False  # a restarted coordinator's workers wait for the next snapshot
        self.probe_ids = probe_tokens(len(tokenizer))
        if probe_on not in PROBE_ON:
            raise ValueError(f"rollout.source.probe_on={probe_on!r}: expected one of {', '.join(PROBE_ON)}")
        self.probe_on = probe_on
        self.probes_beside = False  # whether a publish has left its probe to the coordinator yet (logged once)
        self.settings = CoordinatorSettings(
            token=token, staleness=staleness, prompts_per_step=prompts_per_step, group_size=s.n,
            vocab_size=len(tokenizer), host=host, port=port, heartbeat_timeout_s=heartbeat_timeout_s,
            groups_per_pull=groups_per_pull, seed=seed, journal=rendezvous.journal_path(run_dir), sampling={
                "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                "stop_token_ids": list(s.stop_token_ids)},
            activation=detached(ActivationSettings, activation) or ActivationSettings(),
            broadcast_shape=detached(BroadcastShape, broadcast_shape) or BroadcastShape(),
            liveness=detached(LivenessSettings, liveness),
            checks=CheckSettings(max_abs_log_ratio=check_max_abs_log_ratio, evidence_nats=check_evidence_nats),
            broadcaster=broadcaster, reward_processes=reward_processes, reward_timeout_s=reward_timeout_s,
            reward_memory_mb=reward_memory_mb, reward_cpu_s=reward_cpu_s, journal_compact_mb=journal_compact_mb,
            max_steps=parts.max_steps,
            episode=task.episode_spec().as_dict() if task.episode_spec() is not None else None,
            # this learner process's epoch: kept by a restarted coordinator, new after a resume (echo2/worker/agent.py)
            epoch=os.urandom(8).hex(), version=self.version,
            steps_per_batch=parts.steps_per_batch,  # a bad value fails here, not in the child
            evaluate=parts.worker_eval_every_steps > 0,
            probe_model=model_path if probe_on != "learner" else None)
        self.eval_every, self.max_steps = parts.worker_eval_every_steps, parts.max_steps
        self.eval_asked: set[int] = set()  # versions asked of the coordinator and not yet answered
        self.eval_next: int | None = None  # the version to ask for once its snapshot is published
        self.check_every_steps = check_every_steps  # read by the learner (trainer._check)
        self.ca_hash, tls_dir = self._tls(tls, host)
        self.requires = run_needs(task, tokenizer, model_path, s.max_tokens)
        self.settings = replace(self.settings, tls_dir=tls_dir, requires=self.requires)
        self.pool.fit_context(self.requires["max_model_len"])
        recover = {"resume_offset": resume["journal_offset"]} if resume else None
        self.coordinator = self._spawn(recover)
        # a restarted coordinator listens where this one did
        self.settings = replace(self.settings, port=urlsplit(self.coordinator.url).port)
        rendezvous.write(run_dir, self.coordinator.url, self.requires, ca_hash=self.ca_hash)
        self.pool.start(self.coordinator.url, token, model_path, run_dir, ca_hash=self.ca_hash)
        self.min_workers, self.wait_log_s = min_workers, wait_log_s
        self.stop_requested = False
        if self.eval_every and not resume:  # the initial weights, which every worker holds from the start
            self._ask_eval(0)

    def request_stop(self) -> None:
        """Called from the learner's signal handler: a wait for workers or rollouts ends (RunStopped) within
        WAIT_SLICE_S instead of lasting up to take_timeout_s."""
        self.stop_requested = True

    def _waited(self, what: str, start: float, last_log: float) -> float:
        """One turn of a wait loop: stop if asked, fail after take_timeout_s, say what we wait for every
        wait_log_s. Returns when the wait was last logged."""
        if self.stop_requested:
            raise RunStopped(f"stop requested while waiting for {what}")
        now = time.monotonic()
        if now - start > self.take_timeout_s:
            raise TimeoutError(f"waited {now - start:.0f} s for {what} (rollout.source.take_timeout_s): "
                               f"{self._waiting_on()}")
        if self._stranded():
            raise RuntimeError(f"waiting for {what}, but every local worker has exited and no other can join (the "
                               f"coordinator listens on {self.settings.host} only): {self._waiting_on()}")
        if now - last_log >= self.wait_log_s:
            log.warning("waiting %.0f s for %s: %s", now - start, what, self._waiting_on())
            return now
        return last_log

    def _stranded(self) -> bool:
        """Nothing can ever feed this run: every local worker has exited (none restarts by itself), none is
        connected, and the coordinator listens on loopback only, so no worker from elsewhere can join. Waiting out
        take_timeout_s would only hide why (their errors are in the waiting line)."""
        if not (is_loopback(str(self.settings.host)) and self.pool.all_exited()):
            return False
        return not self._retry(CoordinatorProcess.status)["workers"]

    def _waiting_on(self) -> str:
        """What the rollout plane holds now, and where workers should come from."""
        st = self._retry(CoordinatorProcess.status)
        url = rendezvous.advertised_url(self.coordinator.url)
        where = self.pool.describe(url)
        benched = st.get("benched") or []  # struck out: they get no more work (coordinator.log says why)
        benched = f", {len(benched)} of them benched ({', '.join(benched)}: see coordinator.log)" if benched else ""
        return (f"{len(st['workers'])} workers connected{benched} ({st['registered']} registered since the start, "
                f"rollout.source.min_workers={self.min_workers}), {st['buffered_groups']} groups buffered, "
                f"{st['in_flight_groups']} in flight; {where}").rstrip("; ")

    def _tls(self, mode: str, host: str) -> tuple[str | None, str | None]:
        """Decide TLS for the rollout plane; returns the run CA's fingerprint and directory, or None, None for plain
        HTTP."""
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"rollout.source.tls={mode!r}: expected auto, on or off")
        hosts = [host, self.broadcaster.get("host") or "127.0.0.1"]
        exposed = [h for h in hosts if not is_loopback(str(h))]
        if mode == "off" or (mode == "auto" and not exposed):
            if exposed:
                log.warning("rollout.source.tls=off: plain HTTP on %s; tokens and weights cross the network in the "
                            "clear", ", ".join(map(str, exposed)))
            return None, None
        ca = RunCA(os.path.join(self.run_dir, "tls"))
        log.info("TLS on: run CA %s (fingerprint %s)", ca.ca_file, ca.fingerprint)
        return ca.fingerprint, ca.dir

    def _wait_for_workers(self, n: int) -> None:
        """Block until ``n`` workers have registered (rollout.source.min_workers), so that the first steps are not
        all generated by whichever agent loaded its model first; give up after take_timeout_s."""
        log.info("waiting for %d workers to register (rollout.source.min_workers)", n)
        start = last_log = time.monotonic()
        while (have := self._retry(CoordinatorProcess.status)["registered"]) < n:
            last_log = self._waited(f"{n} workers to register (rollout.source.min_workers={n}; {have} so far)",
                                    start, last_log)
            time.sleep(0.2)
        log.info("%d workers registered after %.1f s", have, time.monotonic() - start)

    def _spawn(self, recover: dict | None) -> CoordinatorProcess:
        return CoordinatorProcess(
            task=self.task, tokenizer=self.tokenizer, log_path=os.path.join(self.run_dir, "coordinator.log"),
            cores=self.cores, settings=replace(self.settings, recover=recover, version=self.version))

    def _retry(self, call: Callable[[CoordinatorProcess], T]) -> T:
        """``call(coordinator)``; if the coordinator process is gone, restart it (within budget) and call again."""
        try:
            return call(self.coordinator)
        except CoordinatorDied as e:
            self._restart(e)
            return call(self.coordinator)

    def _restart(self, e: CoordinatorDied) -> None:
        """A new coordinator from the journal, within the restart budget; workers then need the current weights:
        republished at once where this process can write them alone, else (sharded weights, whose gather needs
        every learner rank) with the next version."""
        now = time.monotonic()
        self.restart_times = [t for t in self.restart_times if now - t < self.restart_window_s]
        if len(self.restart_times) >= self.max_restarts:
            raise CoordinatorDied(f"{e}; it was restarted {len(self.restart_times)} times in the last "
                                  f"{self.restart_window_s:.0f} s (rollout.source.coordinator_restarts, "
                                  "restart_window_s): giving up") from e
        self.restart_times.append(now)
        self.restarts += 1
        log.error("%s: starting a new one from the journal (restart %d)", e, self.restarts)
        self.coordinator.abandon()
        self.coordinator = self._spawn({"restart": True})
        for version in sorted(self.eval_asked):  # answered by the weights republished below, or by a newer version
            self.coordinator.request_eval(version)
        if self.weights is not None and self.weights.local:
            self.publish(self.version, self.weights)
        else:
            self.republish = True

    def collect(self, rows: list[dict[str, Any]], version: int, policy: Any = None) -> list[RolloutGroup]:
        """The step's P groups. The learner times this call itself (train/learner_idle_s), the first step's wait
        for min_workers included. Asks the coordinator in slices of WAIT_SLICE_S, so that a stop request or a
        log line is never further away than that."""
        if self.min_workers > 0:
            self._wait_for_workers(self.min_workers)
            self.min_workers = 0
        start = last_log = time.monotonic()
        while True:
            try:
                return self._retry(lambda c: c.take(len(rows), WAIT_SLICE_S))
            except TimeoutError:
                last_log = self._waited(f"{len(rows)} rollout groups for step {version + 1}", start, last_log)

    def on_version(self, version: int, weights: Weights) -> None:
        if self.advance(version):
            self.publish(version, weights)

    def advance(self, version: int) -> bool:
        """Tell the coordinator the new version; returns whether a snapshot is due now (every κ versions, or to
        catch a restarted coordinator's workers up)."""
        self.version = version
        self._retry(lambda c: c.set_version(version))
        if self.eval_every and eval_due(version, self.eval_every, self.max_steps):
            self.eval_next = version  # asked once published: a worker evaluates a snapshot it holds
            return True
        return version % self.publish_interval == 0 or self.republish

    def on_resume(self, version: int, weights: Weights) -> None:
        """A resumed learner's first act: publish its restored weights, so that workers catch up to them."""
        self.version = version
        self.publish(version, weights)

    def learner_probe_ids(self, weights: Weights) -> list[int] | None:
        """The probe tokens where this learner computes the probe of ``weights``' snapshot; None where the
        coordinator's probe process does (``probe_on``: ``coordinator``, or ``auto`` for a LoRA adapter trained on the
        CPU; PROBE_ON says why)."""
        beside = self.probe_on == "coordinator" or (self.probe_on == "auto" and weights.adapter is not None
                                                    and weights.device == "cpu")
        return None if beside else self.probe_ids

    def publish(self, version: int, weights: Weights, probe: list[float] | None = None) -> None:
        """Hand snapshot ``version`` to the broadcaster: ``weights.write`` streams it into a memory file, with its
        probe (the policy's logprobs of fixed tokens, signed into the manifest with the snapshot's dtype), which a
        worker's engine must reproduce after applying the snapshot before the worker claims the version. The
        learner computes the probe (``probe``: already computed, by every learner rank together under ZeRO-3), or
        leaves it to the coordinator's probe process (``learner_probe_ids``), which computes it from the snapshot
        in float32 off the learner's step (echo2/coordinator/prober.py)."""
        self.weights, self.republish = weights, False
        here = self.learner_probe_ids(weights) is not None
        if not here and not self.probes_beside:
            self.probes_beside = True
            log.info("each version's probe is computed beside the coordinator from the published snapshot, off the "
                     "learner's step (rollout.source.probe_on=%s%s); its process starts with v%d", self.probe_on,
                     ": a LoRA adapter on a CPU learner" if self.probe_on == "auto" else "", version)
        if here and probe is None:
            probe = weights.probe_logprobs(self.probe_ids)
        manifest_probe = {"token_ids": self.probe_ids, "logprobs": probe if here else None, "dtype": weights.dtype,
                          "compute_dtype": weights.compute_dtype if here else "float32",
                          "adapter": weights.adapter is not None}
        try:
            self.coordinator.publish_written(version, weights.write, manifest_probe,
                                             probe_dtype=None if here else weights.base_dtype)
        except CoordinatorDied as e:  # not retried here: a sharded write is a collective, done once per version
            self.weights = self.weights if weights.local else None
            self._restart(e)
        if self.eval_next == version:
            self.eval_next = None
            self._ask_eval(version)

    def _ask_eval(self, version: int) -> None:
        self.eval_asked.add(version)
        self._retry(lambda c: c.request_eval(version))

    def evaluations(self) -> list[dict[str, Any]]:
        """Workers' evaluations finished since the last call (each: ``eval/*`` metrics, the ``version`` measured and
        the versions it answers, ``requested``), oldest first. Nothing asked and unanswered: no call to the
        coordinator (this runs after every learner step)."""
        if not self.eval_asked:
            return []
        results = self._retry(CoordinatorProcess.evaluations)["results"]
        for r in results:
            self.eval_asked -= {v for v in self.eval_asked if v <= r["version"]}
        return results

    def wait_for_evaluations(self) -> list[dict[str, Any]]:
        """At the end of training: the evaluations still to come (the last version's), waited for up to
        take_timeout_s (TimeoutError, naming why, after that)."""
        results = self.evaluations()
        start = last_log = time.monotonic()
        while self.eval_asked:
            last_log = self._waited(f"a worker's evaluation of v{max(self.eval_asked)} (evaluations go to workers "
                                    "that joined with the run secret only)", start, last_log)
            time.sleep(0.5)
            results += self.evaluations()
        return results

    def on_check(self, stats: dict[str, tuple[int, float, float]]) -> list[str]:
        """Per-worker sums (tokens, log-ratio, |log-ratio|) of the learner's logprobs against the workers' (rollout
        checks); returns the workers whose groups in the checked batch must not be trained on."""
        return self._retry(lambda c: c.check(stats))

    def checkpoint(self, kept: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """What a learner checkpoint must hold to resume this source: the version and the journal's length. The
        journal may drop what only checkpoints older than ``kept`` need."""
        offsets = [k["journal_offset"] for k in kept or () if isinstance(k.get("journal_offset"), int)]
        keep_from = min(offsets) if kept and len(offsets) == len(kept) else None
        return {"version": self.version, "journal_offset": self._retry(lambda c: c.mark(keep_from))}

    def metrics(self) -> dict[str, float]:
        out = self._retry(CoordinatorProcess.metrics)  # the coordinator's and the broadcaster's
        out[ROLLOUT_COORDINATOR_RESTARTS] = float(self.restarts)
        return out

    def close(self) -> dict[str, Any]:
        getattr(self.task, "close", lambda: None)()  # the learner's own episodes (its evaluation)
        self.pool.stop()
        try:
            accounting = self.coordinator.close()
        except CoordinatorDied as e:  # died at the very end (close() has reaped it): the journal has the books
            log.error("%s; the books are in %s", e, self.settings.journal)
            accounting = {}
        accounting["coordinator_restarts"] = self.restarts
        log.info("rollout accounting: %s", accounting)
        return accounting
