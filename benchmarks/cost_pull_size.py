"""At S = 1, what activation picks against the best the simulator finds, for pulls of 4 down to 1 group.

Activation's pick is the set the capacity model says is cheapest (the cost scenario, `python -m echo2.sim --scenario
cost`, runs it in the discrete-event simulator, and at S = 1 first checks it there against its neighbours:
echo2.sim.refine; this script's "activation" column is the model's own pick). At S = 1 every rollout a step consumes
is generated after the version before it was applied and must be back before the step starts, so a worker's pull
(4 groups of 16 rollouts in the scenario) either fits in what is left of a learner step or costs a step's worth of
waiting: the simulator's utilization climbs in steps with the number of workers (each step where one more pull per
worker fits), where the capacity model's (generation as a continuous rate) climbs smoothly. This script prints, for
one cell, activation's pick and the cheapest run the simulator finds over a range of worker counts (the workers
cheapest per rollout first, as activation's greedy baseline orders them), for pulls of 4, 3, 2 and 1 groups.

A smaller pull comes back sooner, but an engine running fewer sequences at once makes fewer tokens a second: decoding
reads the weights and every sequence's KV cache once per token, so at C sequences a decode step takes
(weights + C x KV per sequence) / memory bandwidth and makes C tokens (a roofline; its KV is the model's, bf16, at
the mean context: the prompt plus half the completion). Every worker's rate is scaled by that roofline's rate at
G x pull sequences over its rate at 4 groups a pull (where the scenario takes the serving benchmark's rate to hold).

    python benchmarks/cost_pull_size.py                          # Qwen3-8B, 100 Mbit/s, S = 1, rank 8, merged
    python benchmarks/cost_pull_size.py --model qwen3_4b --staleness 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo2 import cost  # noqa: E402
from echo2.activation.solve import by_price_per_rollout, solve  # noqa: E402
from echo2.sim import simulate, system_of  # noqa: E402

ANCHOR_GROUPS = 4  # the groups a pull at which a worker makes the serving benchmark's tokens/s (the scenario's pull)


def rate_kept(v: dict, model: str, groups: int) -> float:
    """A worker's decode rate with ``groups`` groups at once over its rate with ANCHOR_GROUPS, by the roofline:
    C sequences take (bf16 weights + C x KV cache at the mean context) / bandwidth a token each. The bandwidth (and
    the number of GPUs that share weights and caches) cancels: the ratio is the model's, whatever the GPU."""
    m, sh = v["models"][model], v["shape"]
    kv_per_seq_bytes = 2 * m["layers"] * m["kv_dim"] * 2 * (sh["prompt_tokens"] + sh["completion_tokens"] / 2)
    weights_bytes = cost.snapshot_gb(v, model) * 1e9
    rate = lambda c: c / (weights_bytes + c * kv_per_seq_bytes)  # noqa: E731 (tokens per byte read)
    g = sh["group_size"]
    return rate(groups * g) / rate(ANCHOR_GROUPS * g)


def cell(v: dict, model: str, link_mbit: float, staleness: int, rank: int, groups: int,
         most_workers: int = 160) -> dict:
    """Activation's pick for one cell at ``groups`` a pull, and the simulator's cheapest of the first n workers
    (cheapest per rollout first) for n up to ``most_workers``."""
    v = {**v, "workers": {**v["workers"], "groups_per_pull": groups}}
    cfg = cost.sim_config(v, model, link_mbit, staleness, False, lora_rank=rank)
    kept = rate_kept(v, model, groups)
    pool = cost.market(v, model, link_mbit, throughput=kept)
    colocated_usd = cost.colocated(v, model, rank)["usd_per_step"]

    def run(active: list) -> dict:
        result = simulate(cfg, active)
        s = result.summary()
        return {"workers": len(active), "utilization": s["utilization"], "step_s": s["wall_s"] / max(s["steps"], 1),
                "bcast_s": result.bcast_s, "ratio": s["usd_per_step"] / colocated_usd}

    plan = solve(system_of(cfg, pool), pool, "exact")
    picked = run([w for w in pool if w.id in set(plan.active)])
    by_cost = by_price_per_rollout(pool)
    scan = [run(by_cost[:n]) for n in range(1, min(most_workers, len(pool)) + 1)]
    best = min(scan, key=lambda r: r["ratio"])
    return {"groups_per_pull": groups, "rate_kept": kept, "train_step_s": cfg.train_step_s, "load_s": cfg.load_s,
            "cheapest_pull_s": groups * cfg.group_size / by_cost[0].rollouts_per_s,
            "activation": {**picked, "predicted_utilization": plan.prediction.utilization}, "best": best,
            "utilization_by_workers": {r["workers"]: r["utilization"] for r in scan}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3_8b")
    p.add_argument("--link-mbit", type=float, default=100)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    v = cost.values(cost.load_inputs())
    rows = [cell(v, args.model, args.link_mbit, args.staleness, args.rank, g) for g in (4, 3, 2, 1)]
    print(f"{args.model}, {args.link_mbit:g} Mbit/s, S = {args.staleness}, LoRA rank {args.rank} merged on the "
          f"workers; learner step {rows[0]['train_step_s']:.1f} s of training, apply {rows[0]['load_s']:.1f} s")
    print("| groups a pull | decode rate kept | one pull on the worker cheapest per rollout, s | activation: workers, "
          "utilization (predicted), $/step against colocated | the simulator's cheapest: workers, utilization, "
          "$/step against colocated |")
    print("|---:|---:|---:|---|---|")
    for r in rows:
        a, b = r["activation"], r["best"]
        print(f"| {r['groups_per_pull']} | {r['rate_kept']:.2f} | {r['cheapest_pull_s']:.1f} | {a['workers']}, "
              f"{a['utilization']:.2f} ({a['predicted_utilization']:.2f}), **{a['ratio']:.3f}** | {b['workers']}, "
              f"{b['utilization']:.2f}, **{b['ratio']:.3f}** |")
    by_n = rows[0]["utilization_by_workers"]
    print(f"The simulator's utilization at {rows[0]['groups_per_pull']} groups a pull by workers (cheapest first): "
          + ", ".join(f"{n}: {by_n[n]:.2f}" for n in sorted(by_n) if n % 4 == 0 and n <= 64))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
