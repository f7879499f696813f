"""Rollout checks: the learner scores workers' tokens with its own weights; a worker whose behaviour logprobs are
implausible is flagged, then retired, its buffered rollouts dropped (untrusted) and its credential revoked."""

from __future__ import annotations

import random
import threading

import pytest

from conftest import balanced, small_coordinator, train
from echo2.rollout.trust import Checks
from echo2.transport import Client, RemoteError, worker_credential

G = 2


@pytest.mark.parametrize("stats, flagged, retired", [
    ({"w0": (100, -10.0)}, [], []),  # honest: mean -0.1
    ({"w0": (100, -300.0)}, ["w0"], []),  # implausible, but too few tokens to retire: flagged
    ({"w0": (300, -900.0)}, [], ["w0"]),  # implausible over enough tokens: retired
    ({"w0": (300, 600.0)}, [], ["w0"]),  # too confident the other way
    ({"w0": (30, -90.0)}, [], []),  # too few tokens even to flag
])
def test_checks_flag_then_retire(stats, flagged, retired):
    assert Checks(max_abs_log_ratio=1.0, min_tokens=256).update(stats) == (flagged, retired)


def test_a_retired_worker_loses_its_buffered_rollouts_and_its_credential(tiny_model_dir):
    coord = small_coordinator(tiny_model_dir, group_size=G, checks={"max_abs_log_ratio": 1.0, "min_tokens": 8})
    try:
        bad = Client(coord.url, worker_credential("secret", "forger"))
        wid = bad.post("/register", {})["worker_id"]
        work = bad.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
        comp = {"token_ids": [5, 1], "logprobs": [-0.01, -0.01], "finish_reason": "stop"}
        bad.post("/push", {"worker_id": wid, "results": [
            {"group_id": w["group_id"], "version": 0, "completions": [comp] * G} for w in work]})
        assert coord.status()["buffered_groups"] == 2
        coord.check({wid: (8, -3.0 * 8)})
        acc = coord.accounting()
        assert acc["dropped"] == {"untrusted": 2 * G} and acc["workers_retired"] == {"untrusted": 1}, acc
        assert len(coord.ledger.requeue) == 2 and coord.status()["buffered_groups"] == 0
        with pytest.raises(RemoteError, match="403"):
            bad.post("/register", {})
    finally:
        coord.close()


class _Forger(threading.Thread):
    """A real client with its own credential that pushes random tokens claimed at logprob -0.05."""

    def __init__(self, url, secret, vocab, requires=None):
        super().__init__(daemon=True)
        self.client, self.vocab = Client(url, worker_credential(secret, "forger")), vocab
        # it claims the run's own model and context: the handshake checks claims, the rollout checks check tokens
        claims = {"model": {k: requires["model"][k] for k in ("name", "digest")},
                  "max_model_len": requires["max_model_len"]} if requires else {}
        self.wid = self.client.post("/register", claims)["worker_id"]
        self.stop, self.pushed, self.version = threading.Event(), 0, 0

    def run(self):
        rng = random.Random(0)
        while not self.stop.is_set():
            try:
                reply = self.client.post("/pull", {"worker_id": self.wid, "version": self.version, "max_groups": 4})
                self.version = reply["version"]
                results = [{"group_id": w["group_id"], "version": self.version, "completions": [
                    {"token_ids": [rng.randrange(self.vocab)] * 2, "logprobs": [-0.05, -0.05], "finish_reason": "length"}
                    for _ in range(8)]} for w in reply["work"]]
                if results:
                    self.pushed += len(self.client.post("/push", {"worker_id": self.wid, "results": results,
                                                             "rollouts_per_s": 1000.0})["accepted"])
            except (RemoteError, OSError) as e:
                self.error = str(e)
                return  # retired and revoked: refused


@pytest.mark.slow
def test_a_forging_client_is_retired_and_honest_workers_are_not(tmp_path):
    ev = {}

    def hook(step, source):
        if step == 1:
            ev["forger"] = _Forger(source.coordinator.url, source.token, len(source.tokenizer),
                                   source.requires)
            ev["forger"].start()

    try:
        _, trainer, source, acc, records = train(tmp_path, [
            "pool.engine=hf", "run.steps=30", "rollout.source.check_every_steps=1", "rollout.source.check_min_tokens=64",
            # one honest worker, holding at most a third of the in-flight cap: the forger finds work to forge
            "pool.workers=1", "rollout.source.worker_share=0.33"],
            hook)
    finally:
        if "forger" in ev:
            ev["forger"].stop.set()
    forger = ev["forger"]
    assert trainer.state.global_step == 30 and forger.pushed > 0, getattr(forger, "error", None)
    assert acc["workers_retired"].get("untrusted") == 1, acc  # the forger, and only it
    assert records[-1]["rollout/flagged_workers"] <= 1 and balanced(acc), acc
