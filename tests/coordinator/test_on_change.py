"""The activation hook (coordinator/on_change.py) at fleet scale: every worker in a file (one environment string is
capped at 128 KiB: all workers in a variable failed to exec past ~900 of them), the small variables kept, no run
secret in its environment, and a hook that could not start is started again with every change since. Each test
starts hook processes."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from echo2.activation.planner import Change
from echo2.coordinator import on_change
from echo2.coordinator.on_change import OnChangeHook

pytestmark = pytest.mark.e2e

READ = (f'{sys.executable} -c "import json, os; w = json.load(open(os.environ[\'ECHO2_WORKERS_FILE\'])); '
        'print(len(w[\'workers\']), len(os.environ.get(\'ECHO2_DEACTIVATED\', \'\').split(\',\')), '
        'os.environ.get(\'ECHO2_TOKEN\', \'no secret\'), sep=\'|\')" > "$ECHO2_RUN_DIR/hook.out"')


def fleet(n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(worker_id=f"w{i}", snapshot_url=f"https://worker-{i:05d}.gpu.example.com:8702",
                            relay=f"worker-{i:05d}.gpu.example.com:8703", usd_per_hour=0.39) for i in range(n)]


def test_two_thousand_workers_reach_the_hook_without_the_run_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO2_TOKEN", "the-run-secret")
    workers = fleet(2000)
    hook = OnChangeHook(READ, run_dir=str(tmp_path))
    off = frozenset(w.worker_id for w in workers[1000:])
    hook(Change(active=frozenset(w.worker_id for w in workers[:1000]), on=frozenset(), off=off, replan=3),
         workers, "exact")
    assert hook.running and hook.pending is None
    hook.running[0].wait(timeout=60)
    assert hook.running[0].returncode == 0, (tmp_path / "activation_hook.log").read_text()
    count, told, secret = (tmp_path / "hook.out").read_text().split("|")
    assert (int(count), int(told)) == (2000, 1000) and secret.strip() == "no secret"
    saved = json.loads((tmp_path / "activation" / "workers.3.json").read_text())
    assert saved["replan"] == 3 and len(saved["deactivated"]) == 1000 and saved["workers"][0]["active"]


def test_a_hook_that_could_not_start_is_started_again_with_every_change_since(tmp_path, monkeypatch):
    """The planner has applied a change by the time its hook starts; a hook that failed to exec (E2BIG, a fork that
    failed) was never retried, so workers switched off kept running and being billed. Now the next reaper pass
    starts it again, told what both changes switched on and off."""
    monkeypatch.setattr(on_change, "RETRY_S", 0.0)
    real, calls = subprocess.Popen, []

    def failing_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.E2BIG, "Argument list too long")
        return real(*a, **k)

    monkeypatch.setattr(subprocess, "Popen", failing_once)
    workers = fleet(4)
    hook = OnChangeHook(READ, run_dir=str(tmp_path))
    hook(Change(frozenset({"w0", "w1", "w2"}), frozenset(), frozenset({"w3"}), 1), workers, "exact")
    assert hook.pending is not None and not hook.running and hook.failed_starts == 1
    hook(Change(frozenset({"w0", "w3"}), frozenset({"w3"}), frozenset({"w1", "w2"}), 2), workers, "exact")
    hook.running[0].wait(timeout=60)
    told = json.loads((tmp_path / "activation" / "workers.2.json").read_text())
    assert told["activated"] == ["w3"] and told["deactivated"] == ["w1", "w2"]  # w3: off, then on again
    hook.pending = (Change(frozenset(), frozenset(), frozenset({"w0"}), 3), [])
    hook.reap()  # a pending hook is retried on a reaper pass
    assert hook.pending is None and len(hook.running) >= 1
    for p in hook.running:
        p.wait(timeout=60)
