"""Does a busy coordinator slow the learner? Learner step time with the coordinator idle against serving load,
for the coordinator as threads of the learner's process (how it once ran) and in its own process (how it runs).

The learner is the sync source's (its steps are pure learner work, no waiting), pinned to core 0. A separate
load process plays ``--clients`` workers doing pull + push of valid results over loopback (HTTP, JSON,
validation and reward scoring on the coordinator's side); it and, in ``process`` mode, the coordinator sit on
core 1, as remote workers and a spare core of the learner host would. Within ONE training run per mode the
load is switched on and off (SIGCONT / SIGSTOP) every ``--window`` steps, and the first steps after each switch
are discarded: idle and busy steps are paired in time, because step times on these shared VMs jump between
runs (measured: 0.034 vs 0.052 s/step medians for identical runs) far more than within one.

    python benchmarks/coordinator_load.py --rate 3500     # paced to what this learner consumes
    python benchmarks/coordinator_load.py                 # unpaced: as fast as the clients can go
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def load_client(url: str, token: str, seconds: float, threads: int, rate: float) -> None:
    """Worker impersonators: register, then pull and push valid groups, as fast as possible (rate 0) or paced
    to ``rate`` rollouts/s in all."""
    from echo2.net.http import Client

    def loop():
        c = Client(url, token)
        wid = c.post("/register", {"engine": "load"})["worker_id"]
        end = time.monotonic() + seconds
        allowance, last = 0.0, time.monotonic()  # token bucket, at most 0.1 s of backlog (no burst after SIGCONT)
        while time.monotonic() < end:
            if rate:
                now = time.monotonic()
                allowance = min(allowance + (now - last) * rate / threads, 0.1 * rate / threads)
                last = now
                if allowance < 0:
                    time.sleep(0.005)
                    continue
            work = c.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 4})["work"]
            results = [{"group_id": w["group_id"], "version": 0, "completions": [
                {"token_ids": [5, 1], "logprobs": [-1.0, -0.5], "finish_reason": "stop"}] * 8} for w in work]
            if results:
                c.post("/push", {"worker_id": wid, "results": results})
                allowance -= 8 * len(results)

    ts = [threading.Thread(target=loop) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def ping_pong() -> None:
    """The control load: two threads bouncing 2 kB over a loopback TCP connection as fast as they can, with no
    coordinator anywhere. What it costs the learner is what any busy neighbour core costs on this machine."""
    import socket

    srv = socket.create_server(("127.0.0.1", 0))

    def echo():
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(65536):
            conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    s = socket.create_connection(srv.getsockname())
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"x" * 2048
    while True:
        s.sendall(msg)
        got = 0
        while got < len(msg):
            got += len(s.recv(65536))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--window", type=int, default=20, help="steps per load-on / load-off window")
    p.add_argument("--clients", type=int, default=2, help="client threads in the load process")
    p.add_argument("--rate", type=float, default=0.0, help="rollouts/s the clients push in all (0: as fast as possible)")
    p.add_argument("--modes", nargs="+", default=["threads", "process", "neighbour"],
                   choices=["threads", "process", "neighbour"],
                   help="where the coordinator runs; neighbour: no coordinator, a loopback ping-pong on core 1")
    p.add_argument("--ping-pong", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: run as the load process
    p.add_argument("--token", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ping_pong:
        ping_pong()
        return
    if args.client:
        load_client(args.client, args.token, args.seconds, args.clients, args.rate)
        return

    from transformers import AutoTokenizer, TrainerCallback

    import train
    from echo2.env import configure_process
    from echo2.models.tiny import build_tiny
    from echo2.coordinator.coordinator import Coordinator
    from echo2.scoring import Scorer
    from echo2.learner.sources.coordinator_process import CoordinatorProcess
    from echo2.settings import CoordinatorSettings
    from echo2.tasks.arith import ArithTask
    from step_time import StepTimer, compose

    configure_process()
    learner_core, side_core = 0, (1 if (os.cpu_count() or 1) > 1 else 0)
    os.sched_setaffinity(0, {learner_core})
    cfg = compose(["rollout=sync", f"run.steps={args.steps}", "run.wandb=disabled", "run.progress=false",
                   "run.eval_every_steps=0"])
    task, tok = ArithTask(level="copy"), AutoTokenizer.from_pretrained(build_tiny())
    # A cap that never binds (P huge): the clients always get work, so the load is steady.
    settings = CoordinatorSettings(token="bench", staleness=0, prompts_per_step=10**7, group_size=8,
                                   vocab_size=len(tok), long_poll_s=0.0, heartbeat_timeout_s=3600.0,
                                   sampling={"max_tokens": 2, "temperature": 1.0, "top_p": 1.0, "top_k": 0})
    settle_steps = 2

    class Switch(TrainerCallback):
        """Load on in odd windows, off in even ones; remembers each step's state."""

        def __init__(self, load):
            self.load, self.states, self.busy = load, [], False

        def on_step_end(self, args_, state, control, **kw):
            step = state.global_step  # the step that just ended ran under self.busy
            self.states.append("busy" if self.busy else "idle")
            busy = (step // args.window) % 2 == 1
            if busy != self.busy:
                os.kill(self.load.pid, signal.SIGCONT if busy else signal.SIGSTOP)
                self.busy = busy

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            coord = None
            if mode == "neighbour":
                received = lambda: 0.0  # noqa: E731
                cmd = [sys.executable, __file__, "--ping-pong"]
            elif mode == "threads":
                coord = Coordinator(task.train_dataset(), Scorer(task, tok), tok, settings).start()
                received = lambda: coord.ledger.rollouts["received"]  # noqa: E731
            else:
                coord = CoordinatorProcess(task=task, tokenizer=tok, settings=replace(settings, broadcaster={
                    "_target_": "echo2.coordinator.broadcaster.RelayBroadcaster"}))
                for tid in os.listdir(f"/proc/{coord.proc.pid}/task"):  # every thread; new ones inherit
                    os.sched_setaffinity(int(tid), {side_core})
                received = lambda: coord.metrics()["rollout/received"]  # noqa: E731
            if coord is not None:
                cmd = [sys.executable, __file__, "--client", coord.url, "--token", "bench", "--seconds", "3600",
                       "--clients", str(args.clients), "--rate", str(args.rate)]
            load = subprocess.Popen(cmd, preexec_fn=lambda: os.sched_setaffinity(0, {side_core}))
            time.sleep(3)  # clients registered and in their loop
            os.kill(load.pid, signal.SIGSTOP)
            trainer, source, _ = train.build(cfg, f"{tmp}/{mode}", rank=0, world_size=1)
            timer, switch = StepTimer(), Switch(load)
            trainer.add_callback(timer.callback)
            trainer.add_callback(switch)
            before, busy_s = received(), 0.0
            trainer.train()
            source.close()
            times = {"idle": [], "busy": []}
            for i, (t, st) in enumerate(zip(timer.steps, switch.states)):
                if i % args.window >= settle_steps and i >= args.window:  # skip warm-up and each switch's tail
                    times[st].append(t)
                busy_s += t if st == "busy" else 0.0
            rate = (received() - before) / busy_s
            load.kill()
            load.wait()
            if coord is not None:
                coord.close()
            idle, busy = (statistics.median(times[k]) for k in ("idle", "busy"))
            rows.append((mode, idle, busy, statistics.quantiles(times["busy"], n=10)[-1], rate,
                         len(times["idle"]), len(times["busy"])))
    print(f"\nlearner step time (sync source, tiny model, 128 rollouts/step), one {args.steps}-step run per mode, "
          f"load on/off every {args.window} steps; load = {args.clients} client threads in another process, "
          f"{'unpaced' if not args.rate else f'paced to {args.rate:.0f} rollouts/s'}; learner on core {learner_core}")
    print(f"{'coordinator':<11} {'idle s/step':>11} {'busy s/step':>11} {'busy/idle':>9} {'busy p90':>9} "
          f"{'rollouts/s served':>17} {'steps idle/busy':>15}")
    for mode, idle, busy, p90, rate, n_idle, n_busy in rows:
        print(f"{mode:<11} {idle:>11.4f} {busy:>11.4f} {busy / idle:>9.3f} {p90:>9.4f} {rate:>17.0f} "
              f"{f'{n_idle}/{n_busy}':>15}")


if __name__ == "__main__":
    main()
