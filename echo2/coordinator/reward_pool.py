"""Reward functions in processes of their own, with a time limit per group: never under the coordinator's lock or GIL.

    push handler threads ─ score_many(groups, principal) ─ decode here ─► FairQueue (fair.py): every push's groups,
        │                                                                  per principal, in fair order
        │   one runner thread per reward process (a fresh interpreter, `python -m echo2.coordinator.reward_pool FD`,
        │   holding the task's reward functions): take the next group in fair order ─► score it ─► the process is free
        ◄─ per group: its rewards, or why not; the seconds it took are charged to its principal
    a group unanswered within ``timeout_s``: its process is killed (SIGKILL: a reward stuck in C, such as
    sympy expanding \\boxed{10^{10^{7}}} (18 s, measured), cannot be interrupted any other way) and replaced; the
    group is dropped (``reward_timeout``). A reward that raises: ``reward_error``; a process that dies:
    ``reward_crashed``; a group no process took within ``start_timeout_s`` (none could start, or the pool was closed):
    ``reward_unavailable``. The coordinator books each as a drop with that reason (coordinator.py); none of them
    stops anything, and which of them count against the worker is intake.py's to decide (reward_faults.py).

A process goes back to the pool after every group, not after a whole push, and the next group is the fairest one
(fair.py): a principal whose groups are slow to score (math-verify spends seconds on a crafted answer it then scores
0) is charged that time and goes behind everyone else, and never holds more than half the processes, so it cannot
hold the pool while honest pushes wait (with ``processes`` >= 2; a pool of one process is shared in turn only). Each
reward process leaves the run secret out of its environment (child.SECRET_ENV) and bounds itself: its address space to
what loading the task took plus ``memory_mb``, each group to ``cpu_s`` CPU seconds (RLIMIT_CPU, so that one stuck
in C ends even if the coordinator that would kill it is gone).

Why processes, not threads: a reward holds the GIL (math-verify, sympy), so a slow one froze the coordinator past
its heartbeat timeout, and every worker would have been declared dead. Why fresh interpreters (not fork): the
coordinator process runs threads (HTTP, reaper, broadcaster), and forking a threaded process is unsafe; it is
also a daemonic multiprocessing child, which may not start multiprocessing children. In its main thread a
reward process may use SIGALRM (math-verify's own timeouts do: echo2/tasks/gsm8k.py).

Cost on the demo task (arith, G = 8): one message and one answer per group. Measured on one shared core (client,
coordinator and reward process on it) when a push's groups went in one message: scoring 4 groups took 300 µs
through the pool against 210 µs in place, and a real coordinator over loopback HTTP served 470-510 pushes of 4
groups a second through the pool against 570-630 scoring in place; a message per group adds a socket round trip
per group to that (benchmarks/coordinator_load.py measures it); with a core of its own, the reward process takes
its work off the coordinator's instead. Texts are decoded here: a reward process holds no tokenizer (unpickling one imports
torch: 2.3 s and 250 MB per process, against 0.9 s and 150 MB).
"""

from __future__ import annotations

import logging
import math
import pickle
import resource
import subprocess
import sys
import threading
import time
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any

from echo2.coordinator import child
from echo2.coordinator.fair import FairQueue
from echo2.metrics import ROLLOUT_REWARD_PROCESS_RESTARTS
from echo2.scoring import RewardFunctions, decode
from echo2.records import RolloutGroup

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 5.0
"""Wait before starting a reward process again after one failed to start (a task that does not unpickle in a
fresh interpreter fails every time: no tight loop)."""
SLOW_GROUP_S = 1.0
"""A group whose scoring took longer is logged (SLOW_LOG_PERIOD_S apart at most): an honest one takes milliseconds."""
SLOW_LOG_PERIOD_S = 10.0


class _Proc:
    """One reward process and our end of its socket."""

    def __init__(self, popen: subprocess.Popen, conn: Connection):
        self.popen, self.conn = popen, conn

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        self.conn.close()


class _Job:
    """One group to score (``judge``: to judge, held-out rows), and how it went (``reason``: None, done; else why
    not)."""

    __slots__ = ("group", "judge", "reason", "started", "finished")

    def __init__(self, group: RolloutGroup, judge: bool = False):
        self.group, self.judge, self.reason, self.started, self.finished = group, judge, None, False, False


class RewardPool:
    """``score_many(groups, principal)`` as Scorer has it, in ``processes`` reward processes, ``timeout_s`` per
    group, taken in fair order across pushes and principals (fair.py)."""

    def __init__(self, task: Any, tokenizer: Any = None, processes: int = 2, timeout_s: float = 10.0,
                 start_timeout_s: float = 120.0, memory_mb: int = 2048, cpu_s: float = 30.0, max_steps: int = 0,
                 steps_per_epoch: float = 0.0):
        """``memory_mb``: what scoring may add to a reward process's address space on top of what loading the task
        took (RLIMIT_AS; 0: no limit); ``cpu_s``: CPU seconds one group may use (RLIMIT_CPU, re-armed per group; 0:
        no limit): a reward stuck in C in a process whose coordinator died still ends."""
        if processes < 1 or not timeout_s > 0:
            raise ValueError(f"reward pool: processes={processes} must be >= 1, timeout_s={timeout_s} > 0")
        self.task_bytes = pickle.dumps(task)  # what each process rebuilds its reward functions from
        # here to build each group's job (with the trainer state) and sum rewards with the task's weights
        self.weights = RewardFunctions(task, max_steps, steps_per_epoch)
        self.tokenizer, self.timeout_s, self.start_timeout_s = tokenizer, timeout_s, start_timeout_s
        self.limits = (int(memory_mb), float(cpu_s))
        self.cond = threading.Condition()
        # half the processes at most to one principal's groups at once: the others always have the rest (fair.py)
        self.fair = FairQueue(max_busy=max(1, processes // 2))
        self.live: set[_Proc] = set()
        self.closed = False
        self.broken: str | None = None  # why no process can start (set after one failed to)
        self.counts: Counter = Counter()  # reason -> groups, "restarts", "slow_groups"
        self.slow_logged = -SLOW_LOG_PERIOD_S
        self.runners = [threading.Thread(target=self._runner, name=f"reward-{i}", daemon=True)
                        for i in range(processes)]
        for t in self.runners:
            t.start()

    # ------------------------------------------------------------------ scoring

    def score_many(self, groups: list[RolloutGroup], principal: str = "?", judge: bool = False) -> list[str | None]:
        """Score each group in place; per group None, or the reason it could not be scored (module doc). The groups
        are queued for ``principal`` (fair.py) and scored one at a time by whichever process is free. ``judge``:
        judge them instead (held-out rows evaluated on a worker: scoring.RewardFunctions.judge_job), with the same
        time limit and reasons."""
        if self.tokenizer is not None:
            for g in groups:
                decode(self.tokenizer, g)
        jobs = [_Job(g, judge) for g in groups]
        deadline = time.monotonic() + self.start_timeout_s
        with self.cond:
            if self.closed or (self.broken is not None and not self.live):
                for job in jobs:
                    job.reason, job.finished = "reward_unavailable", True
            else:
                self.fair.push(principal, jobs, time.monotonic())
                self.cond.notify_all()
            for job in jobs:
                while not job.finished:
                    left = deadline - time.monotonic()
                    if self.closed or (not job.started and (left <= 0 or (self.broken and not self.live))):
                        if self.fair.remove(job) or self.closed:  # never started: nobody will score it now
                            job.reason, job.finished = "reward_unavailable", True
                            if left <= 0:
                                log.error("no reward process took group %s within %.0f s%s", job.group.group_id,
                                          self.start_timeout_s, f": {self.broken}" if self.broken else "")
                            continue
                    self.cond.wait(timeout=1.0 if job.started else max(0.05, min(1.0, left)))
        reasons = [job.reason for job in jobs]
        for r in reasons:
            if r is not None:
                self.counts[r] += 1
        return reasons

    def _runner(self) -> None:
        """One reward process's life: take the next group in fair order, score it, give the process back (replaced
        after a timeout or a crash), charge the time to the group's principal."""
        proc: _Proc | None = None
        while True:
            if proc is None:
                proc = self._start()
                if proc is None:
                    return  # closed
            with self.cond:
                while not self.closed and not self.fair.ready():
                    self.cond.wait()
                if self.closed:
                    break
                principal, job = self.fair.pop(time.monotonic())
                job.started = True
            t0 = time.monotonic()
            try:
                reason = self._score(proc, job.group, job.judge)
            except Exception:  # a bug on our side (rewards of the wrong shape): this group only, the runner goes on
                log.exception("reward of group %s could not be applied", job.group.group_id)
                reason = "reward_error"
            if reason in ("reward_timeout", "reward_crashed"):
                self.counts["restarts"] += 1
                self._discard(proc)
                proc = None
            took_s = time.monotonic() - t0
            if took_s > SLOW_GROUP_S:
                self._note_slow(principal, job.group.group_id, took_s)
            with self.cond:
                self.fair.done(principal, took_s, time.monotonic())
                job.reason, job.finished = reason, True
                self.cond.notify_all()
        if proc is not None:
            self._discard(proc)

    def _note_slow(self, principal: str, group_id: str, took_s: float) -> None:
        """Say which principal's groups are slow to score: one line per SLOW_LOG_PERIOD_S at most, with a count."""
        self.counts["slow_groups"] += 1
        now = time.monotonic()
        if now - self.slow_logged >= SLOW_LOG_PERIOD_S:
            log.warning("reward of group %s (%s) took %.1f s, charged to it (%d groups slower than %.0f s so far)",
                        group_id, principal, took_s, self.counts["slow_groups"], SLOW_GROUP_S)
            self.slow_logged = now

    def _score(self, proc: _Proc, group: RolloutGroup, judge: bool = False) -> str | None:
        """Score (or ``judge``) one group in ``proc``: None (its rewards set), or why not."""
        try:
            proc.conn.send([self.weights.job(group, judge)])
        except OSError:  # it died while idle
            why = "reward_crashed"
        else:
            why = None
            if not proc.conn.poll(self.timeout_s):
                why = "reward_timeout"
            else:
                try:
                    status, value = proc.conn.recv()
                except (EOFError, OSError):
                    why = "reward_crashed"
        if why is not None:
            log.warning("reward of group %s: %s (limit %.1f s per group); its reward process is replaced",
                        group.group_id, why, self.timeout_s)
            return why
        if status == "ok":
            (self.weights.apply_judgement if judge else self.weights.apply)(group, value)
            return None
        log.warning("reward of group %s raised: %s", group.group_id, value)
        return "reward_error"

    # ------------------------------------------------------------------ processes

    def _start(self) -> _Proc | None:
        """A ready reward process (a fresh interpreter that has unpickled the task: seconds); retried after
        RESTART_BACKOFF_S while one fails to start, meanwhile failing what waits if no process is left to score it.
        None once the pool is closed."""
        while not self.closed:
            try:
                proc = self._spawn()
            except Exception as e:
                if self.closed:
                    return None
                self.broken = f"{type(e).__name__}: {e}"
                log.error("a reward process failed to start: %s", self.broken)
                with self.cond:
                    self.cond.notify_all()  # a push waiting on a pool with no live process gives up now
                    self.cond.wait(RESTART_BACKOFF_S)
                continue
            if proc is not None:
                self.broken = None
            return proc
        return None

    def _spawn(self) -> _Proc | None:
        proc = _Proc(*child.spawn("echo2.coordinator.reward_pool", str(self.limits[0]), str(self.limits[1])))
        with self.cond:
            if self.closed:
                proc.kill()
                return None
            self.live.add(proc)
        try:
            proc.conn.send_bytes(self.task_bytes)
            if not proc.conn.poll(self.start_timeout_s):
                raise TimeoutError(f"not ready within {self.start_timeout_s:.0f} s")
            status, value = proc.conn.recv()
            if status != "ready":
                raise RuntimeError(value)
        except BaseException:
            self._discard(proc)
            raise
        return proc

    def _discard(self, proc: _Proc) -> None:
        """Kill ``proc`` and close our end of its socket: only its owner (the runner, or _spawn before it hands it
        over) does, once, so that no descriptor is closed twice (the second could be another socket's by then)."""
        with self.cond:
            self.live.discard(proc)
        proc.kill()

    def check_transcripts(self, group: RolloutGroup) -> None:
        """A multi-turn group's episodes read back against their tokens, here (it needs the tokenizer), before
        scoring (scoring.RewardFunctions.read_transcripts)."""
        self.weights.read_transcripts(self.tokenizer, group)

    def set_step(self, global_step: int) -> None:
        """The learner's version now: the ``trainer_state.global_step`` the groups scored from now on are handed."""
        self.weights.set_step(global_step)

    def metrics(self) -> dict[str, float]:
        return {ROLLOUT_REWARD_PROCESS_RESTARTS: float(self.counts["restarts"])}

    def close(self) -> None:
        """Stop every reward process (SIGKILL, by handle; each runner then closes its own socket and ends); pushes
        still waiting are answered ``reward_unavailable``."""
        with self.cond:
            self.closed = True
            procs = list(self.live)
            self.cond.notify_all()
        for proc in procs:
            if proc.popen.poll() is None:
                proc.popen.kill()
            proc.popen.wait()


# ---------------------------------------------------------------------- a reward process


def _serve(fd: int, memory_mb: int = 0, cpu_s: float = 0.0) -> None:
    """A reward process: rebuild the task's reward functions, bound its own memory, then score what arrives until the
    socket closes, each group under a fresh CPU limit."""
    conn = Connection(fd)

    def build() -> RewardFunctions:
        funcs = RewardFunctions(pickle.loads(conn.recv_bytes()))
        if memory_mb > 0:  # on top of what loading the task took: its imports vary by task, hostile text does not
            room = _address_space_bytes() + (memory_mb << 20)
            resource.setrlimit(resource.RLIMIT_AS, (room, room))
        if cpu_s > 0:  # SIGXCPU's default action dumps core: a reward process that ran out leaves no core file
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        return funcs

    funcs = child.ready(conn, build)
    if funcs is None:
        return
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the coordinator closed us, or died
            return
        for group_job in job:
            if cpu_s > 0:  # SIGXCPU (the process ends: reward_crashed) once this group used cpu_s more seconds
                used = resource.getrusage(resource.RUSAGE_SELF)
                soft = math.ceil(used.ru_utime + used.ru_stime + cpu_s)
                resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
            try:
                answer = ("ok", (funcs.judge_job if group_job.get("judge") else funcs.compute_job)(group_job))
            except MemoryError:
                answer = ("error", "MemoryError: the reward outgrew its memory limit")
            except Exception as e:
                answer = ("error", f"{type(e).__name__}: {e}")
            conn.send(answer)


def _address_space_bytes() -> int:
    """This process's virtual address space now (VmSize), bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="[reward process %(process)d][%(levelname)s] %(message)s")
    _serve(int(sys.argv[1]), *(int(sys.argv[2]), float(sys.argv[3])) if len(sys.argv) > 3 else ())
