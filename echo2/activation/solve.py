"""Which workers to run: the active set that minimises the cost of training (docs/design.md §4). Pure.

    cost per learner step = (learner $/h + Σ_{i∈A} worker $/h) / 3600 × T_step(A)

with T_step(A) from the capacity model (echo2/capacity.py) for A's aggregate throughput and A's dissemination
time, subject to ``min_utilization`` (default 0: the cheapest training per step, whatever the utilization;
1.0 asks that the learner never waits). Three solvers:

- ``exact``: for every "link structure" (a slowest downlink d, slowest uplink u and longest RTT r, taken from
  the workers' own values) only workers at least that good may join, and the dissemination time computed
  from (n, d, u, r) bounds that of any such set from above (capacity.bcast_time_s is monotone in each); a DP
  over workers gives, for every (set size n, total price in cents), the largest aggregate throughput; every
  cell is then priced exactly. The true optimum is found in its own structure, so the minimum over all cells
  is the optimum, for prices in whole cents (keeping only the largest μ per cell relies on T_step being
  non-increasing in μ: true of the closed form, and of the round map up to its ~0.05 % averaging noise).
  Only each set size's (price, μ) frontier is priced, all at once. Cost O(structures × N² × total cents) in
  time and N² × total cents bytes for the winner's choice table: fine up to a few dozen workers or a few
  distinct link classes. Past ``MAX_EXACT_OPS`` or ``MAX_EXACT_CHOICE_BYTES`` ``exact()`` refuses by name, and
  ``solve(..., "exact")`` does not refuse a real pool: it logs the refusal and answers with the bounded search
  of milp.py (HiGHS, a time limit, and a proven optimality gap on the plan: ``Plan.gap``); greedy is the last
  resort, where scipy is missing.
- ``greedy``: the baseline of ECHO-2 as reconstructed: sort by price per rollout/s, take the best prefix (every
  prefix priced at once: thousands of workers take milliseconds).
- ``all_on``: everything.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field, replace

import numpy as np

from echo2 import capacity
from echo2.broadcast.topology import FANOUT

log = logging.getLogger(__name__)

SOLVERS = ("exact", "greedy", "all_on")
MAX_EXACT_OPS = 3e9  # numpy element-operations the exact DP may take before it refuses (≈ seconds)
MAX_EXACT_CHOICE_BYTES = 256e6  # the winner's choice table (one bool per worker × size × cent): its memory bound
MILP_TIME_LIMIT_S = 2.0
"""Seconds the bounded search (milp.py) may take when the DP refuses: the online planner runs it with the
coordinator's lock held, so it is kept short; the plan states the gap it proved in that time."""


class TooLarge(ValueError):
    """The exact DP refuses an instance that would take too long (MAX_EXACT_OPS) or too much memory
    (MAX_EXACT_CHOICE_BYTES); ``solve`` then answers with the bounded search of milp.py."""


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
    broadcast: str = "pipelined"  # the relay topology: chain, tree or star (capacity.TOPOLOGIES)
    load_s: float = 0.0
    batch_s: float = 0.0
    fanout: int = FANOUT  # children per relaying peer in a tree
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
    gap: float | None = None  # proven: usd_per_step / lower bound − 1 (0: optimal; None: not known, greedy/all_on)
    lower_bound_usd_per_step: float | None = None


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


def by_price_per_rollout(workers: list[Worker]) -> list[Worker]:
    """Cheapest price per rollout/s first (ties by id): the order greedy takes its prefixes in."""
    return sorted(workers, key=lambda w: (w.usd_per_hour / max(w.rollouts_per_s, 1e-12), w.id))


def greedy(system: System, workers: list[Worker]) -> Plan:
    """Cheapest price per rollout/s first; the best prefix. Every prefix is priced at once (the same numbers as
    ``evaluate`` of each, and ``_better``'s order: meets the floor, cheaper per step, shorter)."""
    ranked = by_price_per_rollout(workers)
    if not ranked:
        return evaluate(system, [], "greedy")
    usd_h = system.learner_usd_per_hour + np.cumsum([w.usd_per_hour for w in ranked])
    mu = np.cumsum([w.rollouts_per_s for w in ranked])
    down = np.minimum.accumulate([w.down_mbit for w in ranked])
    up = np.minimum.accumulate([w.up_mbit for w in ranked])
    rtt = np.maximum.accumulate([w.rtt_ms for w in ranked])
    bcast = np.array([capacity.bcast_time_s(system.broadcast, system.snapshot_bytes, system.learner_uplink_mbit, k + 1,
                                            down[k], up[k], rtt[k], system.fanout) for k in range(len(ranked))])
    step = np.full(len(ranked), math.inf)
    live = mu > 0
    if live.any():
        step[live] = capacity.mean_step_s(system.rollouts_per_step, system.train_step_s, system.staleness,
                                          system.interval, bcast[live], system.load_s + system.batch_s, mu[live])
    usd_step = usd_h / 3600 * step
    with np.errstate(divide="ignore"):
        misses = system.train_step_s / step < system.min_utilization - 1e-9
    k = int(np.lexsort((np.arange(len(ranked)), usd_step, misses))[0])
    return evaluate(system, ranked[: k + 1], "greedy")


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
    choice_bytes = n * (n + 1) * (total + 1)
    if ops > MAX_EXACT_OPS or choice_bytes > MAX_EXACT_CHOICE_BYTES:
        raise TooLarge(f"activation.solver=exact: {n} workers with {len(downs)}x{len(ups)}x{len(rtts)} distinct "
                       f"link values and ${total / 100:.2f}/h in all would take ~{ops:.1e} operations and "
                       f"{choice_bytes / 1e6:.0f} MB; solve() uses the bounded MILP search instead (or use "
                       f"greedy, or group workers into link classes)")
    # Pass 1: for every structure and set size k, the cells (price, μ) that can win, with the structure's T_bcast.
    cells: list[tuple] = []  # (structure, k, cents, μ, T_bcast) as arrays per (structure, k)
    structures = list(itertools.product(downs, ups, rtts))
    for s_i, (d, u, r) in enumerate(structures):
        allowed = _allowed(workers, d, u, r)
        if not allowed:
            continue
        dp, _ = _dp(workers, cents, allowed, keep_choices=False)
        for k in range(1, len(allowed) + 1):
            mu = np.where(dp[k] > 0, dp[k], -np.inf)
            # Only the (price, μ) frontier can win: a dearer cell with no more μ has no shorter T_step (it is
            # non-increasing in μ), so it costs more and meets min_utilization no better.
            frontier = np.flatnonzero(mu > np.maximum.accumulate(np.concatenate(([-np.inf], mu[:-1]))))
            if frontier.size:
                bcast = capacity.bcast_time_s(system.broadcast, system.snapshot_bytes, system.learner_uplink_mbit, k,
                                              d, u, r, system.fanout)
                cells.append((np.full(frontier.size, s_i), np.full(frontier.size, k), frontier, mu[frontier],
                              np.full(frontier.size, bcast)))
    # Pass 2: price every candidate at once (the round map is vectorised), pick the best, walk back its choices
    # (the winning structure's DP is run again with its choice tables: keeping every structure's would cost memory).
    if not cells:  # no worker generates anything
        return evaluate(system, [], "exact")
    s_of, k_of, c_of, mu, bcast = (np.concatenate(x) for x in zip(*cells))
    T = system.train_step_s
    step = capacity.mean_step_s(system.rollouts_per_step, T, system.staleness, system.interval, bcast,
                                system.load_s + system.batch_s, mu)
    cost = (system.learner_usd_per_hour + c_of / 100) / 3600 * step
    misses = T / step < system.min_utilization - 1e-9
    best = np.lexsort((np.arange(cost.size), k_of, cost, misses))[0]  # meets first, then cost, fewer workers
    d, u, r = structures[s_of[best]]
    allowed = _allowed(workers, d, u, r)
    _, took = _dp(workers, cents, allowed, keep_choices=True)
    k, c = int(k_of[best]), int(c_of[best])
    chosen = []
    for j in range(len(allowed) - 1, -1, -1):  # walk back through the choices
        if took[j][k, c]:
            i = allowed[j]
            chosen.append(workers[i])
            k, c = k - 1, c - cents[i]
    return replace(evaluate(system, sorted(chosen, key=lambda w: w.id), "exact"), gap=0.0)


def _allowed(workers: list[Worker], d: float, u: float, r: float) -> list[int]:
    return [i for i, w in enumerate(workers) if w.down_mbit >= d and w.up_mbit >= u and w.rtt_ms <= r]


def _dp(workers: list[Worker], cents: list[int], allowed: list[int], keep_choices: bool):
    """dp[k, c]: the largest total μ of k allowed workers costing exactly c cents (-inf: impossible);
    took[j][k, c]: whether worker j is in the set that reaches dp[k, c] after j was considered."""
    cap = sum(cents[i] for i in allowed)
    dp = np.full((len(allowed) + 1, cap + 1), -np.inf)
    dp[0, 0] = 0.0
    took = []
    for i in allowed:
        c, mu = cents[i], workers[i].rollouts_per_s
        shifted = np.full_like(dp, -np.inf)
        shifted[1:, c:] = dp[:-1, : cap + 1 - c] + mu
        if keep_choices:
            took.append(shifted > dp)
        dp = np.maximum(dp, shifted)
    return dp, took


def solve(system: System, workers: list[Worker], solver: str = "exact", *, time_limit_s: float = MILP_TIME_LIMIT_S,
          incumbent: list[Worker] | None = None) -> Plan:
    """The plan ``solver`` makes. ``exact`` never refuses: past the DP's size it logs why and runs the bounded MILP
    search (milp.py: at most ``time_limit_s``, seeded with ``incumbent``, e.g. the set now active), whose plan
    states its optimality gap; greedy only where scipy is missing."""
    if solver not in SOLVERS:
        raise ValueError(f"activation.solver={solver!r}: expected one of {SOLVERS}")
    if solver != "exact":
        return {"greedy": greedy, "all_on": all_on}[solver](system, workers)
    try:
        return exact(system, workers)
    except TooLarge as e:
        refusal = str(e)
    try:
        from echo2.activation.milp import solve_large
    except ImportError as e:  # scipy absent: the last resort
        _log_fallback(f"{refusal}; scipy is not installed ({e}): greedy")
        return replace(greedy(system, workers), notes=(refusal, "scipy missing: greedy"))
    plan = solve_large(system, workers, time_limit_s=time_limit_s, incumbent=incumbent)
    _log_fallback(f"{len(workers)} workers: past the exact DP's size; bounded MILP search: {plan.notes[-1]}")
    return plan


_fallbacks_logged = 0


def _log_fallback(message: str) -> None:
    """The first fallback of a process is a warning; later ones (the online planner re-plans often) are debug."""
    global _fallbacks_logged
    _fallbacks_logged += 1
    log.log(logging.WARNING if _fallbacks_logged == 1 else logging.DEBUG, "activation: %s", message)
