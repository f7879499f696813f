"""The coordinator in its own process: calls over the pipe, a snapshot through shared memory, and deaths on
either side (a dead coordinator is a clear error for the learner; a dead learner takes the coordinator down)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from transformers import AutoTokenizer

from conftest import ROOT, alive
from echo2.worker.peer import SnapshotReceiver
from echo2.learner.sources.coordinator_process import CoordinatorDied, CoordinatorProcess
from echo2.settings import CoordinatorSettings
from echo2.net.http import Client
from echo2.tasks.arith import ArithTask

G = 2


def start(tiny_model_dir, tmp_path, token="secret"):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return CoordinatorProcess(
        task=ArithTask(level="copy", train_size=20), tokenizer=tok, log_path=str(tmp_path / "coordinator.log"),
        settings=CoordinatorSettings(token=token, staleness=1, prompts_per_step=2, group_size=G, vocab_size=len(tok),
                                     broadcaster={"_target_": "echo2.coordinator.broadcaster.RelayBroadcaster",
                                                  "timeout_s": 5},
                                     long_poll_s=0.0,
                                     sampling={"max_tokens": 3, "temperature": 1.0, "top_p": 1.0, "top_k": 0}))


def test_a_remote_source_without_a_broadcaster_is_refused(tmp_path):
    """No snapshot would ever reach its workers: refused when the source is built, before any process starts."""
    from types import SimpleNamespace

    from echo2.learner.sources.async_source import AsyncRolloutSource
    from echo2.seams import RunParts

    parts = RunParts(task=None, tokenizer=None, scorer=None, sampling=None, engine=None, model_path="m",
                     run_dir=str(tmp_path), seed=0, staleness=1, prompts_per_step=2, publish_interval=1, token="t",
                     broadcaster=None, pool=SimpleNamespace(), activation=None, broadcast_shape=None)
    with pytest.raises(ValueError, match="needs a broadcaster"):
        AsyncRolloutSource(parts)
    assert not list(tmp_path.iterdir())


def fill(url, token, groups, receiver=None):
    """A worker impersonator: register, pull ``groups`` groups, push valid results for all of them."""
    c = Client(url, token)
    peer = {"snapshot_url": receiver.url, "relay": receiver.relay_addr} if receiver else {}
    wid = c.post("/register", {"engine": "test", **peer})["worker_id"]
    work = []
    while len(work) < groups:
        work += c.post("/pull", {"worker_id": wid, "version": 0, "max_groups": groups - len(work)})["work"]
    results = [{"group_id": w["group_id"], "version": 0, "completions": [
        {"token_ids": [5, 1], "logprobs": [-1.0, -0.2], "finish_reason": "stop"}] * G} for w in work]
    reply = c.post("/push", {"worker_id": wid, "results": results})
    assert len(reply["accepted"]) == groups, reply
    return wid


@pytest.mark.e2e
def test_take_publish_metrics_and_close_over_the_pipe(tiny_model_dir, tmp_path):
    received = []
    receiver = SnapshotReceiver.of_run("secret", lambda v, blob, manifest: received.append((v, bytes(blob), manifest["probe"])))
    receiver.start()
    coord = start(tiny_model_dir, tmp_path)
    try:
        assert coord.proc.pid != os.getpid() and coord.proc.is_alive()
        fill(coord.url, "secret", 2, receiver=receiver)
        groups = coord.take(2, timeout_s=10)
        assert len(groups) == 2 and all(len(g.rollouts) == G for g in groups)
        assert all(r.reward is not None and r.version == 0 for g in groups for r in g.rollouts)  # scored there
        coord.set_version(1)
        blob = b"not really safetensors, but bytes are bytes"
        probe = {"token_ids": [3, 4], "logprobs": [-0.5], "dtype": "float32"}
        coord.publish(1, blob, probe)
        deadline = time.monotonic() + 10
        while not received and time.monotonic() < deadline:
            time.sleep(0.05)
        # pulled through the relay, every chunk checked against the signed manifest, which carries the probe
        assert received == [(1, blob, probe)]
        for v in (2, 3):  # the learner keeps only the last two staged memory files open
            coord.publish(v, blob)
        assert len(coord.staged) == 2
        m = coord.metrics()
        assert m["rollout/received"] == 2 * G and "broadcast/bytes" in m
        with pytest.raises(TimeoutError, match="admissible"):
            coord.take(2, timeout_s=0.5)
        status = coord.status()
        assert status["registered"] == 1 and status["version"] == 1
    finally:
        acc = coord.close()
        receiver.close()
    assert acc["consumed"] == 2 * G and acc["dispatched"] == 2 * G, acc
    assert not coord.proc.is_alive() and not coord.staged


@pytest.mark.e2e
def test_a_dead_coordinator_is_a_clear_error(tiny_model_dir, tmp_path):
    coord = start(tiny_model_dir, tmp_path)
    os.kill(coord.proc.pid, signal.SIGKILL)
    coord.proc.join(timeout=10)
    with pytest.raises(CoordinatorDied, match=r"exit code -9; log: .*coordinator.log"):
        coord.take(2, timeout_s=5)
    with pytest.raises(CoordinatorDied):
        coord.close()


@pytest.mark.e2e
def test_a_killed_learner_takes_its_coordinator_down(tiny_model_dir, tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(ROOT / 'tests')!r}, {str(ROOT / 'tests' / 'learner')!r}]
        from pathlib import Path
        from test_coordinator_process import start
        coord = start({tiny_model_dir!r}, Path({str(tmp_path)!r}))
        print(coord.proc.pid, flush=True)
        time.sleep(600)
    """)
    learner = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        child = int(learner.stdout.readline())
        assert alive(child)
        os.kill(learner.pid, signal.SIGKILL)
        learner.wait()
        deadline = time.monotonic() + 20
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(child), "coordinator outlived a SIGKILLed learner"
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait()
