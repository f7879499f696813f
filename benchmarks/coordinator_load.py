"""Does a busy coordinator slow the learner? Learner step time with the coordinator idle against serving load.

The coordinator runs as threads in the learner's process (HTTP server, JSON parsing, validation, reward
scoring), so the question is how much its Python work takes from the learner through the GIL. The learner
here is the sync source's (its steps are pure learner work, no waiting); in the "busy" rounds a separate
process plays ``--clients`` workers hammering the coordinator with pull + push of valid results as fast as it
can over loopback. Rounds alternate idle / busy; the ratio of medians is the cost.

    python benchmarks/coordinator_load.py                 # 2 rounds x 60 steps, 2 client threads, unpaced
    python benchmarks/coordinator_load.py --rate 3500     # paced to what this learner consumes
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def load_client(url: str, token: str, seconds: float, threads: int, rate: float) -> None:
    """Worker impersonators: register, then pull and push valid groups, as fast as possible (rate 0) or paced
    to ``rate`` rollouts/s in all."""
    from echo2.rollout.wire import Client

    def loop():
        c = Client(url, token)
        wid = c.post("/register", {"engine": "load"})["worker_id"]
        start = time.monotonic()
        end, sent = start + seconds, 0
        while time.monotonic() < end:
            if rate and sent > rate / threads * (time.monotonic() - start):
                time.sleep(0.005)
                continue
            work = c.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 4})["work"]
            results = [{"group_id": w["group_id"], "version": 0, "completions": [
                {"token_ids": [5, 1], "logprobs": [-1.0, -0.5], "finish_reason": "stop"}] * 8} for w in work]
            if results:
                c.post("/push", {"worker_id": wid, "results": results})
                sent += 8 * len(results)

    ts = [threading.Thread(target=loop) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=2, help="client threads in the load process")
    p.add_argument("--rate", type=float, default=0.0, help="rollouts/s the clients push in all (0: as fast as possible)")
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: run as the load process
    p.add_argument("--token", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        load_client(args.client, args.token, args.seconds, args.clients, args.rate)
        return

    from transformers import AutoTokenizer

    from echo2.env import configure_process
    from echo2.models.tiny import build_tiny
    from echo2.rollout.coordinator import Coordinator
    from echo2.rollout.scoring import Scorer
    from echo2.tasks.arith import ArithTask
    from step_time import compose, run_echo2

    configure_process()
    cfg = compose(["rollout=sync", f"run.steps={args.steps}", "run.wandb=disabled", "run.progress=false",
                   "run.eval_every_steps=0"])
    task, tok = ArithTask(level="copy"), AutoTokenizer.from_pretrained(build_tiny())
    # A cap that never binds (P huge): the clients always get work, so the load is steady.
    coord = Coordinator(task.train_dataset(), Scorer(task, tok), tok, token="bench", staleness=0,
                        prompts_per_step=10**7, group_size=8, vocab_size=len(tok), long_poll_s=0.0,
                        sampling={"max_tokens": 2, "temperature": 1.0, "top_p": 1.0, "top_k": 0}).start()
    times: dict[str, list[float]] = {"idle": [], "busy": []}
    received = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            times["idle"] += run_echo2(cfg, f"{tmp}/idle{r}")[5:]
            before, t0 = coord.rollouts["received"], time.monotonic()
            load = subprocess.Popen([sys.executable, __file__, "--client", coord.url, "--token", "bench",
                                     "--seconds", "3600", "--clients", str(args.clients), "--rate", str(args.rate)])
            time.sleep(3)  # clients registered and in their loop
            times["busy"] += run_echo2(cfg, f"{tmp}/busy{r}")[5:]
            received.append((coord.rollouts["received"] - before) / (time.monotonic() - t0))
            load.terminate()
            load.wait()
    coord.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nlearner step time (sync source, tiny model, 128 rollouts/step), {args.rounds} rounds x "
          f"{args.steps - 5} steps; busy = {args.clients} client threads in another process, "
          f"{'unpaced' if not args.rate else f'paced to {args.rate:.0f} rollouts/s'}")
    print(f"{'coordinator':<12} {'median s/step':>14} {'p90':>8}")
    for k, v in times.items():
        print(f"{k:<12} {med[k]:>14.4f} {statistics.quantiles(v, n=10)[-1]:>8.4f}")
    print(f"coordinator served {statistics.mean(received):.0f} rollouts/s (validated and scored) while busy")
    print(f"ratio busy/idle (median): {med['busy'] / med['idle']:.3f}")


if __name__ == "__main__":
    main()
