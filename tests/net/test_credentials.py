"""Per-worker credentials: derived from the run secret, bound to the workers registered with them, revocable
mid-run (admin route and CLI) with the revoked worker's in-flight work re-queued and booked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, balanced, delivered_by, slow_until, small_coordinator, train, wait_until
from echo2.broadcast.manifest import verify_key
from echo2.net.http import Client, RemoteError
from echo2.credential import credential_name, worker_credential

SECRET = "secret"  # small_coordinator's run secret


def test_a_credential_names_its_worker_and_cannot_be_forged():
    cred = worker_credential(SECRET, "box17")
    assert cred.startswith("box17:") and credential_name(SECRET, cred) == "box17"
    assert credential_name(SECRET, "box17:" + "0" * 64) is None  # a guessed MAC
    assert credential_name(SECRET, worker_credential("another-run", "box17")) is None
    assert credential_name(SECRET, SECRET) is None
    for bad in ("", "a b", "x" * 65, "a:b"):
        with pytest.raises(ValueError):
            worker_credential(SECRET, bad)


@pytest.fixture
def coord(tiny_model_dir, tmp_path):
    c = small_coordinator(tiny_model_dir, journal=str(tmp_path / "rollouts.journal"))
    yield c
    c.close()


def _join(url, name):
    client = Client(url, worker_credential(SECRET, name))
    return client, client.post("/register", {})["worker_id"]


def test_a_worker_acts_only_for_itself_and_only_the_secret_revokes(coord):
    a, wa = _join(coord.url, "a")
    b, wb = _join(coord.url, "b")
    with pytest.raises(RemoteError, match="401.*did not register"):
        b.post("/pull", {"worker_id": wa, "version": 0, "max_groups": 1})
    with pytest.raises(RemoteError, match="401.*run secret"):
        a.post("/revoke", {"name": "b"})
    # what its snapshot receiver checks manifests and orders against; no secret-derived relay key is handed out (the
    # relay key is random and comes with the learner's orders)
    assert a.post("/manifest-key", {}) == {"manifest_key": verify_key(SECRET)}
    with pytest.raises(RemoteError, match="404"):
        a.post("/relay-key", {})


def test_revoking_a_worker_refuses_it_requeues_its_work_and_spares_the_others(coord, tiny_model_dir, tmp_path):
    a, wa = _join(coord.url, "a")
    b, wb = _join(coord.url, "b")
    held = a.post("/pull", {"worker_id": wa, "version": 0, "max_groups": 2})["work"]
    assert len(held) == 2
    rows = [coord.ledger.open[w["group_id"]][0] for w in held]
    reply = Client(coord.url, SECRET).post("/revoke", {"name": "a"})
    assert reply == {"revoked": "a", "retired": [wa]}
    with pytest.raises(RemoteError, match="403.*revoked"):
        a.post("/heartbeat", {"worker_id": wa})
    with pytest.raises(RemoteError, match="403"):  # registering afresh with the same credential does not help
        a.post("/register", {})
    acc = coord.accounting()
    assert acc["lost"] == {"revoked": 4} and acc["workers_retired"] == {"revoked": 1}, acc
    assert acc["requests_rejected"] == {"Revoked": 2}
    again = b.post("/pull", {"worker_id": wb, "version": 0, "max_groups": 2})["work"]  # b goes on, with a's prompts
    assert [coord.ledger.open[w["group_id"]][0] for w in again] == rows
    # a restarted coordinator (or a resumed learner) in the same run dir still refuses it
    assert (tmp_path / "revoked.txt").read_text() == "a\n"
    coord.close()
    other = small_coordinator(tiny_model_dir, journal=str(tmp_path / "rollouts.journal"), recover={"restart": True})
    try:
        with pytest.raises(RemoteError, match="403"):
            Client(other.url, worker_credential(SECRET, "a")).post("/register", {})
    finally:
        other.close()


@pytest.mark.e2e
def test_the_cli_makes_and_revokes_credentials(coord):
    env = dict(os.environ, ECHO2_TOKEN=SECRET)
    out = subprocess.run([sys.executable, "-m", "echo2.credential", "box17"], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == worker_credential(SECRET, "box17")
    _, wid = _join(coord.url, "box17")
    out = subprocess.run([sys.executable, "-m", "echo2.credential", "box17", "--revoke", "--coordinator", coord.url],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    assert f'"retired": ["{wid}"]' in out and coord.status()["workers"] == []
    bad = subprocess.run([sys.executable, "-m", "echo2.credential", "no way"], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "worker name" in bad.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_a_real_agent_with_its_own_credential_is_revoked_mid_run(tmp_path, tiny_model_dir):
    """A third worker agent joins a running job (TLS on) with its own credential and delivers; it is revoked with
    the CLI: it is refused and exits, its work is re-queued, the two local workers finish the run; the books
    balance."""
    ev = {}

    def hook(step, source):
        if step == 2:
            cred = worker_credential(source.token, "box17")
            log = open(tmp_path / "box17.log", "wb")
            ev["agent"] = subprocess.Popen(
                [sys.executable, "-m", "echo2.worker", "--coordinator", source.coordinator.url, "--ca-hash",
                 source.ca_hash, "--engine", "hf", "--model", tiny_model_dir], cwd=ROOT, stdout=log,
                stderr=subprocess.STDOUT, env=dict(os.environ, ECHO2_TOKEN=cred))
            # hold the learner until it has joined (not until it delivers: a held learner consumes nothing, so
            # nothing new is dispatched)
            wait_until(lambda: source.coordinator.status()["registered"] >= 3, timeout_s=120)
        if step > 2 and "revoke" not in ev and slow_until(lambda: delivered_by(source, "w2")):
            ev["delivered"] = source.coordinator.status()["by_worker"]["w2"]
            env = dict(os.environ, ECHO2_TOKEN=source.token)
            ev["revoke"] = subprocess.run(
                [sys.executable, "-m", "echo2.credential", "box17", "--revoke", "--coordinator", source.coordinator.url,
                 "--ca-file", str(tmp_path / "tls" / "ca.pem")], cwd=ROOT, env=env, capture_output=True, text=True)
            ev["exit"] = ev["agent"].wait(timeout=60)

    try:
        _, trainer, source, acc, _ = train(tmp_path, ["pool.engine=hf", "run.steps=60", "rollout.source.tls=on",
                                                      "rollout.source.min_workers=2"], hook)
    finally:
        if "agent" in ev and ev["agent"].poll() is None:
            ev["agent"].kill()
            ev["agent"].wait()
    assert "revoke" in ev, "the third agent delivered nothing during the run"
    assert ev["revoke"].returncode == 0, ev["revoke"].stderr
    assert trainer.state.global_step == 60 and ev["delivered"] > 0
    log = (tmp_path / "box17.log").read_text()
    assert "revoked" in log and ev["exit"] == 0, log[-2000:]
    assert acc["workers_retired"].get("revoked") == 1 and balanced(acc), acc
    assert acc["requests_rejected"].get("Revoked", 0) >= 1, acc
