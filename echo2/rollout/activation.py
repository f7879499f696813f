"""The coordinator's side of activation and cost accounting: measurements in, an active set and dollars out.

    take() returns ─► took(t)          } the learner's compute per step, T_train = set_version − take
    set_version    ─► step_done(t)     } and the dollars of that step: (learner + active workers' $/h) × Δt
    reaper loop    ─► replan(workers)  every ``replan_every_s``, and within a second of a join or a leave:
                      System from measurements (T_train, μ_i from pushes, snapshot bytes and dissemination time
                      from the broadcaster) → OnlineActivation (echo2/activation/online.py) → active set

Called with the coordinator's lock held; no threads or sockets of its own. Workers that have not reported a
throughput yet are planned with the mean of those that have (1 rollout/s if none has). A change of the active
set runs ``activation.on_change`` (a shell command: stop or start cloud instances) in its own process, which
is reaped, and its exit status logged, on a later call.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from dataclasses import asdict
from typing import Any

from echo2.activation.online import OnlineActivation
from echo2.activation.solve import System, Worker
from echo2.config import ActivationConfig

log = logging.getLogger(__name__)


class Activation:
    def __init__(self, cfg: dict[str, Any], staleness: int, rollouts_per_step: int, run_dir: str | None = None):
        # conf/activation's defaults (its schema), plus what train.py adds: from the broadcast group, and the
        # directory it was started from (``workdir``, where activation.on_change runs)
        self.cfg = {**asdict(ActivationConfig()), "interval": 1, "broadcast": "pipelined", **cfg}
        self.staleness, self.R = staleness, rollouts_per_step
        self.online = OnlineActivation(self.cfg["solver"], self.cfg["hysteresis"])
        self.active: frozenset[str] | None = None  # None: everyone (before the first plan)
        self.dirty = False
        self.next_at = 0.0
        self.train_step_s: float | None = None  # EMA of the learner's compute per step
        self.taken_at: float | None = None
        self.last_step_at: float | None = None
        self.usd = 0.0
        self.step_usd = 0.0
        self.run_dir = run_dir or os.getcwd()
        self.hooks: list[subprocess.Popen] = []

    def is_active(self, worker_id: str) -> bool:
        return self.active is None or worker_id in self.active

    def took(self, now: float) -> None:
        self.taken_at = now

    def step_done(self, workers: dict, now: float) -> None:
        if self.taken_at is not None:
            dt = now - self.taken_at
            self.train_step_s = dt if self.train_step_s is None else 0.8 * self.train_step_s + 0.2 * dt
        if self.last_step_at is not None:
            self.step_usd = (now - self.last_step_at) / 3600 * self.usd_per_hour(workers)
            self.usd += self.step_usd
        self.last_step_at = now

    def usd_per_hour(self, workers: dict) -> float:
        return self.cfg["learner_usd_per_hour"] + sum(
            w.usd_per_hour for w in workers.values() if self.is_active(w.worker_id))

    def replan(self, workers: list, bcast: dict[str, float], now: float) -> bool:
        """Re-plan if due; True if the active set changed."""
        self._reap_hooks()
        if not workers or self.train_step_s is None or (now < self.next_at and not self.dirty):
            return False
        self.next_at, self.dirty = now + self.cfg["replan_every_s"], False
        known = [w.rollouts_per_s for w in workers if w.rollouts_per_s > 0]
        prior = sum(known) / len(known) if known else 1.0
        specs = [Worker(w.worker_id, w.usd_per_hour, w.rollouts_per_s or prior, w.down_mbit, w.up_mbit, w.rtt_ms)
                 for w in workers]
        system = System(self.R, self.train_step_s, self.staleness, self.cfg["interval"],
                        float(bcast.get("broadcast/bytes", 0.0)), self.cfg["learner_usd_per_hour"],
                        self.cfg["learner_uplink_mbit"], self.cfg["broadcast"], self.cfg["load_s"],
                        min_utilization=self.cfg["min_utilization"])
        new = self.online.update(system, specs)
        if new is None:
            return False
        live = frozenset(w.worker_id for w in workers)
        before = self.active if self.active is not None else live  # before a first plan, everyone works
        on, off = new - before, (before & live) - new  # a worker that left is gone, not deactivated
        log.info("activation re-plan %d (%s): active %s%s%s", self.online.replans, self.cfg["solver"], sorted(new),
                 f"; activated {sorted(on)}" if on else "", f"; deactivated {sorted(off)}" if off else "")
        self.active = new
        self._run_hook(workers, on, off)
        return True

    def _run_hook(self, workers: list, on: frozenset[str], off: frozenset[str]) -> None:
        """activation.on_change, told who is on and who was switched on and off (see conf/activation)."""
        if not self.cfg.get("on_change"):
            return
        ids = lambda xs: ",".join(sorted(xs))  # noqa: E731
        env = dict(os.environ, ECHO2_RUN_DIR=self.run_dir, ECHO2_ACTIVE=ids(self.active), ECHO2_ACTIVATED=ids(on),
                   ECHO2_DEACTIVATED=ids(off), ECHO2_REPLAN=str(self.online.replans), ECHO2_WORKERS_JSON=json.dumps([
                       {"id": w.worker_id, "snapshot_url": w.snapshot_url, "relay": w.relay,
                        "usd_per_hour": w.usd_per_hour, "active": w.worker_id in self.active} for w in workers]))
        with open(os.path.join(self.run_dir, "activation_hook.log"), "ab") as out:
            # From where train.py was started, so that a relative path in the command means what the user typed.
            self.hooks.append(subprocess.Popen(self.cfg["on_change"], shell=True, cwd=self.cfg.get("workdir"),
                                               env=env, stdout=out, stderr=subprocess.STDOUT,
                                               start_new_session=True))
        log.info("activation.on_change started (pid %d)", self.hooks[-1].pid)

    def _reap_hooks(self) -> None:
        for p in [p for p in self.hooks if p.poll() is not None]:
            self.hooks.remove(p)
            (log.info if p.returncode == 0 else log.warning)("activation.on_change (pid %d) exited with %d", p.pid,
                                                              p.returncode)

    def metrics(self, workers: dict) -> dict[str, float]:
        return {"cost/usd": self.usd, "cost/usd_per_step": self.step_usd,
                "cost/usd_per_hour": self.usd_per_hour(workers),
                "activation/active_workers": float(sum(self.is_active(w) for w in workers)),
                "activation/replans": float(self.online.replans)}
