"""A worker credential (or the run secret's agents) acting against the coordinator, each finding of issue 27 that
lives in the coordinator: bad declarations, a reaper that must not die, one credential taking more than its share
or shedding its strikes, claims of weights never delivered, addresses that point the learner host elsewhere, and a
push whose scoring fails half way. Route tests against a real coordinator over loopback HTTP."""

from __future__ import annotations

import json
import logging
import math
import time

import pytest

from conftest import balanced, small_coordinator, wait_until
from echo2.settings import LivenessSettings
from echo2.net.http import BadRequest, Client, RemoteError
from echo2.credential import worker_credential

G = 2
STRONG = "c2VjcmV0LWVub3VnaC1mb3ItYW4tZXhwb3NlZC1ydW4"  # an exposed coordinator refuses a weak run secret
DONE = {"token_ids": [5, 1], "logprobs": [-1.0, -0.2], "finish_reason": "stop"}


def results(work, version=0, completion=DONE):
    return [{"group_id": w["group_id"], "version": version, "completions": [completion] * G} for w in work]


@pytest.fixture
def coord(tiny_model_dir):
    c = small_coordinator(tiny_model_dir, group_size=G, heartbeat_timeout_s=4.0)
    yield c
    c.close()


def join(url, name=None, **declared):
    client = Client(url, worker_credential("secret", name) if name else "secret")
    return client, client.post("/register", declared)["worker_id"]


# ---------------------------------------------------------------------- 1. declarations are validated


@pytest.mark.parametrize("route, body, field", [
    ("/register", {"down_mbit": 0}, "down_mbit"),  # the reaper divided by it
    ("/register", {"up_mbit": 0}, "up_mbit"),
    ("/register", {"usd_per_hour": 1e308}, "usd_per_hour"),  # the exact solver overflowed on it
    ("/register", {"usd_per_hour": -1}, "usd_per_hour"),
    ("/register", {"rtt_ms": "10"}, "rtt_ms"),
    ("/register", {"down_mbit": True}, "down_mbit"),
    ("/register", {"engine": "x" * 1000}, "engine"),
    ("/register", {"max_model_len": 2.5}, "max_model_len"),
    ("/register", {"favourite_colour": "blue"}, "favourite_colour"),
    ("/register", {"model": {"name": "m", "digest": "d", "weights": "mine"}}, "model.weights"),
    ("/heartbeat", {"worker_id": "w0", "version": -1}, "version"),
    ("/pull", {"worker_id": "w0", "max_groups": 10 ** 9}, "max_groups"),
    ("/pull", {"worker_id": "w" * 1000}, "worker_id"),
    ("/push", {"worker_id": "w0", "results": [{}] * 1100}, "results"),
    ("/push", {"worker_id": "w0", "results": [], "rollouts_per_s": -1.0}, "rollouts_per_s"),
    ("/release", {"worker_id": "w0", "reason": "bored", "group_ids": []}, "reason"),
    ("/leave", {"worker_id": 7}, "worker_id"),
    ("/revoke", {"name": "a b"}, "name"),
    ("/manifest-key", {"anything": 1}, "anything"),
])
def test_bad_declarations_are_refused_naming_the_field(coord, route, body, field):
    client = Client(coord.url, "secret")
    client.post("/register", {})  # w0 exists: a refusal is about the body, not an unknown worker
    with pytest.raises(RemoteError, match=rf"HTTP 400: .*{field}") as e:
        client.post(route, body)
    assert "got" in str(e.value)  # the value it got, so that the sender sees what was wrong
    assert coord.status()["workers"] == ["w0"] and coord.ledger.next_worker == 1  # nothing half-done


def test_a_body_past_its_routes_limit_is_refused_unread(coord):
    """Every route's body limit is what its largest honest body can be (coordinator/bounds.py): a release naming more
    groups than the in-flight cap holds is refused on its declared length (413) before its schema could see it."""
    client = Client(coord.url, "secret")
    client.post("/register", {})
    with pytest.raises(RemoteError, match="HTTP 413: body of .* exceeds"):
        client.post("/release", {"worker_id": "w0", "reason": "generate_failed", "group_ids": ["g1"] * 1100})
    assert coord.server.rejected["TooLarge"] == 1 and coord.status()["workers"] == ["w0"]


def test_nan_is_refused_where_a_number_belongs(coord):
    client = Client(coord.url, "secret")
    body = json.dumps({"down_mbit": float("nan")}).encode()  # NaN is not JSON, but Python's parser takes it
    with pytest.raises(RemoteError, match="400.*down_mbit.*finite"):
        client.post("/register", data=body, headers={"Content-Type": "application/json"})


# ---------------------------------------------------------------------- 2. nothing stops liveness


def test_the_reaper_survives_a_failing_replan_and_still_retires_the_dead(coord, monkeypatch, caplog):
    """A re-plan that raises (a planner bug, or a declaration that got through) used to kill the reaper thread:
    from then on no heartbeat timeout, deadline or re-plan happened. Now it is logged, counted, and liveness goes on."""
    def broken(*_a, **_k):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(coord.activation, "replan", broken)
    client, wid = join(coord.url)
    work = client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
    assert work
    wait_until(lambda: wid not in coord.status()["workers"], timeout_s=15)  # silent past 4 s: dead
    assert coord.metrics()["rollout/reaper_errors"] >= 2
    acc = coord.accounting()
    assert acc["lost"] == {"worker_dead": len(work) * G} and acc["workers_retired"] == {"worker_dead": 1}, acc
    assert "ZeroDivisionError" in caplog.text and "Traceback" in caplog.text


class _BrokenScorer:
    """A scorer that fails outright (a bug on our side): the push gets a 500, its groups must still be booked."""

    def score(self, group, principal=None):
        raise RuntimeError("scorer bug")

    score_many = score

    def metrics(self):
        return {}

    def close(self):
        pass


def test_a_push_whose_scoring_fails_leaves_no_group_unaccounted(coord):
    client, wid = join(coord.url)
    work = client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
    coord.scorer = _BrokenScorer()
    with pytest.raises(RemoteError, match="500"):
        client.post("/push", {"worker_id": wid, "results": results(work)})
    acc = coord.accounting()  # dropped with a reason, prompts re-queued: not neither in flight nor settled
    assert acc["dropped"] == {"coordinator_error": len(work) * G} and acc["in_flight"] == 0, acc
    assert len(coord.ledger.requeue) == len(work)
    assert balanced(coord.close())


def test_a_push_of_many_refused_results_writes_one_journal_line(tiny_model_dir, tmp_path):
    coord = small_coordinator(tiny_model_dir, group_size=G, journal=str(tmp_path / "rollouts.journal"))
    try:
        client, wid = join(coord.url)
        lines = len((tmp_path / "rollouts.journal").read_text().splitlines())
        # as many as fit in a push's body limit (coordinator/bounds.py: sized from the in-flight cap and G)
        bogus = [{"group_id": f"g{i}", "version": 0, "completions": []} for i in range(1000, 1100)]
        reply = client.post("/push", {"worker_id": wid, "results": bogus})
        assert len(reply["rejected"]) == 100
        assert len((tmp_path / "rollouts.journal").read_text().splitlines()) - lines <= 1
        assert coord.accounting()["results_refused"] == {"not_in_flight_for_this_worker": 100}
    finally:
        coord.close()


# ---------------------------------------------------------------------- 3. one credential, one share


def test_one_credential_is_one_share_however_many_ids_it_registers(coord):
    """Cap (S+1)·P = 4 groups, share 0.5: two credentials at work hold 2 each; a second id of one is no second share."""
    x, a = join(coord.url, "x")
    _, b = Client(coord.url, worker_credential("secret", "x")), x.post("/register", {})["worker_id"]
    honest, h = join(coord.url)
    assert len(x.post("/pull", {"worker_id": a, "version": 0, "max_groups": 4})["work"]) == 2
    assert x.post("/pull", {"worker_id": b, "version": 0, "max_groups": 4})["work"] == []
    assert len(honest.post("/pull", {"worker_id": h, "version": 0, "max_groups": 4})["work"]) == 2


def test_a_lone_worker_may_hold_the_whole_cap(coord):
    """The share never starves a run with one honest worker: alone, it may hold the whole in-flight cap."""
    client, wid = join(coord.url)
    assert len(client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 4})["work"]) == 4


@pytest.mark.parametrize("misses, principals, limit", [
    (0, 1, 48), (0, 2, 24), (0, 3, 24), (0, 0, 24),  # alone: the whole cap; two: half each; more: the share
    (1, 1, 24), (2, 2, 6), (3, 1, 0),  # each miss halves it, strikes bench
])
def test_the_share_grows_to_one_over_the_credentials_at_work(misses, principals, limit):
    from echo2.coordinator.liveness import Liveness

    assert Liveness(share=0.5, strikes=3).worker_limit(48, misses, principals) == limit


def test_invalid_results_strike_and_benching_sticks_to_the_credential(coord):
    """Each push with an invalid result is a miss; at `strikes` misses the credential is benched, and registering
    again (a new id) is refused instead of wiping its record."""
    client, wid = join(coord.url, "cheat")
    bad = {"token_ids": [5, 999], "logprobs": [-1.0, -1.0], "finish_reason": "stop"}
    for _ in range(3):  # strikes = 3 (the default)
        work = client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 1})["work"]
        assert work, coord.status()
        client.post("/push", {"worker_id": wid, "results": results(work, completion=bad)})
    assert coord.status()["benched"] == [wid]
    assert client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 1})["work"] == []
    with pytest.raises(RemoteError, match="409.*benched"):
        client.post("/register", {})
    assert coord.metrics()["rollout/invalid_strikes"] == 3


def test_the_planner_uses_the_measured_rate_never_the_claimed_one(coord):
    client, wid = join(coord.url)
    work = client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
    bad = {"token_ids": [5, 999], "logprobs": [-1.0, -1.0], "finish_reason": "stop"}
    client.post("/push", {"worker_id": wid, "results": results(work, completion=bad), "rollouts_per_s": 1e5})
    assert coord.workers[wid].rollouts_per_s == 0.0  # nothing valid pushed: no rate at all
    work = client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
    time.sleep(0.2)
    client.post("/push", {"worker_id": wid, "results": results(work), "rollouts_per_s": 1e5})
    rate = coord.workers[wid].rollouts_per_s
    assert 0 < rate < len(work) * G / 0.2 and coord.workers[wid].reported_rollouts_per_s == 1e5


def test_a_fresh_worker_gets_the_fleets_deadline_not_the_cap(tiny_model_dir):
    coord = small_coordinator(tiny_model_dir, group_size=G, liveness=LivenessSettings(floor_s=1.0, cap_s=600.0))
    try:
        fast, f = join(coord.url)
        fast.post("/push", {"worker_id": f, "results": results(
            fast.post("/pull", {"worker_id": f, "version": 0, "max_groups": 1})["work"])})
        coord.take(1, timeout_s=1)
        fresh, n = join(coord.url, "newcomer")
        work = fresh.post("/pull", {"worker_id": n, "version": 0, "max_groups": 1})["work"]
        due_s = coord.in_flight[work[0]["group_id"]].deadline - time.monotonic()
        assert due_s < 60, due_s  # the fleet's measured rate, times the slack: not 600 s for free
    finally:
        coord.close()


def test_a_credential_with_no_valid_push_holds_one_pull_at_most(tiny_model_dir):
    coord = small_coordinator(tiny_model_dir, group_size=G, groups_per_pull=1)
    try:
        client, wid = join(coord.url, "stranger")
        assert len(client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 4})["work"]) == 1
        assert client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 4})["work"] == []
    finally:
        coord.close()


# ---------------------------------------------------------------------- 6. trust gaps in the rollout plane


def test_a_claimed_version_must_be_one_the_worker_was_delivered(coord):
    """Without rollout checks, S is enforced for a lying worker only if it cannot claim weights it never got."""
    liar, lw = join(coord.url, "liar")
    honest, hw = join(coord.url)
    coord.set_version(1)
    coord._snapshot_delivered(hw, 1)  # the broadcaster handed v1 to the honest worker only
    lwork = liar.post("/pull", {"worker_id": lw, "version": 1, "max_groups": 1})["work"]
    hwork = honest.post("/pull", {"worker_id": hw, "version": 1, "max_groups": 1})["work"]
    assert coord.workers[lw].version == 0  # its claim of v1 was not believed for dispatch either
    reply = liar.post("/push", {"worker_id": lw, "results": results(lwork, version=1)})
    assert reply["accepted"] == [] and reply["rejected"][0]["reason"] == "undelivered_version"
    assert honest.post("/push", {"worker_id": hw, "results": results(hwork, version=1)})["accepted"]
    assert coord.accounting()["dropped"] == {"undelivered_version": G}


def test_a_version_ordered_to_the_worker_but_not_proven_costs_it_no_strike(coord):
    """An honest worker may apply a snapshot, generate and push before the broadcaster has its answer (on a loaded
    box the demo's honest workers were all benched within seconds for undelivered_version, and the run waited
    forever): a version ordered to it is dropped and re-queued without a strike; one ordered to another worker is
    struck."""
    from types import SimpleNamespace

    from echo2.coordinator.broadcaster import RelayBroadcaster

    calls = []
    stub = SimpleNamespace(timeout_s=1.0, on_ordered=lambda pid, v: calls.append(("ordered", pid, v)),
                           _settle=lambda *a: calls.append(("settled",)))
    peer = SimpleNamespace(client=SimpleNamespace(post=lambda *a, **k: calls.append(("sent",)) or {}))
    RelayBroadcaster._send(stub, "w7", peer, {}, "cred", SimpleNamespace(version=3))
    assert calls == [("ordered", "w7", 3), ("sent",), ("settled",)]  # told before the peer can hold it

    first, fw = join(coord.url, "first")
    other, ow = join(coord.url, "other")
    coord.set_version(1)
    coord._snapshot_ordered(fw, 1)  # on its way to the first worker; not yet proven, not ordered to the other
    fwork = first.post("/pull", {"worker_id": fw, "version": 1, "max_groups": 1})["work"]
    owork = other.post("/pull", {"worker_id": ow, "version": 1, "max_groups": 1})["work"]
    reply = first.post("/push", {"worker_id": fw, "results": results(fwork, version=1)})
    assert reply["accepted"] == [] and reply["rejected"][0]["reason"] == "unproven_version"  # never trained on
    assert other.post("/push", {"worker_id": ow, "results": results(owork, version=1)})["accepted"] == []
    assert coord.accounting()["dropped"] == {"unproven_version": G, "undelivered_version": G}
    misses = {w: coord.reg.principals[coord.workers[w].principal].misses for w in (fw, ow)}
    assert misses == {fw: 0, ow: 1}, misses  # a strike only for the version never ordered to it


@pytest.mark.parametrize("declared, why", [
    ({"snapshot_url": "http://203.0.113.7:8702"}, "https"),  # TLS is on: plain http would carry the key in clear
    ({"snapshot_url": "https://user:pw@203.0.113.7:8702"}, "only https"),
    ({"snapshot_url": "https://203.0.113.7:8702/steal?x=1"}, "only https"),
    ({"snapshot_url": "https://169.254.169.254:80"}, "not an address of another host"),  # cloud metadata
    ({"snapshot_url": "https://127.0.0.1:22"}, "not an address of another host"),
    ({"snapshot_url": "https://localhost:8080"}, "learner's own host"),
    ({"snapshot_url": "https://203.0.113.7"}, "port"),
    ({"relay": "[::1]:8703"}, "not an address of another host"),
    ({"relay": "evil host:1"}, "neither an IP address nor a host name"),
    ({"relay": "203.0.113.7:99999"}, "host:port"),
])
def test_a_worker_cannot_point_the_learner_host_anywhere(tiny_model_dir, tmp_path, declared, why):
    """The learner host POSTs the relay key to a worker's snapshot_url: with TLS on it must be https (verified against
    the run's CA), HOST:PORT only, and, off loopback, not the learner host itself or its provider's addresses."""
    coord = small_coordinator(tiny_model_dir, host="0.0.0.0", tls_dir=str(tmp_path / "tls"), token=STRONG)
    try:
        client = Client(f"https://127.0.0.1:{coord.server.address[1]}", worker_credential(STRONG, "box"),
                        ca_file=coord.gate.trust.ca_file, server_name="learner.echo2.invalid")
        with pytest.raises(RemoteError, match=f"400.*{why}"):
            client.post("/register", declared)
        wid = client.post("/register", {"snapshot_url": "https://203.0.113.7:8702", "relay": "box17.example:8703"})
        assert wid["worker_id"] in coord.status()["workers"]
    finally:
        coord.close()


def test_the_static_pool_never_tells_operators_to_hand_out_the_run_secret(caplog):
    from echo2.learner.sources.pool import StaticPool

    pool = StaticPool()
    with caplog.at_level(logging.INFO):
        pool.start("https://learner:8700", "the-run-secret", "Qwen/Qwen3-0.6B", "/tmp/run", ca_hash="sha256:ab")
    text = caplog.text + pool.describe("https://learner:8700")
    assert "the-run-secret" not in text and "run's token" not in text and "run's ECHO2_TOKEN" not in text
    assert text.count("python -m echo2.credential NAME") == 2


# ---------------------------------------------------------------------- the planner at the edges of what is valid


@pytest.mark.parametrize("solver", ["all_on", "greedy", "exact"])
def test_the_planner_takes_every_valid_declaration(solver):
    """Capacity and activation at the bounds schemas.py lets through: no division by zero, no overflow, no refusal."""
    import itertools

    from echo2.activation.solve import System, Worker, solve
    from echo2.coordinator import schemas

    edges = itertools.product([0.0, schemas.MAX_USD_PER_HOUR], [schemas.MIN_MBIT, schemas.MAX_MBIT],
                              [schemas.MIN_MBIT, schemas.MAX_MBIT], [0.0, schemas.MAX_RTT_MS],
                              [1e-3, schemas.MAX_ROLLOUTS_PER_S])
    for usd, down, up, rtt, mu in edges:
        workers = [Worker(f"w{i}", usd, mu, down, up, rtt) for i in range(2)] + [Worker("x", 0.5, 2.0)]
        system = System(rollouts_per_step=128, train_step_s=1.0, staleness=2, interval=1, snapshot_bytes=1e12,
                        learner_usd_per_hour=3.0, learner_uplink_mbit=1000.0)
        plan = solve(system, workers, solver)
        assert plan.active and not math.isnan(plan.prediction.step_s)


def test_the_online_planner_falls_back_to_a_bounded_search_when_exact_would_take_too_long():
    from echo2.activation.online import OnlineActivation
    from echo2.activation.solve import System, Worker

    workers = [Worker(f"w{i}", 1000.0 - i, 1.0 + i, 100.0 + i, 50.0 + i, float(i)) for i in range(60)]
    system = System(rollouts_per_step=128, train_step_s=1.0, staleness=2, interval=1, snapshot_bytes=1e9,
                    learner_usd_per_hour=3.0, learner_uplink_mbit=1000.0)
    online = OnlineActivation("exact")
    assert online.update(system, workers) and online.fallbacks == 1


def test_capacity_refuses_a_zero_rate_by_name():
    from echo2.capacity import bcast_time_s

    with pytest.raises(ValueError, match="must be finite and > 0"):
        bcast_time_s("chain", 1e9, 1000.0, 2, 0.0, 100.0, 10.0)


@pytest.mark.parametrize("host, client, refused", [
    # the resolver's shorthands for loopback and the metadata address (they passed as host names)
    ("127.1", "198.51.100.9", "not an address of another host"),
    ("2130706433", "198.51.100.9", "not an address of another host"),
    ("0x7f.1", "198.51.100.9", "not an address of another host"),
    ("017700000001", "198.51.100.9", "not an address of another host"),
    ("169.254.43518", "198.51.100.9", "not an address of another host"),
    ("::ffff:127.0.0.1", "198.51.100.9", "not an address of another host"),
    ("fe80::1", "198.51.100.9", "not an address of another host"),
    ("1.2.3.4.5", "198.51.100.9", "neither an IP address nor a host name"),  # an all-numeric top label: no name
    # private ranges: only for a worker that reaches the coordinator from a private network itself
    ("10.0.0.7", "8.8.8.8", "private address"),
    ("172.16.3.4", "8.8.8.8", "private address"),
    ("192.168.1.20", "8.8.8.8", "private address"),
    ("100.64.0.9", "8.8.8.8", "private address"),  # carrier-grade NAT's shared space
    ("fd00::17", "8.8.8.8", "private address"),
    ("10.0.0.7", "10.0.0.99", None),  # a cluster's worker names its cluster address
    ("fd00::17", "fd00::99", None),
    ("8.8.4.4", "8.8.8.8", None),
    ("box17.example", "8.8.8.8", None),
])
def test_an_exposed_coordinator_reads_addresses_as_the_resolver_does(host, client, refused):
    from echo2.coordinator.schemas import relay_address, snapshot_url

    bracketed = f"[{host}]" if ":" in host else host
    for check in (lambda: snapshot_url(f"https://{bracketed}:8702", tls=True, exposed=True, client=client),
                  lambda: relay_address(f"{bracketed}:8703", exposed=True, client=client)):
        if refused is None:
            check()
        else:
            with pytest.raises(BadRequest, match=refused):
                check()
    if refused != "neither an IP address nor a host name":  # a loopback run's own workers may name anything else
        assert snapshot_url(f"https://{bracketed}:8702", tls=True, exposed=False, client=client)
