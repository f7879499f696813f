"""Synchronous on-policy GRPO against asynchronous rollouts with staleness S, same model, task and machine.

Each configuration is a real ``train.py`` run (a subprocess): the learner is pinned to one core
(``taskset -c LEARNER_CORE``); in the asynchronous runs one worker agent with its vLLM server, and the
coordinator's process, are pinned to another (``pool.cores``, ``rollout.source.coordinator_cores``). The sync baseline generates inside the learner, on the learner's core.

Reported per run, all from the run's own ``metrics.jsonl`` / ``summary.json``:
  * steps/s and seconds to a reward threshold (10-step moving mean), counted from the end of step 1 so that
    worker start-up (vLLM loads in ~30 s) is not charged to the asynchronous runs;
  * learner utilization over steps 2..N: 1 - (time waiting for or generating rollouts) / wall time;
  * the fraction of generated rollouts dropped as too stale;
  * the overlap bound, from the sync run: T_gen (its generation time per step) and T_train (the rest of its
    step); overlapping them perfectly gives (T_gen + T_train) / T_train times the sync steps/s. Each async
    run's speed-up over sync is reported as a fraction of that bound.

    python benchmarks/async_vs_sync.py                       # sync, S=0,1,2,4; copy task, 150 steps
    python benchmarks/async_vs_sync.py --staleness 0 2 --steps 100 --json out.json
    python benchmarks/async_vs_sync.py --staleness 1 2 --steps 60 -- experiment=gen_heavy   # generation-heavy
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(name: str, overrides: list[str], out_dir: Path, learner_core: int, threshold: float) -> dict:
    run_dir = out_dir / name
    cmd = ["taskset", "-c", str(learner_core), sys.executable, "train.py", f"hydra.run.dir={run_dir}",
           "run.wandb=disabled", "run.progress=false", "run.eval_every_steps=0", *overrides]
    print(f"[{name}] {' '.join(cmd[3:])}", flush=True)
    with open(out_dir / f"{name}.log", "w") as log:
        if subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"[{name}] failed; its output:\n{(out_dir / f'{name}.log').read_text()[-3000:]}")
    return summarise(name, run_dir, threshold)


def summarise(name: str, run_dir: Path, threshold: float = 0.8, window: int = 10) -> dict:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    summary = json.loads((run_dir / "summary.json").read_text())
    t1 = records[0]["time_s"]
    steady = records[1:]
    wall = records[-1]["time_s"] - t1
    idle = sum(r["train/learner_idle_s"] for r in steady)
    rewards = [r["reward/mean"] for r in records]
    reached = next((i for i in range(window - 1, len(rewards))
                    if sum(rewards[i - window + 1 : i + 1]) / window >= threshold), None)
    acc = summary["rollout_accounting"]
    gen = [r["rollout/generate_s"] for r in steady if r.get("rollout/generate_s") is not None]
    return {
        "run": name,
        "steps": len(records),
        "steps_per_s": len(steady) / wall,
        "s_to_threshold": None if reached is None else records[reached]["time_s"] - t1,
        "step_at_threshold": None if reached is None else records[reached]["step"],
        "utilization": 1 - idle / wall,
        "dropped_stale_frac": acc["dropped"].get("stale", 0) / max(acc["received"], 1),
        "staleness_mean": sum(r["buffer/staleness_mean"] for r in records) / len(records),
        "reward_last20": sum(rewards[-20:]) / 20,
        # sync only: generation time per step (in the learner's process), the rest of the step is training
        "t_gen_s": sum(gen) / len(gen) if gen else None,
        "t_step_s": wall / len(steady),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--learner-core", type=int, default=0)
    p.add_argument("--worker-core", type=int, default=1)
    p.add_argument("--engine", default="vllm", help="worker engine (vllm, hf)")
    p.add_argument("--threshold", type=float, default=0.8, help="the reward to time (10-step mean)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("overrides", nargs="*", help="extra hydra overrides for every run")
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs 2 cores: one for the learner, one for the worker")
    common = [f"run.steps={args.steps}", *args.overrides]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(run("sync", ["rollout=sync", *common], Path(tmp), args.learner_core, args.threshold))
        for s in args.staleness:
            interval = max(1, s)  # κ = S for S >= 1 (the paper's κ = S - 1 would be 0 at S = 1)
            rows.append(run(f"async_S{s}", [
                "rollout=async", f"rollout.staleness={s}", f"broadcast.interval={interval}", "pool.workers=1",
                f"pool.cores=[{args.worker_core}]", f"rollout.source.coordinator_cores=[{args.worker_core}]",
                f"pool.engine={args.engine}", *common], Path(tmp),
                args.learner_core, args.threshold))
    base = rows[0]
    t_gen = base["t_gen_s"]
    t_train = base["t_step_s"] - t_gen
    bound = base["t_step_s"] / t_train
    print(f"\nsync vs async, {args.steps} steps, learner on core {args.learner_core}, "
          f"1 {args.engine} worker on core {args.worker_core}; threshold: 10-step mean reward >= {args.threshold}")
    print(f"sync run: T_gen {t_gen:.3f} s + T_train {t_train:.3f} s per step; overlap bound "
          f"(T_gen + T_train) / T_train = {bound:.2f}x sync")
    print(f"{'run':<12} {'steps/s':>8} {'x sync':>7} {'of bound':>8} {'s to thr':>9} {'step':>5} {'util':>6} "
          f"{'stale drop':>10} {'lag mean':>8} {'reward last20':>13}")
    for r in rows:
        thr = "-" if r["s_to_threshold"] is None else f"{r['s_to_threshold']:.1f}"
        step = "-" if r["step_at_threshold"] is None else str(r["step_at_threshold"])
        speedup = r["steps_per_s"] / base["steps_per_s"]
        print(f"{r['run']:<12} {r['steps_per_s']:>8.2f} {speedup:>7.2f} {speedup / bound:>8.2f} {thr:>9} "
              f"{step:>5} {r['utilization']:>6.2f} {r['dropped_stale_frac']:>10.3f} {r['staleness_mean']:>8.2f} "
              f"{r['reward_last20']:>13.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
