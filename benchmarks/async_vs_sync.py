"""Synchronous on-policy GRPO against asynchronous rollouts with staleness S, same model, task and machine.

Each configuration is a real ``train.py`` run (a subprocess): the learner is pinned to one core
(``taskset -c LEARNER_CORE``); in the asynchronous runs one worker agent with its vLLM server, and the
coordinator's process, are pinned to another (``pool.cores``, ``rollout.source.coordinator_cores``). The sync
baseline generates inside the learner, on the learner's core.

Reported per run, all from the run's own ``metrics.jsonl`` / ``summary.json``:
  * steps/s and seconds to a reward threshold (10-step moving mean), counted from the end of step 1 so that
    worker start-up (vLLM loads in ~30 s) is not charged to the asynchronous runs;
  * learner utilization over steps 2..N: 1 - (time waiting for or generating rollouts) / wall time;
  * the fraction of generated rollouts dropped as too stale;
  * the overlap bound, from the sync run: T_gen (its generation time per step) and T_train (the rest of its
    step); overlapping them perfectly gives (T_gen + T_train) / T_train times the sync steps/s. Each async
    run's speed-up over sync is reported as a fraction of that bound;
  * with --neighbour-load, one more sync run with a memory-streaming process on the worker's core: on a machine
    whose cores share a cache, a busy neighbour slows training, and T_gen + T_train over that slower T_train is
    the bound an async run with its worker on the same machine can reach.

    python benchmarks/async_vs_sync.py                       # sync, S=0,1,2,4; copy task, 150 steps
    python benchmarks/async_vs_sync.py --staleness 0 2 --steps 100 --json out.json
    python benchmarks/async_vs_sync.py --staleness 1 2 --steps 60 -- experiment=gen_heavy   # generation-heavy
    python benchmarks/async_vs_sync.py --staleness 1 2 --steps 30 --repeats 3 -- experiment=gen_heavy
    python benchmarks/async_vs_sync.py --staleness 1 2 --steps 30 --neighbour-load -- experiment=gen_heavy
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# A neighbour that streams through memory (a 64 MiB array, twice this machine's L3), until killed.
STREAM = "import numpy as np\na = np.ones(2**24, dtype=np.float32)\nwhile True: a += 1.0"


def run(name: str, overrides: list[str], out_dir: Path, learner_core: int, threshold: float, tag: str = "",
        load_core: int | None = None) -> dict:
    run_dir = out_dir / f"{tag}{name}"
    cmd = ["taskset", "-c", str(learner_core), sys.executable, "train.py", f"hydra.run.dir={run_dir}",
           "run.wandb=disabled", "run.progress=false", "run.eval_every_steps=0", *overrides]
    print(f"[{name}] {' '.join(cmd[3:])}" + ("" if load_core is None else f"  (load on core {load_core})"),
          flush=True)
    log_path = out_dir / f"{tag}{name}.log"
    load = None if load_core is None else subprocess.Popen(["taskset", "-c", str(load_core), sys.executable, "-c",
                                                            STREAM])
    try:
        with open(log_path, "w") as log:
            failed = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    finally:
        if load is not None:
            load.kill()
            load.wait()
    if failed:
        sys.exit(f"[{name}] failed; its output:\n{log_path.read_text()[-3000:]}")
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
        # the learner's busy time per step (its step minus its wait for rollouts; in sync runs that wait is
        # generation): slower in async runs when the worker's generation on the other core contends for cache
        "t_train_s": (wall - idle) / len(steady),
        "completion_len": sum(r["rollout/completion_len_mean"] for r in steady) / len(steady),
    }


def async_overrides(s: int, worker_core: int, engine: str) -> list[str]:
    interval = max(1, s)  # κ = S for S >= 1 (the paper's κ = S - 1 would be 0 at S = 1)
    return ["rollout=async", f"rollout.staleness={s}", f"broadcast.interval={interval}", "pool.workers=1",
            f"pool.cores=[{worker_core}]", f"rollout.source.coordinator_cores=[{worker_core}]", f"pool.engine={engine}"]


def print_round(rows: list[dict], label: str) -> dict:
    """One round's table; each async run against this round's own sync run and overlap bound."""
    base = next(r for r in rows if r["run"] == "sync")
    t_gen = base["t_gen_s"]
    t_train = base["t_step_s"] - t_gen
    bound = base["t_step_s"] / t_train
    print(f"\n{label}sync run: T_gen {t_gen:.3f} s + T_train {t_train:.3f} s per step; overlap bound "
          f"(T_gen + T_train) / T_train = {bound:.2f}x sync")
    loaded = next((r for r in rows if r["run"] == "sync_load"), None)
    loaded_bound = base["t_step_s"] / loaded["t_train_s"] if loaded else None
    if loaded:
        print(f"sync run with a memory-streaming neighbour: T_train {loaded['t_train_s']:.3f} s "
              f"({loaded['t_train_s'] / t_train - 1:+.0%}); bound with that slowdown {loaded_bound:.2f}x sync")
    print(f"{'run':<12} {'steps/s':>8} {'x sync':>7} {'of bound':>8} {'of loaded':>9} {'s to thr':>9} {'step':>5} "
          f"{'util':>6} {'train s':>7} {'len':>5} {'stale drop':>10} {'lag mean':>8} {'reward last20':>13}")
    for r in rows:
        thr = "-" if r["s_to_threshold"] is None else f"{r['s_to_threshold']:.1f}"
        step = "-" if r["step_at_threshold"] is None else str(r["step_at_threshold"])
        r["x_sync"] = r["steps_per_s"] / base["steps_per_s"]
        r["of_bound"] = r["x_sync"] / bound
        r["of_loaded_bound"] = r["x_sync"] / loaded_bound if loaded else None
        of_loaded = "-" if r["of_loaded_bound"] is None else f"{r['of_loaded_bound']:.2f}"
        print(f"{r['run']:<12} {r['steps_per_s']:>8.2f} {r['x_sync']:>7.2f} {r['of_bound']:>8.2f} {of_loaded:>9} "
              f"{thr:>9} {step:>5} {r['utilization']:>6.2f} {r['t_train_s']:>7.3f} {r['completion_len']:>5.1f} "
              f"{r['dropped_stale_frac']:>10.3f} {r['staleness_mean']:>8.2f} {r['reward_last20']:>13.3f}")
    return {"t_gen_s": t_gen, "t_train_s": t_train, "bound": bound, "loaded_bound": loaded_bound}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of (sync, then each S); the order reverses every other round, and each async run is "
                        "compared with its own round's sync run (the machine's speed drifts between rounds)")
    p.add_argument("--neighbour-load", action="store_true",
                   help="also run sync with a memory-streaming process on the worker's core (see above)")
    p.add_argument("--learner-core", type=int, default=0)
    p.add_argument("--worker-core", type=int, default=1)
    p.add_argument("--engine", default="vllm", help="worker engine (vllm, hf)")
    p.add_argument("--threshold", type=float, default=0.8, help="the reward to time (10-step mean)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("overrides", nargs="*", help="extra hydra overrides for every run")
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs 2 cores: one for the learner, one for the worker")
    if args.repeats < 1:
        sys.exit("--repeats must be at least 1")
    common = [f"run.steps={args.steps}", *args.overrides]
    plan = [("sync", ["rollout=sync"], None)]
    if args.neighbour_load:
        plan.append(("sync_load", ["rollout=sync"], args.worker_core))
    plan += [(f"async_S{s}", async_overrides(s, args.worker_core, args.engine), None) for s in args.staleness]
    names = [name for name, _, _ in plan]
    print(f"sync vs async, {args.steps} steps, learner on core {args.learner_core}, "
          f"1 {args.engine} worker on core {args.worker_core}; threshold: 10-step mean reward >= {args.threshold}")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):  # each round's table as soon as it is done
            order = plan if k % 2 == 0 else plan[::-1]
            rows = sorted((run(name, [*extra, *common], Path(tmp), args.learner_core, args.threshold, tag=f"r{k}_",
                               load_core=load) for name, extra, load in order),
                          key=lambda r: names.index(r["run"]))
            label = f"round {k + 1} of {args.repeats}: " if args.repeats > 1 else ""
            out.append({"round": k + 1, **print_round(rows, label), "rows": rows})
    if args.repeats > 1:
        print(f"\nmedian over {args.repeats} rounds (each against its own round's sync run):")
        print(f"{'run':<12} {'x sync':>7} {'of bound':>8} {'of loaded bound':>15}   per round (of bound)")
        for name in names[1:]:
            mine = [next(r for r in o["rows"] if r["run"] == name) for o in out]
            fracs = [r["of_bound"] for r in mine]
            lb = "-" if not args.neighbour_load else f"{statistics.median(r['of_loaded_bound'] for r in mine):.2f}"
            print(f"{name:<12} {statistics.median(r['x_sync'] for r in mine):>7.2f} {statistics.median(fracs):>8.2f} "
                  f"{lb:>15}   {', '.join(f'{f:.2f}' for f in fracs)}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
