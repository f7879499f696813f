"""The coordinator process: what it runs, and how it answers the learner (whose side is echo2/learner/sources/coordinator_process.py).

The learner spawns it with ``serve`` as its entry point and hands it one frozen CoordinatorSettings
(echo2/settings.py); ``serve`` builds the reward pool, the broadcaster (from its config) and the Coordinator, then
runs the Coordinator method each message from the learner names (``CALLS``) until ``close``, or until the learner's
process is gone.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import sys
import threading
from typing import Any

from hydra.utils import instantiate

from echo2.coordinator import heap
from echo2.coordinator.coordinator import Coordinator
from echo2.coordinator.reward_pool import RewardPool
from echo2.seams import CoordinatorCalls

log = logging.getLogger(__name__)

CALLS = frozenset(name for name in vars(CoordinatorCalls) if not name.startswith("_")) - {"close"}
"""The Coordinator methods the learner may call through the pipe (seams.CoordinatorCalls; ``close`` ends the
process)."""


def serve(conn: Any, spec: dict[str, Any]) -> None:
    """Entry point of the coordinator process: answer the learner's calls until ``close`` or its death."""
    if spec["cores"]:  # before any thread exists, so that all of them inherit it
        os.sched_setaffinity(0, set(spec["cores"]))
    _configure_logging(spec["log_path"], spec["log_level"])
    heap.keep()  # before any thread exists too: the arena cap binds the threads started after it
    task, tokenizer, settings = spec["task"], spec["tokenizer"], spec["settings"]
    # reward functions in processes of their own
    dataset = task.train_dataset()
    rewards = RewardPool(task, tokenizer, processes=settings.reward_processes, timeout_s=settings.reward_timeout_s,
                         memory_mb=settings.reward_memory_mb, cpu_s=settings.reward_cpu_s, max_steps=settings.max_steps,
                         steps_per_epoch=len(dataset) / settings.prompts_per_step)
    # the run directory keeps the orders' sequence (broadcaster.py, order_seq.py), beside the journal
    state_dir = os.path.dirname(settings.journal) if settings.journal else None
    broadcaster = (instantiate(settings.broadcaster, secret=settings.token, state_dir=state_dir)
                   if settings.broadcaster else None)
    coordinator = Coordinator(dataset, rewards, tokenizer, settings, broadcaster,
                              encode=functools.partial(task.prompt_ids, tokenizer),
                              eval_rows=list(task.eval_dataset()) if settings.evaluate else None).start()
    _exit_with_parent()
    conn.send(("ok", coordinator.url))
    while True:
        try:
            method, args, reply = conn.recv()
        except (EOFError, OSError):  # the learner is gone without saying close (killed): leave the journal as
            log.warning("learner process gone; coordinator exiting")  # it is, for a resume to book what was open
            coordinator.abort()
            return
        if method == "close":
            accounting = coordinator.close()
            try:
                conn.send(("ok", accounting))
            except OSError:
                pass
            return
        try:
            if method not in CALLS:
                raise ValueError(f"no coordinator call {method!r}")
            value = getattr(coordinator, method)(*args)
            if reply:
                conn.send(("ok", value))
        except Exception as e:  # report to the learner; the coordinator's state is untouched by a failed call
            if not isinstance(e, TimeoutError):  # a take that found no batch yet: the learner asks again
                log.exception("coordinator call %s failed", method)
            if reply:
                conn.send(("error", (type(e).__name__, str(e))))


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
