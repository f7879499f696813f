"""Who a request is from, decided once, and what each caller may see and do: a worker credential cannot pass for the
run secret (two Authorization headers are refused; the route reads the identity admission established), acts only
for its own worker ids, sees only its own workers, registers at a bounded rate, and a revocation is all or nothing,
even on a full disk. Route tests against a real coordinator over loopback HTTP."""

from __future__ import annotations

import errno

import pytest

from conftest import balanced, post_with_credentials, small_coordinator
from echo2.coordinator import bounds
from echo2.coordinator.coordinator import MAX_IDS_PER_CREDENTIAL
from echo2.credential import worker_credential
from echo2.net.http import Client, RemoteError

G = 2
STRONG = "c2VjcmV0LWVub3VnaC1mb3ItYW4tZXhwb3NlZC1ydW4"  # an exposed coordinator refuses a weak run secret
DONE = {"token_ids": [5, 1], "logprobs": [-1.0, -0.2], "finish_reason": "stop"}


def results(work, version=0):
    return [{"group_id": w["group_id"], "version": version, "completions": [DONE] * G} for w in work]


def smuggle(coord, path: str, body: dict, *credentials: str) -> tuple[int, dict]:
    """POST with one Authorization header per credential, in that order (as the attack sent them)."""
    return post_with_credentials(*coord.server.address, path, body, credentials)


@pytest.fixture
def exposed(tiny_model_dir, tmp_path):
    """A coordinator listening off loopback (its address checks apply to worker credentials), TLS off."""
    c = small_coordinator(tiny_model_dir, group_size=G, host="0.0.0.0", token=STRONG,
                          journal=str(tmp_path / "rollouts.journal"))
    yield c
    c.close()


def test_a_worker_credential_never_passes_for_the_run_secret(exposed):
    """The smuggling attack, step by step: a junk first header read as "the run secret" by the route while the
    admission check took the credential in the last. Every step is now refused at admission (400), and with the
    credential alone each is what a worker credential may do, no more."""
    c = exposed
    url = f"http://127.0.0.1:{c.server.address[1]}"
    evil_cred, victim_cred = worker_credential(STRONG, "evil"), worker_credential(STRONG, "victim")
    victim = Client(url, victim_cred)
    w0 = victim.post("/register", {})["worker_id"]
    work = victim.post("/pull", {"worker_id": w0, "version": 0, "max_groups": 2})["work"]
    assert work
    evil = Client(url, evil_cred)
    for path, body in [("/register", {}), ("/register", {"snapshot_url": "http://127.0.0.1:22"}),
                       ("/heartbeat", {"worker_id": w0}), ("/pull", {"worker_id": w0, "max_groups": 4}),
                       ("/push", {"worker_id": w0, "results": results(work)}),
                       ("/release", {"worker_id": w0, "reason": "push_failed", "group_ids": [w["group_id"]
                                                                                          for w in work]}),
                       ("/leave", {"worker_id": w0}), ("/revoke", {"name": "victim"})]:
        for headers in [("junk", evil_cred), (evil_cred, "junk"), (evil_cred, STRONG), (STRONG, evil_cred)]:
            status, reply = smuggle(c, path, body, *headers)
            assert status == 400 and "Authorization headers" in reply["error"], (path, headers, reply)
        if path == "/register":
            continue
        with pytest.raises(RemoteError, match="401"):  # alone: not its worker, not its route
            evil.post(path, body)
    with pytest.raises(RemoteError, match="400.*not an address of another host"):
        evil.post("/register", {"snapshot_url": "http://127.0.0.1:22"})
    # the victim's work and record are untouched: its own push is accepted, not refused as a duplicate
    assert len(victim.post("/push", {"worker_id": w0, "results": results(work)})["accepted"]) == len(work)
    assert c.reg.principals["victim"].misses == 0 and c.status()["workers"] == [w0]


def test_one_credential_holds_at_most_its_ids_and_loses_them_all_when_revoked(exposed):
    url = f"http://127.0.0.1:{exposed.server.address[1]}"
    evil = Client(url, worker_credential(STRONG, "evil"))
    ids = [evil.post("/register", {})["worker_id"] for _ in range(MAX_IDS_PER_CREDENTIAL)]
    with pytest.raises(RemoteError, match="400.*at most 16"):
        evil.post("/register", {})
    for _ in range(3):  # smuggled past the cap: refused, not registered under the run secret
        assert smuggle(exposed, "/register", {}, "junk", worker_credential(STRONG, "evil"))[0] == 400
    assert len(exposed.status()["workers"]) == MAX_IDS_PER_CREDENTIAL
    assert Client(url, STRONG).post("/revoke", {"name": "evil"})["retired"] == sorted(ids)
    assert exposed.status()["workers"] == []


def test_one_credential_cannot_have_the_coordinator_hold_many_large_bodies_at_once(exposed):
    """Each push is bounded by the push limit, but one credential has 64 connections: each could declare the
    largest body and the coordinator would hold them all at once (a 4B-model run's push limit is ~38 MB). Now the
    bodies one credential's requests hold at once are bounded (two of the largest); a third is refused unread (503),
    another credential is not affected, and the budget comes back when a request ends. Also the per-credential
    connection cap, through the coordinator's own identities (not a stand-in)."""
    import http.client
    import socket
    import time

    host, port = "127.0.0.1", exposed.server.address[1]
    push = exposed.server.route_max_bytes["POST /push"]
    assert exposed.server.principal_body_bytes == 2 * push
    evil = worker_credential(STRONG, "evil")

    def hold(cred: str) -> socket.socket:  # headers of a push of the largest size; the body never comes
        sock = socket.create_connection((host, port))
        sock.sendall(f"POST /push HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {cred}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {push}\r\n\r\n".encode())
        return sock

    holders = [hold(evil), hold(evil)]
    time.sleep(0.3)
    third = hold(evil)
    third.settimeout(5)
    answer = third.recv(400)
    assert answer.startswith(b"HTTP/1.1 503") and b"body bytes" in answer  # refused on its headers, body unread
    other = Client(f"http://{host}:{port}", worker_credential(STRONG, "other"))
    assert other.post("/register", {})["worker_id"]  # another credential is served
    holders.pop().close()
    time.sleep(0.3)  # the server saw the disconnect: that budget is back
    again = hold(evil)
    again.settimeout(1)
    try:
        again.recv(200)
        raise AssertionError("the budget should have admitted it (it waits for its body)")
    except TimeoutError:
        pass
    for sock in [*holders, third, again]:
        sock.close()
    conns = []
    try:  # the connection cap per credential: 64, counted under the credential's name
        statuses = []
        for _ in range(65):
            c = http.client.HTTPConnection(host, port, timeout=5)
            c.request("POST", "/heartbeat", body=b'{"worker_id": "w999"}',
                      headers={"Authorization": f"Bearer {evil}", "Content-Type": "application/json"})
            statuses.append(c.getresponse().status)
            conns.append(c)
        assert statuses[:64] == [400] * 64 and statuses[64] == 503  # (400: no such worker; 503: the cap)
    finally:
        for c in conns:
            c.close()


def test_a_worker_credential_sees_only_its_own_workers(tiny_model_dir):
    coord = small_coordinator(tiny_model_dir, group_size=G)
    try:
        a, b = Client(coord.url, worker_credential("secret", "a")), Client(coord.url, worker_credential("secret", "b"))
        wa, wb = a.post("/register", {})["worker_id"], b.post("/register", {})["worker_id"]
        a.post("/push", {"worker_id": wa, "results": results(a.post("/pull", {"worker_id": wa, "version": 0,
                                                                              "max_groups": 1})["work"])})
        b.post("/pull", {"worker_id": wb, "version": 0, "max_groups": 1})
        seen = a.session.get(coord.url + "/status", timeout=5).json()
        assert seen["workers"] == [wa] and set(seen["by_worker"]) == {wa} and set(seen["held"]) <= {wa}
        assert "registered" not in seen
        full = Client(coord.url, "secret").session.get(coord.url + "/status", timeout=5).json()
        assert full["workers"] == sorted([wa, wb]) and full["held"] == {wb: 1} and full["registered"] == 2
    finally:
        coord.close()


def test_register_and_leave_in_a_loop_is_slowed_and_forgotten(tiny_model_dir):
    """Each registration costs an id, a journal line and a place in the books: a credential gets REGISTER_BURST of
    them at once, then one every REGISTER_EVERY_S (429 meanwhile, nothing written); the ids it left are forgotten
    past RETIRED_MEMORY. The run secret (the learner's own agents) is not limited."""
    coord = small_coordinator(tiny_model_dir, group_size=G)
    try:
        churn = Client(coord.url, worker_credential("secret", "churn"))
        statuses = []
        for _ in range(bounds.REGISTER_BURST + 5):
            try:
                wid = churn.post("/register", {})["worker_id"]
                churn.post("/leave", {"worker_id": wid})
                statuses.append(200)
            except RemoteError as e:
                statuses.append(e.status)
        assert statuses == [200] * bounds.REGISTER_BURST + [429] * 5, statuses
        assert coord.ledger.next_worker == bounds.REGISTER_BURST  # a refused registration takes no id
        admin = Client(coord.url, "secret")
        for _ in range(bounds.REGISTER_BURST + 5):
            admin.post("/leave", {"worker_id": admin.post("/register", {})["worker_id"]})
        assert coord.reg.principal_of == {} and len(coord.reg.retired_of) == 2 * bounds.REGISTER_BURST + 5
        assert balanced(coord.close())
    finally:
        coord.close()


def test_the_retired_ids_remembered_are_bounded(monkeypatch):
    from echo2.coordinator import registry
    from echo2.coordinator.liveness import Liveness

    monkeypatch.setattr(registry, "RETIRED_MEMORY", 3)
    reg = registry.Registry(Liveness())
    for i in range(10):
        reg.principal("box", f"w{i}")
        reg.add(registry.WorkerInfo(f"w{i}", "box", None, "hf"))
        reg.remove(f"w{i}")
    assert reg.principal_of == {} and list(reg.retired_of) == ["w7", "w8", "w9"] and reg.owner("w9") == "box"
    assert reg.owner("w0") is None


def _disk_full(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_revocation_on_a_full_disk_changes_nothing_and_says_so(tiny_model_dir, tmp_path, monkeypatch):
    """It used to take effect in memory half-way (the name refused, its ids kept, the relay not re-keyed, nothing
    written): now it is written down first, and if that fails nothing changes and the operator is told (507); once
    there is room again it goes through whole."""
    coord = small_coordinator(tiny_model_dir, group_size=G, journal=str(tmp_path / "rollouts.journal"))
    try:
        box = Client(coord.url, worker_credential("secret", "box"))
        wid = box.post("/register", {})["worker_id"]
        held = box.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
        admin = Client(coord.url, "secret")
        monkeypatch.setattr(coord.gate, "_append", _disk_full)
        with pytest.raises(RemoteError, match="507.*nothing was revoked"):
            admin.post("/revoke", {"name": "box"})
        assert box.post("/heartbeat", {"worker_id": wid}) and coord.status()["workers"] == [wid]
        assert coord.accounting()["in_flight"] == len(held) * G
        monkeypatch.undo()
        assert admin.post("/revoke", {"name": "box"})["retired"] == [wid]
        assert (tmp_path / "revoked.txt").read_text() == "box\n"
        with pytest.raises(RemoteError, match="403"):
            box.post("/heartbeat", {"worker_id": wid})
    finally:
        coord.close()


def test_an_operators_revocation_drops_what_the_credential_pushed_and_was_not_yet_trained_on(tiny_model_dir):
    """A credential the operator revokes is no longer trusted: the groups it pushed that wait in the buffer are
    dropped (revoked, their prompts re-queued), as a forger's are when the checks retire it; before, they were still
    handed to the learner after the revocation."""
    coord = small_coordinator(tiny_model_dir, group_size=G)
    try:
        box = Client(coord.url, worker_credential("secret", "box"))
        wid = box.post("/register", {})["worker_id"]
        work = box.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
        assert len(box.post("/push", {"worker_id": wid, "results": results(work)})["accepted"]) == len(work) == 2
        assert coord.accounting()["buffered"] == 2 * G
        assert Client(coord.url, "secret").post("/revoke", {"name": "box"})["retired"] == [wid]
        acc = coord.accounting()
        assert acc["buffered"] == 0 and acc["dropped"] == {"revoked": 2 * G}
        with pytest.raises(TimeoutError):
            coord.take(1, timeout_s=0.5)
    finally:
        coord.close()
    assert balanced(coord.accounting())


def test_a_forgers_verdict_on_a_full_disk_still_retires_it_and_is_reported(tiny_model_dir, tmp_path, monkeypatch):
    """The rollout checks catch a forger while the disk is full: its credential is refused, its ids retired and its
    buffered groups dropped all the same (in this coordinator's memory), the failure is logged and counted
    (rollout/revocations_unwritten), and the learner gets its verdict, not an exception."""
    coord = small_coordinator(tiny_model_dir, group_size=G, journal=str(tmp_path / "rollouts.journal"))
    try:
        forger = Client(coord.url, worker_credential("secret", "forger"))
        wid = forger.post("/register", {})["worker_id"]
        work = forger.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
        assert forger.post("/push", {"worker_id": wid, "results": results(work)})["accepted"]
        taken = coord.take(1, timeout_s=5)
        monkeypatch.setattr(coord.gate, "_append", _disk_full)
        bad = coord.check({wid: (100, -1000.0, 1000.0)})  # 10 nats a token: a forger
        assert bad == [wid] and taken
        assert coord.status()["workers"] == [] and coord.metrics()["rollout/revocations_unwritten"] == 1
        assert coord.accounting()["buffered"] == 0  # its other buffered group dropped: untrusted
        with pytest.raises(RemoteError, match="403"):
            forger.post("/register", {})
        assert not (tmp_path / "revoked.txt").exists() or "forger" not in (tmp_path / "revoked.txt").read_text()
        monkeypatch.undo()
        Client(coord.url, "secret").post("/revoke", {"name": "forger"})  # room again: the operator writes it down
        assert (tmp_path / "revoked.txt").read_text() == "forger\n"
        assert coord.metrics()["rollout/revocations_unwritten"] == 0
    finally:
        coord.close()
