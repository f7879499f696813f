"""Reward curves of finished runs, as a table: mean reward per tenth of the run, last-20 mean, eval accuracy.

    python benchmarks/curves.py multirun/2026-11-30/05-00-00/*/
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(run_dir: Path) -> str:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    rewards = [r["reward/mean"] for r in records]
    n = len(rewards)
    tenths = [rewards[i * n // 10 : (i + 1) * n // 10] for i in range(10)]
    curve = " ".join(f"{sum(t) / len(t):.2f}" for t in tenths if t)
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = " ".join(f"{a:.2f}" for a in summary["eval_accuracy_by_step"].values())
    seconds = records[-1]["time_s"] / n
    return f"| {run_dir.name} | {n} | {seconds:.3f} | {curve} | {summary['reward_last20_mean']:.3f} | {evals} |"


def main() -> None:
    print("| run | steps | s/step | reward by tenth of the run | last-20 mean | eval accuracy (each eval) |")
    print("|---|---|---|---|---|---|")
    for arg in sys.argv[1:]:
        print(row(Path(arg)))


if __name__ == "__main__":
    main()
