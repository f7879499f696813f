"""Plan a run before renting it: which workers to activate, what it costs, how busy the learner will be.

    python -m echo2.plan --pool conf/pool/demo_market.yaml --rollouts-per-step 512 --train-step-s 30 \\
        --staleness 2 --snapshot-mb 8000 --learner-usd-per-hour 20 --learner-uplink-mbit 10000
    ... --broadcast one_to_many --solver greedy --json
    ... --plot plan.png        # utilization against aggregate throughput for several S; cost against S

The capacity model is echo2/capacity.py, the solvers echo2/activation/solve.py (their docstrings derive and
define them). A pool file is a conf/pool YAML with a ``workers`` list: id, usd_per_hour, rollouts_per_s,
downlink_mbit, uplink_mbit, rtt_ms.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from echo2 import capacity
from echo2.activation.solve import SOLVERS, System, Worker, solve
from echo2.broadcast.topology import FANOUT


def load_pool(path: str) -> list[Worker]:
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    rows = data.get("workers") if isinstance(data, dict) else None
    if not rows:
        raise SystemExit(f"{path}: no 'workers' list (id, usd_per_hour, rollouts_per_s, downlink_mbit, "
                         f"uplink_mbit, rtt_ms)")
    if not isinstance(rows, list) or not all(isinstance(w, dict) for w in rows):
        raise SystemExit(f"{path}: 'workers' is {rows!r}, not a list of workers. The planner needs each worker's "
                         "price and rate (a list of id, usd_per_hour, rollouts_per_s, downlink_mbit, uplink_mbit, "
                         "rtt_ms), as in conf/pool/demo_market.yaml; a pool that only counts the workers a run starts "
                         "(pool=local) has none")
    out = []
    for i, w in enumerate(rows):
        try:
            out.append(Worker(str(w["id"]), float(w["usd_per_hour"]), float(w["rollouts_per_s"]),
                              float(w.get("downlink_mbit", 1000)), float(w.get("uplink_mbit", 1000)),
                              float(w.get("rtt_ms", 0))))
        except (KeyError, TypeError, ValueError) as e:
            raise SystemExit(f"{path}: worker #{i} ({w!r}): {e!r}") from None
    if len({w.id for w in out}) != len(out):
        raise SystemExit(f"{path}: worker ids must be unique")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m echo2.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool", required=True)
    p.add_argument("--rollouts-per-step", type=float, required=True, help="R = prompts per step x group size")
    p.add_argument("--train-step-s", type=float, required=True, help="learner compute per step, seconds")
    p.add_argument("--staleness", type=int, required=True, help="S")
    p.add_argument("--interval", type=int, default=1, help="κ, snapshot every this many steps (1 <= κ <= S+1)")
    p.add_argument("--snapshot-mb", type=float, required=True)
    p.add_argument("--learner-usd-per-hour", type=float, required=True)
    p.add_argument("--learner-uplink-mbit", type=float, required=True)
    p.add_argument("--broadcast", choices=sorted(capacity.TOPOLOGIES), default="pipelined",
                   help="the relay topology (broadcast.sender.topology: chain, tree, star; or the broadcast "
                        "option's name: pipelined = chain, one_to_many = star)")
    p.add_argument("--fanout", type=int, default=FANOUT, help="children per relaying peer, for --broadcast tree")
    p.add_argument("--load-s", type=float, default=0.0, help="seconds to apply a snapshot in the engine")
    p.add_argument("--batch-s", type=float, default=0.0, help="seconds of one worker batch")
    p.add_argument("--min-utilization", type=float, default=0.0, help="learner utilization floor (0..1)")
    p.add_argument("--solver", choices=SOLVERS, default="exact")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", help="write utilization-vs-throughput and cost-vs-S plots to this PNG")
    a = p.parse_args(argv)
    if a.staleness < 0:
        p.error(f"--staleness {a.staleness}: S must be >= 0 (0: on-policy)")
    if not 1 <= a.interval <= a.staleness + 1:
        p.error(f"--interval {a.interval} needs 1 <= κ <= S+1 (S={a.staleness})")
    workers = load_pool(a.pool)
    system = System(rollouts_per_step=a.rollouts_per_step, train_step_s=a.train_step_s, staleness=a.staleness,
                    interval=a.interval, snapshot_bytes=a.snapshot_mb * 1e6,
                    learner_usd_per_hour=a.learner_usd_per_hour, learner_uplink_mbit=a.learner_uplink_mbit,
                    broadcast=a.broadcast, fanout=a.fanout, load_s=a.load_s, batch_s=a.batch_s,
                    min_utilization=a.min_utilization)
    plan = solve(system, workers, a.solver)
    pred = plan.prediction
    out = {
        "feasible": pred.feasible and pred.utilization >= max(a.min_utilization, 1e-9),
        "keeps_learner_busy": pred.feasible,
        "required_rollouts_per_s": pred.required_rollouts_per_s if math.isfinite(pred.required_rollouts_per_s)
        else None,
        "paper_required_rollouts_per_s": _finite(capacity.paper_required_rate(
            a.rollouts_per_step, a.train_step_s, a.interval, plan.bcast_s)),
        "active": list(plan.active), "aggregate_rollouts_per_s": pred.aggregate_rollouts_per_s,
        "usd_per_hour": plan.usd_per_hour, "usd_per_step": plan.usd_per_step,
        "predicted_utilization": pred.utilization, "step_s": pred.step_s, "bcast_s": plan.bcast_s,
        "solver": a.solver, "broadcast": a.broadcast,
    }
    if a.plot:
        plot(system, workers, a.solver, a.plot)
        out["plot"] = a.plot
    if a.json:
        print(json.dumps(out))
        return
    print(f"{a.solver} plan, {a.broadcast} broadcast, S={a.staleness}, κ={a.interval}: "
          f"{len(plan.active)} of {len(workers)} workers active")
    print(f"  active: {', '.join(plan.active) or '-'}")
    print(f"  aggregate {pred.aggregate_rollouts_per_s:.1f} rollouts/s; required to keep the learner busy: "
          f"{'infeasible at this S/κ (the learner must wait)' if not pred.feasible else f'{pred.required_rollouts_per_s:.1f}'}"
          f" (paper's rule: {_fmt(out['paper_required_rollouts_per_s'])})")
    print(f"  dissemination {plan.bcast_s:.1f} s; step {pred.step_s:.1f} s; learner utilization {pred.utilization:.2f}")
    print(f"  ${plan.usd_per_hour:.2f}/h in all, ${plan.usd_per_step:.4f} per learner step")
    if a.plot:
        print(f"  plots: {a.plot}")


def _fmt(x: float | None) -> str:
    return "infeasible" if x is None else f"{x:.1f}"


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def plot(system: System, workers: list[Worker], solver: str, path: str) -> None:
    import dataclasses

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    mus = [system.rollouts_per_step / system.train_step_s * f for f in [x / 20 for x in range(1, 61)]]
    bcast = capacity.bcast_time_s(system.broadcast, system.snapshot_bytes, system.learner_uplink_mbit,
                                  len(workers), min(w.down_mbit for w in workers), min(w.up_mbit for w in workers),
                                  max(w.rtt_ms for w in workers), system.fanout)
    for S in sorted({0, 1, 2, 4, 8, system.staleness}):
        u = system.train_step_s / capacity.mean_step_s(system.rollouts_per_step, system.train_step_s, S, 1, bcast,
                                                       system.load_s + system.batch_s, mus)
        ax1.plot(mus, u, label=f"S={S}")
    ax1.set(xlabel="aggregate rollouts/s", ylabel="predicted learner utilization",
            title=f"{system.broadcast}, T_bcast {bcast:.0f} s (all workers)")
    ax1.legend()
    Ss = list(range(0, 11))
    costs = [solve(dataclasses.replace(system, staleness=S, interval=1), workers, solver).usd_per_step for S in Ss]
    ax2.plot(Ss, costs, marker="o")
    ax2.set(xlabel="staleness S (κ = 1)", ylabel="$ per learner step", title=f"{solver} activation")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
