"""Deadlines, per-credential shares, strikes and hand-backs: the policy table, the coordinator's routes, and a run
with a real agent whose engine sits on every batch past its deadline."""

from __future__ import annotations

import threading
import time

import pytest

from conftest import balanced, small_coordinator, train, wait_until
from echo2.worker.engines.hf import HFWorkerEngine
from echo2.coordinator.liveness import Liveness
from echo2.settings import LivenessSettings
from echo2.net.http import Client, RemoteError
from echo2.credential import worker_credential

G = 2


@pytest.mark.parametrize("rate, held, expected_s", [
    (0.0, 4, 60.0),  # no measured rate yet: the cap
    (100.0, 4, 2.0),  # 4·2/100·4 = 0.32 s: the floor
    (2.0, 4, 16.0),  # 4·2/2 = 4 s expected, times slack 4
    (0.1, 4, 60.0),  # 320 s: the cap
])
def test_deadline_is_the_rate_times_slack_within_floor_and_cap(rate, held, expected_s):
    assert Liveness(floor_s=2, cap_s=60, slack=4).deadline_s(rate, held, G) == pytest.approx(expected_s)


@pytest.mark.parametrize("misses, limit", [(0, 24), (1, 12), (2, 6), (3, 0)])
def test_each_miss_halves_the_share_and_strikes_bench(misses, limit):
    assert Liveness(share=0.5, strikes=3).worker_limit(48, misses) == limit


def test_bad_liveness_settings_are_refused():
    for bad in ({"floor_s": 0}, {"floor_s": 5, "cap_s": 1}, {"share": 1.5}, {"slack": 0.5}, {"strikes": 0}):
        with pytest.raises(ValueError):
            Liveness(**bad)


def _coord(tiny_model_dir, **liveness):
    return small_coordinator(tiny_model_dir, group_size=G, heartbeat_timeout_s=4.0, liveness=LivenessSettings(**liveness))


def _push(client, wid, work, version=0):
    comp = {"token_ids": [5, 1], "logprobs": [-1.0, -0.2], "finish_reason": "stop"}
    return client.post("/push", {"worker_id": wid, "results": [
        {"group_id": w["group_id"], "version": version, "completions": [comp] * G} for w in work]})


def test_a_worker_holds_at_most_its_share(tiny_model_dir):
    coord = _coord(tiny_model_dir, share=0.5)  # cap (S+1)·P = 4 groups, so 2 each
    try:
        client = Client(coord.url, "secret")
        a = client.post("/register", {})["worker_id"]
        b = client.post("/register", {})["worker_id"]
        assert len(client.post("/pull", {"worker_id": a, "version": 0, "max_groups": 4})["work"]) == 2
        assert client.post("/pull", {"worker_id": a, "version": 0, "max_groups": 4})["work"] == []
        assert len(client.post("/pull", {"worker_id": b, "version": 0, "max_groups": 4})["work"]) == 2
    finally:
        coord.close()


def test_groups_past_their_deadline_are_lost_requeued_and_the_late_push_refused(tiny_model_dir):
    coord = _coord(tiny_model_dir, floor_s=0.5, cap_s=0.5, strikes=2)
    try:
        client = Client(coord.url, "secret")
        wid = client.post("/register", {})["worker_id"]
        other = client.post("/register", {})["worker_id"]  # two workers that can get work: a share of 2 each
        work = client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
        assert len(work) == 2
        wait_until(lambda: coord.accounting()["lost"].get("deadline") == 2 * G, timeout_s=10)
        acc = coord.accounting()
        assert acc["lost"] == {"deadline": 2 * G} and acc["in_flight"] == 0 and len(coord.ledger.requeue) == 2
        reply = _push(client, wid, work)  # too late: not in flight any more, refused and counted (its miss is)
        assert reply["accepted"] == [] and coord.accounting()["results_refused"] == {"past_deadline": 2}
        # one miss halved its share (2 -> 1); the re-queued prompts are handed out first
        client.post("/heartbeat", {"worker_id": other})
        again = client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
        assert len(again) == 1
        wait_until(lambda: coord.status()["benched"] == [wid], timeout_s=10)  # second miss: strikes=2
        assert coord.status()["benched"] == [wid]
        client.post("/heartbeat", {"worker_id": wid})
        assert client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"] == []
        assert coord.metrics()["rollout/benched_workers"] == 1.0
        acc = coord.close()
        assert acc["lost"] == {"deadline": 3 * G} and balanced(acc), acc
    finally:
        coord.close()


def test_a_worker_hands_its_groups_back_with_a_reason(tiny_model_dir):
    coord = _coord(tiny_model_dir)
    try:
        client = Client(coord.url, "secret")
        wid = client.post("/register", {})["worker_id"]
        work = client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
        gids = [w["group_id"] for w in work]
        with pytest.raises(RemoteError, match="reason"):
            client.post("/release", {"worker_id": wid, "reason": "bored", "group_ids": gids})
        reply = client.post("/release", {"worker_id": wid, "reason": "generate_failed", "group_ids": gids + ["g99"]})
        assert reply["released"] == gids
        acc = coord.accounting()
        assert acc["lost"] == {"generate_failed": 2 * G} and acc["results_refused"] == {"release_not_in_flight": 1}
        assert list(coord.ledger.requeue) and acc["in_flight"] == 0
    finally:
        coord.close()



def test_an_agent_retired_as_dead_that_comes_back_is_not_struck_for_its_old_groups(tiny_model_dir):
    """An agent silent past the heartbeat timeout is retired and its groups re-queued; when it comes back (a new
    id, the same worker credential) and pushes the groups it was generating, they are refused as ``worker_gone``: not
    struck as results never in flight for it (an honest worker on a stalled link was struck, then benched)."""
    coord = small_coordinator(tiny_model_dir, group_size=G, heartbeat_timeout_s=1.0,
                              liveness=LivenessSettings(floor_s=60, cap_s=60))  # the heartbeat, not a deadline, takes them
    try:
        client = Client(coord.url, worker_credential("secret", "box3"))
        wid = client.post("/register", {})["worker_id"]
        work = client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
        assert len(work) == 2
        wait_until(lambda: coord.accounting()["workers_retired"].get("worker_dead") == 1, timeout_s=15)
        again = client.post("/register", {})["worker_id"]
        reply = _push(client, again, work)
        assert reply["accepted"] == [] and coord.accounting()["results_refused"] == {"worker_gone": 2}
        assert all(p.misses == 0 for p in coord.reg.principals.values())
        assert balanced(coord.close())
    finally:
        coord.close()

class _FailingEngine:
    name = "failing"

    def __init__(self):
        self.calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        raise OSError("engine died mid-batch")


def test_the_agent_hands_back_its_groups_when_generate_fails(tiny_model_dir):
    from echo2.worker.agent import Agent, EngineError
    from echo2.records import SamplingParams

    coord = _coord(tiny_model_dir)
    agent = Agent(coord.url, "secret", _FailingEngine())
    try:
        agent.worker_id = agent.client.post("/register", {})["worker_id"]
        # the engine's failure stops the worker as the engine's (not retried as an unreachable coordinator)
        with pytest.raises(EngineError, match="engine died"):
            agent._step(SamplingParams(n=G, max_tokens=3))
        acc = coord.accounting()  # a lone worker may hold the whole cap, (S+1)·P = 4 groups
        assert acc["lost"] == {"generate_failed": 4 * G} and acc["in_flight"] == 0, acc
    finally:
        agent.receiver.close()
        coord.close()


class _Engine:
    """Generates a valid two-token completion for every sample."""
    name = "stub"

    def generate(self, prompts, params):
        from echo2.records import Completion

        return [[Completion(token_ids=[5, 1], logprobs=[-1.0, -0.2], finish_reason="stop")] * params.n
                for _ in prompts]


def test_the_agent_hands_back_its_groups_when_its_push_fails(tiny_model_dir):
    """The push of a generated batch fails on the way (the connection drops): the agent hands the groups back at
    once, counted lost: push_failed and re-queued, instead of leaving them to their deadline."""
    from echo2.worker.agent import Agent
    from echo2.records import SamplingParams

    coord = _coord(tiny_model_dir)
    agent = Agent(coord.url, "secret", _Engine())
    post = agent.client.post

    def dropped_push(path, body, **kw):
        if path == "/push":
            raise ConnectionError("connection reset by peer")
        return post(path, body, **kw)

    try:
        agent.worker_id = agent.client.post("/register", {})["worker_id"]
        agent.client.post = dropped_push
        agent._step(SamplingParams(n=G, max_tokens=3))  # the push goes in the background
        agent.pusher.wait()
        # the failure is raised at the top of the next step, before it pulls: with no batch in hand
        pulls = []
        agent.client.post = lambda path, body, **kw: pulls.append(path) or dropped_push(path, body, **kw)
        with pytest.raises(ConnectionError, match="reset by peer"):
            agent._step(SamplingParams(n=G, max_tokens=3))
        assert pulls == []
        acc = coord.accounting()  # a lone worker may hold the whole cap, (S+1)·P = 4 groups
        assert acc["lost"] == {"push_failed": 4 * G} and acc["in_flight"] == 0 and acc["received"] == 0, acc
    finally:
        agent.receiver.close()
        coord.close()


def test_the_agent_generates_the_next_batch_while_its_push_is_scored(tiny_model_dir):
    """The push of batch n runs in the background: the agent pulls and generates batch n+1 before batch n's push has
    been answered, then waits for it before pushing n+1 (one push at a time, on one thread for the agent's life);
    every rollout lands."""
    from echo2.worker.agent import Agent
    from echo2.records import SamplingParams

    coord = _coord(tiny_model_dir)
    engine = _Engine()
    agent = Agent(coord.url, "secret", engine, max_groups=1)
    post, release, order = agent.client.post, threading.Event(), []

    def slow_push(path, body, **kw):
        if path == "/push":
            order.append("push " + body["results"][0]["group_id"])
            assert release.wait(10)
        return post(path, body, **kw)

    generate = engine.generate
    engine.generate = lambda prompts, params: order.append("generate") or generate(prompts, params)
    try:
        agent.worker_id = agent.client.post("/register", {})["worker_id"]
        agent.client.post = slow_push
        agent._step(SamplingParams(n=G, max_tokens=3))
        pusher = agent.pusher.thread
        wait_until(lambda: len(order) == 2, timeout_s=5)  # batch 1 generated, its push on its way
        second = threading.Thread(target=agent._step, args=(SamplingParams(n=G, max_tokens=3),))
        second.start()
        wait_until(lambda: len(order) == 3, timeout_s=5)
        assert order[:3] == ["generate", order[1], "generate"]  # batch 2 generated while push 1 is unanswered
        assert second.is_alive()  # and its own push waits for push 1
        release.set()
        second.join(10)
        agent.flush()
        assert len(order) == 4 and order[1] != order[3]
        assert agent.pusher.thread is pusher and pusher.is_alive()  # one thread for every push, not one a batch
        acc = coord.accounting()
        assert acc["received"] == 2 * G and acc["lost"] == {} and acc["in_flight"] == 0, acc
    finally:
        agent.receiver.close()
        coord.close()


class _StallingEngine(HFWorkerEngine):
    """A worker's engine that sits on every batch past any deadline, then answers: its agent heartbeats all along
    and applies snapshots between batches like any agent (a real transformers model scores the probe), so it claims
    only versions it was delivered and keeps being worth dispatching to, and each batch it was handed expires."""

    name = "stalling"

    def __init__(self, model_path, stall_s):
        super().__init__(model_path)
        self.stall_s, self.stop = stall_s, threading.Event()
        self.batches = 0

    def generate(self, prompts, params):
        from echo2.records import Completion

        self.batches += 1
        self.stop.wait(self.stall_s)
        return [[Completion([5, 1], [-1.0, -0.2], "stop")] * params.n for _ in prompts]


class _Hoarder(threading.Thread):
    """A real agent (the run secret's, as a local worker's) whose engine stalls every batch past its deadline."""

    def __init__(self, source, stall_s):
        from echo2.worker.agent import Agent

        super().__init__(daemon=True)
        requires = source.requires
        claims = {"model": {k: requires["model"][k] for k in ("name", "digest")},
                  "max_model_len": requires["max_model_len"]}
        self.engine = _StallingEngine(requires["model"]["name"], stall_s)
        self.agent = Agent(source.coordinator.url, source.token, self.engine, declared=claims, max_groups=64)
        self.error = None

    @property
    def wid(self):
        return self.agent.worker_id

    def run(self):
        try:
            self.agent.run()
        except BaseException as e:
            self.error = e

    def close(self):
        self.engine.stop.set()
        self.agent.stop.set()
        self.agent.receiver.close()
        self.join(timeout=30)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_client_that_holds_work_and_heartbeats_cannot_stop_the_run(tmp_path):
    """With two honest hf workers and a hoarder that joined at step 2, the run finishes: the hoarder's groups
    expire (lost: deadline) and go to the others, it holds at most one pull (it never pushed anything valid), it is
    benched after its strikes, and the books balance."""
    ev = {}

    def hook(step, source):
        if step == 2:
            ev["hoarder"] = _Hoarder(source, stall_s=3.5)  # past the deadline cap (2 s) plus a reaper pass (1 s)
            ev["hoarder"].start()
            wait_until(lambda: ev["hoarder"].wid is not None, timeout_s=60)
        if "hoarder" in ev and not ev.get("benched"):
            hoarder, status = ev["hoarder"], source.coordinator.status()
            ev["max_held"] = max(ev.get("max_held", 0), status["held"].get(hoarder.wid, 0))
            ev["benched"] = hoarder.wid in status["benched"]
            if ev["benched"]:
                ev["benched_at"] = step
            else:  # steps take ~0.05 s here, a stalled batch 3.5 s: slow the learner so that the run sees a few
                time.sleep(0.5)

    start = time.monotonic()
    try:
        _, trainer, source, acc, _ = train(tmp_path, [
            "pool.engine=hf", "run.steps=30", "rollout.source.liveness.floor_s=1", "rollout.source.liveness.cap_s=2",
            "rollout.source.liveness.share=0.25", "rollout.source.liveness.strikes=2"], hook)
    finally:
        if "hoarder" in ev:
            ev["hoarder"].close()
    assert trainer.state.global_step == 30, f"stopped at {trainer.state.global_step} after {time.monotonic() - start} s"
    hoarder = ev["hoarder"]
    assert hoarder.engine.batches > 0 and ev["benched"], (hoarder.engine.batches, hoarder.error)
    print(f"hoarder stalled {hoarder.engine.batches} batches, benched at step {ev['benched_at']}")
    assert acc["lost"].get("deadline", 0) >= 2 * 8, acc  # two strikes, G = 8
    assert ev["max_held"] <= 4, ev["max_held"]  # no valid push yet: one pull's worth (groups_per_pull)
    assert hoarder.wid not in acc["by_worker"] and balanced(acc), acc
