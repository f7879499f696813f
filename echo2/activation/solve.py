"""Which workers to run: the active set that minimises the cost of training (DESIGN §5). Pure.

    cost per learner step = (learner $/h + Σ_{i∈A} worker $/h) / 3600 × T_step(A)

with T_step(A) from the capacity model (echo2/capacity.py) for A's aggregate throughput and A's dissemination
time, subject to ``min_utilization`` (default 0: the cheapest training per step, whatever the utilization;
1.0 asks that the learner never waits). Three solvers:

- ``exact``: for every "link structure" (a slowest downlink d, slowest uplink u and longest RTT r, taken from
  the workers' own values) only workers at least that good may join, and the dissemination time computed
  from (n, d, u, r) bounds that of any such set from above (capacity.bcast_time_s is monotone in each); a DP
  over workers gives, for every (set size n, total price in cents), the largest aggregate throughput; every
  cell is then priced exactly. The true optimum is found in its own structure, so the minimum over all cells
  is the optimum, for prices in whole cents. Cost O(structures × N² × total cents): fine up to a few dozen
  workers or a few distinct link classes (the simulator's pools); it refuses bigger instances by name.
- ``greedy``: the baseline of ECHO-2 as reconstructed: sort by price per rollout/s, take the best prefix.
- ``all_on``: everything.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from echo2 import capacity

SOLVERS = ("exact", "greedy", "all_on")
MAX_EXACT_OPS = 3e9  # numpy element-operations the exact DP may take before it refuses (≈ seconds)


@dataclass(frozen=True)
class Worker:
    id: str
    usd_per_hour: float
    rollouts_per_s: float
    down_mbit: float = 1000.0
    up_mbit: float = 1000.0
    rtt_ms: float = 0.0


@dataclass(frozen=True)
class System:
    """What activation plans around: the learner and the run's settings."""

    rollouts_per_step: float
    train_step_s: float
    staleness: int
    interval: int
    snapshot_bytes: float
    learner_usd_per_hour: float
    learner_uplink_mbit: float
    broadcast: str = "pipelined"
    load_s: float = 0.0
    batch_s: float = 0.0
    fanout: int = 2
    min_utilization: float = 0.0


@dataclass(frozen=True)
class Plan:
    active: tuple[str, ...]
    usd_per_hour: float  # learner + active workers
    usd_per_step: float
    bcast_s: float
    prediction: capacity.Prediction
    solver: str = ""
    meets_min_utilization: bool = True
    notes: tuple[str, ...] = field(default=())


def evaluate(system: System, workers: list[Worker], solver: str = "") -> Plan:
    """Price one active set."""
    if not workers:
        pred = capacity.predict(system.rollouts_per_step, system.train_step_s, system.staleness, system.interval,
                                0.0, system.load_s, [], system.batch_s)
        return Plan((), system.learner_usd_per_hour, math.inf, 0.0, pred, solver, False)
    bcast = capacity.bcast_time_s(system.broadcast, system.snapshot_bytes, system.learner_uplink_mbit, len(workers),
                                  min(w.down_mbit for w in workers), min(w.up_mbit for w in workers),
                                  max(w.rtt_ms for w in workers), system.fanout)
    return _plan(system, [w.id for w in workers], sum(w.usd_per_hour for w in workers),
                 [w.rollouts_per_s for w in workers], bcast, solver)


def _plan(system: System, ids, workers_usd_h: float, mus, bcast: float, solver: str) -> Plan:
    pred = capacity.predict(system.rollouts_per_step, system.train_step_s, system.staleness, system.interval, bcast,
                            system.load_s, list(mus), system.batch_s)
    usd_h = system.learner_usd_per_hour + workers_usd_h
    return Plan(tuple(ids), usd_h, usd_h / 3600 * pred.step_s, bcast, pred, solver,
                pred.utilization >= system.min_utilization - 1e-9)


def _better(a: Plan, b: Plan | None) -> bool:
    """Meeting the utilization floor first, then cheaper per step, then fewer workers."""
    if b is None:
        return True
    return (not a.meets_min_utilization, a.usd_per_step, len(a.active)) < (
        not b.meets_min_utilization, b.usd_per_step, len(b.active))


def all_on(system: System, workers: list[Worker]) -> Plan:
    return evaluate(system, workers, "all_on")


def greedy(system: System, workers: list[Worker]) -> Plan:
    """Cheapest price per rollout/s first; the best prefix."""
    ranked = sorted(workers, key=lambda w: (w.usd_per_hour / max(w.rollouts_per_s, 1e-12), w.id))
    best = None
    for k in range(1, len(ranked) + 1):
        plan = evaluate(system, ranked[:k], "greedy")
        if _better(plan, best):
            best = plan
    return best or evaluate(system, [], "greedy")


def exact(system: System, workers: list[Worker]) -> Plan:
    """The optimum for prices in whole cents (see the module doc)."""
    if not workers:
        return evaluate(system, [], "exact")
    cents = [int(round(w.usd_per_hour * 100)) for w in workers]
    total = sum(cents)
    downs = sorted({w.down_mbit for w in workers})
    ups = sorted({w.up_mbit for w in workers})
    rtts = sorted({w.rtt_ms for w in workers})
    n = len(workers)
    ops = len(downs) * len(ups) * len(rtts) * n * n * (total + 1)
    if ops > MAX_EXACT_OPS:
        raise ValueError(f"activation.solver=exact: {n} workers with {len(downs)}x{len(ups)}x{len(rtts)} distinct "
                         f"link values and ${total / 100:.2f}/h in all would take ~{ops:.1e} operations; use "
                         f"greedy, or group workers into link classes")
    best, where = None, None
    R, T = system.rollouts_per_step, system.train_step_s
    k_window = system.staleness - system.interval + 1
    for d, u, r in itertools.product(downs, ups, rtts):
        allowed = [i for i, w in enumerate(workers) if w.down_mbit >= d and w.up_mbit >= u and w.rtt_ms <= r]
        if not allowed:
            continue
        # dp[k, c]: the largest total μ of k allowed workers costing exactly c cents (-inf: impossible);
        # took[j][k, c]: whether worker j is in the set that reaches dp[k, c] after j was considered.
        cap = sum(cents[i] for i in allowed)
        dp = np.full((len(allowed) + 1, cap + 1), -np.inf)
        dp[0, 0] = 0.0
        took = []
        for i in allowed:
            c, mu = cents[i], workers[i].rollouts_per_s
            shifted = np.full_like(dp, -np.inf)
            shifted[1:, c:] = dp[:-1, : cap + 1 - c] + mu
            took.append(shifted > dp)
            dp = np.maximum(dp, shifted)
        price_h = system.learner_usd_per_hour + np.arange(cap + 1) / 100
        for k in range(1, len(allowed) + 1):
            mu = dp[k]
            ok = np.isfinite(mu) & (mu > 0)
            if not ok.any():
                continue
            bcast = capacity.bcast_time_s(system.broadcast, system.snapshot_bytes, system.learner_uplink_mbit, k, d,
                                          u, r, system.fanout)
            step = capacity.step_time_s(R, T, k_window, bcast + system.load_s + system.batch_s, np.where(ok, mu, 1.0),
                                        system.interval)
            cost = np.where(ok, price_h / 3600 * step, np.inf)
            meets = ok & (T / step >= system.min_utilization - 1e-9)
            pool = np.where(meets, cost, np.inf) if meets.any() else cost
            c = int(np.argmin(pool))
            key = (not bool(meets[c]), float(pool[c]), k)
            if best is None or key < best:
                best, where = key, (allowed, took, k, c)
    allowed, took, k, c = where
    chosen = []
    for j in range(len(allowed) - 1, -1, -1):  # walk back through the choices
        if took[j][k, c]:
            i = allowed[j]
            chosen.append(workers[i])
            k, c = k - 1, c - cents[i]
    return evaluate(system, sorted(chosen, key=lambda w: w.id), "exact")


def solve(system: System, workers: list[Worker], solver: str = "exact") -> Plan:
    if solver not in SOLVERS:
        raise ValueError(f"activation.solver={solver!r}: expected one of {SOLVERS}")
    return {"exact": exact, "greedy": greedy, "all_on": all_on}[solver](system, workers)
