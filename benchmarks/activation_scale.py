"""Activation at scale: pools of 100, 500 and 2,000 priced workers, and the online planner while they join.

    python benchmarks/activation_scale.py                        # the BENCHMARKS.md table
    python benchmarks/activation_scale.py --sizes 100 500 --join-s 60 --time-limit-s 1

The market: 3-6 GPU types drawn from echo2/sim_inputs/cost.yaml (their spot prices, and their Qwen3-8B
throughput by echo2/cost.py's rule), each worker's price spread around its type's (lognormal, sigma 0.25,
whole cents) and its throughput by host (x0.8-1.15); links by host kind: consumer cards at home-like links
(down 300/500/1000, up 50/100/500 Mbit/s), datacenter cards at 1 or 10 Gbit/s, RTT 20/60/120/200 ms; with
``measured`` links every value is jittered by +-10 % (as measured links are: every worker distinct). The demand
grows with the pool (a learner of 8 H100 per 100 workers, R = 2,048 rollouts per step per 100 workers, T_train
140 s, S = 4, sparse deltas on a 1 Gbit/s learner uplink), so the optimum uses a fixed share of any pool.

Per pool: the exact DP (where it does not refuse), ``solve(..., "exact")`` (the DP or its bounded MILP
search: answer, time, proven gap to its lower bound), greedy and all-on against that lower bound. Then the
online planner (echo2/activation/planner.py driven as the coordinator's reaper loop drives it: a tick each
second, ``dirty`` after each join) while the pool joins at random over ``--join-s`` seconds: solves, the ones
that changed the active set, time per solve, and flapping (a worker switched off and on again, or on and off
again, during the ramp).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo2 import cost  # noqa: E402
from echo2.activation.settings import ActivationSettings, BroadcastShape  # noqa: E402
from echo2.activation.solve import System, TooLarge, Worker, all_on, exact, greedy, solve  # noqa: E402

TYPES = ("rtx3090", "rtx4090", "rtx5090", "l40s", "a100_sxm", "rtx_pro_6000")
CONSUMER = {"rtx3090", "rtx4090", "rtx5090"}
MODEL = "qwen3_8b"


def market(n: int, seed: int = 0, measured: bool = False) -> tuple[list[Worker], list[str]]:
    """``n`` workers of 3-6 types (see the module doc) and the types drawn."""
    rng = random.Random(seed)
    v = cost.values(cost.load_inputs())
    kinds = rng.sample(TYPES, rng.randint(3, 6))
    completion = v["shape"]["completion_tokens"]
    workers = []
    for i in range(n):
        kind = rng.choice(kinds)
        mu = cost.gen_tokens_per_s(v, MODEL, kind, 1) * v["generation"]["rollout_efficiency"] / completion
        price = max(0.01, round(v["gpus"][kind]["usd_per_hour"] * rng.lognormvariate(0, 0.25), 2))
        if kind in CONSUMER:
            down, up = rng.choice([300, 500, 1000]), rng.choice([50, 100, 500])
        else:
            down = up = rng.choice([1000, 10000])
        rtt = rng.choice([20, 60, 120, 200])
        if measured:
            down, up, rtt = (x * rng.uniform(0.9, 1.1) for x in (down, up, rtt))
        workers.append(Worker(f"{kind}-{i:04d}", price, mu * rng.uniform(0.8, 1.15), down, up, rtt))
    return workers, kinds


def system_for(n: int) -> System:
    v = cost.values(cost.load_inputs())
    scale = n / 100
    gb = cost.snapshot_gb(v, MODEL)
    return System(rollouts_per_step=2048 * scale, train_step_s=140.0, staleness=4, interval=1,
                  snapshot_bytes=gb * 1e9 * v["network"]["delta_ratio"],
                  learner_usd_per_hour=8 * scale * v["gpus"]["h100_sxm"]["usd_per_hour"], learner_uplink_mbit=1000.0,
                  broadcast="chain", load_s=v["generation"]["load_s_per_gb"] * gb, batch_s=55.0)


def solve_row(n: int, measured: bool, time_limit_s: float, seed: int = 0) -> dict:
    workers, kinds = market(n, seed, measured)
    system = system_for(n)
    row = {"n": n, "types": len(kinds), "links": "measured" if measured else "classes"}
    t0 = time.perf_counter()
    try:
        dp = exact(system, workers)
        row["dp"] = (dp.usd_per_step, time.perf_counter() - t0)
    except TooLarge:
        row["dp"] = None
    t0 = time.perf_counter()
    plan = solve(system, workers, "exact", time_limit_s=time_limit_s)
    row.update(solver=plan.solver, usd=plan.usd_per_step, active=len(plan.active), util=plan.prediction.utilization,
               time_s=time.perf_counter() - t0, gap=plan.gap or 0.0,
               lb=plan.lower_bound_usd_per_step if plan.lower_bound_usd_per_step is not None else plan.usd_per_step)
    t0 = time.perf_counter()
    g = greedy(system, workers)
    row.update(greedy=g.usd_per_step, greedy_s=time.perf_counter() - t0, all_on=all_on(system, workers).usd_per_step)
    return row


def online_row(n: int, join_s: float, seed: int = 0, tick_s: float = 1.0) -> dict:
    """The pool joins at uniform random times over ``join_s``; the planner re-plans at each tick after a join
    (planner.replan, as the coordinator's reaper loop calls it), with T_train measured before the first join."""
    from echo2.activation.planner import OnlinePlanner

    rng = random.Random(seed + 1)
    workers, _ = market(n, seed)
    system = system_for(n)
    arrivals = sorted((rng.uniform(0, join_s), w) for w in workers)
    settings = ActivationSettings(solver="exact", learner_usd_per_hour=system.learner_usd_per_hour,
                                  learner_uplink_mbit=system.learner_uplink_mbit, load_s=system.load_s,
                                  replan_every_s=30.0)
    planner = OnlinePlanner(settings, BroadcastShape(topology="chain", interval=1), staleness=system.staleness,
                            rollouts_per_step=int(system.rollouts_per_step))
    planner.took(-system.train_step_s)
    planner.step_done({}, 0.0)  # T_train measured: the learner ran before the pool came
    times, history = [], []
    update = planner.online.update

    def timed(*a, **k):  # each solve the planner runs, timed
        t0 = time.perf_counter()
        try:
            return update(*a, **k)
        finally:
            times.append(time.perf_counter() - t0)

    planner.online.update = timed
    live: list = []
    i, now = 0, 0.0
    while now <= join_s + 2 * tick_s:
        while i < len(arrivals) and arrivals[i][0] <= now:
            w = arrivals[i][1]
            live.append(SimpleNamespace(worker_id=w.id, usd_per_hour=w.usd_per_hour, rollouts_per_s=w.rollouts_per_s,
                                        down_mbit=w.down_mbit, up_mbit=w.up_mbit, rtt_ms=w.rtt_ms))
            planner.dirty, i = True, i + 1
        change = planner.replan(live, system.snapshot_bytes, now)
        if change is not None:
            history.append(change)
        now += tick_s
    return {"n": n, "join_s": join_s, "replans": planner.online.replans, "solves": len(times),
            "fallbacks": planner.online.fallbacks, **_flapping(history),
            "replan_s_mean": statistics.fmean(times) if times else 0.0, "replan_s_max": max(times, default=0.0),
            "final_active": len(planner.active or ())}


def _flapping(history: list) -> dict:
    """Switches (on + off events) and flaps: workers whose state went on-off-on or off-on-off during the ramp."""
    states: dict[str, list[bool]] = {}
    switches = 0
    for change in history:
        switches += len(change.on) + len(change.off)
        for w in change.on:
            states.setdefault(w, []).append(True)
        for w in change.off:
            states.setdefault(w, []).append(False)
    flaps = sum(1 for s in states.values() if len(s) >= 3 or (len(s) == 2 and s[0] is False))
    return {"switches": switches, "flapped_workers": flaps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 500, 2000])
    p.add_argument("--time-limit-s", type=float, default=2.0, help="the bounded search's limit (solve's default: 2)")
    p.add_argument("--join-s", type=float, default=120.0, help="the pool joins over this many seconds")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print("| workers | types | links | exact DP | solve: solver | $/step | active | util | time s | proven gap | "
          "greedy: gap to bound | time s | all-on: gap |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        for measured in (False, True):
            r = solve_row(n, measured, args.time_limit_s, args.seed)
            dp = "refuses" if r["dp"] is None else f"{r['dp'][0]:.3f} in {r['dp'][1]:.1f} s"
            print(f"| {n} | {r['types']} | {r['links']} | {dp} | {r['solver']} | {r['usd']:.3f} | {r['active']} | "
                  f"{r['util']:.2f} | {r['time_s']:.2f} | {r['gap']:.2%} | {r['greedy'] / r['lb'] - 1:.1%} | "
                  f"{r['greedy_s']:.2f} | {r['all_on'] / r['lb'] - 1:.0%} |", flush=True)
    print(f"\nonline: the pool joins over {args.join_s:.0f} s; reaper ticks each second")
    print("| workers | re-plans that changed the set | solves | fallbacks | switches | flapped workers | "
          "time per solve mean / max s | active at end |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        r = online_row(n, args.join_s, args.seed)
        print(f"| {n} | {r['replans']} | {r['solves']} | {r['fallbacks']} | {r['switches']} | {r['flapped_workers']} "
              f"| {r['replan_s_mean']:.2f} / {r['replan_s_max']:.2f} | {r['final_active']} |", flush=True)


if __name__ == "__main__":
    main()
