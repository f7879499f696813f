"""Soak: a real run (learner + coordinator + N worker agents, tiny model, hf engines) under random faults.

    python benchmarks/soak.py --minutes 12 --workers 3 --calm-minutes 2 [--out DIR] [--json]

First a calm phase (no faults: the baseline, in the same run), then a fault phase in which, every few seconds
(--every-s, uniform), one of these happens to a random target:

    worker_kill      kill -9 a worker agent; a replacement is started at once (a preempted box, re-rented)
    worker_stall     SIGSTOP a worker for 1-8 s, then SIGCONT (past the 3 s heartbeat timeout it is declared
                     dead and must register again)
    coordinator_kill kill -9 the coordinator process (at most every --coordinator-every-s); the learner starts a
                     new one from the journal, the workers reconnect

At the end the learner is stopped with SIGTERM (it finishes its step and writes summary.json). Reported: learner
steps/s and utilization in each phase (ratio fault/calm), drops and losses by reason, time to recover from each
fault kind, and whether the rollout books balance (every dispatched rollout consumed, dropped or lost, with a
reason). Recovery is measured from the coordinator's GET /status, polled every 0.2 s:
    worker_kill       kill      -> the replacement has delivered rollouts
    worker_stall      SIGCONT   -> the stopped agent (under its old or a new worker id) has delivered again
    coordinator_kill  kill      -> the new coordinator answers, every agent not stopped has registered with it,
                                   and the learner has completed a step
No new faults come in the last --drain-s seconds, so that every fault has time to recover.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HEARTBEAT_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Soak:
    def __init__(self, args):
        self.args, self.rng = args, random.Random(args.seed)
        self.out = Path(args.out or tempfile.mkdtemp(prefix="echo2-soak-"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.port, self.token = free_port(), "soak-" + os.urandom(8).hex()
        self.env = dict(os.environ, ECHO2_TOKEN=self.token, OMP_NUM_THREADS="1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers: list[subprocess.Popen] = []  # live agents (replaced on kill)
        self.all_procs: list[subprocess.Popen] = []
        self.events: list[dict] = []
        self.n_started = 0
        self.stopped: set = set()  # agents under SIGSTOP now (not killed, not stopped again meanwhile)

    # ------------------------------------------------------------------ processes

    def start_learner(self) -> None:
        cmd = [sys.executable, "train.py", "pool=static", f"rollout.source.port={self.port}",
               f"rollout.source.heartbeat_timeout_s={HEARTBEAT_S}", "rollout.source.coordinator_restarts=1000",
               "run.steps=1000000", "run.save_every_steps=0",
               "run.eval_every_steps=0", "run.progress=false", "run.wandb=disabled", f"hydra.run.dir={self.out}"]
        self.learner = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=open(self.out / "learner.out", "wb"),
                                        stderr=subprocess.STDOUT)

    def start_worker(self) -> subprocess.Popen:
        i = self.n_started
        self.n_started += 1
        log = open(self.out / f"soak_worker{i}.log", "wb")
        p = subprocess.Popen([sys.executable, "-m", "echo2.worker", "--coordinator", self.url, "--engine", "hf",
                              "--model", self.model, "--reconnect-timeout-s", "120"], cwd=ROOT, env=self.env,
                             stdout=log, stderr=subprocess.STDOUT)
        p.log_path = self.out / f"soak_worker{i}.log"
        self.workers.append(p)
        self.all_procs.append(p)
        return p

    def worker_id(self, p) -> str | None:
        ids = re.findall(r"registered as (w\d+)", p.log_path.read_text(errors="replace"))
        return ids[-1] if ids else None

    def coordinator_pid(self) -> int | None:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != self.learner.pid:
                    continue
                if b"spawn_main" in (stat.parent / "cmdline").read_bytes():  # not the resource tracker
                    return int(stat.parent.name)
            except (OSError, ValueError, IndexError):
                continue
        return None

    def status(self) -> dict | None:
        try:
            r = requests.get(self.url + "/status", headers={"Authorization": f"Bearer {self.token}"}, timeout=1)
            return r.json() if r.status_code == 200 else None
        except requests.RequestException:
            return None

    def steps(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    # ------------------------------------------------------------------ faults

    def fault(self, now: float, last_coord: float) -> tuple[dict, float]:
        kinds = ["worker_kill", "worker_stall"]
        if now - last_coord >= self.args.coordinator_every_s:
            kinds.append("coordinator_kill")
        kind = self.rng.choice(kinds)
        ev = {"kind": kind, "t": now}
        if kind == "worker_kill":
            victim = self.rng.choice(self.workers)
            self.stopped.discard(victim)
            for other in self.events:  # a fault on this agent that it had not recovered from ends in its death
                if (other.get("proc") is victim or other.get("replacement") is victim) and "recover_s" not in other:
                    other["kind"] += "_then_killed"
            victim.kill()
            victim.wait()
            self.workers.remove(victim)
            ev["replacement"] = self.start_worker()
        elif kind == "worker_stall":
            stoppable = [w for w in self.workers if w not in self.stopped]
            if not stoppable:
                return {"kind": "skipped"}, last_coord
            victim = self.rng.choice(stoppable)
            secs = self.rng.uniform(1, 8)
            ev.update(proc=victim, stall_s=round(secs, 2), cont_at=now + secs)
            os.kill(victim.pid, signal.SIGSTOP)
            self.stopped.add(victim)
        else:
            pid = self.coordinator_pid()
            if pid is None:
                ev["kind"] = "skipped"
                return ev, last_coord
            os.kill(pid, signal.SIGKILL)
            ev["pid"], last_coord = pid, now
            ev["steps_before"] = len(self.steps())
        return ev, last_coord

    def recovered(self, ev: dict) -> bool:
        st = self.status()
        if st is None:
            return False
        if ev["kind"] == "worker_kill":
            wid = self.worker_id(ev["replacement"])
            return wid is not None and st["by_worker"].get(wid, 0) > 0
        if ev["kind"] == "worker_stall":
            if "before" not in ev:
                return False  # still stopped
            wid = self.worker_id(ev["proc"])
            old_id, old_n = ev["before"]
            return wid is not None and st["by_worker"].get(wid, 0) > (old_n if wid == old_id else 0)
        if ev["kind"] != "coordinator_kill":
            return False
        # the new coordinator serves every agent not under SIGSTOP, and the learner has stepped since
        return (st["registered"] >= self.args.workers - len(self.stopped)
                and len(self.steps()) > ev["steps_before"])

    # ------------------------------------------------------------------ the run

    def run(self) -> dict:
        from echo2.models.tiny import build_tiny

        self.model = build_tiny()
        self.start_learner()
        for _ in range(self.args.workers):
            self.start_worker()
        t_start = time.monotonic()
        while not self.steps():
            if self.learner.poll() is not None:
                raise SystemExit(f"learner exited: see {self.out / 'learner.out'}")
            time.sleep(0.5)
        calm_end = time.monotonic() + self.args.calm_minutes * 60
        while time.monotonic() < calm_end:
            time.sleep(1)
        phase_split = len(self.steps())
        end = time.monotonic() + (self.args.minutes - self.args.calm_minutes) * 60
        faults_end = end - self.args.drain_s  # then no new faults: every one has time to recover
        last_coord, pending = 0.0, []
        next_fault = time.monotonic() + self.rng.uniform(*self.args.every_s)
        while time.monotonic() < end or (pending and time.monotonic() < end + self.args.drain_s):
            now = time.monotonic()
            if self.learner.poll() is not None:
                raise SystemExit(f"learner exited during the soak: see {self.out / 'learner.out'}")
            for ev in pending:
                if ev["kind"] == "worker_stall" and "before" not in ev and now >= ev["cont_at"]:
                    os.kill(ev["proc"].pid, signal.SIGCONT)
                    self.stopped.discard(ev["proc"])
                    ev["t"] = time.monotonic()  # recovery counts from the continue
                    wid = self.worker_id(ev["proc"])
                    ev["before"] = (wid, (self.status() or {}).get("by_worker", {}).get(wid, 0))
            pending = [ev for ev in pending if not ev["kind"].endswith("_then_killed")]
            if now >= next_fault and now < faults_end:
                ev, last_coord = self.fault(now, last_coord)
                if ev["kind"] != "skipped":
                    pending.append(ev)
                    self.events.append(ev)
                next_fault = time.monotonic() + self.rng.uniform(*self.args.every_s)
            for ev in list(pending):
                if self.recovered(ev):
                    ev["recover_s"] = time.monotonic() - ev["t"]
                    pending.remove(ev)
            time.sleep(0.2)
        # stop: the learner finishes its step and writes summary.json; then the workers (cleanup)
        self.learner.send_signal(signal.SIGTERM)
        self.learner.wait(timeout=300)
        return self.report(phase_split, time.monotonic() - t_start, pending)

    def cleanup(self) -> None:
        """Whatever happened, leave no process of ours behind (by handle, never by name)."""
        from echo2.rollout.pool import terminate

        terminate([p for p in [getattr(self, "learner", None), *self.all_procs] if p is not None])

    def report(self, split: int, wall_s: float, unrecovered: list) -> dict:
        steps = self.steps()
        summary = json.loads((self.out / "summary.json").read_text())
        acc = summary["rollout_accounting"]
        settled = acc["consumed"] + sum(acc["dropped"].values()) + sum(acc["lost"].values())

        def phase(records, prev_idle, prev_t):
            if len(records) < 2:
                return {"steps": len(records)}
            dt = records[-1]["time_s"] - prev_t
            idle = sum(r["train/learner_idle_s"] for r in records)
            return {"steps": len(records), "steps_per_s": len(records) / dt, "utilization": 1 - idle / dt}

        calm, faulty = steps[1:split], steps[split:]
        phases = {"calm": phase(calm, 0, steps[0]["time_s"]),
                  "faults": phase(faulty, 0, steps[split - 1]["time_s"]) if faulty else {}}
        kinds = {}
        for ev in self.events:
            k = kinds.setdefault(ev["kind"], {"n": 0, "recover_s": []})
            k["n"] += 1
            if "recover_s" in ev:
                k["recover_s"].append(ev["recover_s"])
        for k in kinds.values():
            r = k.pop("recover_s")
            k.update(recovered=len(r), median_s=statistics.median(r) if r else None, max_s=max(r) if r else None)
        return {"out": str(self.out), "wall_s": wall_s, "steps": summary["steps"], "phases": phases,
                "ratio_steps_per_s": phases["faults"].get("steps_per_s", 0) / phases["calm"]["steps_per_s"],
                "faults": kinds, "unrecovered_at_end": len(unrecovered),
                "coordinator_restarts": acc.get("coordinator_restarts"), "dropped": acc["dropped"],
                "lost": acc["lost"], "results_refused": acc.get("results_refused"),
                "workers_retired": acc.get("workers_retired"), "dispatched": acc["dispatched"],
                "consumed": acc["consumed"], "books_balance": acc["dispatched"] == settled + acc["in_flight"]
                + acc["buffered"] and acc["in_flight"] == acc["buffered"] == 0}


def table(r: dict) -> str:
    lines = [f"soak: {r['wall_s'] / 60:.1f} min, {r['steps']} learner steps; run dir {r['out']}", "",
             "| phase | steps | steps/s | learner utilization |", "|---|---|---|---|"]
    for name, p in r["phases"].items():
        if p.get("steps_per_s"):
            lines.append(f"| {name} | {p['steps']} | {p['steps_per_s']:.2f} | {p['utilization']:.2f} |")
    lines += [f"\nsteps/s with faults / calm: {r['ratio_steps_per_s']:.2f}", "",
              "| fault | n | recovered | median recovery s | max s |", "|---|---|---|---|---|"]
    for kind, k in sorted(r["faults"].items()):
        med = f"{k['median_s']:.1f}" if k["median_s"] is not None else "-"
        mx = f"{k['max_s']:.1f}" if k["max_s"] is not None else "-"
        lines.append(f"| {kind} | {k['n']} | {k['recovered']} | {med} | {mx} |")
    lines.append(f"\nfaults not recovered from by the end: {r['unrecovered_at_end']}")
    lines += ["", f"dropped (rollouts): {r['dropped']}", f"lost (rollouts): {r['lost']}",
              f"results refused: {r['results_refused']}; workers retired: {r['workers_retired']}; "
              f"coordinator restarts: {r['coordinator_restarts']}",
              f"books balance (dispatched {r['dispatched']} = consumed {r['consumed']} + dropped + lost): "
              f"{r['books_balance']}"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=12, help="whole run, calm phase included")
    p.add_argument("--calm-minutes", type=float, default=2, help="the fault-free baseline at the start")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--every-s", type=float, nargs=2, default=(3.0, 8.0), help="gap between faults, uniform")
    p.add_argument("--coordinator-every-s", type=float, default=60.0, help="at most one coordinator kill per")
    p.add_argument("--drain-s", type=float, default=30.0, help="no new faults in the last this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="run dir (default: a temp dir)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    soak = Soak(args)
    try:
        result = soak.run()
    finally:
        soak.cleanup()
    print(json.dumps(result, indent=2) if args.json else table(result))
    if not result["books_balance"]:
        sys.exit("the rollout books do not balance")


if __name__ == "__main__":
    main()
