"""A push's groups from claim to settlement: parsed and scored outside the coordinator's lock.

    coordinator._push:  claim (lock: the groups leave ``in flight``)  ──►  score (no lock)
                        ──►  settle (lock: each group received and buffered, or dropped with its reason)
                        ──►  unclaim (lock, always: a group an error left unsettled is dropped, re-queued)

Every claimed group comes out of ``score`` with an outcome, whatever happens: its scored group, or the reason it
is dropped (``invalid`` when results.py refuses it, or the reward pool's reason: ``reward_timeout``,
``reward_error``, ``reward_crashed``, ``reward_unavailable``), so that settling can book each one: a claimed
group is never left neither in flight nor settled. Which reasons are the worker's doing (a strike) and which
prompts go back to the queue is decided here too, next to the reasons.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from echo2.coordinator.buffer import StalenessBuffer
from echo2.coordinator.ledger import IN_FLIGHT, Ledger
from echo2.coordinator.registry import InFlight, Registry, WorkerInfo
from echo2.coordinator.results import parse_result
from echo2.coordinator.reward_faults import RewardFaults
from echo2.coordinator.schemas import MAX_ROLLOUTS_PER_S
from echo2.records import RolloutGroup
from echo2.tasks.environments.episode import TranscriptMismatch
from echo2.net.http import BadRequest

log = logging.getLogger(__name__)

STRIKES = frozenset({"invalid", "future_version", "undelivered_version"})
"""Outcomes that count as a miss for the worker's credential (liveness.py): what it sent was ill-formed, or claimed
weights it was never given (or that do not exist yet). A reward that hung or crashed on its group is struck only
once the reward is seen to work for others (reward_faults.py); one that raises (``reward_error``) or a pool that
cannot start (``reward_unavailable``) is the task's fault: booked, never struck, so that a broken reward cannot
bench every honest worker."""
REQUEUE = frozenset({"invalid", "future_version", "undelivered_version", "unproven_version", "worker_gone",
                     "coordinator_error"})
"""Drops whose prompt goes back to the queue: nothing about the prompt itself was wrong. A reward that failed
on a prompt's completions may fail on that prompt again, so its row waits for the next epoch instead."""
RATE_EMA = 0.5
"""Weight of a push's own measurement in a worker's measured rate: a couple of pushes' memory."""


@dataclass
class Outcome:
    gid: str
    flight: InFlight
    group: RolloutGroup | None  # scored; None when dropped
    reason: str | None = None  # why it is dropped (None: scored)
    detail: str = ""  # what the worker is told


def claim(reg: Registry, ledger: Ledger, worker: WorkerInfo, results: list[dict]) -> tuple[list, list[dict]]:
    """Take the results' groups out of flight; refuse (counted, one journal line per reason, never one per result)
    the others: its own late (``past_deadline``: the miss is counted already) or repeated (``duplicate``: a retry
    after a lost reply) results, and results for groups never in flight for it (a strike)."""
    claimed, rejected, refused = [], [], Counter()
    for res in results:
        gid = res.get("group_id") if isinstance(res.get("group_id"), str) else None
        flight = reg.in_flight.get(gid)
        if flight is None or flight.worker_id != worker.worker_id:
            reason = reg.refusal(gid, worker.principal)
            rejected.append({"group_id": gid, "reason": reason})
            refused[reason] += 1
            continue
        claimed.append((gid, reg.land(gid), res))
        reg.remember(gid, flight, "duplicate")
    for reason, n in refused.items():
        ledger.refuse(reason, n)
        log.warning("worker %s: %d results refused: %s", worker.worker_id, n, reason)
    if refused["not_in_flight_for_this_worker"]:
        reg.strike(worker, "results for groups not in flight for it")
    return claimed, rejected


def score(scorer: Any, claimed: list[tuple[str, InFlight, Any]], group_size: int, max_tokens: int,
          vocab_size: int, episodes: bool = False, principal: str = "?") -> list[Outcome]:
    """Parse each claimed result (results.py; a multi-turn task's transcripts read back and checked against their
    tokens) and score the well-formed ones in one call to the scorer, queued for ``principal`` (the reward pool
    charges it the time: reward_pool.py)."""
    outcomes, parsed = [], []
    for gid, flight, res in claimed:
        try:
            rollouts = parse_result(res, flight.prompt_ids, group_size, max_tokens, vocab_size, episodes)
            group = RolloutGroup(row=flight.row, rollouts=rollouts, group_id=gid, row_index=flight.row_index,
                                 worker_id=flight.worker_id)
            if episodes:
                scorer.check_transcripts(group)
        except (BadRequest, TranscriptMismatch) as e:
            outcomes.append(Outcome(gid, flight, None, "invalid", str(e)))
            continue
        outcomes.append(Outcome(gid, flight, group))
        parsed.append(outcomes[-1])
    if parsed:
        reasons = scorer.score_many([o.group for o in parsed], principal=principal)
        for o, why in zip(parsed, reasons, strict=True):
            if why is not None:
                o.group, o.reason, o.detail = None, why, why
    return outcomes


def delivery_horizon(version: int, staleness: int) -> int:
    """The oldest version whose deliveries are remembered (registry.WorkerInfo.delivered): anything older is
    stale at the learner's next step, so whether it was delivered no longer matters."""
    return version - staleness - 1


def settle(reg: Registry, ledger: Ledger, buffer: StalenessBuffer, worker: WorkerInfo, outcomes: list[Outcome],
           rejected: list[dict], *, version: int, staleness: int, group_size: int, claimed_at: float,
           reported_rate: float | None, faults: RewardFaults | None = None) -> list[str]:
    """Book each scored group (received, buffered) or dropped one (its reason, told to the worker in ``rejected``);
    a version from the future, or one the worker was never delivered, is dropped too. Strike or credit the
    worker's credential (and any credential ``faults`` now proves made the reward fail); measure the worker's rate
    from its valid groups. Returns the accepted group ids."""
    accepted, struck, live = [], set(), worker.worker_id in reg.workers
    for o in outcomes:
        if faults is not None and (o.group is not None or o.reason is not None and o.reason != "invalid"):
            for key in faults.observe(worker.principal, None if o.group is not None else o.reason):
                reg.strike_principal(key, "rewards that hung or crashed on its groups alone")
        if o.group is not None:  # scored: received, then judged by the version it claims
            ledger.received(o.gid, worker.worker_id)
            x = o.group.version  # older than the horizon: no longer remembered, and the buffer drops it as stale
            # a version not proven delivered is never trained on; one ordered to the worker (its answer may still be
            # on its way) is dropped and re-queued without a strike (unproven_version), any other is a strike
            if x > version:
                o.reason = "future_version"
            elif x not in worker.delivered and x >= delivery_horizon(version, staleness):
                o.reason = "unproven_version" if x in worker.ordered else "undelivered_version"
            elif not live:
                o.reason = "worker_gone"
        if o.reason is None:
            buffer.admit(o.group, o.group.version, version)
            accepted.append(o)
            continue
        ledger.drop(o.gid, o.reason, requeue=o.reason in REQUEUE)
        rejected.append({"group_id": o.gid, "reason": o.detail or o.reason})
        struck |= {o.reason} & STRIKES
        log.warning("worker %s: group %s dropped: %s", worker.worker_id, o.gid, o.detail or o.reason)
    principal = reg.principals[worker.principal]
    if struck:
        reg.strike(worker, ", ".join(sorted(struck)))
    elif accepted and principal.misses and not reg.liveness.benched(principal.misses):
        principal.misses -= 1  # on time and valid again: one halving of its share back
    if accepted:
        principal.valid_pushes += 1
        elapsed_s = max(claimed_at - min(o.flight.dispatched_at for o in accepted), 1e-3)
        rate = min(len(accepted) * group_size / elapsed_s, MAX_ROLLOUTS_PER_S)
        worker.rollouts_per_s = rate if not worker.rollouts_per_s else (
            RATE_EMA * rate + (1 - RATE_EMA) * worker.rollouts_per_s)
    if reported_rate is not None:
        worker.reported_rollouts_per_s = min(reported_rate, MAX_ROLLOUTS_PER_S)
    return [o.gid for o in accepted]


def unclaim(reg: Registry, ledger: Ledger, gids: list[str]) -> None:
    """After a push, whatever happened: a claimed group left unsettled (an error on the way) is dropped
    (``coordinator_error``) and its prompt re-queued."""
    for gid in gids:
        if ledger.open.get(gid, (None, None))[1] == IN_FLIGHT and gid not in reg.in_flight:
            log.error("group %s: its push failed before it was settled; dropped (coordinator_error)", gid)
            ledger.drop(gid, "coordinator_error", requeue=True)
