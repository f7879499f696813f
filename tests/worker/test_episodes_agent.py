"""A multi-turn task through the rollout plane, in this process: the coordinator sends the environment's spec when a
worker registers and each group's row with its prompt; the agent runs the episodes around its engine (every turn
in one batch: a snapshot that arrives meanwhile waits, so the episode's version is the one that made all of it);
the coordinator reads each transcript back against its tokens, scores it, and refuses one that was tampered with.
Held-out rows evaluated on the worker (run.eval_on=workers) are greedy episodes, judged from their transcripts."""

from __future__ import annotations

import functools
import json

import pytest
from trl import GRPOTrainer  # noqa: F401 (TRL's tool layout code; importing it runs DeepSpeed's `uname`: at collection)

from echo2.records import SamplingParams
from own_envs import ScriptedPolicy

G = 2


@pytest.fixture
def plane(tmp_path, echo2_cache):
    from echo2.coordinator.coordinator import Coordinator
    from echo2.models.tiny import build_tiny
    from echo2.models.tokenizer import load_tokenizer
    from echo2.scoring import Scorer
    from echo2.settings import CoordinatorSettings
    from echo2.tasks.dataset import DatasetTask

    tok = load_tokenizer(build_tiny(tool_chat=True, max_position_embeddings=2048))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": [{{"role": "user", "content": "Count."}}], "target": {t}}}\n'
                            for t in (5, 4, 5, 4)))
    task = DatasetTask(data_files=str(rows), eval_size=0, environment="own_envs:CounterEnv",
                       reward_funcs=["own_envs.reach_target"], max_completion_length=300)
    settings = CoordinatorSettings(token="secret", staleness=1, prompts_per_step=2, group_size=G, vocab_size=len(tok),
                                   long_poll_s=0.0, episode=task.episode_spec().as_dict(),
                                   sampling={"max_tokens": 300, "temperature": 1.0, "top_p": 1.0, "top_k": 0})
    coord = Coordinator(task.train_dataset(), Scorer(task, tok), tok, settings,
                        encode=functools.partial(task.prompt_ids, tok),
                        eval_rows=list(task.train_dataset())).start()  # held out here: the same rows
    yield coord, tok
    coord.close()


class ScriptedWorkerEngine:
    """A worker engine (generate(ids, params)) over the scripted policy; ``during`` runs before each turn."""

    name = "scripted"

    def __init__(self, tok, during=None):
        self.policy, self.during, self.turns = ScriptedPolicy(tok, steps=(2, 3)), during, 0

    def generate(self, prompt_ids, params):
        self.turns += 1
        if self.during:
            self.during(self.turns)
        return self.policy.generate(prompt_ids, params)

    def close(self):
        pass


def agent_for(coord, tok, engine):
    from echo2.worker.agent import Agent

    agent = Agent(coord.url, "secret", engine, tokenizer=tok, max_groups=2)
    info = agent.client.post("/register", {})
    agent.worker_id, agent.episodes = info["worker_id"], agent._episodes(info["episode"])
    return agent


def test_episodes_run_on_the_worker_and_are_scored_from_their_transcripts(plane):
    coord, tok = plane
    agent = agent_for(coord, tok, None)
    snapshots = []
    # a snapshot arrives while the episodes run (between their turns): it must wait for the batch to end
    agent.engine = ScriptedWorkerEngine(tok, during=lambda turn: turn == 2 and (
        agent._received(1, b"", {"epoch": None}), snapshots.append(agent.version)))
    try:
        agent._step(SamplingParams(n=G, max_tokens=300))
        agent.flush()
        assert agent.engine.turns == 3 and snapshots == [0] and agent.pending is not None  # still pending
        assert set(agent.time_s) == {"apply", "pull", "generate", "push"}  # where the step's time went
        assert all(t > 0 for t in agent.time_s.values())
        (g1, g2) = coord.take(2, timeout_s=5)
        for group in (g1, g2):
            assert group.version == 0  # the version that made every turn
            for r in group.rollouts:
                assert r.episode["turns"] == 3 and [m["role"] for m in r.episode["messages"]] == [
                    "assistant", "tool", "assistant", "tool", "assistant"]
                assert 0 in r.completion.mask and r.completion.mask[-1] == 1
        for group in (g1, g2):  # the scripted steps (2, 3) reach 5, not 4
            hit = float(group.row["target"] == 5)
            assert [r.rewards for r in group.rollouts] == [{"reach_target": hit, "CounterEnv": hit}] * G
            assert all(r.prompt_ids != coord.encode(group.row) for r in group.rollouts)  # reset added to the prompt
    finally:
        agent.receiver.close()
    acc = coord.accounting()  # every dispatched rollout accounted for: 2 groups consumed, the rest still open
    assert acc["consumed"] == 2 * G and acc["dropped"] == {} and acc["lost"] == {}
    assert acc["dispatched"] == acc["consumed"] + acc["in_flight"] + acc["buffered"]


@pytest.mark.parametrize("tamper, why", [
    (lambda c: c.update(logprobs=[-0.5 if m == 0 else lp for m, lp in zip(c["mask"], c["logprobs"])]),
     "carries a logprob"),
    (lambda c: c["episode"]["observations"][0][0].update(content="total=7"), "does not render to its tokens"),
    (lambda c: c.pop("mask"), "mask must be a list"),
    (lambda c: c["episode"].update(reward=1e12), "finite"),
    (lambda c: c["episode"].update(metrics={f"m{i}": 1.0 for i in range(33)}), "at most 32 finite numbers"),
    (lambda c: c["episode"].update(metrics={"x": True}), "finite numbers"),
    (lambda c: c["episode"].update(metrics={"x" * 65: 1.0}), "named in at most 64 characters"),
    (lambda c: c["episode"].update(metrics={"x": 10 ** 400}), "finite numbers"),  # compared, never made a float
    (lambda c: c["episode"].update(reward=-10 ** 400), "finite"),
    (lambda c: c["episode"].pop("prompt"), "prompt_ids without the prompt"),
    (lambda c: c.update(prompt_ids=c["prompt_ids"][:-1]), "does not render to its prompt tokens"),
])
def test_a_tampered_episode_is_refused_as_invalid(plane, tamper, why):
    coord, tok = plane
    agent = agent_for(coord, tok, ScriptedWorkerEngine(tok))
    try:
        work = agent.client.post("/pull", {"worker_id": agent.worker_id, "version": 0, "max_groups": 1})["work"]
        groups = agent._generate(work, SamplingParams(n=G, max_tokens=300))
        completions = json.loads(json.dumps(groups[0]))
        tamper(completions[0])
        reply = agent.client.post("/push", {"worker_id": agent.worker_id, "results": [
            {"group_id": work[0]["group_id"], "version": 0, "completions": completions}]})
        assert reply["accepted"] == [] and why in reply["rejected"][0]["reason"], reply
    finally:
        agent.receiver.close()
    assert coord.accounting()["dropped"] == {"invalid": G}


def test_held_out_episodes_run_on_the_worker_and_are_judged_from_their_transcripts(plane):
    from echo2.metrics import EVAL_ACCURACY, EVAL_REWARD_MEAN, EVAL_UNSCORED

    coord, tok = plane
    agent = agent_for(coord, tok, ScriptedWorkerEngine(tok))
    coord.request_eval(0)
    try:
        agent._step(SamplingParams(n=G, max_tokens=300))  # the pull hands out the held-out rows, not groups
    finally:
        agent.receiver.close()
    (result,) = coord.evaluations()["results"]
    # the scripted steps (2, 3) reach 5: the rows with target 5 are correct, those with 4 not
    assert result[EVAL_ACCURACY] == 0.5 and result[EVAL_REWARD_MEAN] == 0.5 and result[EVAL_UNSCORED] == 0
    assert agent.engine.turns == 3 and coord.accounting()["dispatched"] == 0  # no training group went out


def test_an_episodes_own_metrics_travel_from_the_worker_with_its_rollouts(plane):
    """What an environment's get_metrics() gave (carried in the episode record) is taken in with the push and reaches
    the learner with each rollout."""
    coord, tok = plane
    agent = agent_for(coord, tok, ScriptedWorkerEngine(tok))
    try:
        work = agent.client.post("/pull", {"worker_id": agent.worker_id, "version": 0, "max_groups": 1})["work"]
        completions = json.loads(json.dumps(agent._generate(work, SamplingParams(n=G, max_tokens=300))[0]))
        for c in completions:
            c["episode"]["metrics"] = {"steps": 2.0, "solved": 1.0}
        reply = agent.client.post("/push", {"worker_id": agent.worker_id, "results": [
            {"group_id": work[0]["group_id"], "version": 0, "completions": completions}]})
        assert reply["rejected"] == [], reply
        (group,) = coord.take(1, timeout_s=5)
        assert [r.episode["metrics"] for r in group.rollouts] == [{"steps": 2.0, "solved": 1.0}] * G
    finally:
        agent.receiver.close()


def test_several_environments_by_name_run_on_the_worker_through_the_coordinator(tmp_path, echo2_cache):
    """TRL's dict environment_factory across the rollout plane: the worker gets the spec of every environment, runs
    each row's in its own, and the coordinator reads each transcript with that environment's tools and scores each
    environment's reward column on its own rows only."""
    import math

    from echo2.coordinator.coordinator import Coordinator
    from echo2.models.tiny import build_tiny
    from echo2.models.tokenizer import load_tokenizer
    from echo2.scoring import Scorer
    from echo2.settings import CoordinatorSettings
    from echo2.tasks.dataset import DatasetTask
    from own_envs import EitherPolicy

    tok = load_tokenizer(build_tiny(tool_chat=True, max_position_embeddings=2048))
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "Go."}], "target": 5, "environment": "count"}\n'
                    '{"prompt": [{"role": "user", "content": "Go."}], "target": 9, "environment": "sum"}\n')
    task = DatasetTask(data_files=str(rows), eval_size=0, max_completion_length=300,
                       environment={"count": "own_envs:CounterEnv", "sum": "own_envs:SumEnv"})
    settings = CoordinatorSettings(token="secret", staleness=1, prompts_per_step=2, group_size=G, vocab_size=len(tok),
                                   long_poll_s=0.0, episode=task.episode_spec().as_dict(),
                                   sampling={"max_tokens": 300, "temperature": 1.0, "top_p": 1.0, "top_k": 0})
    coord = Coordinator(task.train_dataset(), Scorer(task, tok), tok, settings,
                        encode=functools.partial(task.prompt_ids, tok)).start()
    engine = ScriptedWorkerEngine(tok)
    engine.policy = EitherPolicy(tok, steps=(2, 3))
    agent = agent_for(coord, tok, engine)
    try:
        agent._step(SamplingParams(n=G, max_tokens=300))
        agent.flush()
        groups = {g.row["environment"]: g for g in coord.take(2, timeout_s=5)}
    finally:
        agent.receiver.close()
        agent.episodes.close()
        coord.close()
    for name, own, other, tool in (("count", "CounterEnv", "SumEnv", "increment"), ("sum", "SumEnv", "CounterEnv",
                                                                                      "add")):
        for r in groups[name].rollouts:
            assert r.rewards[own] == 1.0 and math.isnan(r.rewards[other])
            assert r.episode["messages"][0]["tool_calls"][0]["function"]["name"] == tool
