"""A remote rollout source seen from N learner processes: rank 0 alone owns it (coordinator process, worker pool,
broadcaster); every rank trains on its own slice of the same batch, and every rank joins each snapshot's gather.

    rank 0                                            every rank r of N
    collect:    source.collect(P groups)  ──broadcast──►  groups[r·P/N : (r+1)·P/N]   (whole groups per rank)
    on_version: source.advance(v) → due?  ──broadcast──►  if due: probe forward (where the learner probes), then
                                                             gather parameter by parameter
                source.publish(v, weights, probe)             (rank 0 writes each into the snapshot as it comes)
                                           ──broadcast──►  publish status
    checkpoint / close: rank 0's answer    ──broadcast──►  the same on every rank

Every exchange goes through ``accelerate.utils.broadcast_object_list`` (as TRL's vLLM generation hands out its
completions) and carries ``{"ok": False, "error": ...}`` when rank 0 failed, so that an error on rank 0 (coordinator
dead past its restarts, take timeout) is raised on every rank instead of leaving them waiting in a collective;
a stop requested while rank 0 waited for rollouts (RunStopped) ends the run on every rank.
With one process the broadcasts are no-ops and this is the source itself.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from echo2.metrics import TRAIN_PUBLISH_S
from echo2.records import RolloutGroup
from echo2.seams import RemoteSource, RunStopped

log = logging.getLogger(__name__)


class RankZeroError(RuntimeError):
    """Rank 0's rollout source failed; raised on every learner rank."""


class ShardedSource:
    """A RolloutSource for every learner rank around rank 0's RemoteSource (``source``: None on the other ranks)."""

    needs_policy = False
    max_staleness = None
    single_process = False

    def __init__(self, source: RemoteSource | None, rank: int, world_size: int):
        if (source is None) != (rank != 0):
            raise ValueError("only rank 0 holds the rollout source")
        self.source, self.rank, self.world_size = source, rank, world_size
        # rollout checks run with one learner process only: with several, on_check would be rank 0's collective alone
        self.check_every_steps = source.check_every_steps if source is not None else 0
        if self.check_every_steps and world_size > 1:
            raise ValueError("rollout.source.check_every_steps > 0 with a multi-process learner is not supported yet")
        self.last_batch: list[RolloutGroup] = []  # the whole step's groups (rank 0 logs them as consumed)
        self.resumed: tuple[int, Any] | None = None  # restored weights to publish before the first collect
        self.publish_s = 0.0  # the last on_version's wall time: gather + publish of a snapshot, when one was due

    def _share(self, fn) -> Any:
        """Run ``fn`` on rank 0 and return its result on every rank; its exception, on every rank."""
        payload: dict[str, Any] = {}
        if self.rank == 0:
            try:
                payload = {"ok": True, "value": fn()}
            except BaseException as e:  # noqa: BLE001 - every rank must hear of it, then rank 0 re-raises it too
                payload = {"ok": False, "error": f"{type(e).__name__}: {e}",
                           "stopped": str(e) if isinstance(e, RunStopped) else None}
                if self.world_size == 1:
                    raise
                self._broadcast(payload)
                raise
        payload = self._broadcast(payload)
        if not payload["ok"] and payload.get("stopped") is not None:  # a stop requested on rank 0: every rank ends
            raise RunStopped(payload["stopped"])
        if not payload["ok"]:
            raise RankZeroError(f"learner rank 0's rollout source failed: {payload['error']}")
        return payload["value"]

    def _broadcast(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self.world_size == 1:
            return payload
        from accelerate.utils import broadcast_object_list

        box = [payload]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def collect(self, rows: list[dict[str, Any]], version: int, policy: Any = None) -> list[RolloutGroup]:
        """Rank 0 takes the whole step's P groups (this rank's rows times N); each rank keeps its own P/N."""
        if self.resumed:
            version, weights = self.resumed
            # Under ZeRO-3 a forward with DeepSpeed's hooks before the first training step of a resumed run broke
            # that step's backward (a partition left at size 0); publish from the full parameters with the hooks off,
            # as TRL generates: a full copy on every rank, once per resume.
            with weights.unsharded():
                self._publish(version, weights)
            self.resumed = None
        groups = self._share(lambda: self.source.collect(rows * self.world_size, version))
        self.last_batch = groups
        per_rank = len(groups) // self.world_size
        return groups[self.rank * per_rank:(self.rank + 1) * per_rank]

    def on_version(self, version: int, weights: Any) -> None:
        t0 = time.perf_counter()
        if self._share(lambda: self.source.advance(version)):
            self._publish(version, weights)
        self.publish_s = time.perf_counter() - t0

    def request_stop(self) -> None:
        """From the signal handler: rank 0's wait for rollouts ends (RunStopped on every rank). A signal to another
        rank alone stops every rank after the current step (the learner's StopOnSignal callback)."""
        if self.rank == 0:
            self.source.request_stop()

    def on_resume(self, version: int, weights: Any) -> None:
        self.resumed = (version, weights)

    def _publish(self, version: int, weights: Any) -> None:
        """Every rank: the probe forward (where the learner computes the probe) and the parameter gathers, in the
        same order; rank 0 writes."""
        token_ids = self._share(lambda: self.source.learner_probe_ids(weights))
        probe = weights.probe_logprobs(token_ids) if token_ids is not None else None  # else the coordinator's
        if self.rank == 0:
            try:
                self.source.publish(version, weights, probe)
                status = {"ok": True, "value": None}
            except BaseException as e:  # noqa: BLE001
                status = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                if not weights.written:  # failed before the gathers: join them, as the others do
                    weights.write(None)
            self._broadcast(status)
            if not status["ok"]:
                raise RankZeroError(f"publishing snapshot v{version} failed: {status['error']}")
        else:
            weights.write(None)
            if not self._broadcast({})["ok"]:
                raise RankZeroError(f"learner rank 0 failed to publish snapshot v{version}")

    def metrics(self) -> dict[str, float]:
        """Rank 0's source's metrics, and the time the previous step spent publishing (probe, gather, handoff)."""
        if self.rank != 0:
            return {}  # logged by rank 0 only
        return {**self.source.metrics(), TRAIN_PUBLISH_S: self.publish_s}

    def evaluations(self) -> list[dict[str, Any]]:
        """Rank 0's source's finished worker evaluations (run.eval_on=workers; logged by rank 0 only)."""
        return self.source.evaluations() if self.rank == 0 else []

    def wait_for_evaluations(self) -> list[dict[str, Any]]:
        """Rank 0 waits for the last evaluation; no collective (the other ranks go on to the end of the run)."""
        return self.source.wait_for_evaluations() if self.rank == 0 else []

    def on_check(self, stats: dict[str, tuple[int, float, float]]) -> list[str]:
        return self._share(lambda: self.source.on_check(stats))

    def checkpoint(self, kept: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return self._share(lambda: self.source.checkpoint(kept))

    def close(self) -> dict[str, Any]:
        """Rank 0 stops the pool and the coordinator; every rank returns the accounting. No collective here: close
        runs in train.py's ``finally``, also after another rank failed, when a broadcast could wait forever."""
        return self.source.close() if self.rank == 0 else {}
