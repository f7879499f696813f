"""The operator's hook on a change of the active set: logs each change and runs ``activation.on_change``.

The planning itself (T_train and throughput estimates, cost accrual, re-plan timing, the solver) is pure and
lives in echo2/activation/planner.py; the coordinator feeds it and hands each ``Change`` it returns to
``OnChangeHook``. The hook is a shell command (a cloud provider's stop/start of instances; see
conf/activation/default.yaml) started in its own process group, from where train.py was started (told the run dir
in $ECHO2_RUN_DIR); it is reaped, and its exit status logged, on a later call, so the coordinator's lock is never
held while it runs.

What it is told: the change's ids in small variables (ECHO2_ACTIVE, ECHO2_ACTIVATED, ECHO2_DEACTIVATED,
ECHO2_REPLAN), and every worker in a JSON file named by ECHO2_WORKERS_FILE: one environment string is limited to
128 KiB on Linux, which all workers in one variable passed at about 900 workers (exec failed with E2BIG). The file
also holds the id lists, whole; a list too long for its variable (past ENV_VALUE_BYTES: ~10,000 workers) is left
out of the environment and the hook reads it there. A hook that cannot be started (E2BIG, a fork that failed) is
started again on the next reaper pass, told everything switched on and off since the last hook that started, so
that no change is lost to one failed exec. The hook does not inherit the run secret (child.SECRET_ENV).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from typing import Any

from echo2.activation.planner import Change
from echo2.coordinator import child

log = logging.getLogger(__name__)

ENV_VALUE_BYTES = 64 << 10
"""The longest id list passed in a variable (half the kernel's 128 KiB per string, leaving room for the rest)."""
KEEP_FILES = 16
"""Workers files kept in <run dir>/activation/ (hooks run in the background and may still read an older one)."""
RETRY_S = 5.0
"""Wait between tries to start a hook that could not be started."""


class OnChangeHook:
    def __init__(self, command: str | None, run_dir: str | None = None):
        self.command = command
        self.run_dir = run_dir or os.getcwd()
        self.running: list[subprocess.Popen] = []
        self.pending: tuple[Change, list[dict]] | None = None  # a change whose hook has not started yet
        self.next_try = 0.0
        self.failed_starts = 0

    def __call__(self, change: Change, workers: list[Any], solver: str) -> None:
        """Log the change; start the command, told who is on and who was switched on and off."""
        log.info("activation re-plan %d (%s): active %s%s%s", change.replan, solver, sorted(change.active),
                 f"; activated {sorted(change.on)}" if change.on else "",
                 f"; deactivated {sorted(change.off)}" if change.off else "")
        if not self.command:
            return
        described = [{"id": w.worker_id, "snapshot_url": w.snapshot_url, "relay": w.relay,
                      "usd_per_hour": w.usd_per_hour, "active": w.worker_id in change.active} for w in workers]
        if self.pending:  # its hook never started: this one tells both, of the workers still live
            live = {w["id"] for w in described}
            merged = merge(self.pending[0], change)
            change = Change(merged.active, merged.on & live, merged.off & live, merged.replan)
        self.pending = (change, described)
        self.next_try = 0.0
        self._start_pending()

    def reap(self) -> None:
        """Collect finished hook processes and log how each ended; retry a hook that could not be started."""
        for p in [p for p in self.running if p.poll() is not None]:
            self.running.remove(p)
            (log.info if p.returncode == 0 else log.warning)("activation.on_change (pid %d) exited with %d", p.pid,
                                                              p.returncode)
        if self.pending is not None and time.monotonic() >= self.next_try:
            self._start_pending()

    def _start_pending(self) -> None:
        change, workers = self.pending
        path = self._write(change, workers)
        env = child.secret_free_env()  # a cloud CLI needs its own credentials, not the run secret
        env.update(ECHO2_RUN_DIR=self.run_dir, ECHO2_REPLAN=str(change.replan), ECHO2_WORKERS_FILE=path)
        for name, ids in (("ECHO2_ACTIVE", change.active), ("ECHO2_ACTIVATED", change.on),
                          ("ECHO2_DEACTIVATED", change.off)):
            value = ",".join(sorted(ids))
            if len(value.encode()) <= ENV_VALUE_BYTES:
                env[name] = value
            else:
                log.warning("activation.on_change: %s lists %d workers, too many for a variable: only in %s", name,
                            len(ids), path)
        try:
            with open(os.path.join(self.run_dir, "activation_hook.log"), "ab") as out:
                # From where train.py was started (this process inherits its directory: Hydra does not change it),
                # so that a relative path in the command means what the user typed.
                proc = subprocess.Popen(self.command, shell=True, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        except OSError as e:
            self.failed_starts += 1
            self.next_try = time.monotonic() + RETRY_S
            log.error("activation.on_change could not start (%s); trying again in %.0f s with every change since",
                      e, RETRY_S)
            return
        self.pending = None
        self.running.append(proc)
        log.info("activation.on_change started (pid %d)", proc.pid)

    def _write(self, change: Change, workers: list[dict]) -> str:
        """The change and every worker, as JSON in <run dir>/activation/workers.<replan>.json (written whole, then
        renamed into place); older files past KEEP_FILES are removed."""
        folder = os.path.join(self.run_dir, "activation")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"workers.{change.replan}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"replan": change.replan, "active": sorted(change.active), "activated": sorted(change.on),
                       "deactivated": sorted(change.off), "workers": workers}, f)
        os.replace(path + ".tmp", path)
        kept = sorted((int(n.split(".")[1]), n) for n in os.listdir(folder)
                      if n.startswith("workers.") and n.endswith(".json") and n.split(".")[1].isdigit())
        for _, name in kept[:-KEEP_FILES]:
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass
        return path


def merge(earlier: Change, later: Change) -> Change:
    """One change saying what ``earlier`` then ``later`` did: the later active set, and each worker switched on or off
    by whichever of the two came last."""
    return Change(active=later.active, on=(earlier.on - later.off) | later.on,
                  off=(earlier.off - later.on) | later.off, replan=later.replan)
