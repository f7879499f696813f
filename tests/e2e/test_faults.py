"""Faults with real processes: a stopped (straggling) worker, a killed coordinator, a killed learner resumed from
its checkpoint. Every run must finish, and its books must balance (conftest.balanced). Killed workers are in
test_async_e2e.py; peers dying mid-relay in test_relay.py and below; a cut link in test_testbed.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from conftest import (ROOT, alive, balanced, delivered_by, descendants, read_jsonl, slow_until, train, wait_registered,
                      wait_until)
from echo2.learner.sources.pool import terminate

pytestmark = pytest.mark.slow


def test_a_stopped_worker_is_retired_and_rejoins_when_continued(tmp_path):
    """SIGSTOP one of two workers: past the heartbeat timeout it is declared dead (what it held is counted lost)
    and the run goes on with the other; after SIGCONT it finds itself forgotten, registers again and delivers."""
    ev = {}

    def hook(step, source):
        if step == 2:
            wait_registered(source, 2)
        if step == 3:
            ev["pid"] = source.pool.procs[0].pid
            os.kill(ev["pid"], signal.SIGSTOP)
            ev["stopped"] = time.monotonic()
            # the learner is held until the coordinator has retired it (2 s heartbeat timeout); what the stopped worker
            # holds then (it cannot pull or push any more; it may hold nothing) is what must be counted lost
            held = {}

            def retired() -> bool:
                status = source.coordinator.status()
                if len(status["workers"]) == 2:
                    held.update(status["held"])
                    return False
                ev["held"] = sum(n for w, n in held.items() if w not in status["workers"])
                return True

            wait_until(retired, timeout_s=30, what="the coordinator to retire the stopped worker")
        if step == 6 and "pid" in ev:
            os.kill(ev["pid"], signal.SIGCONT)
            ev["continued"] = time.monotonic()
        if step == 10:
            wait_registered(source, 3)  # it came back
        if step > 10:
            slow_until(lambda: delivered_by(source, "w2"))

    cfg, trainer, source, acc, _ = train(tmp_path, ["pool.engine=hf", "run.steps=40",
                                                    "rollout.source.heartbeat_timeout_s=2"], hook)
    assert trainer.state.global_step == 40 and "continued" in ev
    assert acc["workers_retired"].get("worker_dead") == 1, acc
    assert acc["lost"].get("worker_dead", 0) == ev["held"] * cfg.rollout.group_size, (ev, acc)  # what it held
    assert acc["by_worker"].get("w2", 0) > 0, acc["by_worker"]  # it came back as w2 and delivered
    assert balanced(acc), acc


def test_the_coordinator_killed_mid_run_is_restarted_and_workers_reconnect(tmp_path):
    """kill -9 the coordinator process: the learner's next call starts a new one on the same port from the
    journal; the workers, failing to reach it, back off and retry, then register again; training finishes."""
    ev = {}

    def hook(step, source):
        if step == 2:
            wait_registered(source, 2)
        if step == 8:
            ev["old_pid"] = source.coordinator.proc.pid
            os.kill(ev["old_pid"], signal.SIGKILL)
        if step == 12:
            ev["new_pid"] = source.coordinator.proc.pid
            wait_registered(source, 2)  # both back, in the new coordinator
        if step > 12:
            slow_until(lambda: delivered_by(source, "w2", "w3"))

    _, trainer, source, acc, records = train(tmp_path, ["pool.engine=hf", "run.steps=40"], hook)
    assert trainer.state.global_step == 40 and ev["new_pid"] != ev["old_pid"]
    assert acc["coordinator_restarts"] == 1 and records[-1]["rollout/coordinator_restarts"] == 1
    # What the dead process held is accounted for: the journal's books carry over and its open groups are lost.
    assert acc["lost"].get("coordinator_restart", 0) + acc["dropped"].get("coordinator_restart", 0) > 0, acc
    assert acc["consumed"] == 40 * 16 * 8
    # w0, w1 before; w2, w3 after (ids are never reused), and both delivered to the new coordinator
    assert sorted(w for w in acc["by_worker"] if int(w[1:]) >= 2) == ["w2", "w3"], acc["by_worker"]
    assert balanced(acc), acc
    assert not alive(ev["old_pid"])


def test_a_killed_learner_resumes_from_its_checkpoint_with_a_gapless_consumed_log(tmp_path):
    """kill -9 the learner (its coordinator and workers go with it) after its step-10 checkpoint; the same command
    resumes from the newest checkpoint (it says which): the step count, data position and rollout books come back,
    so the consumed-rollout log covers every step once, no group twice, each within the staleness bound across
    the restart; the books balance, with the dead run's post-checkpoint work counted (dropped:
    discarded_by_resume / learner_restart). The journal is rewritten at every checkpoint (journal_compact_mb=0), so
    the resume reads a compacted one. Weights, optimizer and RNG are restored by the HF Trainer's own resume; this
    test does not compare them."""
    args = [sys.executable, "train.py", "pool.engine=hf", "run.steps=25", "run.save_every_steps=5",
            "rollout.source.journal_compact_mb=0",
            "run.eval_every_steps=0", "run.progress=false", "run.wandb=disabled", f"hydra.run.dir={tmp_path}"]
    env = dict(os.environ)
    first = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 13:
            break
        time.sleep(0.2)
    family = {first.pid} | descendants(first.pid)
    first.kill()
    first.wait()
    killed_at = len(metrics.read_text().splitlines())
    assert 13 <= killed_at < 25, killed_at
    saved = [int(p.parent.name.split("-")[1]) for p in (tmp_path / "trainer").glob("checkpoint-*/echo2_state.json")]
    resume_step = max(saved)
    assert 10 <= resume_step <= killed_at
    assert (tmp_path / "rollouts.journal").read_bytes().startswith(b'["b","')  # compacted at step 10
    wait_until(lambda: not any(alive(p) for p in family), timeout_s=30,
               what="the killed learner's coordinator and workers to exit")
    assert not [p for p in family if alive(p)], "the learner's coordinator or workers outlived it"

    second = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    out = second.stdout + second.stderr
    assert f"checkpoint-{resume_step} (step {resume_step})" in out, out[-3000:]
    consumed = read_jsonl(tmp_path / "consumed.jsonl")
    assert [c["step"] for c in consumed] == list(range(1, 26))
    groups = [g for c in consumed for g in c["groups"]]
    assert len(groups) == len(set(groups)) == 25 * 16, "a group trained on twice"
    # the staleness bound across the restart: at learner step t (logged as step t + 1) every group's version x has
    # t - x <= S, and no group comes from a version the learner had not yet made (t - x >= 0)
    staleness = OmegaConf.load(tmp_path / "resolved_config.yaml").rollout.staleness
    assert all(len(c["groups"]) == 16 for c in consumed)
    lags = [(c["step"], c["step"] - 1 - min(c["versions"]), c["step"] - 1 - max(c["versions"])) for c in consumed]
    assert all(0 <= newest and oldest <= staleness for _, oldest, newest in lags), (staleness, lags)
    assert any(oldest > 0 for _, oldest, _ in lags), "never off-policy: the bound was not exercised"
    assert [r["step"] for r in read_jsonl(metrics)] == list(range(1, 26))
    summary = json.loads((tmp_path / "summary.json").read_text())
    acc = summary["rollout_accounting"]
    assert summary["steps"] == 25 and acc["consumed"] == 25 * 16 * 8 and balanced(acc), acc
    assert acc["dropped"].get("discarded_by_resume", 0) >= (killed_at - resume_step) * 16 * 8, acc
    assert "unconsumed_at_end" not in acc["dropped"] or acc["dropped"]["unconsumed_at_end"] <= 3 * 16 * 8, acc


def test_a_relay_peer_killed_mid_relay_is_routed_around(tmp_path):
    """Two real peer processes in a chain, learner -> A -> B, A's uplink shaped to 40 Mbit/s so that B's copy
    streams through A for ~1.7 s; kill -9 A mid-stream: B resumes from the origin at the byte it holds and
    gets a verified snapshot; the origin sends B only what it lacked."""
    from echo2.coordinator.broadcaster import RelayBroadcaster

    env = dict(os.environ, ECHO2_TOKEN="t0k")
    peers, procs = [], []
    for up in (40, 1000):
        p = subprocess.Popen([sys.executable, "-m", "echo2.lab.bench", "--role", "peer", "--host", "127.0.0.1",
                              "--up-mbit", str(up), "--down-mbit", "1000"], cwd=ROOT, env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        peers.append(json.loads(p.stdout.readline()))
    delivered = {}
    bc = RelayBroadcaster("t0k", topology="chain", chunk_mb=1, retry_s=60)
    bc.on_delivered = lambda peer, v: delivered.setdefault(peer, v)
    try:
        bc.add_peer("A", peers[0]["url"], peers[0]["relay"])
        bc.add_peer("B", peers[1]["url"], peers[1]["relay"])
        # as if measured in earlier rounds: A downloads faster, so it heads the chain (unmeasured peers would be
        # ordered by their loopback RTTs, microseconds apart: noise)
        bc.peers["A"].rate_bytes_per_s, bc.peers["B"].rate_bytes_per_s = 100e6, 50e6
        size = 8 << 20
        blob = os.urandom(size)
        bc.publish(1, blob)
        time.sleep(0.7)  # A has it all from the origin (1 Gbit/s); B is ~40 % through A's 40 Mbit/s uplink
        procs[0].kill()
        killed_at = time.monotonic()
        wait_until(lambda: "B" in delivered, timeout_s=60, what="B to receive the snapshot")
        assert delivered.get("B") == 1, delivered
        assert bc.last_results["B"]["done_at"] > killed_at, "B was done before the kill: not mid-relay"
        # the origin sent A its copy and B less than a whole one (what it lacked when A died)
        assert bc.server.served_bytes < 2 * size, bc.server.served_bytes
        assert bc.last_results["B"]["depth"] == 1, "B was not behind A in the chain: nothing was relayed by A"
    finally:
        bc.close()
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
            p.wait(timeout=30)


def test_a_worker_cut_off_the_network_is_retired_and_rejoins_when_reconnected(tmp_path):
    """The namespace testbed: learner on h0, workers on h1 and h2 (20 ms RTT, 100 Mbit/s). h1's link is cut
    (its switch port down): the coordinator retires it and training goes on with h2;
    when the link comes back the agent, whose requests had stalled, is told to register again and delivers. The
    learner is then stopped with SIGTERM (it finishes its step, writes the summary) and the books balance."""
    from echo2.lab import testbed

    why = testbed.available()
    if why:
        pytest.skip(f"require_netns: {why}")
    from echo2.models.tiny import build_tiny

    from echo2.net.tls import RunCA

    model, port, token = build_tiny(), 29517, "cut-" + os.urandom(6).hex()
    env = dict(os.environ, ECHO2_TOKEN=token)
    ca = RunCA(str(tmp_path / "tls"))  # the run's CA, made here to know its fingerprint (the learner reuses it)
    with testbed.NetnsTestbed([testbed.HostLink(100, 100)] * 3, rtt_ms=20, prefix=f"e2f{os.getpid()}") as tb:
        learner_addr = tb.addr(0)
        learner = tb.popen(0, [sys.executable, "train.py", "pool=static", f"rollout.source.host={learner_addr}",
                               f"rollout.source.port={port}", "rollout.source.heartbeat_timeout_s=3",
                               # the testbed's addresses are in 127/8, where TLS is off by default: as on a WAN
                               "rollout.source.tls=on",
                               f"broadcast.sender.host={learner_addr}", "run.steps=100000",
                               "run.save_every_steps=0", "run.eval_every_steps=0", "run.progress=false",
                               "run.wandb=disabled", f"hydra.run.dir={tmp_path}"],
                           cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        logs = [tmp_path / f"agent{i}.log" for i in (1, 2)]
        agents = [tb.popen(i, [sys.executable, "-m", "echo2.worker", "--coordinator",
                               f"https://{learner_addr}:{port}", "--ca-hash", ca.fingerprint, "--engine", "hf",
                               "--model", model, "--listen-host", tb.addr(i)],
                           cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
                  for i, log in zip((1, 2), logs, strict=True)]
        try:
            metrics = tmp_path / "metrics.jsonl"
            steps = lambda: len(metrics.read_text().splitlines()) if metrics.exists() else 0  # noqa: E731
            registered = lambda log: log.read_text(errors="replace").count("registered as")  # noqa: E731

            def delivering() -> int:
                """Workers that have pushed rollouts (each has a measured throughput in the last metrics line)."""
                lines = metrics.read_text().splitlines() if metrics.exists() else []
                last = json.loads(lines[-1]) if lines else {}
                # a registered worker's key is there from the start, at 0.0: only a push gives it a rate
                return sum(k.startswith("rollout/throughput/") and v > 0 for k, v in last.items())

            # both must have delivered before the cut (a worker that registers late can be cut before its first push)
            wait_until(lambda: steps() >= 20 and all(registered(log) for log in logs) and delivering() >= 2,
                       timeout_s=180, what="20 steps with both agents registered and delivering")
            assert steps() >= 20, "the run did not start"
            tb.set_link(1, up=False)
            coord_log = tmp_path / "coordinator.log"
            wait_until(lambda: "retired: worker_dead" in coord_log.read_text(), timeout_s=30,
                       what="the coordinator to retire the cut-off worker")
            cut_steps = steps()
            # h2 may have been behind h1 in the relay chain: it fails over to the origin after the relay's stall
            # timeout (10 s), and the broadcaster closes its round without the retired h1
            wait_until(lambda: steps() > cut_steps + 10, timeout_s=40, what="10 steps with one worker cut off")
            assert steps() > cut_steps + 10, "training stopped while one worker was cut off"
            tb.set_link(1, up=True)
            wait_until(lambda: registered(logs[0]) >= 2, timeout_s=180,
                       what="the reconnected agent to register again")
            assert registered(logs[0]) >= 2, logs[0].read_text()[-2000:]
            # the retired worker's key is gone, so two delivering again means the rejoined agent has pushed (the 40
            # steps below can pass before its first push: in one CI run it had registered again and never delivered)
            wait_until(lambda: delivering() >= 2, timeout_s=60, what="the rejoined agent to deliver")
            wait_until(lambda: steps() > cut_steps + 40, timeout_s=60, what="40 steps since the cut")
            learner.send_signal(signal.SIGTERM)
            learner.wait(timeout=120)
        finally:
            terminate([learner, *agents])
    summary = json.loads((tmp_path / "summary.json").read_text())
    acc = summary["rollout_accounting"]
    assert summary["stopped_by"] == "SIGTERM" and balanced(acc), acc
    assert acc["workers_retired"].get("worker_dead") == 1, acc
    assert len(acc["by_worker"]) == 3 and all(n > 0 for n in acc["by_worker"].values()), acc["by_worker"]
