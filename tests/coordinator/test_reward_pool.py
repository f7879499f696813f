"""Rewards in processes of their own with a time limit: a reward that hangs, spins in C, raises or kills its process
costs its group (dropped with the reason, counted), never the coordinator's liveness; and the coordinator's
process keeps answering heartbeats while math-verify chews on \\boxed{10^{10^{7}}}. The pool is shared fairly:
a process goes back after every group, and a principal whose groups are slow to score goes behind the others;
reward processes hold no run secret and bound their own memory and CPU. Every test here starts reward processes."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from conftest import FIXTURES, balanced
from echo2.records import Completion, Rollout, RolloutGroup
from echo2.tasks.base import Task

pytestmark = pytest.mark.e2e  # reward processes are processes
G = 2


def slow(prompts, completions, log=None, **_):
    """A reward by the completion's text: 'sleep' sleeps, 'spin' computes in C (no signal interrupts it), 'raise'
    raises, 'die' kills its process, 'slow' takes 0.5 s and scores 0 (math-verify on a crafted answer), 'secret'
    scores whether the run secret is in its environment, 'memory' allocates 256 MiB, 'limits' scores whether its
    address space and CPU are bounded; anything else scores 1. With a ``log`` column, each group's first text is
    appended to that file as it starts."""
    if log:
        with open(log[0], "a") as f:
            f.write(completions[0] + "\n")
    out = []
    for text in completions:
        if text == "slow":
            time.sleep(0.5 / len(completions))
            out.append(0.0)
            continue
        if text == "secret":
            out.append(float("ECHO2_TOKEN" in os.environ))
            continue
        if text == "memory":
            out.append(float(len(bytearray(256 << 20))))
            continue
        if text == "limits":
            import resource

            out.append(float(all(resource.getrlimit(r)[0] != resource.RLIM_INFINITY
                                 for r in (resource.RLIMIT_AS, resource.RLIMIT_CPU))))
            continue
        if text == "sleep":
            time.sleep(60)
        elif text == "spin":
            10 ** (10 ** 8)  # about a minute of bigint arithmetic in C, holding the GIL
        elif text == "raise":
            raise ZeroDivisionError("a reward bug")
        elif text == "die":
            os._exit(3)
        out.append(1.0)
    return out


class SlowTask(Task):
    """Pickled by reference into the reward processes (this module is importable there: tests/ is on their path)."""

    name = "slow"

    def reward_funcs(self):
        return [slow]

    def is_correct(self, completion, row):
        return slow([row["prompt"]], [completion]) == [1.0]


def group(text: str, gid: str, log: str | None = None) -> RolloutGroup:
    rollouts = [Rollout([1], Completion([5], [-1.0], "stop"), 0, text=text) for _ in range(G)]
    return RolloutGroup(row={"prompt": "p", **({"log": log} if log else {})}, rollouts=rollouts, group_id=gid)


@pytest.fixture(scope="module")
def pool():
    from echo2.coordinator.reward_pool import RewardPool

    p = RewardPool(SlowTask(), tokenizer=None, processes=2, timeout_s=1.5)  # texts are set by the test, not decoded
    yield p
    p.close()


@pytest.mark.parametrize("text, reason", [("sleep", "reward_timeout"), ("spin", "reward_timeout"),
                                          ("raise", "reward_error"), ("die", "reward_crashed")])
@pytest.mark.e2e
def test_a_bad_reward_costs_its_group_only(pool, text, reason):
    groups = [group("ok", "g0"), group(text, "g1"), group("ok", "g2")]
    t0 = time.monotonic()
    assert pool.score_many(groups) == [None, reason, None]
    assert time.monotonic() - t0 < 1.5 + 10  # the limit, plus a fresh process for the rest (generous: loaded CI)
    assert [r.reward for r in groups[0].rollouts + groups[2].rollouts] == [1.0] * 2 * G
    assert pool.score_many([group("ok", "g3")]) == [None]  # the pool goes on
    assert pool.counts[reason] >= 1


def test_held_out_rows_are_judged_with_the_tasks_check_under_the_same_limit(pool):
    """run.eval_on=workers: a worker's greedy completions judged in the pool (is_correct, not the rewards), one that
    hangs timed out like a reward."""
    groups = [group("ok", "e0"), group("slow", "e1"), group("sleep", "e2")]
    assert pool.score_many(groups, principal="eval", judge=True) == [None, None, "reward_timeout"]
    assert [r.rewards for r in groups[0].rollouts + groups[1].rollouts] == [{"correct": 1.0}] * G + [{"correct": 0.0}] * G


def test_honest_groups_do_not_wait_behind_one_principals_slow_pushes(tmp_path):
    """Two pushes of 4 groups each that are slow to score (0.5 s each, then scored 0: math-verify on a crafted
    answer), from one principal, on a pool of 2 processes; then an honest push of one group. A push used to keep its
    process until all its groups were scored, so the honest group waited for all 8; now a process goes back after each
    group and takes the fairest next one: the honest group is scored as soon as a process frees up. Judged by the
    order the groups started in (the reward logs each), not by a clock."""
    from echo2.coordinator.reward_pool import RewardPool

    order = tmp_path / "order.log"
    pool = RewardPool(SlowTask(), tokenizer=None, processes=2, timeout_s=30)
    try:
        assert pool.score_many([group("ok", "warm")]) == [None]  # both processes up before the race
        slow_pushes = [threading.Thread(target=pool.score_many, args=(
            [group("slow", f"x{k}{i}", str(order)) for i in range(4)],), kwargs={"principal": "x"}) for k in range(2)]
        for t in slow_pushes:
            t.start()
        deadline = time.monotonic() + 60
        while (not order.exists() or len(order.read_text().split()) < 2) and time.monotonic() < deadline:
            time.sleep(0.01)  # both processes hold one of x's groups
        assert pool.score_many([group("honest", "y0", str(order))], principal="y") == [None]
        for t in slow_pushes:
            t.join(timeout=60)
        started = order.read_text().split()
        assert len(started) == 9 and started.index("honest") <= 3, started  # not behind x's other 6
        assert pool.fair.charge("x", time.monotonic()) > pool.fair.charge("y", time.monotonic())
    finally:
        pool.close()


def test_reward_processes_hold_no_secret_and_bound_themselves(monkeypatch):
    """The run secret (exported on the learner host to mint credentials) does not reach a process that parses
    strangers' text; its address space is capped (an allocation past it fails: reward_error, the process lives on),
    and a group that spins in C past its CPU limit ends the process at once (reward_crashed), not at the wall-clock
    timeout."""
    from echo2.coordinator.reward_pool import RewardPool

    monkeypatch.setenv("ECHO2_TOKEN", "the-run-secret")
    pool = RewardPool(SlowTask(), tokenizer=None, processes=1, timeout_s=60, memory_mb=64, cpu_s=1)
    try:
        groups = [group("secret", "g0"), group("limits", "g1"), group("memory", "g2")]
        assert pool.score_many(groups) == [None, None, "reward_error"]
        assert [r.reward for r in groups[0].rollouts] == [0.0] * G  # no ECHO2_TOKEN in its environment
        assert [r.reward for r in groups[1].rollouts] == [1.0] * G  # RLIMIT_AS and RLIMIT_CPU set
        t0 = time.monotonic()
        assert pool.score_many([group("spin", "g3")]) == ["reward_crashed"]  # SIGXCPU after ~1 s of CPU
        assert time.monotonic() - t0 < 30  # long before the 60 s timeout (generous: a loaded machine)
        assert pool.score_many([group("ok", "g4")]) == [None]
    finally:
        pool.close()


class CharTokenizer:
    """One token per character (ids are code points): enough to carry LaTeX, which the tiny model's digit
    vocabulary cannot. Pickled into the coordinator's process."""

    def __len__(self):
        return 128

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [min(ord(c), 127) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


class _NoBroadcast:
    """The coordinator process's broadcaster, doing nothing (this test sends no snapshot)."""

    on_delivered = None

    def __init__(self, secret=None, state_dir=None):
        pass

    def metrics(self):
        return {}

    def add_peer(self, *a):
        pass

    def remove_peer(self, *a):
        pass

    def close(self):
        pass


@pytest.mark.e2e
def test_heartbeats_are_answered_while_a_reward_chews_on_a_huge_power(tmp_path):
    """The real coordinator process on gsm8k; one worker pushes \\boxed{10^{10^{7}}} (math-verify took 18 s on it in
    the coordinator's own process, holding its GIL), another heartbeats meanwhile: every heartbeat is answered
    within a second, the push within the reward limit, and the books balance."""
    from echo2.learner.sources.coordinator_process import CoordinatorProcess
    from echo2.settings import CoordinatorSettings
    from echo2.tasks.gsm8k import Gsm8kTask
    from echo2.net.http import Client

    tok = CharTokenizer()
    task = Gsm8kTask(data_dir=str(FIXTURES / "gsm8k"), chat=False, max_completion_length=64)
    coord = CoordinatorProcess(
        task=task, tokenizer=tok, log_path=str(tmp_path / "coordinator.log"),
        settings=CoordinatorSettings(token="secret", staleness=1, prompts_per_step=2, group_size=G,
                                     vocab_size=len(tok), long_poll_s=0.0,
                                     broadcaster={"_target_": f"{__name__}._NoBroadcast"},
                                     sampling={"max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": 0}))
    try:
        client = Client(coord.url, "secret", timeout_s=60)
        pusher = client.post("/register", {})["worker_id"]
        beater = client.post("/register", {})["worker_id"]
        work = client.post("/pull", {"worker_id": pusher, "version": 0, "max_groups": 1})["work"]
        bomb = tok("The answer is \\boxed{10^{10^{7}}}")["input_ids"]
        body = {"worker_id": pusher, "results": [{"group_id": work[0]["group_id"], "version": 0, "completions": [
            {"token_ids": bomb, "logprobs": [-0.1] * len(bomb), "finish_reason": "stop"}] * G}]}
        done, latencies = threading.Event(), []

        def beat():
            beats = Client(coord.url, "secret", timeout_s=60)
            while not done.is_set():
                t0 = time.monotonic()
                beats.post("/heartbeat", {"worker_id": beater, "version": 0})
                latencies.append(time.monotonic() - t0)
                time.sleep(0.1)

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        t0 = time.monotonic()
        reply = client.post("/push", body)
        pushed_s = time.monotonic() - t0
        done.set()
        thread.join(timeout=10)
        print(f"push answered in {pushed_s:.1f} s: {reply}; {len(latencies)} heartbeats, slowest "
              f"{max(latencies):.3f} s")
        assert len(latencies) >= 10 and max(latencies) < 1.0, latencies
        assert pushed_s < 15, pushed_s
        acc = coord.close()
        assert balanced(acc), acc
    finally:
        coord.abandon()
    assert "Traceback" not in Path(tmp_path / "coordinator.log").read_text()
