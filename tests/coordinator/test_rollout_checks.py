"""Rollout checks: the learner scores workers' tokens with its own weights; a worker whose behaviour logprobs are
implausible is flagged, then retired, its buffered rollouts dropped (untrusted) and its credential revoked."""

from __future__ import annotations

import random
import threading
import time

import pytest

from conftest import balanced, delivered_by, slow_until, small_coordinator, train, wait_until
from echo2.worker.engines.hf import HFWorkerEngine
from echo2.coordinator.trust import Checks, Verdict
from echo2.settings import CheckSettings
from echo2.net.http import Client, RemoteError
from echo2.credential import worker_credential

G = 2


@pytest.mark.parametrize("stats, flagged, retired, rejected", [
    ({"w0": (100, -10.0, 15.0)}, [], [], []),  # honest: mean |log-ratio| 0.15
    ({"w0": (16, 0.0, 64.0)}, [], ["w0"], ["w0"]),  # ±4 nats in turn: mean 0, mean |.| 4: 48 nats of excess
    ({"w0": (16, -48.0, 48.0)}, [], ["w0"], ["w0"]),  # one forged group, 8 × 2 tokens off by 3 nats: retired at once
    ({"w0": (20, 0.0, 30.0)}, ["w0"], [], ["w0"]),  # 10 nats of excess: flagged (E/4 = 8), its batch rejected
    ({"w0": (8, 0.0, 12.0)}, [], [], ["w0"]),  # a batch a little above the bound: not trained on, no flag
    ({"w0": (300, 600.0, 600.0)}, [], ["w0"], ["w0"]),  # too confident the other way
])
def test_checks_flag_retire_and_reject(stats, flagged, retired, rejected):
    checks = Checks(CheckSettings(max_abs_log_ratio=1.0, evidence_nats=32.0))
    assert checks.update(stats) == Verdict(flagged, retired, rejected)


def test_honest_history_banks_no_credit_for_cheating_later():
    """The evidence is a CUSUM: a long honest past does not hide a forger that starts now (a plain mean would)."""
    checks = Checks(CheckSettings(max_abs_log_ratio=1.0, evidence_nats=32.0))
    for _ in range(100):
        assert checks.update({"w0": (1000, -20.0, 100.0)}) == Verdict([], [], [])
    assert checks.update({"w0": (16, 0.0, 64.0)}).retire == ["w0"]
    assert checks.mean_abs("w0") < 1.0  # its mean over the whole run is still honest-looking


def test_a_non_finite_score_is_rejected_and_never_clears_the_evidence():
    """A NaN in a checked batch's sums (before the fix: a claimed logprob of -1e300 became -inf in float32, and -inf
    times a truncated completion's mask of 0 is NaN) reset the forger's evidence to 0 and passed its batch."""
    checks = Checks(CheckSettings(max_abs_log_ratio=1.0, evidence_nats=32.0))
    assert checks.update({"w0": (20, 0.0, 30.0)}) == Verdict(["w0"], [], ["w0"])  # 10 nats of evidence
    assert checks.update({"w0": (4, float("nan"), float("nan"))}) == Verdict([], [], ["w0"])
    assert checks.evidence["w0"] == 10.0
    assert checks.update({"w0": (16, 0.0, 40.0)}).retire == ["w0"]  # 24 more: 34 >= 32


def test_a_claimed_logprob_too_small_for_float32_is_refused():
    """-1e300 is finite in Python and -inf in the learner's float32: refused at intake with the bound named."""
    from echo2.coordinator.results import parse_result
    from echo2.net.http import BadRequest

    def result(lps):
        return {"version": 0, "completions": [{"token_ids": [5, 1], "logprobs": lps, "finish_reason": "length"}]}

    assert parse_result(result([-1e4, -0.5]), [1, 2], 1, 8, 72)[0].completion.logprobs == [-1e4, -0.5]
    for bad in (-1e300, -1e5, float("-inf"), float("nan")):
        with pytest.raises(BadRequest, match=r"logprobs must be in \[-10000, 0\]"):
            parse_result(result([bad, -0.5]), [1, 2], 1, 8, 72)


def _forge(client, wid, work, lps=(-0.01, -0.01)):
    comp = {"token_ids": [5, 1], "logprobs": list(lps), "finish_reason": "stop"}
    return client.post("/push", {"worker_id": wid, "results": [
        {"group_id": w["group_id"], "version": 0, "completions": [comp] * G} for w in work]})


def test_a_retired_credential_loses_everything_it_holds(tiny_model_dir):
    """Two ids of one credential: one has groups buffered and in the last batch, the other in flight. Caught on
    the first's tokens, the credential is revoked, both ids retired, all of it dropped or lost as untrusted, and
    the learner is told not to train on its groups in the checked batch (booked: dropped, not consumed)."""
    coord = small_coordinator(tiny_model_dir, group_size=G, checks=CheckSettings(max_abs_log_ratio=1.0, evidence_nats=8))
    try:
        bad = Client(coord.url, worker_credential("secret", "forger"))
        a = bad.post("/register", {})["worker_id"]
        b = bad.post("/register", {})["worker_id"]
        work = bad.post("/pull", {"worker_id": a, "version": 0, "max_groups": 3})["work"]
        assert len(work) == 3  # a credential that alone can get work may hold the whole cap, (S+1)·P = 4
        assert _forge(bad, a, work)["accepted"] == [w["group_id"] for w in work]
        taken = coord.take(2, timeout_s=1)  # the learner's batch: two of a's groups; one stays buffered
        assert len(bad.post("/pull", {"worker_id": b, "version": 0, "max_groups": 2})["work"]) == 1
        assert coord.check({a: (2 * 2 * G, -24.0, 24.0)}) == [a]  # 16 tokens off by 1.5 nats: 8 nats of excess
        acc = coord.accounting()  # the batch's 2 and the buffered one dropped, b's one in flight lost
        assert acc["dropped"] == {"untrusted": 3 * G} and acc["lost"] == {"untrusted": G}, acc
        assert acc["consumed"] == 0 and acc["workers_retired"] == {"untrusted": 2}, acc
        assert len(coord.ledger.requeue) == 4 and coord.status()["buffered_groups"] == 0 and len(taken) == 2
        with pytest.raises(RemoteError, match="403"):
            bad.post("/register", {})
        acc = coord.close()
        assert acc["dispatched"] == acc["consumed"] + sum(acc["dropped"].values()) + sum(acc["lost"].values())
    finally:
        coord.close()


def test_a_batch_found_bad_is_not_trained_on_and_honest_ones_are(tiny_model_dir):
    coord = small_coordinator(tiny_model_dir, group_size=G)
    try:
        client = Client(coord.url, "secret")
        w = client.post("/register", {})["worker_id"]
        _forge(client, w, client.post("/pull", {"worker_id": w, "version": 0, "max_groups": 4})["work"])
        coord.take(2, timeout_s=1)
        assert coord.check({w: (2 * 2 * G, -1.0, 2.0)}) == []  # honest-looking: trained on
        coord.take(2, timeout_s=1)
        assert coord.check({w: (2 * 2 * G, 0.0, 20.0)}) == [w]  # 1.25 nats a token: this batch is not
        acc = coord.accounting()
        assert acc["consumed"] == 2 * G and acc["dropped"] == {"untrusted": 2 * G}, acc
        assert acc["workers_retired"] == {}, acc  # 4 nats of evidence: neither flagged nor retired
    finally:
        coord.close()


def test_past_policies_keep_only_the_versions_a_check_asks_for_and_swap_back():
    """Checks at multiples of 5, S = 2: versions 3, 4 (for the check at 5) and 8, 9 (at 10) are kept, 3 and 4 dropped
    once no check can ask for them; inside ``swapping`` the model has the weights loaded last, after it its own,
    even when the block raises."""
    import torch

    from echo2.learner.past_policies import PastPolicies

    past = PastPolicies(lags=2, every=5)
    assert [v for v in range(12) if past.needed(v)] == [3, 4, 8, 9]
    assert not any(PastPolicies(lags=0, every=5).needed(v) for v in range(12))
    assert not any(PastPolicies(lags=2, every=0).needed(v) for v in range(12))
    model = torch.nn.Linear(3, 2)
    for version in range(10):
        with torch.no_grad():
            model.weight.fill_(version)
        past.record(version, model)
        kept = {3: {3}, 4: {3, 4}, 5: {3, 4}, 6: {4}, 8: {8}, 9: {8, 9}}
        assert set(past.kept) == kept.get(version, set()), version
    with past.swapping(model) as load:
        load(8)
        assert (model.weight == 8).all()
        load(9)
        assert (model.weight == 9).all()
        load(8)
    assert (model.weight == 9).all()
    with pytest.raises(RuntimeError), past.swapping(model) as load:
        load(8)
        raise RuntimeError("a forward failed")
    assert (model.weight == 9).all()


@pytest.mark.e2e
@pytest.mark.slow
def test_an_honest_workers_lagged_tokens_are_scored_under_the_version_that_made_them(tmp_path):
    """Two honest hf workers, S = 2, every batch checked against a bound of 0.05 nats a token, at the demo's learning
    rate: scored with the current weights their lagged tokens were 0.12-0.17 nats a token off (what the learner
    learnt since), and the checks would flag them; scored under the version each claims, they are off by numerics
    only (same transformers code on both sides: 0), none is flagged, and everything is trained on."""
    def both_deliver(step, source):  # a worker slow to start on a loaded machine must still be checked
        slow_until(lambda: delivered_by(source, "w0", "w1"))

    _, trainer, _, acc, records = train(tmp_path, ["pool.engine=hf", "run.steps=30", "rollout.staleness=2",
                                                   "rollout.source.check_every_steps=1",
                                                   "rollout.source.check_max_abs_log_ratio=0.05"], both_deliver)
    assert trainer.state.global_step == 30 and max(r["buffer/staleness_max"] for r in records) >= 1
    means = {k: v for k, v in records[-1].items() if k.startswith("rollout/check_abs_log_ratio/")}
    assert len(means) == 2 and all(v < 1e-3 for v in means.values()), means
    assert max(r["rollout/flagged_workers"] for r in records) == 0 and "untrusted" not in acc["workers_retired"], acc
    assert "untrusted" not in acc["dropped"] and balanced(acc), acc


class _ForgingEngine(HFWorkerEngine):
    """A worker's engine that skips generation: each prompt gets ``forge(rng)`` G times, with made-up logprobs. It
    applies snapshots and scores probes honestly (a real transformers model), so the worker claims only versions it
    was delivered, as a careful forger would: the rollout checks are what must catch it."""

    name = "forging"

    def __init__(self, model_path, forge, delay_s=0.0):
        super().__init__(model_path)
        self.forge, self.rng, self.delay_s = forge, random.Random(0), delay_s

    def generate(self, prompt_ids, params):
        time.sleep(self.delay_s)
        return [[self.forge(self.rng) for _ in range(params.n)] for _ in prompt_ids]


class _Forger(threading.Thread):
    """A real worker agent with its own credential ('forger') and a forging engine."""

    def __init__(self, source, forge, delay_s=0.0, max_groups=4):
        from echo2.worker.agent import Agent

        super().__init__(daemon=True)
        requires = source.requires  # it claims the run's own model and context: the handshake checks claims only
        claims = {"model": {k: requires["model"][k] for k in ("name", "digest")},
                  "max_model_len": requires["max_model_len"]}
        self.agent = Agent(source.coordinator.url, worker_credential(source.token, "forger"),
                           _ForgingEngine(requires["model"]["name"], forge, delay_s), declared=claims,
                           max_groups=max_groups)
        self.error = None

    def run(self):
        try:
            self.agent.run()
        except BaseException as e:  # retired and revoked: refused (403)
            self.error = e

    def close(self):
        self.agent.stop.set()
        self.agent.receiver.close()
        self.join(timeout=30)


def _random_tokens(vocab):
    from echo2.records import Completion

    return lambda rng: Completion([rng.randrange(vocab)] * 2, [-0.05, -0.05], "length")


def _one_answer(rng):
    """The same two tokens for every completion of every group, claimed near-certain."""
    from echo2.records import Completion

    return Completion([5, 1], [-0.05, -0.05], "stop")


def _dispatched_to(forger, coordinator) -> bool:
    """Whether the forger holds work, or has delivered some (then it may be retired and gone already)."""
    wid, status = getattr(forger.agent, "worker_id", None), coordinator.status()
    if wid and (wid in status["held"] or wid in status["by_worker"]):
        return True
    assert forger.is_alive(), forger.error
    return False


def _run_with_forger(tmp_path, forge, overrides, **forger):
    ev = {}

    def hook(step, source):
        if step == 1:
            ev["forger"] = _Forger(source, forge(source), **forger)
            ev["forger"].start()
        if "dispatched" not in ev:
            # Slowed, not held, until the forger holds work: on a loaded machine a 30-step run can end before a
            # joiner has loaded its model (CI once saw the forger get no work at all), and a held learner consumes
            # nothing, so once the honest worker has filled the in-flight cap nothing more is dispatched to anyone
            # (a CI run under the parallel suite: held 180 s with 48 groups buffered).
            if slow_until(lambda: _dispatched_to(ev["forger"], source.coordinator), at_most_s=3.0):
                ev["dispatched"] = step
            return
        retired = lambda: ev["forger"].agent.worker_id not in source.coordinator.status()["workers"]  # noqa: E731
        # The forger is a thread of this process: on a loaded machine the learner's steps can starve it until its
        # groups arrive too stale to be consumed (a CI run: 26 pushed, none consumed in 30 steps). Slowed, not held
        # (a held learner consumes nothing): a second a step at most, until it is retired.
        if slow_until(retired):
            # its next request is refused and ends it; the coordinator must still be up to refuse it (a CI run
            # ended first, and the forger's last call met a closed port instead)
            wait_until(lambda: not ev["forger"].is_alive(), timeout_s=60, what="the retired forger to be refused")

    try:
        _, trainer, source, acc, records = train(tmp_path, ["pool.engine=hf", "pool.workers=1", *overrides], hook)
    finally:
        if "forger" in ev:
            ev["forger"].close()
    assert ev.get("dispatched", 99) <= 10, f"the forger got work only at step {ev.get('dispatched')}"
    return trainer, acc, records, ev["forger"]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_forging_worker_is_retired_and_honest_workers_are_not(tmp_path):
    """Random tokens claimed at logprob -0.05, every batch checked: the forger's credential is retired, the honest
    worker's is never flagged, and the books balance."""
    trainer, acc, records, forger = _run_with_forger(
        tmp_path, lambda source: _random_tokens(len(source.tokenizer)),
        ["run.steps=30", "rollout.source.check_every_steps=1"])
    assert trainer.state.global_step == 30 and acc["by_worker"], acc
    assert acc["workers_retired"].get("untrusted") == 1, acc  # the forger, and only it
    assert records[-1]["rollout/flagged_workers"] <= 1 and balanced(acc), acc
    assert "403" in str(forger.error), forger.error


@pytest.mark.e2e
@pytest.mark.slow
def test_one_fabricated_answer_per_group_is_caught_within_a_short_run(tmp_path):
    """Every batch checked (with checks every 10th or 5th batch, whether a forger holding one group at a time has a
    group in one of a 30-step run's few checked batches is chance: the test failed 2 runs in 3) on the demo task,
    whose answers are a couple
    of tokens: a worker answering every group with the same fabricated completion and invented logprobs, one group
    at a time (a few of its groups in each batch), is caught within 30 steps (it used to get 132 groups in and
    never be flagged: 256 tokens of evidence were needed, 16 per group here), and the checked batch's forged groups
    are not trained on (dropped: untrusted)."""
    trainer, acc, records, forger = _run_with_forger(
        tmp_path, lambda source: _one_answer, ["run.steps=30", "rollout.source.check_every_steps=1"],
        delay_s=0.05, max_groups=1)
    print(f"forger: {acc['by_worker']}, retired {acc['workers_retired']}, dropped {acc['dropped']}")
    assert trainer.state.global_step == 30, acc
    assert acc["workers_retired"].get("untrusted") == 1 and acc["dropped"].get("untrusted", 0) > 0, acc
    assert balanced(acc), acc
