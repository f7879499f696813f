"""The coordinator's online planner: measurements in, an active set and dollars out. Pure.

    take() returns ─► took(t)          } the learner's compute per step, T_train = set_version − take
    set_version    ─► step_done(t)     } and the dollars of that step: (learner + active workers' $/h) × Δt
    reaper loop    ─► replan(workers)  every ``replan_every_s``; at once when an active worker left; within
                      JOIN_COALESCE_S of a join or another leave (``dirty``):
                      System from measurements (T_train, μ_i from pushes, the snapshot's size from the
                      broadcaster) and the broadcast's shape → OnlineActivation (online.py) → active set

It owns no threads, sockets or clocks (the caller passes ``now``) and runs no commands: the coordinator calls it
with its lock held and hands a change to the ``activation.on_change`` hook runner (echo2/coordinator/on_change.py).
Workers are anything with ``worker_id``, ``usd_per_hour``, ``rollouts_per_s`` (0: not measured yet),
``down_mbit``, ``up_mbit`` and ``rtt_ms``. Workers without a measured throughput are planned with the mean of
those that have one (1 rollout/s if none has).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from echo2.activation.online import OnlineActivation
from echo2.activation.settings import ActivationSettings, BroadcastShape
from echo2.activation.solve import System, Worker
from echo2.metrics import (ACTIVATION_ACTIVE_WORKERS, ACTIVATION_OPTIMALITY_GAP, ACTIVATION_REPLANS, COST_USD,
                           COST_USD_PER_HOUR, COST_USD_PER_STEP)

TRAIN_STEP_EMA = 0.2
"""Weight of the newest step in the running estimate of T_train: a few steps' memory, so one slow step (a
checkpoint, an eval) moves the plan little, while a lasting change shows within ~5 steps."""


JOIN_COALESCE_S = 5.0
"""After a join, re-plan within this many seconds rather than at the next reaper tick: a crowd joining is planned
every few seconds, not every second. Each solve holds the coordinator's lock (at 2,000 workers the bounded search
takes ~0.8 s: benchmarks/activation_scale.py), and a join replaces a whole plan only past the hysteresis
(online.py) anyway. An active worker leaving breaks the plan and re-plans at the next tick."""


@dataclass(frozen=True)
class Change:
    """A new active set, and who was switched on and off by it (a worker that left is in neither)."""

    active: frozenset[str]
    on: frozenset[str]
    off: frozenset[str]
    replan: int  # the re-plan's number


class OnlinePlanner:
    def __init__(self, settings: ActivationSettings, shape: BroadcastShape, *, staleness: int,
                 rollouts_per_step: int):
        self.settings, self.shape = settings, shape
        self.staleness, self.rollouts_per_step = staleness, rollouts_per_step
        self.online = OnlineActivation(settings.solver, settings.hysteresis)
        self.active: frozenset[str] | None = None  # None: everyone (before the first plan)
        self.dirty = False  # a worker joined or left: re-plan at the next call, whatever the timer says
        self.next_at = 0.0
        self.planned_at = -JOIN_COALESCE_S  # when the last re-plan ran
        self.train_step_s: float | None = None  # running estimate of the learner's compute per step
        self.taken_at: float | None = None
        self.last_step_at: float | None = None
        self.usd = 0.0
        self.step_usd = 0.0

    def is_active(self, worker_id: str) -> bool:
        return self.active is None or worker_id in self.active

    def took(self, now: float) -> None:
        """The learner took a batch: its step's compute starts."""
        self.taken_at = now

    def step_done(self, workers: dict[str, Any], now: float) -> None:
        """The learner finished a step: update T_train and charge the step's wall-clock to everyone running."""
        if self.taken_at is not None:
            dt = now - self.taken_at
            self.train_step_s = dt if self.train_step_s is None else (
                (1 - TRAIN_STEP_EMA) * self.train_step_s + TRAIN_STEP_EMA * dt)
        if self.last_step_at is not None:
            self.step_usd = (now - self.last_step_at) / 3600 * self.usd_per_hour(workers)
            self.usd += self.step_usd
        self.last_step_at = now

    def usd_per_hour(self, workers: dict[str, Any]) -> float:
        return self.settings.learner_usd_per_hour + sum(
            w.usd_per_hour for w in workers.values() if self.is_active(w.worker_id))

    def system(self, snapshot_bytes: float) -> System:
        """What the solver plans around now: the run's settings, the broadcast's shape and the measured T_train."""
        s = self.settings
        return System(rollouts_per_step=self.rollouts_per_step, train_step_s=self.train_step_s or 0.0,
                      staleness=self.staleness, interval=self.shape.interval, snapshot_bytes=snapshot_bytes,
                      learner_usd_per_hour=s.learner_usd_per_hour, learner_uplink_mbit=s.learner_uplink_mbit,
                      broadcast=self.shape.topology, fanout=self.shape.fanout, load_s=s.load_s,
                      min_utilization=s.min_utilization)

    def replan(self, workers: list[Any], snapshot_bytes: float, now: float) -> Change | None:
        """Re-plan if due (the timer; an active worker gone; a join or leave JOIN_COALESCE_S ago) and T_train has
        been measured; the change, if the set changed."""
        if not workers or self.train_step_s is None:
            return None
        live = frozenset(w.worker_id for w in workers)
        broken = self.active is not None and not self.active <= live
        joined = self.dirty and (self.active is None or now >= self.planned_at + JOIN_COALESCE_S)
        if now < self.next_at and not (broken or joined):
            return None
        self.next_at, self.dirty, self.planned_at = now + self.settings.replan_every_s, False, now
        new = self.online.update(self.system(snapshot_bytes), specs(workers))
        if new is None:
            return None
        before = self.active if self.active is not None else live  # before a first plan, everyone works
        self.active = new
        return Change(new, new - before, (before & live) - new, self.online.replans)

    def metrics(self, workers: dict[str, Any]) -> dict[str, float]:
        return {COST_USD: self.usd, COST_USD_PER_STEP: self.step_usd,
                COST_USD_PER_HOUR: self.usd_per_hour(workers),
                ACTIVATION_ACTIVE_WORKERS: float(sum(self.is_active(w) for w in workers)),
                ACTIVATION_REPLANS: float(self.online.replans),
                # how far the plan may be from the optimum (0: the exact DP's; the bounded search states its own)
                **({ACTIVATION_OPTIMALITY_GAP: float(self.online.last.gap)}
                   if self.online.last is not None and self.online.last.gap is not None else {})}


def specs(workers: Iterable[Any]) -> list[Worker]:
    """The solver's view of live workers; an unmeasured throughput gets the mean of the measured ones."""
    workers = list(workers)
    known = [w.rollouts_per_s for w in workers if w.rollouts_per_s > 0]
    prior = sum(known) / len(known) if known else 1.0
    return [Worker(w.worker_id, w.usd_per_hour, w.rollouts_per_s or prior, w.down_mbit, w.up_mbit, w.rtt_ms)
            for w in workers]
