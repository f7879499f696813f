"""What the coordinator shows of itself: ``GET /status`` (the run secret's whole roster, or a worker credential's own
workers) and the metrics the learner logs. Read-only views of its state, taken while the caller holds its lock."""

from __future__ import annotations

from typing import Any

from echo2.metrics import (BUFFER_DROPPED_STALE, BUFFER_GROUPS, BUFFER_IN_FLIGHT_GROUPS, ROLLOUT_BENCHED_WORKERS,
                           ROLLOUT_CHECK_ABS_LOG_RATIO_PREFIX, ROLLOUT_CHECK_LOG_RATIO_PREFIX, ROLLOUT_DEADLINE_MISSES,
                           ROLLOUT_DISPATCHED, ROLLOUT_DROPPED, ROLLOUT_DROPPED_UNTRUSTED, ROLLOUT_FLAGGED_WORKERS,
                           ROLLOUT_INVALID_STRIKES, ROLLOUT_JOURNAL_DAMAGED_LINES, ROLLOUT_JOURNAL_ERRORS,
                           ROLLOUT_LOST, ROLLOUT_LOST_DEADLINE, ROLLOUT_REAPER_ERRORS, ROLLOUT_RECEIVED, ROLLOUT_REFUSED_RESULTS, ROLLOUT_REJECTED_REQUESTS,
                           ROLLOUT_REVOCATIONS_UNWRITTEN, ROLLOUT_THROUGHPUT_PREFIX, ROLLOUT_WORKERS)


def status(coord: Any, name: str | None = None) -> dict[str, Any]:
    """Version, queue depths, live workers, who delivered what, who holds work and who is benched. ``name``: a worker
    credential's view: its own workers only (every worker id, what each holds and who is benched would be a target
    list for a stranger); None: the run secret's, the whole roster and how many registered since the start."""
    reg = coord.reg
    mine = (lambda wid: True) if name is None else (lambda wid: reg.owner(wid) == name)
    workers = [w for w in reg.workers.values() if mine(w.worker_id)]
    out = {"version": coord.version, "buffered_groups": len(coord.buffer), "in_flight_groups": len(reg.in_flight),
           "workers": sorted(w.worker_id for w in workers),
           "by_worker": {wid: n for wid, n in coord.ledger.by_worker.items() if mine(wid)},
           "held": {w.worker_id: w.held for w in workers if w.held},
           # seconds each worker's pulls waited with nothing handed out, by why (registry.WorkerInfo.waited_s)
           "waited_s": {w.worker_id: {k: round(v, 3) for k, v in w.waited_s.items()} for w in workers if w.waited_s},
           "benched": sorted(w.worker_id for w in workers if reg.benched(w))}
    if name is None:
        out["registered"] = coord.registered
    return out


def metrics(coord: Any) -> dict[str, float]:
    """The coordinator's own metrics (echo2/metrics.py); its scorer's and broadcaster's are added by the caller."""
    led, reg, checks = coord.ledger, coord.reg, coord.checks
    out = {BUFFER_GROUPS: float(len(coord.buffer)), BUFFER_IN_FLIGHT_GROUPS: float(len(reg.in_flight)),
           BUFFER_DROPPED_STALE: float(led.dropped["stale"]),
           ROLLOUT_DISPATCHED: float(led.rollouts["dispatched"]), ROLLOUT_RECEIVED: float(led.rollouts["received"]),
           ROLLOUT_DROPPED: float(sum(led.dropped.values())), ROLLOUT_LOST: float(sum(led.lost.values())),
           ROLLOUT_WORKERS: float(len(reg.workers)),
           ROLLOUT_REJECTED_REQUESTS: float(sum(coord.server.rejected.values())),
           ROLLOUT_REFUSED_RESULTS: float(sum(led.refused.values())), ROLLOUT_LOST_DEADLINE: float(led.lost["deadline"]),
           ROLLOUT_FLAGGED_WORKERS: float(len(checks.flagged)), ROLLOUT_DROPPED_UNTRUSTED: float(led.dropped["untrusted"]),
           ROLLOUT_DEADLINE_MISSES: float(coord.deadline_misses), ROLLOUT_INVALID_STRIKES: float(reg.invalid_strikes),
           ROLLOUT_REAPER_ERRORS: float(coord.reaper_errors), ROLLOUT_JOURNAL_ERRORS: float(led.journal_errors),
           ROLLOUT_JOURNAL_DAMAGED_LINES: float(led.damaged_lines),
           ROLLOUT_REVOCATIONS_UNWRITTEN: float(len(coord.gate.unwritten)),
           ROLLOUT_BENCHED_WORKERS: float(sum(reg.benched(w) for w in reg.workers.values()))}
    for w in reg.workers.values():
        out[f"{ROLLOUT_THROUGHPUT_PREFIX}{w.worker_id}"] = w.rollouts_per_s
    for key in checks.tokens:  # rollout checks, per credential (#w3: a run-secret worker)
        out[f"{ROLLOUT_CHECK_LOG_RATIO_PREFIX}{key}"] = checks.mean(key)
        out[f"{ROLLOUT_CHECK_ABS_LOG_RATIO_PREFIX}{key}"] = checks.mean_abs(key)
    out.update(coord.activation.metrics(reg.workers))
    return out
