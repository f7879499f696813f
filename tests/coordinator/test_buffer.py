"""The staleness rule and the dispatch cap (pure), and the coordinator's invariants under random schedules."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2.coordinator.buffer import StalenessBuffer, admissible, worth_dispatching


@pytest.mark.parametrize("step, version, S, ok", [
    (0, 0, 0, True), (1, 0, 0, False), (5, 3, 2, True), (6, 3, 2, False), (3, 3, 0, True),
])
def test_admissible_table(step, version, S, ok):
    assert admissible(step, version, S) is ok


@pytest.mark.parametrize("step, worker_version, ahead, P, S, ok", [
    (0, 0, 0, 16, 0, True), (0, 0, 15, 16, 0, True), (0, 0, 16, 16, 0, False),   # cap (S+1)P = 16
    (4, 4, 47, 16, 2, True), (4, 4, 48, 16, 2, False),                              # cap (S+1)P = 48
    (4, 2, 0, 16, 2, True), (4, 2, 16, 16, 2, False), (4, 1, 0, 16, 2, False),      # stale worker: less room
])
def test_dispatch_cap_table(step, worker_version, ahead, P, S, ok):
    assert worth_dispatching(step, worker_version, ahead, P, S) is ok


def test_buffer_takes_oldest_admissible_after_eviction():
    b = StalenessBuffer(staleness=1)
    for v, name in [(0, "a"), (1, "b"), (2, "c"), (3, "d")]:
        assert b.admit(name, v, current_version=3)
    assert not b.admit("e", 4, current_version=3)  # from the future
    with pytest.raises(RuntimeError, match="evict_stale"):
        b.take(2, step=3)  # a is stale at step 3 and was not evicted
    assert b.evict_stale(step=3) == ["a", "b"]  # lag 3, 2 > 1
    assert b.take(2, step=3) == [(2, "c"), (3, "d")]
    assert b.take(1, step=3) is None


def _admin():
    """What a route is handed for a request admitted with the run secret."""
    from echo2.coordinator.gate import RUN_SECRET
    from echo2.net.http import RequestHeaders

    return RequestHeaders([], RUN_SECRET, "127.0.0.1")


ADMIN = _admin()


class SimCoordinatorHarness:
    """Drives the real Coordinator's route handlers (no sockets) with simulated workers."""

    def __init__(self, tiny_model_dir, S, P, G, n_workers, seed):
        from transformers import AutoTokenizer

        from echo2.coordinator.coordinator import Coordinator
        from echo2.scoring import Scorer
        from echo2.settings import CoordinatorSettings
        from echo2.tasks.arith import ArithTask

        task = ArithTask(level="copy", train_size=50)
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        self.c = Coordinator(task.train_dataset(), Scorer(task, tok), tok, CoordinatorSettings(
            token="t", staleness=S, prompts_per_step=P, group_size=G, vocab_size=len(tok), long_poll_s=0.0,
            sampling={"max_tokens": 2, "temperature": 1.0, "top_p": 1.0, "top_k": 0}))
        self.G, self.rng = G, random.Random(seed)
        self.workers = [self.c._register({"engine": "sim"}, ADMIN)["worker_id"] for _ in range(n_workers)]
        self.held = {w: [] for w in self.workers}  # (group_id, version it generates with)
        self.versions = {w: 0 for w in self.workers}

    def tick(self):
        """One worker acts: picks up a newer version, pulls, or pushes some of what it holds."""
        w = self.rng.choice(self.workers)
        action = self.rng.random()
        if action < 0.2:
            self.c._snapshot_delivered(w, self.c.version)  # a snapshot arrived (the broadcaster says so)
            self.versions[w] = self.c.version
        elif action < 0.6:
            reply = self.c._pull({"worker_id": w, "version": self.versions[w], "max_groups": 2}, ADMIN)
            self.held[w] += [(g["group_id"], self.versions[w]) for g in reply["work"]]
        elif self.held[w]:
            k = self.rng.randint(1, len(self.held[w]))
            batch, self.held[w] = self.held[w][:k], self.held[w][k:]
            results = [{"group_id": gid, "version": v,
                        "completions": [{"token_ids": [5, 1], "logprobs": [-1.0, -0.5], "finish_reason": "stop"}]
                        * self.G} for gid, v in batch]
            self.c._push({"worker_id": w, "results": results}, ADMIN)


@settings(max_examples=25, deadline=None)
@given(S=st.integers(0, 3), n_workers=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_staleness_invariant_under_random_worker_delays(tiny_model_dir, S, n_workers, seed):
    """Whatever the interleaving, every group the learner consumes has lag <= S, and the books balance."""
    P, G = 4, 2
    h = SimCoordinatorHarness(tiny_model_dir, S, P, G, n_workers, seed)
    steps = 0
    for _ in range(3000):
        h.tick()
        try:
            groups = h.c.take(P, timeout_s=0)
        except TimeoutError:
            continue
        assert all(h.c.version - g.version <= S for g in groups)
        steps += 1
        h.c.set_version(steps)
        if steps == 15:
            break
    acc = h.c.close()
    assert steps >= 3, "the simulation made too little progress to mean anything"
    total = acc["consumed"] + sum(acc["dropped"].values()) + sum(acc["lost"].values()) + acc["in_flight"] + acc["buffered"]
    assert acc["dispatched"] == total
    assert acc["consumed"] == steps * P * G


def _waiting_coordinator(tiny_model_dir):
    """A coordinator at S = 0, P = 2, G = 2 whose long poll gives up after 50 ms."""
    from echo2.coordinator.coordinator import Coordinator
    from echo2.scoring import Scorer
    from echo2.settings import CoordinatorSettings
    from echo2.tasks.arith import ArithTask
    from transformers import AutoTokenizer

    task = ArithTask(level="copy", train_size=50)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return Coordinator(task.train_dataset(), Scorer(task, tok), tok, CoordinatorSettings(
        token="t", staleness=0, prompts_per_step=2, group_size=2, vocab_size=len(tok), long_poll_s=0.05,
        sampling={"max_tokens": 2, "temperature": 1.0, "top_p": 1.0, "top_k": 0}))


def test_a_pull_says_why_it_waited(tiny_model_dir):
    """A worker whose pulls wait with nothing handed out is told apart by why, in GET /status: the staleness window
    full (more would be stale before the learner reached it) or its credential's share held."""
    c = _waiting_coordinator(tiny_model_dir)
    try:
        a = c._register({"engine": "sim"}, ADMIN)["worker_id"]
        work = c._pull({"worker_id": a, "version": 0, "max_groups": 8}, ADMIN)["work"]
        assert len(work) == 2  # S = 0: one step's groups, and its share of them is held
        assert c._pull({"worker_id": a, "version": 0, "max_groups": 8}, ADMIN)["work"] == []
        assert set(c.status()["waited_s"][a]) == {"share"}
        done = [{"token_ids": [5, 1], "logprobs": [-1.0, -0.5], "finish_reason": "stop"}] * 2
        c._push({"worker_id": a, "results": [{"group_id": g["group_id"], "version": 0, "completions": done}
                                             for g in work]}, ADMIN)
        assert c._pull({"worker_id": a, "version": 0, "max_groups": 8}, ADMIN)["work"] == []  # buffered, not taken
        waited = c.status()["waited_s"][a]
        assert set(waited) == {"share", "window"} and waited["window"] >= 0.04
    finally:
        c.close()


def test_a_pull_that_waited_because_a_prompt_could_not_be_built_says_so(tiny_model_dir):
    """A dataset row whose prompt cannot be built is lost (dispatch_failed, not re-queued), and the pull that got
    nothing because of it is booked under that reason, not as a held share."""
    c = _waiting_coordinator(tiny_model_dir)

    def broken(row):
        raise ValueError("no prompt in this row")

    try:
        a = c._register({"engine": "sim"}, ADMIN)["worker_id"]
        c.encode = broken
        assert c._pull({"worker_id": a, "version": 0, "max_groups": 8}, ADMIN)["work"] == []
        assert set(c.status()["waited_s"][a]) == {"dispatch_failed"}
        lost = c.accounting()["lost"]  # a group (G = 2) each time the long poll tried again
        assert set(lost) == {"dispatch_failed"} and lost["dispatch_failed"] >= 2 and lost["dispatch_failed"] % 2 == 0
    finally:
        c.close()
