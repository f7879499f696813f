"""The operator's hook on a change of the active set: logs each change and runs ``activation.on_change``.

The planning itself (T_train and throughput estimates, cost accrual, re-plan timing, the solver) is pure and
lives in echo2/activation/planner.py; the coordinator feeds it and hands each ``Change`` it returns to
``OnChangeHook``. The hook is a shell command (a cloud provider's stop/start of instances; see
conf/activation/default.yaml) started in its own process group, from where train.py was started (told the run dir
in $ECHO2_RUN_DIR); it is reaped, and its exit status logged, on a later call, so the coordinator's lock is never
held while it runs.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from typing import Any

from echo2.activation.planner import Change

log = logging.getLogger(__name__)


class OnChangeHook:
    def __init__(self, command: str | None, run_dir: str | None = None):
        self.command = command
        self.run_dir = run_dir or os.getcwd()
        self.running: list[subprocess.Popen] = []

    def __call__(self, change: Change, workers: list[Any], solver: str) -> None:
        """Log the change; start the command, told who is on and who was switched on and off."""
        log.info("activation re-plan %d (%s): active %s%s%s", change.replan, solver, sorted(change.active),
                 f"; activated {sorted(change.on)}" if change.on else "",
                 f"; deactivated {sorted(change.off)}" if change.off else "")
        if not self.command:
            return
        ids = lambda xs: ",".join(sorted(xs))  # noqa: E731
        env = dict(os.environ, ECHO2_RUN_DIR=self.run_dir, ECHO2_ACTIVE=ids(change.active),
                   ECHO2_ACTIVATED=ids(change.on), ECHO2_DEACTIVATED=ids(change.off), ECHO2_REPLAN=str(change.replan),
                   ECHO2_WORKERS_JSON=json.dumps([
                       {"id": w.worker_id, "snapshot_url": w.snapshot_url, "relay": w.relay,
                        "usd_per_hour": w.usd_per_hour, "active": w.worker_id in change.active} for w in workers]))
        with open(os.path.join(self.run_dir, "activation_hook.log"), "ab") as out:
            # From where train.py was started (this process inherits its directory: Hydra does not change it), so
            # that a relative path in the command means what the user typed.
            self.running.append(subprocess.Popen(self.command, shell=True, env=env, stdout=out,
                                                 stderr=subprocess.STDOUT, start_new_session=True))
        log.info("activation.on_change started (pid %d)", self.running[-1].pid)

    def reap(self) -> None:
        """Collect finished hook processes and log how each ended."""
        for p in [p for p in self.running if p.poll() is not None]:
            self.running.remove(p)
            (log.info if p.returncode == 0 else log.warning)("activation.on_change (pid %d) exited with %d", p.pid,
                                                              p.returncode)
