"""The learner's handle on the coordinator, which runs in a process of its own so that its work never takes the
learner's GIL or core (the child's side: echo2/coordinator/process.py).

    learner process                                        coordinator process (spawned, one per run)
    AsyncRolloutSource ─ CoordinatorProcess ══ pipe ══►  process.serve() → Coordinator (HTTP server, reapers)
       collect   take(n)             request → reply (P scored groups)       + its Broadcaster (its send thread)
                                                                             + its RewardPool (reward processes)
       on_version set_version(v)     one-way
                 publish(v)          one-way; the bytes go through a memory file (memfd) the child maps, not the pipe
       metrics   metrics()           request → reply  (also status(), for tests and tools)
       on_save   mark()              request → reply (the journal's length, fsynced: where a resume starts from)
       checks    check(stats)        request → reply (the workers whose groups in the batch are not trained on)
       evaluate  request_eval(v)     one-way, after publish(v) (run.eval_on=workers)
                 evaluations()       request → reply (workers' finished evaluations)
       close     close()             request → reply (the rollout accounting); then the process exits

Each call sends the name of the method that serves it with its arguments: CoordinatorProcess.take sends
CoordinatorCalls.take (echo2/seams.py), which is Coordinator.take in the child. The learner's code imports nothing
of the coordinator: the child's entry point and the broadcaster go by name (``COORDINATOR_MAIN``, the
``broadcast.sender`` config's ``_target_``). One tool does, in this process: echo2/config.py (train.py's config
schema) reads the broadcaster's constructor to type ``broadcast.sender.*`` (tests/repo/test_layout.py names that import).

    waits for (learner): a reply to take, i.e. P admissible groups;   unblocked by: worker pushes in the child

Why: with the coordinator as threads of the learner, serving 3.4k rollouts/s (HTTP, JSON, validation, reward
scoring) made learner steps 1.96x slower (BENCHMARKS-history.md, "Does a busy coordinator slow the learner?"); the GIL was shared. Here the learner pays one pipe
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
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from echo2.broadcast.snapshot import new_memory_fd
from echo2.env import run_named
from echo2.seams import CoordinatorCalls
from echo2.settings import CoordinatorSettings

log = logging.getLogger(__name__)

COORDINATOR_MAIN = "echo2.coordinator.process:serve"
"""The coordinator process's entry point, imported by name in the child."""


class CoordinatorDied(RuntimeError):
    pass


class CoordinatorProcess:
    """The learner's handle on the coordinator process; the same calls as an in-process Coordinator."""

    def __init__(self, *, task: Any, tokenizer: Any, settings: CoordinatorSettings, log_path: str | None = None,
                 cores: list[int] | None = None, start_timeout_s: float = 120.0):
        """``settings``: what the coordinator runs with (its broadcaster's config among them, built in the child
        with the run's token as ``secret``); ``log_path``, ``cores``: where the child logs and runs."""
        self.log_path = log_path
        self.staged: deque[int] = deque()  # memory files of the last published snapshots (see _handoff)
        spec = dict(task=task, tokenizer=tokenizer, settings=settings, log_path=log_path,
                    log_level=logging.getLogger().level, cores=list(cores) if cores else None)
        ctx = mp.get_context("spawn")  # never fork a process that holds torch threads and a model
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=run_named, args=(COORDINATOR_MAIN, child_conn, spec),
                                name="echo2-coordinator", daemon=True)
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
        return self._call(CoordinatorCalls.take, n, timeout_s)

    def set_version(self, version: int) -> None:
        self._send(CoordinatorCalls.set_version, version)

    def publish(self, version: int, blob: bytes, probe: dict | None = None) -> None:
        """Hand snapshot bytes to the broadcaster in the child; returns once they are written to memory."""
        self._handoff(version, lambda path: Path(path).write_bytes(blob), probe)

    def publish_written(self, version: int, write: Callable[[str], None], probe: dict | None = None,
                        probe_dtype: str | None = None) -> None:
        """Publish what ``write(path)`` streams into a memory file (a sharded learner's gathered weights).
        ``probe_dtype``: the coordinator computes the probe's logprobs (Coordinator.publish)."""
        self._handoff(version, write, probe, probe_dtype)

    def _handoff(self, version: int, write, probe: dict | None, probe_dtype: str | None = None) -> None:
        """Write the snapshot into a new memory file and tell the child its path; the child maps it (no copy).

        A memory file (snapshot.MemoryFile says why), not a disk file, which would put every snapshot through
        the disk. The file lives until two newer ones are published: by then the child, which handles calls in
        order, has mapped it (its map keeps the memory after we close ours)."""
        fd, path = new_memory_fd(f"echo2-snapshot-v{version}")
        try:
            write(path)
        except BaseException:
            os.close(fd)
            raise
        self.staged.append(fd)
        while len(self.staged) > 2:
            os.close(self.staged.popleft())
        self._send(CoordinatorCalls.publish, version, path, probe, probe_dtype)

    def metrics(self) -> dict[str, float]:
        return self._call(CoordinatorCalls.metrics)

    def mark(self, keep_from: int | None = None) -> int:
        """The journal's length now: a learner checkpoint taken between steps resumes from here."""
        return self._call(CoordinatorCalls.mark, keep_from)

    def status(self) -> dict[str, Any]:
        return self._call(CoordinatorCalls.status)

    def check(self, stats: dict[str, tuple[int, float, float]]) -> list[str]:
        """The learner's per-worker scores of behaviour logprobs (rollout checks); returns the workers whose groups
        in the checked batch must not be trained on."""
        return self._call(CoordinatorCalls.check, stats)

    def request_eval(self, version: int) -> None:
        self._send(CoordinatorCalls.request_eval, version)

    def evaluations(self) -> dict[str, Any]:
        return self._call(CoordinatorCalls.evaluations)

    def close(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Stop serving and return the accounting (what was buffered or in flight counted as at the end)."""
        if self.closed:
            return {}
        self.closed = True
        try:
            self._send(CoordinatorCalls.close, reply=True)  # the child answers, then exits
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
        """Ask the child to run ``method`` (a CoordinatorCalls method: the Coordinator's of that name) with
        ``args``; one-way unless ``reply``. The message names the method."""
        try:
            self.conn.send((method.__name__, args, reply))
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
