"""Greedy and all-on activation against the exact optimum, on random priced pools; and the exact solver's time.

Instances as in tests/planning/test_activation.py (prices $0.10-3.00/h, 5-120 rollouts/s, links from {100, 500, 1000}
Mbit/s, RTT {20, 80, 150} ms; R, T_train, S, snapshot size, learner price and broadcast mode drawn per
instance). The gap is cost per learner step over the optimum's, among instances where the plan meets the
utilization floor as the optimum does. The exact solver is checked against brute force in the tests (N <= 12).

    python benchmarks/activation_gap.py --instances 300
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from echo2.activation.solve import all_on, exact, greedy
    from test_activation import random_instance

    rng = random.Random(args.seed)
    gaps = {"greedy": [], "all_on": []}
    worse_floor = {"greedy": 0, "all_on": 0}
    for _ in range(args.instances):
        system, workers = random_instance(rng, rng.randint(2, 12))
        best = exact(system, workers)
        for name, solver in (("greedy", greedy), ("all_on", all_on)):
            plan = solver(system, workers)
            if plan.meets_min_utilization != best.meets_min_utilization:
                worse_floor[name] += 1
                continue
            gaps[name].append(plan.usd_per_step / best.usd_per_step - 1)
    print(f"\nactivation against the exact optimum, {args.instances} random instances (N = 2..12)")
    print(f"{'solver':<8} {'optimal':>8} {'median gap':>11} {'mean gap':>9} {'p90 gap':>8} {'max gap':>8} "
          f"{'misses floor':>12}")
    for name, g in gaps.items():
        print(f"{name:<8} {sum(x < 1e-9 for x in g) / len(g):>8.0%} {statistics.median(g):>11.1%} "
              f"{statistics.fmean(g):>9.1%} {statistics.quantiles(g, n=10)[-1]:>8.1%} {max(g):>8.1%} "
              f"{worse_floor[name]:>12}")
    print("\nexact solver time (link classes as above, one instance each)")
    for n in (12, 24, 48):
        system, workers = random_instance(random.Random(n), n)
        t0 = time.perf_counter()
        exact(system, workers)
        print(f"  N = {n:>3}: {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
