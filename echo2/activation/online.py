"""Online re-planning of the active set, with hysteresis: a pure state machine the coordinator feeds.

    coordinator (every ``replan_every_s``, and at once when a worker joins or leaves)
        ──update(system, workers)──► OnlineActivation ──► the new active set, or None (keep the current one)

It owns no sockets, threads or clocks. A plan is replaced when the set of live workers changed, when the
current plan no longer meets ``min_utilization`` under the latest measurements (μ_i drift, T_train), or when
the solver's plan is cheaper per step by more than ``hysteresis`` (a fraction): small drifts do not flap
workers on and off. An instance the exact solver refuses as too large (a crowd of workers, or of prices) is
planned with greedy instead (logged once, counted in ``fallbacks``). Deactivated workers stop getting work; the coordinator logs each change and runs
``activation.on_change`` (a cloud provider's stop/start of instances; echo2/rollout/activation.py).
planner.py feeds it from the coordinator's measurements.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from echo2.activation.solve import Plan, System, TooLarge, Worker, evaluate, solve

log = logging.getLogger(__name__)


@dataclass
class OnlineActivation:
    solver: str = "all_on"
    hysteresis: float = 0.1
    active: frozenset[str] | None = None
    known: frozenset[str] = frozenset()
    replans: int = 0
    last: Plan | None = None
    history: list[tuple[str, ...]] = field(default_factory=list)
    fallbacks: int = 0  # re-plans the exact solver refused (too large) and greedy made instead

    def update(self, system: System, workers: list[Worker]) -> frozenset[str] | None:
        """The new active set if it should change, else None."""
        ids = frozenset(w.id for w in workers)
        if not workers:
            self.known, self.active = ids, frozenset()
            return None
        try:
            best = solve(system, workers, self.solver)
        except TooLarge as e:  # too many workers or prices for the exact DP now: plan greedily rather than not at all
            self.fallbacks += 1
            if self.fallbacks == 1:
                log.warning("activation: %s; planning with greedy while it is", e)
            best = solve(system, workers, "greedy")
        if self.active is not None and ids == self.known:
            current = evaluate(system, [w for w in workers if w.id in self.active])
            self.last = current
            keep = current.meets_min_utilization and (
                best.usd_per_step >= current.usd_per_step * (1 - self.hysteresis) or not best.meets_min_utilization)
            if keep:
                return None
        self.known = ids
        new = frozenset(best.active)
        changed = new != self.active
        self.active, self.last = new, best
        if changed:
            self.replans += 1
            self.history.append(tuple(sorted(new)))
            return new
        return None
