"""The coordinator's small pure policies, table-driven: body limits and registration rates (bounds.py), the reward
pool's fair order (fair.py), whose fault a failed reward is (reward_faults.py); and, against a real coordinator with
a stand-in scorer, that a reward failing for everyone benches no one while one worker's crafted groups still cost it
strikes."""

from __future__ import annotations

import pytest

from conftest import small_coordinator
from echo2.coordinator.bounds import REGISTER_BURST, REGISTER_EVERY_S, Registrations, body_limits
from echo2.coordinator.fair import FairQueue
from echo2.coordinator.reward_faults import RewardFaults
from echo2.credential import worker_credential
from echo2.net.http import Client

# ---------------------------------------------------------------------- bounds


@pytest.mark.parametrize("s, p, g, max_tokens, push_at_least, push_at_most", [
    (2, 16, 8, 2, 48 * 8 * 2 * 33, 1 << 20),  # the demo: every honest push fits, and it is well under a MiB
    (2, 16, 8, 1024, 48 * 8 * 1024 * 33, 32 << 20),  # GSM8K on Qwen3: ~19 MB at most
    (0, 4096, 16, 8192, 1024 * 16 * 8192 * 33, 8 << 30),  # groups per push capped at MAX_GROUPS_PER_REQUEST
])
def test_a_push_limit_holds_every_honest_push_and_little_more(s, p, g, max_tokens, push_at_least, push_at_most):
    limits = body_limits(s, p, g, max_tokens)
    assert push_at_least < limits["POST /push"] <= push_at_most
    assert limits["POST /register"] <= 8 << 10 and limits["POST /release"] < 100 << 10


def test_the_largest_honest_push_fits_its_limit():
    """What an agent sends for the whole in-flight cap at the worst JSON lengths (6-digit ids, 17-digit logprobs)."""
    import json

    s, p, g, max_tokens = 2, 16, 8, 64
    completion = {"token_ids": [151935] * max_tokens, "logprobs": [-1.2345678901234567e-05] * max_tokens,
                  "finish_reason": "length"}
    body = {"worker_id": "w" + "9" * 63, "results": [{"group_id": f"g{10 ** 12 + i}", "version": 2 ** 40,
                                                     "completions": [completion] * g} for i in range((s + 1) * p)],
            "rollouts_per_s": 1.2345678901234567e+05, "version": 2 ** 40}
    assert len(json.dumps(body).encode()) <= body_limits(s, p, g, max_tokens)["POST /push"]


@pytest.mark.parametrize("times, allowed", [
    ([0.0] * REGISTER_BURST + [0.0], [True] * REGISTER_BURST + [False]),  # the burst, then no
    ([0.0] * REGISTER_BURST + [REGISTER_EVERY_S], [True] * REGISTER_BURST + [True]),  # one more per period
    ([0.0] * REGISTER_BURST + [REGISTER_EVERY_S / 2] * 2, [True] * REGISTER_BURST + [False, False]),
    ([0.0] * REGISTER_BURST + [REGISTER_BURST * REGISTER_EVERY_S * 3] + [1e6] * REGISTER_BURST,
     [True] * (2 * REGISTER_BURST + 1)),  # back to a full burst after a long quiet, never more
])
def test_registrations_are_a_token_bucket(times, allowed):
    r = Registrations()
    assert [r.allow("box", t) for t in times] == allowed
    assert r.allow("other", times[-1])  # per credential


# ---------------------------------------------------------------------- fair order in the reward pool


def drain(q: FairQueue, now: float, seconds: dict[str, float]) -> list[str]:
    """Pop everything one at a time, each job taking ``seconds[principal]``; returns the jobs in the order taken."""
    out = []
    while (nxt := q.pop(now)) is not None:
        key, job = nxt
        out.append(job)
        now += seconds.get(key, 0.0)
        q.done(key, seconds.get(key, 0.0), now)
    return out


def test_pushes_of_one_principal_take_turns_and_principals_alternate():
    q = FairQueue()
    q.push("x", ["a1", "a2", "a3"], 0.0)
    q.push("x", ["b1", "b2"], 0.0)
    q.push("y", ["c1", "c2"], 0.0)
    assert drain(q, 0.0, {}) == ["a1", "c1", "b1", "c2", "a2", "b2", "a3"]


def test_a_principal_slow_to_score_goes_behind_the_others():
    q = FairQueue()
    q.push("slow", ["s1", "s2", "s3"], 0.0)
    q.push("fast", ["f1"], 0.0)
    key, job = q.pop(0.0)
    q.done(key, 5.0, 5.0)  # its first group took 5 s of a reward process
    q.push("fast", ["f2", "f3"], 5.0)
    assert drain(q, 5.0, {"slow": 5.0, "fast": 0.01}) == ["f1", "f2", "f3", "s2", "s3"]
    assert job == "s1"


def test_a_busy_principal_waits_for_one_that_has_none_being_scored():
    q = FairQueue()
    q.push("x", ["x1", "x2"], 0.0)
    assert q.pop(0.0) == ("x", "x1")  # being scored: busy
    q.push("y", ["y1"], 1.0)
    assert q.pop(1.0) == ("y", "y1")  # not x2, though x waited longer


def test_charges_decay_and_idle_principals_are_forgotten():
    q = FairQueue(half_life_s=10.0)
    q.push("x", ["x1"], 0.0)
    q.done(*q.pop(0.0)[:1], 8.0, 0.0)
    assert q.charge("x", 10.0) == pytest.approx(4.0) and q.charge("x", 20.0) == pytest.approx(2.0)
    q.push("y", ["y1"], 200.0)
    q.done(*q.pop(200.0)[:1], 0.0, 200.0)
    assert "x" not in q.principals and q.queued == 0 and not q.busy


def test_no_principal_has_more_than_its_share_of_processes_at_once():
    """With max_busy=1 (a pool of 2 processes), a principal alone gets one process, not both: the other stays free
    for the next honest push, however slow its groups are to score."""
    q = FairQueue(max_busy=1)
    q.push("slow", ["s1", "s2"], 0.0)
    assert q.pop(0.0) == ("slow", "s1") and not q.ready() and q.pop(0.0) is None
    q.push("honest", ["h1"], 1.0)
    assert q.ready() and q.pop(1.0) == ("honest", "h1")
    q.done("slow", 8.0, 8.0)
    assert q.pop(8.0) == ("slow", "s2")


def test_a_job_that_gave_up_waiting_is_taken_out():
    q = FairQueue()
    q.push("x", ["x1", "x2"], 0.0)
    assert q.remove("x2") and not q.remove("x9")
    assert drain(q, 0.0, {}) == ["x1"] and q.queued == 0


# ---------------------------------------------------------------------- whose fault a failed reward is


@pytest.mark.parametrize("events, struck", [
    # (principal, outcome) in the order groups settle; outcome None: scored
    ([("x", "reward_crashed"), ("y", None)], ["x"]),  # the reward works for y: x's output did it
    ([("x", "reward_timeout"), ("x", None)], []),  # its own success proves nothing
    ([("x", "reward_crashed"), ("y", "reward_crashed"), ("y", None), ("x", None)], []),  # fails for everyone
    ([("x", "reward_crashed"), ("x", "reward_crashed"), ("y", None), ("z", None)], ["x"]),  # one strike a verdict
    ([("x", "reward_error"), ("y", None)], []),  # a reward that raises is the task's fault
    ([("x", "reward_unavailable"), ("y", None)], []),
    ([("x", "reward_timeout"), ("y", "reward_error"), ("z", None)], ["x"]),
])
def test_a_failed_reward_strikes_its_sender_only_once_it_works_for_another(events, struck):
    faults = RewardFaults()
    out = []
    for principal, outcome in events:
        out += faults.observe(principal, outcome)
    assert out == struck


class _Verifier:
    """A reward pool stand-in: every group's reward crashes while ``broken``; else only groups whose completions
    start with token 9 (a crafted answer) do."""

    broken = True

    def score_many(self, groups, principal=None):
        out = []
        for g in groups:
            crafted = g.rollouts[0].completion.token_ids[0] == 9
            out.append("reward_crashed" if self.broken or crafted else None)
            for r in g.rollouts:
                r.reward = 0.0
        return out

    def metrics(self):
        return {}

    def close(self):
        pass


def _push(client, wid, first_token=5):
    work = client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 1})["work"]
    comp = {"token_ids": [first_token, 1], "logprobs": [-1.0, -0.2], "finish_reason": "stop"}
    return client.post("/push", {"worker_id": wid, "results": [
        {"group_id": w["group_id"], "version": 0, "completions": [comp] * 2} for w in work]})


def test_a_broken_verifier_benches_no_one_and_a_crafted_answer_still_costs_its_sender(tiny_model_dir):
    """While the reward crashes on everything, honest workers' pushes are dropped (reward_crashed) but nobody is
    struck (each crash used to be a strike: three pushes benched every worker). Once it works again, a worker whose
    own groups crash it is struck, and benched at the third."""
    coord = small_coordinator(tiny_model_dir, group_size=2, groups_per_pull=1)
    verifier = _Verifier()
    coord.scorer = verifier
    try:
        honest = [Client(coord.url, worker_credential("secret", f"h{i}")) for i in range(2)]
        ids = [c.post("/register", {})["worker_id"] for c in honest]
        for _ in range(4):
            for c, wid in zip(honest, ids):
                assert _push(c, wid)["rejected"][0]["reason"] == "reward_crashed"
        assert all(p.misses == 0 for p in coord.reg.principals.values()), coord.reg.principals
        assert coord.status()["benched"] == []
        verifier.broken = False
        crafty = Client(coord.url, worker_credential("secret", "crafty"))
        cw = crafty.post("/register", {})["worker_id"]
        for _ in range(3):
            assert _push(crafty, cw, first_token=9)["rejected"][0]["reason"] == "reward_crashed"
            assert _push(honest[0], ids[0])["accepted"]  # buffered: 3 of the in-flight cap's 4 by the end
        assert coord.reg.principals["crafty"].misses == 3 and coord.status()["benched"] == [cw]
        assert coord.reg.principals["h0"].misses == 0
    finally:
        coord.close()


def test_secret_bits_of_generated_and_chosen_secrets():
    import secrets

    from echo2.credential import MIN_SECRET_BITS, secret_bits

    assert all(secret_bits(secrets.token_urlsafe(24)) >= MIN_SECRET_BITS for _ in range(2000))
    assert all(secret_bits(secrets.token_hex(16)) >= MIN_SECRET_BITS for _ in range(2000))
    for weak in ("", "secret", "hunter2", "a" * 200, "ab" * 100, "abcdefgh" * 8, "correcthorsebatterystaple",
                 "soak-0123456789ab", "aB3-" * 16):
        assert secret_bits(weak) < MIN_SECRET_BITS, weak


def test_an_exposed_coordinator_refuses_a_weak_run_secret():
    """A credential is HMAC(secret, name), so every worker can test guesses of the secret offline: on a coordinator
    others can reach, a secret below MIN_SECRET_BITS is refused when the settings are built (in the learner, before
    any process starts), saying how to make one. A loopback run's secret never leaves the machine."""
    from echo2.settings import CoordinatorSettings

    kw = dict(staleness=1, prompts_per_step=2, group_size=2, sampling={"max_tokens": 2}, vocab_size=10)
    with pytest.raises(ValueError, match="token_urlsafe"):
        CoordinatorSettings(token="hunter2", host="0.0.0.0", **kw)
    with pytest.raises(ValueError, match="holds at most"):
        CoordinatorSettings(token="ab" * 40, host="203.0.113.7", **kw)
    CoordinatorSettings(token="hunter2", host="127.0.0.1", **kw)
    CoordinatorSettings(token="c2VjcmV0LWVub3VnaC1mb3ItYW4tZXhwb3NlZC1ydW4", host="0.0.0.0", **kw)
