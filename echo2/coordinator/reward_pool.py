"""Reward functions in processes of their own, with a time limit per group: never under the coordinator's lock or GIL.

    push handler thread ─ score_many(groups) ─ decode here ─► an idle reward process (a fresh interpreter:
        │                                                      `python -m echo2.coordinator.reward_pool FD`, holding
        │                                                      the task's reward functions)
        │  one message with the push's groups (each a scoring job) ─►  scores them in turn, one answer each
        ◄─ per group: its rewards, or why not ─────────────────────────┘
    a group unanswered within ``timeout_s``: its process is killed (SIGKILL: a reward stuck in C, such as
    sympy expanding \\boxed{10^{10^{7}}} (18 s, measured), cannot be interrupted any other way) and replaced; the
    group is dropped (``reward_timeout``) and the push's other groups go to another process. A reward that
    raises: ``reward_error``; a process that dies: ``reward_crashed``; no process could start: ``reward_unavailable``.
    The coordinator books each as a drop with that reason (coordinator.py); none of them stops anything.

Why processes, not threads: a reward holds the GIL (math-verify, sympy), so a slow one froze the coordinator past
its heartbeat timeout, and every worker would have been declared dead. Why fresh interpreters (not fork): the
coordinator process runs threads (HTTP, reaper, broadcaster), and forking a threaded process is unsafe; it is
also a daemonic multiprocessing child, which may not start multiprocessing children. In its main thread a
reward process may use SIGALRM (math-verify's own timeouts do: echo2/tasks/gsm8k.py).

Cost on the demo task (arith, G = 8): one message per push and one answer per group. Measured on one shared core
(client, coordinator and reward process on it): scoring 4 groups took 300 µs through the pool against 210 µs in
place, and a real coordinator over loopback HTTP served 470-510 pushes of 4 groups a second through the pool
against 570-630 scoring in place; with a core of its own, the reward process takes its work off the
coordinator's instead. Texts are decoded here: a reward process holds no tokenizer (unpickling one imports
torch: 2.3 s and 250 MB per process, against 0.9 s and 150 MB).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any

from echo2.metrics import ROLLOUT_REWARD_PROCESS_RESTARTS
from echo2.scoring import RewardFunctions, decode
from echo2.records import RolloutGroup

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 5.0
"""Wait before starting a reward process again after one failed to start (a task that does not unpickle in a
fresh interpreter fails every time: no tight loop)."""


class _Proc:
    """One reward process and our end of its socket."""

    def __init__(self, popen: subprocess.Popen, conn: Connection):
        self.popen, self.conn = popen, conn

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        self.conn.close()


class RewardPool:
    """``score_many(groups)`` as Scorer has it, in ``processes`` reward processes, ``timeout_s`` per group."""

    def __init__(self, task: Any, tokenizer: Any = None, processes: int = 2, timeout_s: float = 10.0,
                 start_timeout_s: float = 120.0, max_steps: int = 0, steps_per_epoch: float = 0.0):
        if processes < 1 or not timeout_s > 0:
            raise ValueError(f"reward pool: processes={processes} must be >= 1, timeout_s={timeout_s} > 0")
        self.task_bytes = pickle.dumps(task)  # what each process rebuilds its reward functions from
        # here to build each group's job (with the trainer state) and sum rewards with the task's weights
        self.weights = RewardFunctions(task, max_steps, steps_per_epoch)
        self.tokenizer, self.timeout_s, self.start_timeout_s = tokenizer, timeout_s, start_timeout_s
        self.idle: queue.Queue[_Proc] = queue.Queue()
        self.live: set[_Proc] = set()
        self.lock = threading.Lock()
        self.closed = False
        self.broken: str | None = None  # why no process can start (set after one failed to)
        self.counts: Counter = Counter()  # reason -> groups, and "restarts"
        for _ in range(processes):
            self._start()

    # ------------------------------------------------------------------ scoring

    def score_many(self, groups: list[RolloutGroup]) -> list[str | None]:
        """Score each group in place; per group None, or the reason it could not be scored (module doc)."""
        reasons: list[str | None] = [None] * len(groups)
        if self.tokenizer is not None:
            for g in groups:
                decode(self.tokenizer, g)
        todo = list(range(len(groups)))
        while todo:
            proc = self._acquire()
            if proc is None:
                for i in todo:
                    reasons[i] = "reward_unavailable"
                break
            todo = self._run(proc, groups, todo, reasons)
        for r in reasons:
            if r is not None:
                self.counts[r] += 1
        return reasons

    def _run(self, proc: _Proc, groups: list[RolloutGroup], todo: list[int], reasons: list) -> list[int]:
        """Send ``todo``'s groups to ``proc``, collect answers; returns the groups left when it had to go."""
        try:
            proc.conn.send([self.weights.job(groups[i]) for i in todo])
        except OSError as e:  # it died while idle: a new one takes the same groups
            self._replace(proc, f"died while idle ({e})")
            return todo
        for k, i in enumerate(todo):
            why = None
            if not proc.conn.poll(self.timeout_s):
                why = "reward_timeout"
            else:
                try:
                    status, value = proc.conn.recv()
                except (EOFError, OSError):
                    why = "reward_crashed"
            if why is not None:
                reasons[i] = why
                log.warning("reward of group %s: %s (limit %.1f s per group); its reward process is replaced",
                            groups[i].group_id, why, self.timeout_s)
                self._replace(proc, why)
                return todo[k + 1:]
            if status == "ok":
                self.weights.apply(groups[i], value)
            else:
                reasons[i] = "reward_error"
                log.warning("reward of group %s raised: %s", groups[i].group_id, value)
        self.idle.put(proc)
        return []

    def check_transcripts(self, group: RolloutGroup) -> None:
        """A multi-turn group's episodes read back against their tokens, here (it needs the tokenizer), before
        scoring (scoring.RewardFunctions.read_transcripts)."""
        self.weights.read_transcripts(self.tokenizer, group)

    def set_step(self, global_step: int) -> None:
        """The learner's version now: the ``trainer_state.global_step`` the groups scored from now on are handed."""
        self.weights.set_step(global_step)

    def _acquire(self) -> _Proc | None:
        """An idle process; None if none can start (``broken``) or none came within start_timeout_s."""
        deadline = time.monotonic() + self.start_timeout_s
        while not self.closed:
            if self.broken is not None and not self.live:
                return None
            try:
                return self.idle.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    log.error("no reward process answered within %.0f s%s", self.start_timeout_s,
                              f": {self.broken}" if self.broken else "")
                    return None
        return None

    # ------------------------------------------------------------------ processes

    def _start(self) -> None:
        """Start a process; a thread waits for it to say it is ready (unpickling the task imports its modules,
        seconds), then makes it available."""
        threading.Thread(target=self._spawn, name="reward-start", daemon=True).start()

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        try:
            popen = subprocess.Popen([sys.executable, "-m", "echo2.coordinator.reward_pool", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                     start_new_session=True)  # a Ctrl-C in the terminal is the learner's to handle
        finally:
            theirs.close()
        proc = _Proc(popen, Connection(ours.detach()))
        with self.lock:
            if self.closed:
                proc.kill()
                return
            self.live.add(proc)
        try:
            proc.conn.send_bytes(self.task_bytes)
            if not proc.conn.poll(self.start_timeout_s):
                raise TimeoutError(f"not ready within {self.start_timeout_s:.0f} s")
            status, value = proc.conn.recv()
            if status != "ready":
                raise RuntimeError(value)
        except Exception as e:
            if self.closed:  # closed while it started: nothing is wrong
                self._discard(proc)
                return
            self.broken = f"{type(e).__name__}: {e}"
            log.error("a reward process failed to start: %s", self.broken)
            self._discard(proc)
            time.sleep(RESTART_BACKOFF_S)
            if not self.closed:
                self._start()
            return
        self.broken = None
        self.idle.put(proc)

    def _replace(self, proc: _Proc, why: str) -> None:
        self.counts["restarts"] += 1
        self._discard(proc)
        if not self.closed:
            self._start()

    def _discard(self, proc: _Proc) -> None:
        with self.lock:
            self.live.discard(proc)
        proc.kill()

    def metrics(self) -> dict[str, float]:
        return {ROLLOUT_REWARD_PROCESS_RESTARTS: float(self.counts["restarts"])}

    def close(self) -> None:
        """Stop every reward process (by handle)."""
        with self.lock:
            self.closed = True
            procs, self.live = list(self.live), set()
        for proc in procs:
            proc.kill()


# ---------------------------------------------------------------------- a reward process


def _serve(fd: int) -> None:
    """A reward process: rebuild the task's reward functions, then score what arrives until the socket closes."""
    conn = Connection(fd)
    try:
        funcs = RewardFunctions(pickle.loads(conn.recv_bytes()))
    except Exception:
        conn.send(("failed", traceback.format_exc(limit=5)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the coordinator closed us, or died
            return
        for group_job in job:
            try:
                answer = ("ok", funcs.compute_job(group_job))
            except Exception as e:
                answer = ("error", f"{type(e).__name__}: {e}")
            conn.send(answer)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="[reward process %(process)d][%(levelname)s] %(message)s")
    _serve(int(sys.argv[1]))
