"""The coordinator process's own children: a fresh Python interpreter on a socket, without the run secret.

    spawn(module, *args) ──► python -m MODULE FD ARGS  (its own session, stdin closed, ECHO2_TOKEN left out)
         ◄── Connection ──► ready(conn, build): build what it serves, then ("ready", pid), or ("failed", traceback)

Used by the reward processes (reward_pool.py) and the probe process (prober.py). Why fresh interpreters, not fork:
the coordinator process runs threads (HTTP, reaper, broadcaster), and forking a threaded process is unsafe; it is
also a daemonic multiprocessing child, which may not start multiprocessing children.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

SECRET_ENV = ("ECHO2_TOKEN",)
"""Left out of every child's environment (and the activation hook's, on_change.py): a reward process parses
strangers' text, the probe process reads only snapshots, a hook runs a cloud CLI with its own credentials; none needs
the run secret."""


def secret_free_env() -> dict[str, str]:
    """This process's environment without the run secret."""
    return {k: v for k, v in os.environ.items() if k not in SECRET_ENV}


def spawn(module: str, *args: str) -> tuple[subprocess.Popen, Connection]:
    """``python -m module FD *args`` (FD: its end of a new socket pair) with this process's import path, in a session
    of its own (a Ctrl-C in the terminal is the learner's to handle); our end of the socket as a Connection."""
    ours, theirs = socket.socketpair()
    env = secret_free_env()
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    try:
        popen = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno()), *args],
                                 pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return popen, Connection(ours.detach())


def ready(conn: Connection, build: Callable[[], Any]) -> Any | None:
    """In the child: ``build()`` what it serves and say ("ready", pid); if that raised, say ("failed", traceback)
    and return None (the child then ends)."""
    try:
        built = build()
    except Exception:
        conn.send(("failed", traceback.format_exc(limit=5)))
        return None
    conn.send(("ready", os.getpid()))
    return built
