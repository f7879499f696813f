"""Rollout checks on real runs: is a forging worker caught, and are honest workers left alone, at S = 0, 1, 2, 4?

Each S is one real ``train.py`` run (a subprocess): two honest local hf worker agents, and, from the moment the
coordinator answers, a forging worker agent in this process with its own worker credential that pushes random
tokens claiming logprob -0.05 each (what a worker that skips generation would send); it applies snapshots like
any agent, so that it claims only versions it was delivered. The learner scores every batch
(``rollout.source.check_every_steps=1``). Reported per run: whether the forger was retired as untrusted, the
forged rollouts received before that less those dropped when it was (an upper bound on what was trained on),
the honest workers flagged or retired (false alarms), and
every credential's mean per-token |log-ratio| (the learner's logprob, under the version the worker claims, minus
the reported logprob) from ``metrics.jsonl``.

    python benchmarks/rollout_checks.py                      # S = 0 1 2 4, 40 steps each
    python benchmarks/rollout_checks.py --staleness 2 --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo2.worker.engines.hf import HFWorkerEngine  # noqa: E402
from echo2.records import Completion  # noqa: E402
from echo2.net.http import Client, RemoteError, worker_credential  # noqa: E402


class ForgingEngine(HFWorkerEngine):
    """What a worker that skips generation runs: a real transformers model for applying snapshots and scoring the
    probe (so that it claims only versions it was delivered, as the coordinator requires), and random tokens
    claiming logprob -0.05 each for every completion."""

    name = "forging"

    def __init__(self, model: str, vocab: int):
        super().__init__(model)
        self.vocab, self.rng = vocab, random.Random(0)

    def generate(self, prompt_ids, params):
        return [[Completion([self.rng.randrange(self.vocab)] * 2, [-0.05, -0.05], "length") for _ in range(params.n)]
                for _ in prompt_ids]


def forge(url: str, secret: str, model: str, vocab: int, stop: threading.Event, out: dict, run_dir: Path) -> None:
    """Join as 'forger' once the coordinator answers (a worker agent claiming the run's own model and context, read
    from its coordinator.json, as a hostile client would), with a forging engine, until refused or stopped."""
    from echo2.worker.agent import Agent

    while not stop.is_set():
        try:
            found = json.loads((run_dir / "coordinator.json").read_text())
            Client(url, secret, timeout_s=2).post("/heartbeat", {"worker_id": "-"})
        except RemoteError:  # up: it answered (an unknown worker, as expected)
            break
        except (OSError, ValueError):  # not up yet (no file, a half-written one, no server)
            time.sleep(0.5)
    if stop.is_set():
        return
    claims = {"model": {k: found["model"][k] for k in ("name", "digest")}, "max_model_len": found["max_model_len"]}
    agent = Agent(url, worker_credential(secret, "forger"), ForgingEngine(model, vocab), declared=claims, stop=stop)
    try:
        agent.run()
    except BaseException as e:  # retired and revoked: refused
        out["refused"] = str(e)
    finally:
        out["wid"] = agent.worker_id
        agent.receiver.close()


def run(staleness: int, steps: int, out_dir: Path, port: int) -> dict:
    from transformers import AutoTokenizer

    from echo2.models.tiny import build_tiny

    model = build_tiny()
    secret = secrets.token_urlsafe(16)
    run_dir = out_dir / f"S{staleness}"
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", "run.wandb=disabled", "run.progress=false",
           "run.eval_every_steps=0", "run.save_every_steps=0", f"run.steps={steps}", "rollout=async", "pool=local",
           "pool.engine=hf", f"rollout.staleness={staleness}", f"broadcast.interval={max(1, staleness)}",
           f"rollout.source.port={port}", "rollout.source.check_every_steps=1", "rollout.source.min_workers=2"]
    stop, forged = threading.Event(), {}
    vocab = len(AutoTokenizer.from_pretrained(model))
    thread = threading.Thread(target=forge, args=(f"http://127.0.0.1:{port}", secret, model, vocab, stop, forged,
                                                  run_dir), daemon=True)
    thread.start()
    with open(out_dir / f"S{staleness}.log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env=dict(os.environ, ECHO2_TOKEN=secret)).returncode
    stop.set()
    thread.join(timeout=30)
    if code:
        sys.exit(f"S={staleness}: train.py failed; see {out_dir / f'S{staleness}.log'}")
    acc = json.loads((run_dir / "summary.json").read_text())["rollout_accounting"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ratios = {}  # per credential: 'forger', and '#w0', '#w1' for the local workers (the run secret's)
    for r in records:
        ratios.update({k.rsplit("/", 1)[1]: v for k, v in r.items() if k.startswith("rollout/check_abs_log_ratio/")})
    wid = forged.get("wid")
    coord_log = (run_dir / "coordinator.log").read_text()
    honest = [w.lstrip("#") for w in ratios if w != "forger"]
    return {"S": staleness, "forger": "forger", "forger_pushed_groups": acc["by_worker"].get(wid, 0) // 8,
            "forger_retired": f"worker {wid} retired as untrusted" in coord_log,
            # received from it, less what was dropped at retirement: trained on, or dropped as stale (an upper bound)
            "forged_consumed_at_most": acc["by_worker"].get(wid, 0) - acc["dropped"].get("untrusted", 0),
            "dropped_untrusted": acc["dropped"].get("untrusted", 0),
            "honest_flagged_or_retired": sum(f"worker {w} flagged" in coord_log or f"worker {w} retired as untrusted"
                                             in coord_log for w in honest),
            "log_ratio": ratios, "steps": len(records)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--port", type=int, default=29631)
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="echo2-checks-") as tmp:
        for s in args.staleness:
            rows.append(run(s, args.steps, Path(tmp), args.port))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'S':>2} {'forger retired':>14} {'forged trained <=':>17} {'dropped untrusted':>17} "
          f"{'honest false alarms':>19}  mean |log-ratio| per credential (* forger)")
    for r in rows:
        lr = ", ".join(f"{w}{'*' if w == r['forger'] else ''} {v:+.3f}" for w, v in sorted(r["log_ratio"].items()))
        print(f"{r['S']:>2} {str(r['forger_retired']):>14} {r['forged_consumed_at_most']:>17} "
              f"{r['dropped_untrusted']:>17} {r['honest_flagged_or_retired']:>19}  {lr}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
