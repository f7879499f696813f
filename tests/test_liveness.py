"""Deadlines, per-worker shares, strikes and hand-backs: the policy table, the coordinator's routes, and a run
with a real client that pulls and heartbeats but never pushes."""

from __future__ import annotations

import threading
import time

import pytest

from conftest import balanced, small_coordinator, train, wait_until
from echo2.rollout.liveness import Liveness
from echo2.transport import Client, RemoteError

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
    return small_coordinator(tiny_model_dir, group_size=G, heartbeat_timeout_s=4.0, liveness=liveness)


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
        work = client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
        assert len(work) == 2
        wait_until(lambda: coord.accounting()["lost"].get("deadline") == 2 * G, timeout_s=10)
        acc = coord.accounting()
        assert acc["lost"] == {"deadline": 2 * G} and acc["in_flight"] == 0 and len(coord.ledger.requeue) == 2
        reply = _push(client, wid, work)  # too late: not in flight any more, refused and counted
        assert reply["accepted"] == [] and coord.accounting()["results_refused"] == {"not_in_flight_for_this_worker": 2}
        # one miss halved its share (2 -> 1); the re-queued prompts are handed out first
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


class _FailingEngine:
    name = "failing"

    def __init__(self):
        self.calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        raise OSError("engine died mid-batch")


def test_the_agent_hands_back_its_groups_when_generate_fails(tiny_model_dir):
    from echo2.rollout.agent import Agent, EngineError
    from echo2.rollout.types import SamplingParams

    coord = _coord(tiny_model_dir)
    agent = Agent(coord.url, "secret", _FailingEngine())
    try:
        agent.worker_id = agent.client.post("/register", {})["worker_id"]
        # the engine's failure stops the worker as the engine's (not retried as an unreachable coordinator)
        with pytest.raises(EngineError, match="engine died"):
            agent._step(SamplingParams(n=G, max_tokens=3))
        acc = coord.accounting()
        assert acc["lost"] == {"generate_failed": 2 * G} and acc["in_flight"] == 0, acc
    finally:
        agent.receiver.close()
        coord.close()


class _Engine:
    """Generates a valid two-token completion for every sample."""
    name = "stub"

    def generate(self, prompts, params):
        from echo2.rollout.types import Completion

        return [[Completion(token_ids=[5, 1], logprobs=[-1.0, -0.2], finish_reason="stop")] * params.n
                for _ in prompts]


def test_the_agent_hands_back_its_groups_when_its_push_fails(tiny_model_dir):
    """The push of a generated batch fails on the way (the connection drops): the agent hands the groups back at
    once, counted lost: push_failed and re-queued, instead of leaving them to their deadline."""
    from echo2.rollout.agent import Agent
    from echo2.rollout.types import SamplingParams

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
        with pytest.raises(ConnectionError, match="reset by peer"):
            agent._step(SamplingParams(n=G, max_tokens=3))
        acc = coord.accounting()
        assert acc["lost"] == {"push_failed": 2 * G} and acc["in_flight"] == 0 and acc["received"] == 0, acc
    finally:
        agent.receiver.close()
        coord.close()


class _Hoarder(threading.Thread):
    """A real client that registers, pulls as much as it is given and heartbeats, but never pushes.

    It never applies a snapshot, so it claims the learner's latest version instead: its heartbeats (every 10 ms)
    learn the version and claim it, which keeps it as worth dispatching to as an honest worker that is up to date
    (a client stuck at an old version is only given work when the window runs low, and would rarely be struck)."""

    def __init__(self, url, token, requires=None):
        super().__init__(daemon=True)
        self.client, self.stop, self.pulled, self.version = Client(url, token), threading.Event(), 0, 0
        # it declares the run's own model and context, as a hostile client would (the handshake checks claims only)
        claims = {"model": {k: requires["model"][k] for k in ("name", "digest")},
                  "max_model_len": requires["max_model_len"]} if requires else {}
        self.wid = self.client.post("/register", {"engine": "hoarder", **claims})["worker_id"]
        self.errors: list[str] = []
        self.beat = threading.Thread(target=self._heartbeats, args=(Client(url, token),), daemon=True)

    def start(self):
        super().start()
        self.beat.start()

    def _heartbeats(self, client):
        while not self.stop.wait(0.01):
            try:
                self.version = client.post("/heartbeat", {"worker_id": self.wid, "version": self.version})["version"]
            except (RemoteError, OSError) as e:
                self.errors.append(str(e))

    def run(self):
        while not self.stop.is_set():  # the pull is a long poll: no busy loop
            try:
                reply = self.client.post("/pull", {"worker_id": self.wid, "version": self.version, "max_groups": 64})
                self.pulled += len(reply["work"])
                self.version = reply["version"]
            except (RemoteError, OSError) as e:
                self.errors.append(str(e))


@pytest.mark.slow
def test_a_client_that_holds_work_and_heartbeats_cannot_stop_the_run(tmp_path):
    """With two honest hf workers and a hoarder that joined at step 2, the run finishes: the hoarder's groups
    expire (lost: deadline) and go to the others, it holds at most its share, it is benched after its strikes,
    and the books balance."""
    ev = {}

    def hook(step, source):
        if step == 2:
            ev["hoarder"] = _Hoarder(source.coordinator.url, source.token, source.requires)
            ev["hoarder"].start()
        if "hoarder" in ev:
            wid = ev["hoarder"].wid
            held = source.coordinator.status()["held"].get(wid, 0)
            ev["max_held"] = max(ev.get("max_held", 0), held)
            # Steps take ~0.05 s here, deadlines 1-2 s: hold the learner (not the deadlines) until what the hoarder
            # holds has expired, so that each batch it was handed costs it a strike before the run moves on. The
            # expiry frees room while the version stands still, and the hoarder (claiming it) is handed new groups.
            wait_until(lambda: source.coordinator.status()["held"].get(wid, 0) == 0, timeout_s=30)
            status = source.coordinator.status()
            ev["benched"] = wid in status["benched"]
            if ev["benched"]:
                ev.setdefault("benched_at", step)

    start = time.monotonic()
    try:
        _, trainer, source, acc, _ = train(tmp_path, [
            "pool.engine=hf", "run.steps=30", "rollout.source.deadline_floor_s=1", "rollout.source.deadline_cap_s=2",
            "rollout.source.worker_share=0.25", "rollout.source.deadline_strikes=2"], hook)
    finally:
        if "hoarder" in ev:
            ev["hoarder"].stop.set()
    assert trainer.state.global_step == 30, f"stopped at {trainer.state.global_step} after {time.monotonic() - start} s"
    hoarder = ev["hoarder"]
    assert hoarder.pulled > 0 and ev["benched"], (hoarder.pulled, hoarder.errors[:3])
    print(f"hoarder pulled {hoarder.pulled} groups, benched at step {ev['benched_at']}")
    assert acc["lost"].get("deadline", 0) >= 2 * 8, acc  # two strikes, G = 8
    assert ev["max_held"] <= 0.25 * 3 * 16, ev["max_held"]  # share · (S+1)·P with S=2, P=16
    assert hoarder.wid not in acc["by_worker"] and balanced(acc), acc
