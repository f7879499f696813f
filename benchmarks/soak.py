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

**--hostile**: a soak with hostile clients instead of faults (issue 27, item 4):

    python benchmarks/soak.py --hostile --minutes 10 --calm-minutes 2 --engine vllm --workers 1 [--json]

A real learner (train.py: tiny model, copy task, rollout=async with pool=static, TLS on over loopback, rollout
checks every --check-every-steps steps; with --model smollm2_135m, experiment=smollm2_arith's real model and
arithmetic questions instead, whose steps take seconds: its pace is judged over 120 s windows) and --workers honest
worker agents (`python -m echo2.worker`, each with its own credential, finding the learner through its run dir's
coordinator.json). The hostile clients are started after the learner's first step and idle until told to attack;
after a calm phase (--calm-minutes, from when they are all ready: the reference pace, same run), one client of each
kind in benchmarks/hostile.py attacks at once until the end: absurd declarations, a hoarding credential with many
ids, invalid results, version claims never delivered, fabricated completions, an outsider's floods and ~100
half-open connections (to the coordinator and to an honest worker's snapshot-control port), orders to a worker from
a worker, and a relay that accepts connections and never answers; then the second round's: groups slow to score (the
learner runs the copy task with a reward slow on one crafted answer, benchmarks/slow_task.py, --slow-reward-s a
completion: math-verify's limit), two Authorization headers on every route, GET /ca with a 16 MiB or chunked body,
connections trickling GET /ca, register/leave in a loop, the largest pushes at once, and a worker reading every
version from its sources slowly enough never to stall out (slow_relay_reader). The outsiders (outsider, ca_bomb, ca_trickler) connect
from 127.0.0.2-4: a host each, as the coordinator sees it (127.0.0.1, the learner host itself, is not capped per
address).

The rollout checks run with b = check_max_abs_log_ratio = 2 nats a token (the default). They score each worker's
tokens under the version it claims: scored with the learner's current weights, on the tiny model (learning rate
3e-3) a large learner step moved an honest worker's lagged tokens by ~1.1 nats each, the first short soak (b = 1
then) retired its only honest worker as untrusted and stalled, and a later CI run's short soak did at b = 2. The
forger's tokens are ~10 nats off. Every honest worker is checked for it all the same (flagged, retired, struck: a
failure).

Reported (and with --json as JSON): whether the run finished (the learner stopped by SIGTERM, summary.json written);
the learner's steps/s in --window-s windows of the hostile phase against the calm phase's (goal: every window >=
--pace-goal, 0.8), and with --loaded-minutes also against a loaded phase's (calm, with a process burning the cores the
hostile clients' own processes take here, --load-cores: what the attacks cost beyond their clients' CPU); the
coordinator process's memory (sampled every second: goal, the hostile phase's peak of its own heap, RssAnon, within
--memory-goal-mib, 64, of the calm phase's; the total, VmRSS, is reported too: it also holds
the snapshots mapped from the learner, a whole snapshot on a real model; their growth over calm is reported in
snapshots, slow_relay_reader's aim); per kind, what its client was told and
what the coordinator did (its metrics, summary.json's rollout_accounting, coordinator.log); what was trained on, by
credential (consumed.jsonl against the journal's received and distrusted groups: nothing of the forger after it was
retired, nothing of any other hostile kind at all; the forger's groups consumed in the unchecked steps before its
first checked batch are trained on, and counted); that no honest worker was flagged, retired, struck or benched;
whether the books balance (dispatched = consumed + dropped + lost); the cores each role used per phase, the trainer's
own (the learner's process) apart (everything shares this machine: on a real deployment the hostile clients' own CPU
is not the learner host's; --learner-core N, with ``--override 'rollout.source.coordinator_cores=[M]'``, gives the
trainer a core of its own, --workers-nice and --hostile-nice lower the others' priority, --clients-cpu-shares puts
the clients in one CPU cgroup); and any process
left behind (the soak is the child subreaper of everything it starts, so orphans are found). ``--report-only
RUN_DIR`` reports again on a finished run's directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
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
from collections import Counter
from pathlib import Path
from typing import Any

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
        return read_jsonl(self.out / "metrics.jsonl")

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
        from echo2.learner.sources.pool import terminate

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


# ---------------------------------------------------------------------- --hostile: a soak with hostile clients

HOSTILE_KINDS = ("absurd", "hoarder", "invalid", "liar", "forger", "outsider", "relay_orders", "hung_relay",
                 "slow_reward", "smuggler", "ca_bomb", "ca_trickler", "churner", "bulk_pusher", "slow_relay_reader")
OUTSIDERS = {"outsider": "127.0.0.2", "ca_bomb": "127.0.0.3", "ca_trickler": "127.0.0.4"}
"""The kinds with no credential, and the address each connects from: a host of its own, as the coordinator sees it
(capped per address, unlike 127.0.0.1, the learner host itself)."""
SLOW_REWARD = ("the learner runs benchmarks/slow_task.py (the copy task, or the real model's arithmetic questions; a "
               "group whose every completion is the end-of-sequence token twice, which no honest engine makes, costs "
               "ECHO2_SLOW_REWARD_S a completion, then scores 0): the slow_reward kind sends only those")
JOINED = re.compile(r"worker (w\d+) joined \(.*?(?:, credential '([^']+)')?\)$")


def become_subreaper() -> None:
    """Orphans of everything this process starts (an engine whose agent died) become its children, so that
    ``left_behind`` finds them (Linux: PR_SET_CHILD_SUBREAPER)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


def left_behind() -> list[dict]:
    """Live processes under this one (orphans included, see become_subreaper), after reaping dead orphans; each
    is killed (it is ours) and named in the result."""
    from echo2.env import descendants

    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    out = []
    for pid in sorted(descendants(os.getpid())):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append({"pid": pid, "cmd": cmd})
            os.kill(pid, signal.SIGKILL)
    return out


def kinds_of(args) -> tuple[str, ...]:
    """The hostile kinds this soak runs (--kinds; default every one)."""
    return tuple(getattr(args, "kinds", None) or HOSTILE_KINDS)


def coordinator_rss(learner_pid: int) -> dict[str, int] | None:
    """Resident bytes of the learner's coordinator process (its multiprocessing child: spawn_main on its command
    line): ``rss`` in all (VmRSS) and ``anon``, its own heap (RssAnon: what clients can make it hold; the rest is
    libraries and the snapshots it maps from the learner's memory files, paged in and out as they are served, which
    on a real model swings the total by a snapshot's size from one sample to the next); None if it is not running."""
    from echo2.env import descendants

    for pid in sorted(descendants(learner_pid)):
        try:
            if b"spawn_main" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = {line.split(":")[0]: int(line.split()[1]) << 10 for line in status.splitlines()
                  if line.startswith(("VmRSS:", "RssAnon:", "RssShmem:"))}
        return {"rss": fields.get("VmRSS"), "anon": fields.get("RssAnon"), "shmem": fields.get("RssShmem")}
    return None


def cpu_seconds(procs: dict[str, subprocess.Popen]) -> dict[str, dict[int, float]]:
    """CPU seconds (user + system) so far of every live process under each of ``procs`` (itself included)."""
    from echo2.env import descendants

    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for name, proc in procs.items():
        out[name] = {}
        for pid in {proc.pid, *descendants(proc.pid)}:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[name][pid] = (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                continue
    return out


def cpu_used(before: dict, after: dict, wall_s: float, trainer_pid: int | None = None) -> dict[str, float]:
    """Cores used between two cpu_seconds snapshots, by role: the learner (with its coordinator and reward
    processes), of which the trainer (the learner's own process, ``trainer_pid``: the training step), the honest
    workers (with their engines), the hostile clients; and the whole machine's cores."""
    roles = {"learner": ["learner"], "honest": [n for n in after if n.startswith("honest")],
             "hostile": [n for n in after if n in HOSTILE_KINDS], "load": [n for n in after if n == "load"]}
    used = {role: round(sum(cpu - before.get(n, {}).get(pid, 0.0)
                            for n in names for pid, cpu in after.get(n, {}).items()) / wall_s, 2)
            for role, names in roles.items()}
    if trainer_pid is not None and trainer_pid in after.get("learner", {}):
        used["trainer"] = round((after["learner"][trainer_pid] - before.get("learner", {}).get(trainer_pid, 0.0))
                                / wall_s, 2)
    return {**used, "machine_cores": os.cpu_count()}


class HostileSoak:
    def __init__(self, args):
        from echo2.credential import worker_credential

        self.args = args
        self.out = Path(args.out or tempfile.mkdtemp(prefix="echo2-hostile-soak-"))
        (self.out / "hostile").mkdir(parents=True, exist_ok=True)
        self.secret = "soak-" + os.urandom(8).hex()
        self.credential = lambda name: worker_credential(self.secret, name)
        self.env = dict(os.environ, ECHO2_TOKEN=self.secret, OMP_NUM_THREADS="1")
        self.go = self.out / "hostile" / "go"
        self.procs: dict[str, subprocess.Popen] = {}
        self.victim_port = free_port()
        self.samples: list[dict] = []  # GET /status, every second: latency, held groups, benched ids
        self.t_go = None
        self._group: Path | None = None  # the clients' CPU cgroup, once made (clients_group)

    def cores(self, role: str) -> set[int] | None:
        """The cores a process of ``role`` runs on (--learner-core): the learner's tree on its core, every other
        process (workers and their engines, hostile clients, the burner) on the rest; None: anywhere."""
        core = self.args.learner_core
        if core is None:
            return None
        return {core} if role == "learner" else set(range(os.cpu_count() or 1)) - {core}

    def clients_group(self) -> Path | None:
        """The CPU cgroup (v1 cpu controller) the hostile clients and the burner share (--clients-cpu-shares), made
        on first use; None: none asked for."""
        shares = self.args.clients_cpu_shares
        if shares is None:
            return None
        if self._group is None:
            root = Path("/sys/fs/cgroup/cpu")
            if not (root / "cpu.shares").exists():
                raise SystemExit("--clients-cpu-shares needs cgroup v1's cpu controller at /sys/fs/cgroup/cpu")
            self._group = root / f"echo2-soak-{os.getpid()}"
            self._group.mkdir()
            (self._group / "cpu.shares").write_text(str(shares))
        return self._group

    def _start(self, name: str, cmd: list[str], env: dict, log: Path, nice: int = 0) -> subprocess.Popen:
        from echo2.learner.sources.pool import _child_setup

        setup, cores = _child_setup(None), self.cores(name)
        group = self.clients_group() if name in HOSTILE_KINDS or name == "load" else None

        def preexec() -> None:
            setup()
            if cores is not None:  # inherited by what it starts: the learner's coordinator and reward processes
                os.sched_setaffinity(0, cores)
            if group is not None:  # one scheduling entity for all of them, whatever their number
                (group / "cgroup.procs").write_text(str(os.getpid()))
            if nice:
                os.nice(nice)

        self.procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                            preexec_fn=preexec)
        return self.procs[name]

    def start(self) -> None:
        from echo2.models.tiny import build_tiny
        from echo2.learner.sources.pool import engine_core

        a = self.args
        if a.model == "tiny":
            model = build_tiny()
            task = ["task._target_=benchmarks.slow_task.SlowCopyTask"]  # the copy task, slow on one crafted answer
        else:  # experiment=smollm2_arith's model and task, its arithmetic questions slow on one crafted answer
            from echo2.models.packaged import from_gguf_wheel
            from echo2.models.tokenizer import load_tokenizer

            model = from_gguf_wheel()
            task = ["experiment=smollm2_arith", "task._target_=benchmarks.slow_task.SlowChatTask",
                    f"+task.trap_token_id={load_tokenizer(model).eos_token_id}"]
        self._start("learner", [
            sys.executable, "train.py", "pool=static", "rollout.source.tls=on", *task,
            f"rollout.source.check_every_steps={a.check_every_steps}",
            f"rollout.source.check_max_abs_log_ratio={a.check_max_abs_log_ratio}",
            f"rollout.source.heartbeat_timeout_s={a.heartbeat_s}",
            f"rollout.source.liveness.floor_s={a.deadline_floor_s}", f"rollout.source.min_workers={a.workers}",
            "run.steps=1000000", "run.save_every_steps=0", "run.eval_every_steps=0", "run.progress=false",
            "run.wandb=disabled", f"hydra.run.dir={self.out}", *a.override],
            dict(self.env, ECHO2_SLOW_REWARD_S=str(a.slow_reward_s)), self.out / "learner.out")
        for i in range(a.workers):  # honest agents, as launchers start them, each with its own credential
            cores = self.cores("honest")
            env = dict(self.env, ECHO2_TOKEN=self.credential(f"honest{i}"),
                       VLLM_CPU_OMP_THREADS_BIND=str(engine_core(i, sorted(cores) if cores else None)))
            port = self.victim_port if i == 0 else 0
            self._start(f"honest{i}", [
                sys.executable, "-m", "echo2.worker", "--coordinator", str(self.out / "coordinator.json"), "--model",
                model, "--engine", a.engine, "--dtype", "float32", "--max-groups", "4", "--snapshot-port", str(port),
                "--reconnect-timeout-s", "300", "--engine-log", str(self.out / f"honest{i}.engine.log")],
                env, self.out / f"honest{i}.log", nice=a.workers_nice)

    def start_hostile(self) -> None:
        """One client of each kind, started after the learner's first step (so that a dozen interpreters importing
        torch do not compete with the learner's own start), attacking once --go appears; returns once each has
        finished its imports (its ``.ready`` file), so that the calm phase is calm."""
        a = self.args
        victim = f"https://127.0.0.1:{self.victim_port}"  # honest0's snapshot-control port
        for kind in kinds_of(a):
            env = dict(self.env, ECHO2_TOKEN=self.credential(kind))
            if kind in OUTSIDERS:
                env.pop("ECHO2_TOKEN")
            self._start(kind, [sys.executable, "benchmarks/hostile.py", kind, "--run-dir", str(self.out), "--report",
                               str(self.out / "hostile" / f"{kind}.json"), "--go", str(self.go), "--victim", victim,
                               "--half-open", str(a.half_open), "--silent-every-s", str(a.silent_every_s),
                               *(["--source-address", OUTSIDERS[kind]] if kind in OUTSIDERS else [])],
                        env, self.out / "hostile" / f"{kind}.log", nice=a.hostile_nice)
        deadline = time.monotonic() + a.start_timeout_s
        ready = lambda: all((self.out / "hostile" / f"{k}.ready").exists() for k in kinds_of(a))  # noqa: E731
        while not ready() and time.monotonic() < deadline:
            if any(self.procs[k].poll() is not None for k in kinds_of(a)):
                break  # one exited: its report says why
            time.sleep(0.5)

    def start_load(self) -> None:
        """The loaded phase's stand-in for the hostile clients' own CPU: one process busy ``--load-cores`` of each
        10 ms (a core at most), on the run's cores and at their niceness (--hostile-nice), as the clients are."""
        busy_s = min(1.0, self.args.load_cores) * 0.01
        loop = ("import time\nwhile True:\n t = time.perf_counter()\n while time.perf_counter() - t < "
                f"{busy_s!r}: pass\n time.sleep({0.01 - busy_s!r})\n")
        self._start("load", [sys.executable, "-c", loop], self.env, self.out / "hostile" / "load.log",
                    nice=self.args.hostile_nice)

    def poll_status(self, phase: str) -> None:
        from echo2.net.http import Client
        from echo2.net.tls import LEARNER_NAME

        if not hasattr(self, "client"):
            info = json.loads((self.out / "coordinator.json").read_text())
            self.client = Client(info["url"], self.secret, timeout_s=10, ca_file=str(self.out / "tls" / "ca.pem"),
                                 server_name=LEARNER_NAME)
        t0 = time.perf_counter()
        memory = coordinator_rss(self.procs["learner"].pid) or {}  # rss, anon, shmem
        try:
            st = self.client.session.get(self.client.base_url + "/status", timeout=10, verify=self.client.verify).json()
        except Exception as e:  # noqa: BLE001 (a sample that failed is a result)
            self.samples.append({"t": time.time(), "phase": phase, "error": type(e).__name__, **memory})
            return
        self.samples.append({"t": time.time(), "phase": phase, "latency_s": time.perf_counter() - t0,
                             "held": st["held"], "benched": st["benched"], "by_worker": st["by_worker"],
                             "waited_s": st.get("waited_s", {}),
                             "workers": len(st["workers"]), **memory})

    def run(self) -> dict:
        from echo2.learner.sources.pool import terminate

        a = self.args
        become_subreaper()
        t_start = time.monotonic()
        self.start()
        while not steps_of(self.out):
            if self.procs["learner"].poll() is not None:
                raise SystemExit(f"learner exited: see {self.out / 'learner.out'}")
            if time.monotonic() - t_start > a.start_timeout_s:
                raise SystemExit(f"no learner step within {a.start_timeout_s} s: see {self.out}")
            time.sleep(0.5)
        self.start_hostile()
        calm_from = len(steps_of(self.out))  # the calm phase's reference pace: from when the clients were ready
        loaded_s = a.loaded_minutes * 60
        phases = [("calm", a.calm_minutes * 60), *([("loaded", loaded_s)] if loaded_s else []),
                  ("hostile", (a.minutes - a.calm_minutes - a.loaded_minutes) * 60)]
        split, loaded_from, self.cpu = 0, None, {}
        for phase, seconds in phases:
            if phase == "loaded":
                loaded_from = len(steps_of(self.out))
                self.start_load()
            if phase == "hostile":
                if "load" in self.procs:
                    terminate([self.procs["load"]], timeout_s=10)
                split = len(steps_of(self.out))
                self.t_go = time.time()
                self.go.touch()
            cpu0, t0 = cpu_seconds(self.procs), time.monotonic()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if self.procs["learner"].poll() is not None:
                    raise SystemExit(f"learner exited during the soak: see {self.out / 'learner.out'}")
                self.poll_status(phase)
                time.sleep(max(0.0, 1.0 - (time.monotonic() % 1.0)))
            self.cpu[phase] = cpu_used(cpu0, cpu_seconds(self.procs), time.monotonic() - t0,
                                       trainer_pid=self.procs["learner"].pid)
        end_split = len(steps_of(self.out))  # the steps after this one come after the hostile clients
        terminate([self.procs[k] for k in kinds_of(a)], timeout_s=30)  # first: each writes its report
        learner = self.procs["learner"]
        learner.send_signal(signal.SIGTERM)  # it finishes its step, closes the coordinator, writes summary.json
        try:
            learner.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pass
        terminate([p for name, p in self.procs.items() if name.startswith("honest")])
        terminate(list(self.procs.values()), timeout_s=10)
        time.sleep(1.0)  # an engine orphaned by its agent's exit has a moment to go
        state = {"split": [split, end_split, calm_from, loaded_from], "t_go": self.t_go, "samples": self.samples,
                 "args": vars(a), "cpu": self.cpu}
        (self.out / "hostile" / "soak_state.json").write_text(json.dumps(state) + "\n")  # --report-only reads it
        result = hostile_report(self.out, (split, end_split, calm_from, loaded_from), self.t_go, self.samples, a)
        result.update(wall_s=time.monotonic() - t_start, learner_rc=learner.returncode, left_behind=left_behind(),
                      cpu_cores=self.cpu)
        result["finished"] = learner.returncode == 0 and result["finished"]
        result["ok"] = bool(result["ok"] and result["finished"] and not result["left_behind"])
        return result

    def cleanup(self) -> None:
        from echo2.learner.sources.pool import terminate

        terminate([p for p in self.procs.values() if p.poll() is None], timeout_s=30)
        group = self._group
        if group is not None:
            for pid in (group / "cgroup.procs").read_text().split():  # none should be left; if one is, it leaves
                with contextlib.suppress(ProcessLookupError):  # or it exited since
                    Path("/sys/fs/cgroup/cpu/cgroup.procs").write_text(pid)
            group.rmdir()


def steps_of(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def pace(steps: list[dict], split: tuple[int, ...], window_s: float) -> dict:
    """Steps/s of the calm phase (from when the hostile clients were ready; its first step, a warm-up, left out) and
    of each full ``window_s`` window of the hostile phase (from the last calm step's time), each with its ratio to the
    calm pace. ``split``: the steps taken when the hostile phase began and ended, when the calm phase began, and when
    the loaded phase began (None: no loaded phase). With a loaded phase (calm, with a process burning the CPU the
    hostile clients will), each window has its ratio to the loaded pace too: what the attacks cost beyond their
    clients' own CPU, which on a real deployment is not the learner host's."""
    split, end, calm_from, loaded_from = (*split, 1, None)[:4]  # older runs: no calm_from (1), no loaded phase
    steps = steps[:end]
    calm = steps[max(1, calm_from):loaded_from or split]
    out: dict[str, Any] = {"calm": {"steps": len(calm)}}
    if len(calm) < 2 or len(steps) <= split:
        return {**out, "windows": [], "min_ratio": None}
    rate = (len(calm) - 1) / (calm[-1]["time_s"] - calm[0]["time_s"])
    loaded = steps[loaded_from + 1:split] if loaded_from else []  # its first step began before the load did
    loaded_rate = (len(loaded) - 1) / (loaded[-1]["time_s"] - loaded[0]["time_s"]) if len(loaded) >= 2 else None
    if loaded_rate:
        out["loaded"] = {"steps": len(loaded), "steps_per_s": loaded_rate, "ratio_to_calm": loaded_rate / rate}
    out["calm"]["steps_per_s"] = rate
    c0 = calm[0]["time_s"]  # the calm phase's own windows: how much the pace varies with nobody hostile
    out["calm"]["window_ratios"] = [round(sum(c0 + k * window_s <= r["time_s"] < c0 + (k + 1) * window_s
                                              for r in calm) / window_s / rate, 2)
                                    for k in range(int((calm[-1]["time_s"] - c0) // window_s))]
    t0, t_end = steps[split - 1]["time_s"], steps[-1]["time_s"]
    n = max(1, int((t_end - t0) // window_s))
    width = min(window_s, t_end - t0)
    times = [s["time_s"] for s in steps[split:]]
    windows = []
    for k in range(n):
        lo, hi = t0 + k * width, t0 + (k + 1) * width
        count = sum(lo <= t < hi for t in times)
        windows.append({"from_s": lo - t0, "steps": count, "steps_per_s": count / width,
                        "ratio": count / width / rate,
                        **({"ratio_loaded": count / width / loaded_rate} if loaded_rate else {})})
    return {**out, "hostile_steps": len(times), "windows": windows,
            "min_ratio": min(w["ratio"] for w in windows),
            "min_ratio_loaded": min(w["ratio_loaded"] for w in windows) if loaded_rate else None}


def read_jsonl(path: Path) -> list:
    """The file's JSON lines (none if it does not exist); a torn one (a line being written, a process killed
    mid-write) is skipped."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def trained_by_credential(out: Path, names: dict[str, str]) -> dict[str, dict]:
    """Per credential: groups received, consumed (consumed.jsonl), masked by the checks (the journal's distrusted
    groups), trained on (consumed, not masked) and trained on after the credential was retired (journal order). The
    soak saves no checkpoint, so its journal is never compacted: it holds the whole run."""
    events = read_jsonl(out / "rollouts.journal")
    consumed_log = {g for row in read_jsonl(out / "consumed.jsonl") for g in row["groups"]}
    worker_of, consumed_at, masked, retired_at = {}, {}, set(), {}
    for i, (kind, *rest) in enumerate(events):
        if kind == "r":
            worker_of[rest[0]] = rest[1]
        elif kind == "c":
            consumed_at.update((g, i) for g in rest[0])
        elif kind == "u":
            masked.update(rest[0])
        elif kind == "t" and rest[1] in ("untrusted", "revoked"):
            retired_at.setdefault(names.get(rest[0], "?"), i)
    by: dict[str, dict] = {}
    for gid, wid in worker_of.items():
        name = names.get(wid, "?")
        b = by.setdefault(name, Counter())
        b["received"] += 1
        if gid in consumed_log:
            b["consumed"] += 1
            if gid in masked:
                b["masked"] += 1
            else:
                b["trained"] += 1
                if name in retired_at and consumed_at.get(gid, -1) > retired_at[name]:
                    b["trained_after_retired"] += 1
    return {name: {**dict(b), "retired": name in retired_at} for name, b in by.items()}


def coordinator_story(log: str, names: dict[str, str]) -> dict[str, Counter]:
    """What coordinator.log says the coordinator did to each credential's workers."""
    story: dict[str, Counter] = {}
    patterns = [
        (re.compile(r"worker ([\w,]+): \d+ groups past their deadline"), lambda m: "deadline pass (miss)"),
        (re.compile(r"worker (w\d+) \(.*?\): a strike for (.*?) \(miss"), lambda m: f"strike: {m.group(2)[:50]}"),
        (re.compile(r"worker (w\d+): group g\d+ dropped: ([\w ]+)"), lambda m: f"dropped: {m.group(2)[:40]}"),
        (re.compile(r"worker (w\d+): (\d+) results refused: (\w+)"), lambda m: f"refused: {m.group(3)}"),
        (re.compile(r"worker (w\d+) retired: (\w+)"), lambda m: f"retired: {m.group(2)}"),
        (re.compile(r"worker ([\w,]+) flagged:"), lambda m: "flagged by the checks"),
        (re.compile(r"worker credential '(\S+)' revoked"), lambda m: "revoked"),
        (re.compile(r"peer w\d+ says (w\d+)'s relay \w+, and it does"), lambda m: "its relay reported silent: planned last"),
        (re.compile(r"the credential '(\S+)' was benched"), lambda m: "register refused: benched"),
        (re.compile(r"the credential '(\S+)' already has \d+ live workers"), lambda m: "register refused: id cap")]
    for line in log.splitlines():
        for pattern, what in patterns:
            m = pattern.search(line)
            if m:
                who = m.group(1).split(",")[0]
                story.setdefault(names.get(who, who), Counter())[what(m)] += 1
    return story


def log_lines(log: Path, marker: str) -> list[tuple[float, str]]:
    """The lines of an echo2 log holding ``marker``, each with its time stamp (epoch seconds); unstamped lines are
    skipped."""
    import datetime

    out = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if marker in line:
            try:
                out.append((datetime.datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp(), line))
            except ValueError:
                continue
    return out


def snapshot_applies(log: Path, t_go: float) -> dict:
    """An honest worker's snapshot applies before and after the hostile phase began, and the longest gap after."""
    times = [t for t, _ in log_lines(log, "applied snapshot v")]
    after = [t for t in times if t >= t_go]
    gaps = [b - a for a, b in zip(after, after[1:])]
    return {"calm": len(times) - len(after), "hostile": len(after), "max_gap_s": max(gaps, default=None)}


def loop_time(log: Path, t_go: float, t_end: float) -> dict[str, dict[str, float]]:
    """Where an honest worker's loop spent its time in each phase, as shares of the phase (its agent logs its time so
    far, by what, every 30 s: the calm phase is from its first such line to the last before ``t_go``, the hostile
    one from there to the last before ``t_end``)."""
    marks = []
    for t, line in log_lines(log, "time so far, s: "):
        parts = (p.rsplit(" ", 1) for p in line.split("time so far, s: ", 1)[1].split(", ") if " " in p)
        marks.append((t, {k: float(v) for k, v in parts}))
    out = {}
    for phase, lo, hi in (("calm", -math.inf, t_go), ("hostile", t_go, t_end)):
        before = [m for m in marks if m[0] <= lo] if phase == "hostile" else marks[:1]
        upto = [m for m in marks if lo < m[0] <= hi]
        if before and upto and upto[-1][0] > before[-1][0]:
            (t0, a), (t1, b) = before[-1], upto[-1]
            out[phase] = {k: round((b[k] - a.get(k, 0.0)) / (t1 - t0), 3) for k in sorted(b)}
    return out


def hostile_report(out: Path, split: tuple[int, ...], t_go: float, samples: list[dict], args) -> dict:
    """Everything the soak reports (see the module doc), with one verdict per kind."""
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    acc = summary.get("rollout_accounting", {})
    steps = steps_of(out)
    metrics = steps[-1] if steps else {}
    log = (out / "coordinator.log").read_text(errors="replace") if (out / "coordinator.log").exists() else ""
    names = {}
    for line in log.splitlines():
        m = JOINED.search(line)
        if m:
            names[m.group(1)] = m.group(2) or "run secret"
    clients = {k: json.loads(p.read_text()) if (p := out / "hostile" / f"{k}.json").exists() else {"error": "no report"}
               for k in HOSTILE_KINDS}
    trained = trained_by_credential(out, names) if (out / "rollouts.journal").exists() else {}
    story = coordinator_story(log, names)
    p = pace(steps, split, args.window_s)
    settled = acc.get("consumed", 0) + sum(acc.get("dropped", {}).values()) + sum(acc.get("lost", {}).values())
    books = {k: acc.get(k) for k in ("dispatched", "consumed", "dropped", "lost", "in_flight", "buffered")}
    books["balanced"] = bool(acc) and acc["dispatched"] == settled and acc["in_flight"] == acc["buffered"] == 0
    held = Counter()  # most groups each credential held at once (GET /status)
    for s in samples:
        per = Counter()
        for wid, n in s.get("held", {}).items():
            per[names.get(wid, wid)] += n
        for name, n in per.items():
            held[name] = max(held[name], n)
    latency = {ph: sorted(s["latency_s"] for s in samples if s["phase"] == ph and "latency_s" in s)
               for ph in ("calm", "hostile")}
    honest_waited = idle_share(samples, {w for w, n in names.items() if n.startswith("honest")})
    def peaks(key: str) -> dict[str, int | None]:
        return {ph: max((s[key] for s in samples if s["phase"] == ph and s.get(key)), default=None)
                for ph in ("calm", "hostile")}

    peak, anon, shmem = peaks("rss"), peaks("anon"), peaks("shmem")
    judged = anon if None not in anon.values() else peak  # a run sampled before RssAnon was: its VmRSS
    goal_mib = getattr(args, "memory_goal_mib", 64.0)
    memory = {"calm_peak_mib": peak["calm"] and peak["calm"] / 2**20,
              "hostile_peak_mib": peak["hostile"] and peak["hostile"] / 2**20,
              "calm_anon_peak_mib": anon["calm"] and anon["calm"] / 2**20,
              "hostile_anon_peak_mib": anon["hostile"] and anon["hostile"] / 2**20,
              # the snapshots mapped from the learner's memory files: bounded by the versions its relay keeps
              # (broadcast/store.py, tested there), paged in as they are served
              "calm_shmem_peak_mib": shmem["calm"] and shmem["calm"] / 2**20,
              "hostile_shmem_peak_mib": shmem["hostile"] and shmem["hostile"] / 2**20,
              "judged": "anon" if judged is anon else "rss",
              # the snapshots it maps more than calm, in snapshots (slow_relay_reader's aim; store.MAX_RETAINED)
              "shmem_growth_snapshots": None if None in shmem.values() or not clients.get(
                  "slow_relay_reader", {}).get("snapshot_bytes") else round(
                  (shmem["hostile"] - shmem["calm"]) / clients["slow_relay_reader"]["snapshot_bytes"], 2),
              "within_goal": None if None in judged.values()
              else judged["hostile"] - judged["calm"] <= goal_mib * 2**20}
    kinds = {k: {"client": clients[k], "coordinator": dict(story.get(k, {})), "trained": trained.get(k, {}),
                 "max_held": held.get(k, 0)} for k in HOSTILE_KINDS}
    verdicts = hostile_verdicts(kinds, metrics, acc, names, log, t_go, args)
    kinds = {k: kinds[k] for k in kinds_of(args)}
    verdicts = {k: verdicts[k] for k in kinds}
    for k, v in verdicts.items():
        kinds[k]["verdict"] = v
    honest = {n: {"trained": trained.get(n, {}), "coordinator": dict(story.get(n, {})),
                  "snapshots": snapshot_applies(out / f"{n}.log", t_go),
                  "loop_time_share": loop_time(out / f"{n}.log", t_go, max((x["t"] for x in samples), default=t_go))}
              for n in sorted({n for n in names.values() if n.startswith("honest")})}
    honest_ok = honest_verdict(story, names, {names.get(w, w) for s in samples for w in s.get("benched", [])})
    pace_goal = getattr(args, "pace_goal", 0.8)
    pace_met = p["min_ratio"] is not None and p["min_ratio"] >= pace_goal
    ok = all(all(v.values()) for v in verdicts.values()) and all(honest_ok.values()) and books["balanced"] \
        and pace_met and memory["within_goal"] is not False
    return {"out": str(out), "finished": bool(summary) and summary.get("stopped_by") == "SIGTERM",
            "steps": summary.get("steps"), "pace": p, "pace_goal": pace_goal, "pace_goal_met": pace_met,
            "load_cores": getattr(args, "load_cores", None) if "loaded" in p else None, "coordinator_memory": memory,
            "placement": {k: getattr(args, k, None) for k in ("learner_core", "workers_nice", "hostile_nice",
                                                                "clients_cpu_shares")},
            "kinds": kinds, "slow_reward": SLOW_REWARD, "books": books, "honest": honest, "honest_verdict": honest_ok,
            "status_latency_s": {ph: {"p50": v[len(v) // 2], "max": v[-1]} if v else {} for ph, v in latency.items()},
            "honest_waited_share": honest_waited,
            "coordinator": {k: metrics.get(k) for k in sorted(metrics) if k.startswith(("rollout/", "broadcast/"))
                            and "/throughput/" not in k and "/check_" not in k},
            "accounting": acc, "ok": ok}


def idle_share(samples: list[dict], workers: set[str]) -> dict[str, dict[str, float]]:
    """Per phase, the share of its time the ``workers``' pulls waited with nothing handed out, by why (the coordinator's
    ``waited_s`` in GET /status: ``window``, ``share``, ...), summed over the workers, from the phase's first and last
    sample."""
    out = {}
    for ph in ("calm", "hostile"):
        seen = [s for s in samples if s["phase"] == ph and "waited_s" in s]
        if len(seen) < 2 or seen[-1]["t"] <= seen[0]["t"]:
            continue
        first, last, span = seen[0]["waited_s"], seen[-1]["waited_s"], seen[-1]["t"] - seen[0]["t"]
        why = Counter()
        for w in workers:
            for k, v in last.get(w, {}).items():
                why[k] += (v - first.get(w, {}).get(k, 0.0)) / span
        out[ph] = {k: round(v, 3) for k, v in sorted(why.items())}
    return out


def hostile_verdicts(kinds: dict, metrics: dict, acc: dict, names: dict, log: str, t_go: float, args) -> dict:
    """Per kind, the properties the soak requires of the coordinator's answer to it (each True when it held)."""
    def untrained(k):
        return kinds[k]["trained"].get("trained", 0) == 0

    def refused_all(statuses: dict) -> bool:
        return bool(statuses) and all(s != "200" for per in statuses.values() for s in per)

    c = {k: kinds[k]["client"] for k in kinds}
    story = {k: kinds[k]["coordinator"] for k in kinds}
    retired_dead = set(re.findall(r"worker (w\d+) retired: worker_dead", log))
    ended = c["absurd"].get("stopped_at", 0)  # a silent id registered within a heartbeat timeout of that: not yet due
    due = [s for s in c["absurd"].get("silent_ids", []) if "worker_id" in s and s["at"] < ended - args.heartbeat_s - 5]
    hoarder_later = c["hoarder"].get("register_later", {})
    outsider = c["outsider"]
    v = {
        "absurd": {"every absurd declaration refused": refused_all(c["absurd"].get("statuses", {})),
                   "the reaper never failed": metrics.get("rollout/reaper_errors", 1) == 0,
                   "its silent ids retired as dead": all(s["worker_id"] in retired_dead for s in due)},
        "hoarder": {"its ids capped": str(c["hoarder"].get("first_refusal", "")).startswith("400"),
                    "it held at most one pull's worth": kinds["hoarder"]["max_held"] <= 4,
                    "its groups lost to deadlines": story["hoarder"].get("deadline pass (miss)", 0) > 0,
                    "benched, and registering again refused": hoarder_later.get("409", 0) > 0,
                    "nothing of it trained on": untrained("hoarder")},
        "invalid": {"its results refused as invalid": any("strike" in k for k in story["invalid"]),
                    "benched, and registering again refused": any("409" in k for k in c["invalid"].get("counts", {})),
                    "nothing of it trained on": untrained("invalid")
                    and not c["invalid"].get("pushed", {}).get("accepted")},
        "liar": {"its claims refused": any(k.startswith("dropped: ") and ("version" in k) for k in story["liar"]),
                 "benched, and registering again refused": any("409" in k for k in c["liar"].get("counts", {})),
                 "nothing of it trained on": untrained("liar") and not c["liar"].get("pushed", {}).get("accepted")},
        "forger": {"retired as untrusted": kinds["forger"]["trained"].get("retired", False),
                   "its credential revoked for good": any("403" in k for k in c["forger"].get("counts", {})),
                   "nothing of it trained on after it was retired":
                       kinds["forger"]["trained"].get("trained_after_retired", 0) == 0},
        "outsider": {"no request without a credential accepted": all(
                         s != "200" for t in outsider.values() if isinstance(t, dict)
                         for per in t.get("flood", {}).values() for s in per),
                     "answered at once": all(t.get("max_answer_s") is not None and t["max_answer_s"] < 5
                                             for t in outsider.values() if isinstance(t, dict) and "flood" in t),
                     "half-open connections dropped": all(
                         t.get("half_open_dropped", 0) > 0
                         for t in outsider.values() if isinstance(t, dict) and "flood" in t)},
        "relay_orders": {"every order from a worker refused": refused_all(c["relay_orders"].get("statuses", {})),
                         "nothing of it trained on": untrained("relay_orders")},
        # what its readers cost the learner's origin is in coordinator_memory (its snapshots mapped, in units of one
        # snapshot: at most store.MAX_RETAINED collected versions more than calm); a snapshot smaller than the
        # socket buffers (the tiny model's) is sent whole at once, so that only the real model's soak can show it
        "slow_relay_reader": {"it read versions slowly from the relay": c["slow_relay_reader"].get(
                                  "outcomes", {}).get("opened", 0) > 0,
                              "nothing of it trained on": untrained("slow_relay_reader")},
        "hung_relay": {"planned last once a successor found its relay silent": c["hung_relay"].get(
                           "relay_connections", 0) == 0 or story["hung_relay"].get(
                           "its relay reported silent: planned last", 0) > 0,
                       "nothing of it trained on": untrained("hung_relay")},
        **second_round_verdicts(kinds, c, untrained, refused_all, args),
    }
    for k in v:
        if c[k].get("error"):
            v[k]["its client ran"] = False
    return v


def second_round_verdicts(kinds: dict, c: dict, untrained, refused_all, args) -> dict:
    """The properties for benchmarks/hostile_wire.py's kinds and the slow-reward pusher."""
    from echo2.coordinator.bounds import REGISTER_BURST, REGISTER_EVERY_S
    from echo2.net.httpd import Limits

    smug, bomb, trick, churn, bulk = c["smuggler"], c["ca_bomb"], c["ca_trickler"], c["churner"], c["bulk_pusher"]
    hostile_s = (args.minutes - args.calm_minutes) * 60
    limits = Limits()
    return {
        "slow_reward": {"it pushed groups slow to score": sum(c["slow_reward"].get("pushed", {}).values()) > 0,
                        "nothing of it trained on after it was retired":
                            kinds["slow_reward"]["trained"].get("trained_after_retired", 0) == 0},
        "smuggler": {"every request with two credentials refused (400)": bool(smug.get("smuggled")) and all(
                         s == "400" for per in smug["smuggled"].values() for s in per),
                     "nothing done for another credential's worker id": all(
                         s != "200" for per in smug.get("for_others_alone", {}).values() for s in per),
                     "GET /status showed it its own workers only":
                         set(smug.get("status_showed", [])) <= set(smug.get("own_ids", [])),
                     "nothing of it trained on": untrained("smuggler")},
        "ca_bomb": {"every body on GET /ca refused": refused_all(bomb.get("statuses", {})),
                    "answered before its body was read": bomb.get("max_answer_s") is not None
                    and bomb["max_answer_s"] < 5},
        "ca_trickler": {"it held at most its address's share of connections":
                            trick.get("most_held_at_once", 0) <= limits.max_anonymous_per_address,
                        "each connection dropped at the header deadline": trick.get("held_s_max") is not None
                        and trick["held_s_max"] <= limits.header_timeout_s + 5},
        "churner": {"registering again and again slowed to the bucket's rate": churn.get("statuses", {}).get("429", 0) > 0,
                    "its ids bounded": churn.get("ids_registered", 0) <= REGISTER_BURST + hostile_s / REGISTER_EVERY_S + 2},
        "bulk_pusher": {"its pushes held at most two of the largest body at once (the credential's budget)":
                            bool(bulk.get("admitted_per_round")) and max(bulk["admitted_per_round"]) <= 2,
                        "the rest refused unread (503)": bulk.get("statuses", {}).get("refused 503", 0) > 0},
    }


def honest_verdict(story: dict[str, Counter], names: dict[str, str], benched: set[str]) -> dict[str, bool]:
    """What must never happen to an honest worker: flagged or retired by the rollout checks, struck, benched
    (``benched``: the credentials GET /status ever listed as benched)."""
    honest = {n for n in names.values() if n.startswith("honest")}
    seen = Counter()
    for n in honest:
        for what, count in story.get(n, {}).items():
            seen[what.split(":")[0]] += count if what.startswith(("retired: untrusted", "flagged", "strike",
                                                                  "register refused")) or what == "revoked" else 0
    return {"no honest worker flagged by the checks": not seen["flagged by the checks"],
            "no honest worker retired as untrusted": not seen["retired"],
            "no honest worker struck or benched": not (seen["strike"] or seen["register refused"] or honest & benched)}


def hostile_table(r: dict) -> str:
    p = r["pace"]
    calm = p["calm"].get("steps_per_s")
    lines = [f"hostile soak: {r['wall_s'] / 60:.1f} min, {r['steps']} learner steps, finished: {r['finished']}; "
             f"run dir {r['out']}", "",
             f"calm: {p['calm']['steps']} steps, {calm or 0:.2f} steps/s (the reference)", ""]
    loaded = p.get("loaded")
    if loaded:
        lines += [f"loaded (calm, one process burning {r.get('load_cores')} cores): {loaded['steps']} steps, "
                  f"{loaded['steps_per_s']:.2f} steps/s, {loaded['ratio_to_calm']:.2f} of calm", ""]
    lines += ["| hostile window from (s) | steps | steps/s | / calm |" + (" / loaded |" if loaded else ""),
              "|---|---|---|---|" + ("---|" if loaded else "")]
    for w in p["windows"]:
        lines.append(f"| {w['from_s']:.0f} | {w['steps']} | {w['steps_per_s']:.2f} | {w['ratio']:.2f} |"
                     + (f" {w['ratio_loaded']:.2f} |" if loaded else ""))
    lines += ["", f"slowest window / calm: {p['min_ratio'] if p['min_ratio'] is None else round(p['min_ratio'], 2)} "
              f"(goal >= {r.get('pace_goal', 0.5)}: {r['pace_goal_met']})"
              + (f"; / loaded: {p['min_ratio_loaded']:.2f}" if loaded else ""),
              f"coordinator memory (peaks, MiB; the goal is judged on its own heap, RssAnon): "
              f"{r.get('coordinator_memory')}", "",
              "| kind | what the coordinator did | trained on | verdict |", "|---|---|---|---|"]
    for k, d in r["kinds"].items():
        did = "; ".join(f"{what} x{n}" for what, n in sorted(d["coordinator"].items())) or "-"
        t = d["trained"]
        tr = f"{t.get('trained', 0)} of {t.get('received', 0)} received" + (
            f", {t.get('trained_after_retired', 0)} after retired" if t.get("retired") else "")
        bad = [name for name, held in d["verdict"].items() if not held]
        lines.append(f"| {k} | {did} | {tr} | {'ok' if not bad else 'FAILED: ' + ', '.join(bad)} |")
    bad = [name for name, held in r["honest_verdict"].items() if not held]
    lines += ["", f"honest workers: {'ok' if not bad else 'FAILED: ' + ', '.join(bad)}; {r['honest']}",
              f"calm windows / calm: {p['calm'].get('window_ratios')}",
              f"cores used (by phase): {r.get('cpu_cores')}", f"placement: {r.get('placement')}", "",
              f"slow reward: {r['slow_reward']}", "",
              f"books: {r['books']}", f"GET /status latency: {r['status_latency_s']}",
              f"honest workers' pulls waiting with nothing handed out, share of the time by why: "
              f"{r.get('honest_waited_share')}",
              f"processes left behind: {r['left_behind'] or 'none'}", f"all properties held: {r['ok']}"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=None, help="whole run, calm phase included (default: 12; "
                   "--hostile: 10)")
    p.add_argument("--calm-minutes", type=float, default=2, help="the fault-free baseline at the start")
    p.add_argument("--workers", type=int, default=None, help="worker agents (default: 3; --hostile: 1 honest one)")
    p.add_argument("--every-s", type=float, nargs=2, default=(3.0, 8.0), help="gap between faults, uniform")
    p.add_argument("--coordinator-every-s", type=float, default=60.0, help="at most one coordinator kill per")
    p.add_argument("--drain-s", type=float, default=30.0, help="no new faults in the last this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="run dir (default: a temp dir)")
    p.add_argument("--json", action="store_true")
    h = p.add_argument_group("--hostile")
    h.add_argument("--hostile", action="store_true", help="hostile clients instead of faults (see above)")
    h.add_argument("--engine", default="vllm", choices=["vllm", "hf"], help="the honest workers' engine")
    h.add_argument("--window-s", type=float, default=None,
                   help="the hostile phase's pace is judged per window (default: 30 s on the tiny model, 120 s on "
                        "smollm2_135m, whose steps take seconds: a window should hold 15 steps or more)")
    h.add_argument("--model", choices=("tiny", "smollm2_135m"), default="tiny",
                   help="tiny: the copy task on the tiny model (a step is ~0.2 s, so the round trips an attack slows "
                        "are most of it); smollm2_135m: experiment=smollm2_arith's real model and arithmetic "
                        "questions (a step of seconds, as a researcher's run has; judged over 120 s windows)")
    h.add_argument("--check-every-steps", type=int, default=5, help="rollout.source.check_every_steps")
    h.add_argument("--check-max-abs-log-ratio", type=float, default=2.0,
                   help="rollout.source.check_max_abs_log_ratio, b (nats a token)")
    h.add_argument("--heartbeat-s", type=float, default=10.0, help="rollout.source.heartbeat_timeout_s")
    h.add_argument("--deadline-floor-s", type=float, default=10.0, help="rollout.source.liveness.floor_s")
    h.add_argument("--half-open", type=int, default=100, help="the outsider's half-open connections per target")
    h.add_argument("--hostile-nice", type=int, default=0,
                   help="run the hostile clients at this niceness (0-19): here they share the run's cores, which "
                        "their own machines would not; a high value tells their own CPU from what the run spends "
                        "on them")
    h.add_argument("--workers-nice", type=int, default=0,
                   help="run the honest workers (and their engines) at this niceness: with --hostile-nice at the "
                        "same value, every process that would run on a machine of its own elsewhere has a lower "
                        "priority than the learner's (measured at 5: the 15 clients still took the trainer's core; "
                        "--learner-core keeps them apart)")
    h.add_argument("--clients-cpu-shares", type=int, default=None,
                   help="put the hostile clients (and the burner) in one CPU cgroup with these cpu.shares (1024: "
                        "together they weigh what one ordinary process does): they attack at full rate while a core "
                        "is free, and when the cores are contended they share one process's turn, as clients on "
                        "machines of their own would not compete at all; per-process niceness cannot do that for 15 "
                        "processes (Linux cgroup v1 cpu controller, root)")
    h.add_argument("--learner-core", type=int, default=None,
                   help="pin the learner (its trainer, coordinator and reward processes) to this core and every "
                        "other process of the soak to the others: the learner host's CPU is its own, as on a real "
                        "deployment, where the workers and the clients run on machines of their own (here they "
                        "share the other cores, the honest worker's generation slowed by the clients' CPU)")
    h.add_argument("--loaded-minutes", type=float, default=0.0,
                   help="a loaded phase after the calm one: calm, with one process burning --load-cores of the run's "
                        "cores, the CPU the hostile clients' own processes take here; each hostile window's pace is "
                        "then also reported against it (part of --minutes)")
    h.add_argument("--load-cores", type=float, default=0.5,
                   help="the loaded phase's burn (the clients' processes used 0.48-0.50 cores on the real model)")
    h.add_argument("--silent-every-s", type=float, default=30.0, help="a silent registration this often (absurd)")
    h.add_argument("--slow-reward-s", type=float, default=1.0,
                   help="seconds a crafted completion costs to score (slow_reward; math-verify's limit is 1 s)")
    h.add_argument("--kinds", nargs="+", choices=HOSTILE_KINDS, default=None,
                   help="run only these hostile kinds (default: every one)")
    h.add_argument("--pace-goal", type=float, default=0.8, help="every hostile window's pace / calm must reach this")
    h.add_argument("--memory-goal-mib", type=float, default=64.0,
                   help="the coordinator's hostile-phase heap (RssAnon) peak may exceed its calm peak by at most this")
    h.add_argument("--start-timeout-s", type=float, default=600.0, help="give up if no learner step by then")
    h.add_argument("--override", action="append", default=[], help="one more train.py override (repeatable)")
    h.add_argument("--report-only", metavar="RUN_DIR", default=None,
                   help="report again on a finished --hostile run's directory (no process is started)")
    args = p.parse_args()
    if args.report_only:
        out = Path(args.report_only)
        state = json.loads((out / "hostile" / "soak_state.json").read_text())
        saved = argparse.Namespace(**state["args"])
        result = hostile_report(out, tuple(state["split"]), state["t_go"], state["samples"], saved)
        result.update(wall_s=0.0, learner_rc=None, left_behind=[], cpu_cores=state.get("cpu", {}))
        print(json.dumps(result, indent=2) if args.json else hostile_table(result))
        return
    args.minutes = args.minutes or (10.0 if args.hostile else 12.0)
    if args.hostile and args.window_s is None:
        args.window_s = 120.0 if args.model == "smollm2_135m" else 30.0
    args.workers = args.workers or (1 if args.hostile else 3)
    soak = HostileSoak(args) if args.hostile else Soak(args)
    try:
        result = soak.run()
    finally:
        soak.cleanup()
    print(json.dumps(result, indent=2) if args.json else (hostile_table if args.hostile else table)(result))
    if args.hostile and not result["ok"]:
        sys.exit("a property of the hostile soak did not hold (see above)")
    if not args.hostile and not result["books_balance"]:
        sys.exit("the rollout books do not balance")


if __name__ == "__main__":
    main()
