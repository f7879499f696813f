"""Online re-planning of the active set, with hysteresis: a pure state machine the coordinator feeds.

    coordinator (every ``replan_every_s``, and soon after a worker joins or leaves: planner.py)
        ──update(system, workers)──► OnlineActivation ──► the new active set, or None (keep the current one)

It owns no sockets, threads or clocks. A plan is replaced when an active worker left (the current set is
broken), when the current plan no longer meets ``min_utilization`` under the latest measurements (μ_i drift,
T_train, joins), or when the solver's plan is cheaper per step by more than ``hysteresis`` (a fraction): small
drifts, and joins that improve the plan by less, do not flap workers on and off (while a crowd joins, a join
used to replace the plan by any cheaper one: benchmarks/activation_scale.py measured 43 of 500 workers switched
on, off and on again in two minutes). An instance the exact DP refuses as too large (a crowd of workers, or of
prices) is planned by the bounded MILP search instead (solve.solve: logged, counted in ``fallbacks``; the plan's
``gap`` says how far from the optimum it may be), warm-started with the set now active. Deactivated workers stop
getting work; the coordinator logs each change and runs ``activation.on_change`` (a cloud provider's stop/start
of instances; echo2/coordinator/on_change.py). planner.py feeds it from the coordinator's measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from echo2.activation.solve import Plan, System, Worker, evaluate, solve


@dataclass
class OnlineActivation:
    solver: str = "all_on"
    hysteresis: float = 0.1
    active: frozenset[str] | None = None
    known: frozenset[str] = frozenset()
    replans: int = 0
    last: Plan | None = None
    history: list[tuple[str, ...]] = field(default_factory=list)
    fallbacks: int = 0  # re-plans the exact DP refused (too large): made by the bounded MILP search (or greedy)

    def update(self, system: System, workers: list[Worker]) -> frozenset[str] | None:
        """The new active set if it should change, else None."""
        ids = frozenset(w.id for w in workers)
        if not workers:
            self.known, self.active = ids, frozenset()
            return None
        current_ids = self.active or frozenset()
        best = solve(system, workers, self.solver, incumbent=[w for w in workers if w.id in current_ids])
        if best.solver != self.solver:  # the DP refused this instance (logged by solve)
            self.fallbacks += 1
        # the current set is whole: joins alone keep it (under all_on there is no plan to keep: everyone works)
        if self.active is not None and self.active <= ids and self.solver != "all_on":
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
