"""The coordinator in a process of its own, so that its work never takes the learner's GIL or core.

    learner process                                        coordinator process (spawned, one per run)
    AsyncRolloutSource ─ CoordinatorProcess ══ pipe ══►  serve() → InChild: Coordinator (HTTP server, reapers)
       collect   take(n)             request → reply (P scored groups)       + Broadcaster (its send thread)
                                                                             + RewardPool (reward processes)
       on_version set_version(v)     one-way
                 publish_written(v)  one-way; the bytes go through a memory file (memfd) the child maps, not the pipe
       metrics   metrics()           request → reply  (also status(), for tests and tools)
       on_save   mark()              request → reply (the journal's length, fsynced: where a resume starts from)
       checks    check(stats)        request → reply (the workers whose groups in the batch are not trained on)
       close     close()             request → reply (the rollout accounting); then the process exits

Each call sends the InChild method that serves it (pickled by name) with its arguments: follow a call from
CoordinatorProcess.take to InChild.take to Coordinator.take.

    waits for (learner): a reply to take, i.e. P admissible groups;   unblocked by: worker pushes in the child

Why: with the coordinator as threads of the learner, serving 3.4k rollouts/s (HTTP, JSON, validation, reward
scoring) made learner steps 1.96x slower (BENCHMARKS.md); the GIL was shared. Here the learner pays one pipe
round trip per step plus unpickling its batch. The pipe carries pickles, but it is a socketpair between two
processes of this run, never the network: workers only ever reach the coordinator's JSON routes.

If the learner dies (even kill -9) the child notices its parent's sentinel and exits; if the child dies the
learner's next call raises CoordinatorDied with the child's exit code and log path, and the source starts a new
one from the ledger's journal (async_source.py).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import mmap
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class CoordinatorDied(RuntimeError):
    pass


class CoordinatorProcess:
    """The learner's handle on the coordinator process; the same calls as an in-process Coordinator."""

    def __init__(self, *, task: Any, tokenizer: Any, make_broadcaster: Any, coordinator_kwargs: dict[str, Any],
                 log_path: str | None = None, cores: list[int] | None = None, start_timeout_s: float = 120.0,
                 rewards: dict[str, Any] | None = None):
        """``rewards``: the reward pool's settings (reward_pool.RewardPool: ``processes``, ``timeout_s``)."""
        self.log_path = log_path
        self.staged: deque[int] = deque()  # memory files of the last published snapshots (see _handoff)
        spec = dict(task=task, tokenizer=tokenizer, make_broadcaster=make_broadcaster,
                    coordinator_kwargs=coordinator_kwargs, log_path=log_path, log_level=logging.getLogger().level,
                    cores=list(cores) if cores else None, rewards=dict(rewards or {}))
        ctx = mp.get_context("spawn")  # never fork a process that holds torch threads and a model
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child_conn, spec), name="echo2-coordinator", daemon=True)
        self.proc.start()
        child_conn.close()
        if not self.conn.poll(start_timeout_s):
            self._kill()
            raise CoordinatorDied(f"coordinator process did not start within {start_timeout_s} s ({self._where()})")
        self.url = self._reply()
        self.closed = False
        log.info("coordinator process pid %d on %s", self.proc.pid, self.url)

    # ------------------------------------------------------------------ calls

    def take(self, n: int, timeout_s: float | None = None) -> list:
        return self._call(InChild.take, n, timeout_s)

    def set_version(self, version: int) -> None:
        self._send(InChild.set_version, version)

    def publish(self, version: int, blob: bytes, probe: dict | None = None) -> None:
        """Hand snapshot bytes to the broadcaster in the child; returns once they are written to memory."""
        self._handoff(version, lambda path: Path(path).write_bytes(blob), probe)

    def publish_written(self, version: int, write: Callable[[str], None], probe: dict | None = None) -> None:
        """Publish what ``write(path)`` streams into a memory file (a sharded learner's gathered weights)."""
        self._handoff(version, write, probe)

    def _handoff(self, version: int, write, probe: dict | None) -> None:
        """Write the snapshot into a new memory file and tell the child its path; the child maps it (no copy).

        Why a memory file and not /dev/shm: containers mount /dev/shm at 64 MB by default, and a disk file would
        put every snapshot through the disk. The file lives until two newer ones are published: by then the
        child, which handles calls in order, has mapped it (its map keeps the memory after we close ours)."""
        fd = os.memfd_create(f"echo2-snapshot-v{version}", os.MFD_CLOEXEC)
        try:
            write(f"/proc/self/fd/{fd}")
        except BaseException:
            os.close(fd)
            raise
        self.staged.append(fd)
        while len(self.staged) > 2:
            os.close(self.staged.popleft())
        self._send(InChild.publish, version, f"/proc/{os.getpid()}/fd/{fd}", probe)

    def metrics(self) -> dict[str, float]:
        return self._call(InChild.metrics)

    def mark(self) -> int:
        """The journal's length now: a learner checkpoint taken between steps resumes from here."""
        return self._call(InChild.mark)

    def status(self) -> dict[str, Any]:
        return self._call(InChild.status)

    def check(self, stats: dict[str, tuple[int, float, float]]) -> list[str]:
        """The learner's per-worker scores of behaviour logprobs (rollout checks); returns the workers whose groups
        in the checked batch must not be trained on."""
        return self._call(InChild.check, stats)

    def close(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Stop serving and return the accounting (what was buffered or in flight counted as at the end)."""
        if self.closed:
            return {}
        self.closed = True
        try:
            self._send(InChild.close, reply=True)  # the child answers, then exits
            if not self.conn.poll(timeout_s):
                raise CoordinatorDied(f"coordinator did not answer close within {timeout_s} s ({self._where()})")
            return self._reply()
        finally:
            self.proc.join(timeout=10)  # it exits by itself after answering close
            self.abandon()

    def abandon(self) -> None:
        """Forget the coordinator (dead, hopeless, or done): reap it and free what this handle holds."""
        self.closed = True
        self._kill()
        self.conn.close()
        while self.staged:
            os.close(self.staged.popleft())

    # ------------------------------------------------------------------ plumbing

    def _send(self, method: Callable, *args: Any, reply: bool = False) -> None:
        """Ask the child to run ``method`` (an InChild method) with ``args``; one-way unless ``reply``."""
        try:
            self.conn.send((method, args, reply))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as e:
            raise CoordinatorDied(f"coordinator process is gone ({self._where()})") from e

    def _reply(self) -> Any:
        try:
            status, value = self.conn.recv()
        except (EOFError, ConnectionResetError, OSError) as e:
            self.proc.join(timeout=5)
            raise CoordinatorDied(f"coordinator process is gone ({self._where()})") from e
        if status == "error":
            kind, message = value
            raise (TimeoutError if kind == "TimeoutError" else RuntimeError)(f"coordinator: {message}")
        return value

    def _call(self, method: Callable, *args: Any) -> Any:
        self._send(method, *args, reply=True)
        return self._reply()

    def _where(self) -> str:
        code = self.proc.exitcode
        state = "running" if code is None else f"exit code {code}"
        return f"pid {self.proc.pid}, {state}; log: {self.log_path or 'stderr'}"

    def _kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)


# ---------------------------------------------------------------------- the child


def serve(conn: Any, spec: dict[str, Any]) -> None:
    """Entry point of the coordinator process: answer the learner's calls until ``close`` or its death."""
    if spec["cores"]:  # before any thread exists, so that all of them inherit it
        os.sched_setaffinity(0, set(spec["cores"]))
    _configure_logging(spec["log_path"], spec["log_level"])
    from echo2.rollout.coordinator import Coordinator
    from echo2.rollout.reward_pool import RewardPool

    task, tokenizer = spec["task"], spec["tokenizer"]
    rewards = RewardPool(task, tokenizer, **spec["rewards"])  # reward functions in processes of their own
    broadcaster = spec["make_broadcaster"]()
    coordinator = Coordinator(task.train_dataset(), rewards, tokenizer, broadcaster=broadcaster,
                              **spec["coordinator_kwargs"]).start()
    _exit_with_parent()
    conn.send(("ok", coordinator.url))
    served = InChild(coordinator, broadcaster, rewards)
    while True:
        try:
            method, args, reply = conn.recv()
        except (EOFError, OSError):  # the learner is gone without saying close (killed): leave the journal as
            log.warning("learner process gone; coordinator exiting")  # it is, for a resume to book what was open
            served.abort()
            return
        if method is InChild.close:
            accounting = served.close()
            try:
                conn.send(("ok", accounting))
            except OSError:
                pass
            return
        try:
            value = method(served, *args)
            if reply:
                conn.send(("ok", value))
        except Exception as e:  # report to the learner; the coordinator's state is untouched by a failed call
            if not isinstance(e, TimeoutError):  # a take that found no batch yet: the learner asks again
                log.exception("coordinator call %s failed", method.__name__)
            if reply:
                conn.send(("error", (type(e).__name__, str(e))))


class InChild:
    """What the coordinator process does for each of CoordinatorProcess's calls, one method per call (the learner
    sends the method itself down the pipe)."""

    def __init__(self, coordinator: Any, broadcaster: Any, rewards: Any = None):
        self.coordinator, self.broadcaster, self.rewards = coordinator, broadcaster, rewards

    def take(self, n: int, timeout_s: float | None) -> list:
        return self.coordinator.take(n, timeout_s)

    def set_version(self, version: int) -> None:
        self.coordinator.set_version(version)

    def publish(self, version: int, path: str, probe: dict | None) -> None:
        self.broadcaster.publish(version, _map(path), probe)

    def metrics(self) -> dict[str, float]:
        return {**self.coordinator.metrics(), **self.broadcaster.metrics()}

    def status(self) -> dict[str, Any]:
        return self.coordinator.status()

    def mark(self) -> int:
        return self.coordinator.mark()

    def check(self, stats: dict[str, tuple[int, float, float]]) -> list[str]:
        return self.coordinator.check(stats)

    def close(self) -> dict[str, Any]:
        """Stop serving; the rollout accounting, with what was buffered or in flight counted as at the end."""
        self.broadcaster.close()
        try:
            return self.coordinator.close()
        finally:
            if self.rewards is not None:
                self.rewards.close()

    def abort(self) -> None:
        """The learner died: stop without settling the journal."""
        self.broadcaster.close()
        self.coordinator.abort()
        if self.rewards is not None:
            self.rewards.close()


def _map(path: str) -> mmap.mmap:
    """The learner's snapshot memory file, mapped read-only: its memory stays while the map does."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _exit_with_parent() -> None:
    """A learner killed with SIGKILL sends no close: leave when its process handle becomes ready."""
    parent = mp.parent_process()

    def watch():
        parent.join()
        log.warning("learner process gone; coordinator exiting")
        os._exit(0)

    if parent is not None:
        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _configure_logging(log_path: str | None, level: int) -> None:
    fmt = logging.Formatter("[%(asctime)s][coordinator][%(name)s][%(levelname)s] - %(message)s")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        handlers.append(logging.FileHandler(log_path))
    root = logging.getLogger()
    root.setLevel(level or logging.INFO)
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
