"""The asynchronous source: rollouts from remote worker agents, each at most S versions stale (DESIGN §2).

    learner step t:  collect() ── coordinator.take(P) ──► P scored groups, every one with t − x ≤ S
                     ...loss, optimizer step...
                     on_version(t+1) ── coordinator.set_version(t+1)  (evicts what became too stale)
                                     └─ every κ steps: weights.write(memory file) → coordinator.publish(t+1, probe)
                                        (returns at once; probe: the learner's logprobs of fixed tokens, which every
                                        worker reproduces with its engine before it claims version t+1)

With several learner processes only rank 0 holds this source (echo2/learner/distributed.py hands each rank its
slice and runs the snapshot's gather on every rank); nothing here knows how many learner processes there are.

The coordinator and the broadcaster run in a process of their own (service.py), so serving workers takes
neither the learner's GIL nor its core. The learner never generates and never waits for a broadcast; it waits
only when fewer than P admissible groups are buffered (``train/learner_idle_s``). Prompts come from the task's
training set in the coordinator's own seeded order, so the rows TRL's sampler hands to ``collect`` are unused.

Restarts. If the coordinator process dies, the next call starts a new one on the same port from the ledger's
journal (ledger.py: what was in flight or buffered is counted lost / dropped, ``coordinator_restart``, and its
prompts re-queued), republishes the current weights, and repeats the call; workers reconnect by themselves
(agent.py). At most ``coordinator_restarts`` times within ``restart_window_s`` (a crash loop is an error). A learner resumed from a checkpoint starts its
coordinator from the journal length the checkpoint recorded (``resume``), with the data position of then.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any
from urllib.parse import urlsplit

from echo2.activation.settings import ActivationSettings, BroadcastShape, detached
from echo2.rollout.ledger import journal_path
from echo2.rollout.protocols import RolloutContext, Weights
from echo2.rollout.service import CoordinatorDied, CoordinatorProcess
from echo2.rollout.types import RolloutGroup

log = logging.getLogger(__name__)


def probe_tokens(vocab_size: int, n: int = 33) -> list[int]:
    """The fixed tokens whose logprobs check a worker's weights: a seeded draw over the whole vocabulary, so that
    every row of the embedding and of the LM head can show up (a stale tied head did, by ~1 nat)."""
    import random

    rng = random.Random(0)
    return [rng.randrange(vocab_size) for _ in range(n)]


class AsyncRolloutSource:
    needs_policy = False

    def __init__(self, ctx: RolloutContext, host: str = "127.0.0.1", port: int = 0,
                 heartbeat_timeout_s: float = 30.0, take_timeout_s: float = 900.0, groups_per_pull: int = 4,
                 coordinator_cores: list[int] | None = None, coordinator_restarts: int = 3,
                 restart_window_s: float = 600.0, min_workers: int = 0):
        if ctx.publish_interval < 1:
            raise ValueError(f"broadcast.interval={ctx.publish_interval}: must be >= 1")
        s = ctx.sampling
        self.ctx, self.take_timeout_s, self.cores = ctx, take_timeout_s, coordinator_cores
        self.max_restarts, self.restart_window_s = coordinator_restarts, restart_window_s
        self.restart_times: list[float] = []
        self.restarts = 0
        self.pool = ctx.pool
        self.version = ctx.resume["version"] if ctx.resume else 0
        self.weights: Weights | None = None  # the live weights, kept to republish after a coordinator restart
        self.republish = False  # a restarted coordinator's workers wait for the next snapshot
        self.probe_ids = probe_tokens(len(ctx.tokenizer))
        self.kwargs = dict(
            token=ctx.token, staleness=ctx.staleness, prompts_per_step=ctx.prompts_per_step, group_size=s.n,
            vocab_size=len(ctx.tokenizer), host=host, port=port, heartbeat_timeout_s=heartbeat_timeout_s,
            groups_per_pull=groups_per_pull, seed=ctx.seed, journal=journal_path(ctx.run_dir), sampling={
                "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k},
            activation=detached(ActivationSettings, ctx.activation),
            broadcast_shape=detached(BroadcastShape, ctx.broadcast_shape))
        recover = {"resume_offset": ctx.resume["journal_offset"]} if ctx.resume else None
        self.coordinator = self._spawn(recover)
        self.kwargs["port"] = urlsplit(self.coordinator.url).port  # a restarted coordinator listens where this one did
        self.pool.start(self.coordinator.url, ctx.token, ctx.model_path, ctx.run_dir)
        if min_workers > 0:
            try:
                self._wait_for_workers(min_workers)
            except BaseException:  # (Ctrl-C too) stop the coordinator we started; its journal keeps the books
                self.close()
                raise

    def _wait_for_workers(self, n: int) -> None:
        """Block until ``n`` workers have registered (rollout.source.min_workers), so that the first steps are not
        all generated by whichever agent loaded its model first; give up after take_timeout_s."""
        log.info("waiting for %d workers to register (rollout.source.min_workers)", n)
        start = time.monotonic()
        while (have := self._call("status")["registered"]) < n:
            if time.monotonic() - start > self.take_timeout_s:
                raise TimeoutError(f"only {have} of rollout.source.min_workers={n} workers registered within "
                                   f"{self.take_timeout_s:.0f} s (rollout.source.take_timeout_s); see the workers' "
                                   "logs, or lower min_workers")
            time.sleep(0.2)
        log.info("%d workers registered after %.1f s", have, time.monotonic() - start)

    def _spawn(self, recover: dict | None) -> CoordinatorProcess:
        return CoordinatorProcess(
            task=self.ctx.task, tokenizer=self.ctx.tokenizer, make_broadcaster=self.ctx.make_broadcaster,
            log_path=os.path.join(self.ctx.run_dir, "coordinator.log"), cores=self.cores,
            coordinator_kwargs=dict(self.kwargs, recover=recover, version=self.version))

    def _call(self, name: str, *args: Any) -> Any:
        """``coordinator.name(*args)``; if the coordinator process is gone, restart it (within budget) and retry."""
        try:
            return getattr(self.coordinator, name)(*args)
        except CoordinatorDied as e:
            self._restart(e)
            return getattr(self.coordinator, name)(*args)

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
        if self.weights is not None and getattr(self.weights, "local", True):
            self.publish(self.version, self.weights)
        else:
            self.republish = True

    def collect(self, rows: list[dict[str, Any]], version: int, policy: Any = None) -> list[RolloutGroup]:
        # The learner times this call itself (train/learner_idle_s).
        return self._call("take", len(rows), self.take_timeout_s)

    def on_version(self, version: int, weights: Weights) -> None:
        if self.advance(version):
            self.publish(version, weights)

    def advance(self, version: int) -> bool:
        """Tell the coordinator the new version; returns whether a snapshot is due now (every κ versions, or to
        catch a restarted coordinator's workers up)."""
        self.version = version
        self._call("set_version", version)
        return version % self.ctx.publish_interval == 0 or self.republish

    def on_resume(self, version: int, weights: Weights) -> None:
        """A resumed learner's first act: publish its restored weights, so that workers catch up to them."""
        self.version = version
        self.publish(version, weights)

    def publish(self, version: int, weights: Weights, probe: list[float] | None = None) -> None:
        """Hand snapshot ``version`` to the broadcaster: ``weights.write`` streams it into a memory file, with its
        probe (the policy's logprobs of fixed tokens, signed into the manifest with the snapshot's dtype), which a
        worker's engine must reproduce after applying the snapshot before the worker claims the version.
        ``probe``: already computed (by every learner rank together, under ZeRO-3)."""
        self.weights, self.republish = weights, False
        if probe is None:
            probe = weights.probe_logprobs(self.probe_ids)
        manifest_probe = {"token_ids": self.probe_ids, "logprobs": probe, "dtype": weights.dtype}
        try:
            self.coordinator.publish_written(version, weights.write, manifest_probe)
        except CoordinatorDied as e:  # not retried here: a sharded write is a collective, done once per version
            self.weights = self.weights if getattr(weights, "local", True) else None
            self._restart(e)

    def checkpoint(self) -> dict[str, Any]:
        """What a learner checkpoint must hold to resume this source: the version and the journal's length."""
        return {"version": self.version, "journal_offset": self._call("mark")}

    def metrics(self) -> dict[str, float]:
        out = self._call("metrics")  # the coordinator's and the broadcaster's
        out["rollout/coordinator_restarts"] = float(self.restarts)
        return out

    def close(self) -> dict[str, Any]:
        self.pool.stop()
        try:
            accounting = self.coordinator.close()
        except CoordinatorDied as e:  # died at the very end (close() has reaped it): the journal has the books
            log.error("%s; the books are in %s", e, self.kwargs["journal"])
            accounting = {}
        accounting["coordinator_restarts"] = self.restarts
        log.info("rollout accounting: %s", accounting)
        return accounting
