"""Multi-turn episodes, token in and token out, with environments written for TRL and SkyRL-gym running unchanged:
the layout and masks TRL's code renders, budgets and turn limits as TRL counts them, failures that end a trajectory
with their reason, and the transcript read back (and checked) where rewards are scored."""

from __future__ import annotations

import json
import math

import pytest
from trl import GRPOTrainer  # noqa: F401 (TRL's tool layout code; importing it runs DeepSpeed's `uname`: at collection)

from echo2.models.tokenizer import load_tokenizer
from echo2.records import Completion, Rollout, RolloutGroup, SamplingParams
from echo2.scoring import Scorer
from echo2.tasks.dataset import DatasetTask
from echo2.tasks.environments import Episodes, TranscriptMismatch, spec_for
from own_envs import ScriptedPolicy

PROMPT = [{"role": "user", "content": "Count."}]


@pytest.fixture(scope="module")
def tok(echo2_cache):
    from echo2.models.tiny import build_tiny

    return load_tokenizer(build_tiny(tool_chat=True, max_position_embeddings=2048))


def episodes(tok, env="own_envs:CounterEnv", tools=(), budget=300, **kw):
    return Episodes(spec_for(env, list(tools), budget, timeout_s=kw.pop("timeout_s", 5.0), **kw), tok)


def segments(tok, t):
    out, i = [], 0
    while i < len(t.mask):
        j = i
        while j < len(t.mask) and t.mask[j] == t.mask[i]:
            j += 1
        out.append((t.mask[i], tok.decode(t.token_ids[i:j])))
        i = j
    return out


def test_trl_environment_runs_unchanged_with_trls_layout(tok):
    ep = episodes(tok)
    policy = ScriptedPolicy(tok, steps=(2, 3))
    (t,) = ep.run(policy.generate, [{"prompt": PROMPT, "target": 5}], SamplingParams(n=1, max_tokens=300), n=1)[0]
    assert t.prompt == [{"role": "user", "content": "Count. Reach 5."}]  # reset's text, appended as TRL appends it
    assert tok.decode(t.prompt_ids).endswith("Count. Reach 5.<|im_end|>\n<|im_start|>assistant\n")
    assert '"name": "increment"' in tok.decode(t.prompt_ids)  # the tool's schema, from its hints and docstring
    assert segments(tok, t) == [
        (1, '<tool_call>\n{"name": "increment", "arguments": {"step": 2}}\n</tool_call><|im_end|>'),
        (0, "\n<|im_start|>user\n<tool_response>\ntotal=2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        (1, '<tool_call>\n{"name": "increment", "arguments": {"step": 3}}\n</tool_call><|im_end|>'),
        (0, "\n<|im_start|>user\n<tool_response>\ntotal=5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        (1, "done<|im_end|>")]
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask) if m == 0)  # environment tokens: no behaviour logprob
    assert all(lp == -0.5 for lp, m in zip(t.logprobs, t.mask) if m == 1)
    assert (t.turns, t.tool_calls, t.tool_errors, t.reward, t.error) == (3, 2, 0, 1.0, None)
    assert t.state == {"history": [2, 3], "target": 5, "total": 5}
    assert policy.calls == 3  # one generation batch per turn
    messages = ep.transcript(t.prompt_ids, t.token_ids, t.mask, t.record(), PROMPT)
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert messages[0]["tool_calls"][0]["function"] == {"name": "increment", "arguments": {"step": 2}}
    assert messages[1] == {"role": "tool", "name": "increment", "content": "total=2"}


def test_the_budget_counts_every_turn_and_an_answer_that_does_not_fit_ends_the_episode(tok):
    ep = episodes(tok, budget=120)  # room for the first turn and answer, not the second answer
    (t,) = ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, [{"prompt": PROMPT, "target": 5}],
                  SamplingParams(n=1, max_tokens=120), n=1)[0]
    assert len(t.token_ids) <= 120 and t.observations == [[{"role": "tool", "name": "increment", "content": "total=2"}]]
    assert t.mask[-1] == 1 and t.turns == 2  # the second tool answer was not appended (TRL rolls it back)
    short = episodes(tok, budget=30)
    (t,) = short.run(ScriptedPolicy(tok).generate, [{"prompt": PROMPT, "target": 5}], SamplingParams(n=1), n=1)[0]
    assert (len(t.token_ids), t.finish_reason, t.turns) == (30, "length", 1)  # the turn cut at the budget


def test_max_turns_is_trls_max_tool_calling_iterations_plus_one(tok):
    ep = episodes(tok, max_turns=2)
    (t,) = ep.run(ScriptedPolicy(tok, steps=(1, 1, 1)).generate, [{"prompt": PROMPT, "target": 5}],
                  SamplingParams(n=1, max_tokens=300), n=1)[0]
    assert (t.turns, t.tool_calls, len(t.observations)) == (2, 1, 1)  # the last turn's call is not run


def test_max_turn_tokens_caps_each_turn_and_the_episode_goes_on(tok):
    asked = []

    def ramble(ids, params):  # a model that never stops by itself: it runs to whatever it may have
        asked.append(params.max_tokens)
        text = tok(" seven" * 40, add_special_tokens=False)["input_ids"]
        return [[Completion(text[:params.max_tokens], [-0.1] * min(len(text), params.max_tokens), "length")]
                for _ in ids]

    row = {"prompt": PROMPT, "reward_spec": {"ground_truth": "7"}}
    ep = episodes(tok, env="own_envs:StepsEnv", max_turns=3, max_turn_tokens=5)
    (t,) = ep.run(ramble, [row], SamplingParams(n=1, max_tokens=300), n=1)[0]
    assert asked == [5, 5, 5] and t.turns == 3 and t.error is None
    assert [len(tok(text, add_special_tokens=False)["input_ids"]) for m, text in segments(tok, t) if m == 1] == [5] * 3
    assert t.finish_reason == "stop"  # cut per turn, not by the budget: not a truncated trajectory
    asked.clear()
    budget = t.mask.index(1, 5) + 3  # the first turn, its answer, and 3 tokens of the second turn
    tight = episodes(tok, env="own_envs:StepsEnv", max_turns=3, max_turn_tokens=5, budget=budget)
    (t,) = tight.run(ramble, [row], SamplingParams(n=1, max_tokens=budget), n=1)[0]
    assert asked == [5, 3] and len(t.token_ids) == budget
    assert t.finish_reason == "length"  # the budget still cuts a turn, and that is truncation
    with pytest.raises(ValueError, match="max_turn_tokens=0: must be >= 1"):
        DatasetTask(data_files="rows.jsonl", reward_funcs=["own_envs.add"], environment="own_envs:StepsEnv",
                    max_turn_tokens=0)


def test_plain_tools_without_an_environment(tok):
    ep = episodes(tok, env=None, tools=["own_envs.add"])
    (t,) = ep.run(ScriptedPolicy(tok, steps=(4,), tool="add").generate, [{"prompt": PROMPT}],
                  SamplingParams(n=1, max_tokens=300), n=1)[0]
    assert t.observations == [[{"role": "tool", "name": "add", "content": "6"}]] and t.reward is None


def test_failures_end_the_trajectory_with_their_reason_and_a_raising_tool_is_answered(tok):
    ep = episodes(tok, env="own_envs:FlakyEnv", timeout_s=0.5)
    rows = [{"prompt": PROMPT, "target": 13}, {"prompt": PROMPT, "target": 5}]
    runs = ep.run(ScriptedPolicy(tok, steps=(7, 9)).generate, rows, SamplingParams(n=1, max_tokens=300), n=1)
    (reset_failed,), (hung,) = runs  # (the scripted steps: 7 raises, 9 hangs)
    assert reset_failed.error == "reset raised RuntimeError: no such level"
    assert reset_failed.token_ids == [tok.eos_token_id] and reset_failed.mask == [0]  # a stand-in, never trained on
    assert hung.observations[0] == [{"role": "tool", "name": "increment", "content": "{'error': 'step 7 is not allowed'}"}]
    assert hung.tool_errors == 1 and hung.error.startswith("tool increment did not return within 0.5 s")


def test_one_environment_is_called_on_one_thread_as_trl_calls_it(tok):
    """A sqlite3 connection made in __init__ and used by the tools and get_reward: before, each call ran on a thread
    of its own and sqlite3 refused the connection there (every tool answered with an error)."""
    ep = episodes(tok, env="own_envs:LedgerEnv")
    (t,) = ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, [{"prompt": PROMPT, "target": 5}],
                  SamplingParams(n=1, max_tokens=300), n=1)[0]
    assert (t.tool_errors, t.reward, t.error) == (0, 1.0, None) and t.state["total"] == 5


def test_async_tools_run_after_the_sync_ones_on_one_event_loop(tok):
    """TRL's order inside a turn (sync results first, then the async ones, gathered) and its one event loop: a client
    bound to a loop works from one episode to the next."""
    from own_envs import LOOPS

    calls = [{"name": "double", "arguments": {}}, {"name": "increment", "arguments": {"step": 3}}]
    turn = "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls) + "<|im_end|>"

    def gen(prompts, params):  # both calls in the first turn, then done
        out = []
        for ids in prompts:
            text = turn if "<tool_response>" not in tok.decode(ids) else "done<|im_end|>"
            new = tok(text, add_special_tokens=False)["input_ids"]
            out.append([Completion(new, [-0.5] * len(new), "stop")])
        return out

    LOOPS.clear()
    ep = episodes(tok, env="own_envs:AsyncCounterEnv")
    for _ in range(2):
        (t,) = ep.run(gen, [{"prompt": PROMPT, "target": 6}], SamplingParams(n=1, max_tokens=300), n=1)[0]
        assert t.observations[0] == [{"role": "tool", "name": "increment", "content": "total=3"},
                                     {"role": "tool", "name": "double", "content": "total=6"}]
        assert (t.tool_calls, t.tool_errors, t.reward) == (2, 0, 1.0)
    assert len(LOOPS) == 2 and LOOPS[0] is LOOPS[1] and not LOOPS[0].is_closed()
    calls[1]["arguments"]["step"] = 101  # double fails (over 100): answered with its error, as TRL answers it
    turn = "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls) + "<|im_end|>"
    (t,) = ep.run(gen, [{"prompt": PROMPT, "target": 6}], SamplingParams(n=1, max_tokens=300), n=1)[0]
    assert t.observations[0][1] == {"role": "tool", "name": "double", "content": "{'error': 'too large to double'}"}
    assert (t.tool_errors, t.error) == (1, None)


def test_environments_are_pooled_as_trl_pools_them_and_a_failed_one_is_not_reused(tok):
    """TRL makes an environment once and resets it for each later rollout (its pool grows to the most rollouts at
    once); before, echo2 made one per rollout, so an environment whose constructor is dear (a sandbox, a database)
    paid it every time. One that raised or overran is not given another rollout."""
    import own_envs

    own_envs.CountedEnv.made = 0
    ep = episodes(tok, env="own_envs:CountedEnv", timeout_s=0.5)
    rows = [{"prompt": PROMPT, "target": 5}, {"prompt": PROMPT, "target": 5}]
    params = SamplingParams(n=1, max_tokens=300)
    for _ in range(3):
        runs = ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, rows, params, n=1)
        assert [(t.reward, t.error) for (t,) in runs] == [(1.0, None), (1.0, None)]
    assert own_envs.CountedEnv.made == 2  # two at once, each reset for three rollouts
    assert sorted(t.state["rollouts"] for (t,) in runs) == [3, 3] and runs[0][0].state["history"] == [2, 3]
    (t,) = ep.run(ScriptedPolicy(tok, steps=(7,)).generate, rows[:1], params, n=1)[0]  # a tool that raises: answered
    assert t.error is None and t.tool_errors == 1 and own_envs.CountedEnv.made == 2
    (t,) = ep.run(ScriptedPolicy(tok, steps=(2,)).generate, [{"prompt": PROMPT, "target": 13}], params, n=1)[0]
    assert t.error == "reset raised RuntimeError: no such level"  # that instance is let go
    runs = ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, rows, params, n=1)
    assert own_envs.CountedEnv.made == 3 and sorted(t.state["serial"] for (t,) in runs) == [1, 3]
    ep.close()


def test_an_environments_thread_ends_when_it_leaves_the_pool_even_one_that_overran(tok):
    """Each environment has a thread of its own for its calls; it stays with the environment in the pool and ends
    when the environment leaves it (a failure, or the episodes closed), and one left in a call past its time limit
    ends when that call returns (then the environment is let go): none is left behind."""
    import threading
    import time

    from conftest import holds_within

    before = set(threading.enumerate())  # (another test's hung tool may still be sleeping in its thread)

    def new_env_threads():
        return [t for t in threading.enumerate() if t.name.startswith("env:") and t.is_alive() and t not in before]

    ep = episodes(tok, env="own_envs:FlakyEnv", timeout_s=0.5)
    rows = [{"prompt": PROMPT, "target": 13}, {"prompt": PROMPT, "target": 5}, {"prompt": PROMPT, "target": 5}]
    runs = ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, rows, SamplingParams(n=1, max_tokens=300), n=1)
    assert [t.error is None for (t,) in runs] == [False, True, True]
    assert holds_within(lambda: len(new_env_threads()) == 2, timeout=2)  # the failed reset's ended; two pooled

    def engine_down(ids, params):
        raise ConnectionError("the engine went away")

    with pytest.raises(ConnectionError):
        ep.run(engine_down, rows[1:], SamplingParams(n=1, max_tokens=300), n=1)
    assert holds_within(lambda: not new_env_threads(), timeout=2)  # a failed batch ended the ones it had started

    import own_envs

    hung = own_envs.FlakyEnv.increment

    def increment(self, step: int) -> str:  # returns, but only after its time limit
        time.sleep(1.5)
        return hung(self, step)

    own_envs.FlakyEnv.increment = increment
    try:
        (t,) = ep.run(ScriptedPolicy(tok, steps=(2,)).generate, rows[1:2], SamplingParams(n=1, max_tokens=300),
                      n=1)[0]
    finally:
        own_envs.FlakyEnv.increment = hung
    assert t.error.startswith("tool increment did not return within 0.5 s")
    assert len(new_env_threads()) == 1  # still in the call that overran
    assert holds_within(lambda: not new_env_threads(), timeout=5)  # it returned, and its thread ended
    ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, rows[1:], SamplingParams(n=1, max_tokens=300), n=1)
    assert len(new_env_threads()) == 2
    ep.close()
    assert holds_within(lambda: not new_env_threads(), timeout=2)  # the episodes closed: the pool's threads ended


def test_an_environment_factory_need_not_be_a_class(tok):
    """TRL takes any callable as environment_factory (it probes one instance for its tools); before, a factory
    function was refused as neither contract."""
    ep = episodes(tok, env="own_envs:make_counter")
    assert ep.spec.contract == "trl" and ep.spec.environment_reward == "CounterEnv"
    assert any(s["function"]["name"] == "increment" for s in ep.spec.tool_schemas)
    (t,) = ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, [{"prompt": PROMPT, "target": 5}],
                  SamplingParams(n=1, max_tokens=300), n=1)[0]
    assert (t.turns, t.reward, t.error) == (3, 1.0, None)


def test_a_reset_that_adds_content_blocks_reads_back_as_trl_builds_it():
    """TRL appends a list observation as content blocks (the text made a text block first); the prompt reported back
    is checked against the row's by the same rule (before, only text was accepted, and the group was dropped)."""
    from echo2.tasks.environments.episode import _extends

    row = [{"role": "system", "content": "s"}, {"role": "user", "content": "Count."}]
    text = [*row[:-1], {"role": "user", "content": "Count. Reach 5."}]
    blocks = [*row[:-1], {"role": "user", "content": [{"type": "text", "text": "Count."},
                                                      {"type": "text", "text": " Reach 5."}]}]
    assert _extends(text, row) and _extends(blocks, row)
    assert _extends(blocks, blocks[:-1] + [{"role": "user", "content": blocks[-1]["content"][:1]}])
    assert not _extends([*row[:-1], {"role": "user", "content": [{"type": "text", "text": "Other."}]}], row)
    assert not _extends([{"role": "system", "content": "t"}, text[-1]], row)


def test_skyrl_environments_run_unchanged_constructed_as_skyrl_does(tok):
    ep = episodes(tok, env="own_envs:StepsEnv", max_turns=3, environment_config={"suffix": "!"})
    assert ep.spec.contract == "skyrl" and ep.spec.environment_reward == "StepsEnv"

    def gen(ids, params):  # answers "7" each turn
        return [[Completion(tok("7<|im_end|>", add_special_tokens=False)["input_ids"], [-0.1] * 2, "stop")]
                for _ in ids]

    row = {"prompt": PROMPT, "reward_spec": {"ground_truth": "7"}}
    (t,) = ep.run(gen, [row], SamplingParams(n=1, max_tokens=300), n=1)[0]
    assert (t.turns, t.reward, t.error) == (3, 3.0, None)  # the step rewards, summed
    assert t.observations == [[{"role": "user", "content": "1!"}], [{"role": "user", "content": "2!"}]]
    assert segments(tok, t)[1] == (0, "\n<|im_start|>user\n1!<|im_end|>\n<|im_start|>assistant\n")
    assert t.state["ground_truth"] == "7" and t.state["max_turns"] == 3  # extras: the row, max_turns
    library = episodes(tok, env="skyrl_gym.envs.gsm8k.multi_turn_env:GSM8kMultiTurnEnv", max_turns=2, budget=400)
    (t,) = library.run(gen, [row], SamplingParams(n=1, max_tokens=400), n=1)[0]  # one SkyRL ships, as it is
    assert t.turns == 2 and t.error is None and len(t.observations) == 1


def test_a_transcript_that_does_not_match_its_tokens_is_refused(tok):
    ep = episodes(tok)
    (t,) = ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, [{"prompt": PROMPT, "target": 5}],
                  SamplingParams(n=1, max_tokens=300), n=1)[0]
    record = t.record()
    forged = {**record, "observations": [[{"role": "tool", "name": "increment", "content": "total=5"}],
                                         record["observations"][1]]}
    with pytest.raises(TranscriptMismatch, match="answer 1 does not render"):
        ep.transcript(t.prompt_ids, t.token_ids, t.mask, forged, PROMPT)
    extra = {**record, "observations": record["observations"] + [[{"role": "tool", "name": "x", "content": "1"}]]}
    with pytest.raises(TranscriptMismatch, match="3 environment answers reported, 2 found"):
        ep.transcript(t.prompt_ids, t.token_ids, t.mask, extra, PROMPT)
    start = t.mask.index(0)
    hidden = t.mask[:start] + [1] * (t.mask.index(1, start) - start) + t.mask[t.mask.index(1, start):]
    with pytest.raises(TranscriptMismatch):  # an environment answer passed off as the model's tokens
        ep.transcript(t.prompt_ids, t.token_ids, hidden, record, PROMPT)
    swapped = {**record, "prompt": [{"role": "user", "content": "Something else. Reach 5."}]}
    with pytest.raises(TranscriptMismatch, match="does not render to its prompt tokens"):
        ep.transcript(t.prompt_ids, t.token_ids, t.mask, swapped, PROMPT)


def test_rewards_read_the_transcript_the_environments_and_their_own_reward(tok, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "Count."}], "target": 5}\n' * 3)
    task = DatasetTask(data_files=str(rows), eval_size=0, environment="own_envs:CounterEnv",
                       reward_funcs=["own_envs.reach_target", "own_envs.env_history"])
    scorer = Scorer(task, tok)
    assert scorer.names == ["reach_target", "env_history", "CounterEnv"] and scorer.weights == [1.0, 1.0, 1.0]
    ep = task.episodes(tok)
    runs = ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, [task.train_dataset()[0]] * 2,
                  SamplingParams(n=1, max_tokens=300), n=1)
    rollouts = [Rollout(t.prompt_ids, Completion(t.token_ids, t.logprobs, t.finish_reason, t.mask), 0,
                        episode=t.record()) for (t,) in runs]
    rollouts[1].episode["error"] = "step raised"  # as a failed environment reports itself
    group = scorer.score(RolloutGroup(row=task.train_dataset()[0], rollouts=rollouts))
    assert group.rollouts[0].rewards == {"reach_target": 1.0, "env_history": 3.0, "CounterEnv": 1.0}
    assert group.rollouts[0].reward == 5.0
    assert all(math.isnan(v) for v in group.rollouts[1].rewards.values()) and math.isnan(group.rollouts[1].reward)


def test_a_turn_never_asks_more_than_the_engines_context_holds(tok):
    ep = episodes(tok, budget=300)
    asked = []
    policy = ScriptedPolicy(tok, steps=(2, 3))

    def generate(ids, params):
        asked.append(max(len(i) for i in ids) + params.max_tokens)
        return policy.generate(ids, params)

    prompt_len = len(ep.prompt_ids([{"role": "user", "content": "Count. Reach 5."}]))
    (t,) = ep.run(generate, [{"prompt": PROMPT, "target": 5}], SamplingParams(n=1), n=1,
                  context_tokens=prompt_len + 100)[0]
    assert max(asked) <= prompt_len + 100 and t.turns == 2  # the second answer would not fit: the episode ends
    (t,) = ep.run(generate, [{"prompt": PROMPT, "target": 5}], SamplingParams(n=1), n=1, context_tokens=prompt_len)[0]
    assert t.error == "the prompt does not fit the engine's context" and t.mask == [0]


def test_skyrls_last_observations_are_kept_and_its_metrics_read(tok):
    """An observation returned with done is appended (masked), as SkyRL's generator appends it: without the next
    turn's generation prompt; then the environment's get_metrics() is read, its numbers kept (booleans as 0/1), and
    the transcript check accepts that last segment."""
    ep = episodes(tok, env="own_envs:VerdictEnv", max_turns=3)

    def gen(ids, params):
        return [[Completion(tok("7<|im_end|>", add_special_tokens=False)["input_ids"], [-0.1] * 2, "stop")]
                for _ in ids]

    row = {"prompt": PROMPT, "reward_spec": {"ground_truth": "7"}}
    (t,) = ep.run(gen, [row], SamplingParams(n=1, max_tokens=300), n=1)[0]
    assert t.turns == 3 and t.observations[-1] == [{"role": "user", "content": "final"}]
    assert segments(tok, t)[-1] == (0, "\n<|im_start|>user\nfinal<|im_end|>\n")  # no "<|im_start|>assistant\n"
    assert t.metrics == {"steps": 3.0, "solved": 1.0} and t.record()["metrics"] == t.metrics
    messages = ep.transcript(t.prompt_ids, t.token_ids, t.mask, t.record(), PROMPT)
    assert messages[-1] == {"role": "user", "content": "final"}


def test_a_skyrl_environment_may_be_named_as_skyrl_names_it_and_rows_naming_another_are_refused(tmp_path):
    """SkyRL names an environment by its registered id (``env_class``): task.environment takes one (resolved to the
    class SkyRL-gym registered), and a dataset whose rows' env_class names another environment is refused at load,
    not run in the task's one."""
    from echo2.tasks.environments.contracts import environment_path

    spec = spec_for("gsm8k_multi_turn", [], 300)
    assert spec.contract == "skyrl"
    assert spec.environment == "skyrl_gym.envs.gsm8k.multi_turn_env:GSM8kMultiTurnEnv"
    assert environment_path("own_envs:StepsEnv") == "own_envs:StepsEnv"
    with pytest.raises(ValueError, match="nor an environment SkyRL-gym registers .*gsm8k"):
        spec_for("no_such_env", [], 300)
    rows = tmp_path / "rows.jsonl"

    def task(*classes):
        rows.write_text("".join(json.dumps({"prompt": PROMPT, "env_class": c, "reward_spec": {"ground_truth": "7"}})
                                + "\n" for c in classes))
        return DatasetTask(data_files=str(rows), eval_size=0, environment="gsm8k_multi_turn", reward_funcs=[])

    assert len(task("gsm8k_multi_turn", None, "skyrl_gym.envs.gsm8k.multi_turn_env:GSM8kMultiTurnEnv")
               .train_dataset()) == 3
    with pytest.raises(ValueError, match="rows name env_class aime, nonesuch, but the task runs"):
        task("gsm8k_multi_turn", "aime", "nonesuch").train_dataset()


def test_a_worker_keeps_only_the_metrics_the_coordinator_takes():
    """An honest environment's odd metric (a timestamp in ms, an integer too large for a float, numpy's numbers) must
    not get its worker's groups refused: the worker keeps what the coordinator's bounds take, and numpy's numbers."""
    import numpy as np

    from echo2.tasks.environments.sessions import MAX_METRICS, episode_metrics

    got = episode_metrics({"ms": 1.7e12, "huge": 10 ** 400, "nan": float("nan"), "np": np.float32(2.5),
                           "n": np.int64(3), "flag": False, "text": "7", "x" * 65: 1.0})
    assert got == {"np": 2.5, "n": 3.0, "flag": 0.0}
    assert len(episode_metrics({f"m{i}": i for i in range(100)})) == MAX_METRICS
    assert episode_metrics(["not", "a", "dict"]) == {}


def test_a_coroutine_that_blocks_the_event_loop_fails_alone(monkeypatch):
    """An async tool that calls blocking code (time.sleep, not asyncio.sleep) holds the process's one event loop, on
    which every rollout's coroutines run (TRL's one daemon loop): before, every other rollout's async tools then
    overran too, for as long as it blocked. Now the rollout whose coroutine overran fails, the loop is replaced, the
    others go on at once, and the old loop's thread ends once the blocking call returns."""
    import asyncio
    import time

    from echo2.tasks import rewards
    from echo2.tasks.environments.contracts import Calls, Overran

    async def forever():  # a client's keep-alive task: it never ends by itself
        while True:
            await asyncio.sleep(0.05)

    async def blocks():
        blocks.keepalive = asyncio.get_running_loop().create_task(forever())
        time.sleep(3)
        return "late"

    async def quick():
        await asyncio.sleep(0)
        return "ok"

    monkeypatch.setattr(rewards, "STOP_GRACE_S", 0.5)
    wedger, honest = Calls("wedger"), Calls("honest")
    old = rewards.event_loop()
    with pytest.raises(Overran, match="blocked the event loop"):
        wedger.gather("tool blocks", 0.3, [blocks()])
    start = time.monotonic()
    assert honest.gather("tool quick", 1.0, [quick()]) == ["ok"]
    assert time.monotonic() - start < 1.0 and rewards.event_loop() is not old
    deadline = time.monotonic() + 10
    while not old.is_closed() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert old.is_closed() and blocks.keepalive.cancelled()  # its keep-alive cancelled, its thread ended
    assert wedger.stuck == "tool blocks"  # the environment is let go: its coroutine ran on past its limit


def test_a_coroutine_that_is_only_slow_keeps_the_loop():
    """A coroutine that overruns while awaiting (a slow service) leaves the loop as it is: only blocking code wedges it."""
    import asyncio

    from echo2.tasks import rewards
    from echo2.tasks.environments.contracts import Calls, Overran

    async def slow():
        await asyncio.sleep(5)

    loop = rewards.event_loop()
    with pytest.raises(Overran) as e:
        Calls("slow").gather("tool slow", 0.2, [slow()])
    assert "blocked" not in str(e.value) and rewards.event_loop() is loop


def test_several_environments_by_name_as_trls_dict_environment_factory(tok, tmp_path):
    """TRL's GRPOTrainer(environment_factory={name: factory}): each row's environment column picks its environment,
    its prompt shows the plain tools and that environment's own, reset gets the row without the control column, the
    turns are parsed with those tools, and each environment class that has get_reward is a reward column of its own,
    scored on its own environment's rollouts only (NaN, TRL's None, on the others'). Before, task.environment took one
    import path."""
    from own_envs import EitherPolicy

    spec = spec_for({"count": "own_envs:CounterEnv", "sum": "own_envs:SumEnv"}, [], 300)
    assert (spec.environment, spec.reward_columns()) == (None, ["CounterEnv", "SumEnv"])
    assert [s["function"]["name"] for s in spec.schemas("count")] == ["increment"]
    assert [s["function"]["name"] for s in spec.schemas("sum")] == ["add"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "Go."}], "target": 5, "environment": "count"}\n'
                    '{"prompt": [{"role": "user", "content": "Go."}], "target": 9, "environment": "sum"}\n')
    task = DatasetTask(data_files=str(rows), eval_size=0,
                       environment={"count": "own_envs:CounterEnv", "sum": "own_envs:SumEnv"})
    count_row, sum_row = task.train_dataset()
    assert '"name": "add"' in tok.decode(task.prompt_ids(tok, sum_row))
    assert '"name": "increment"' not in tok.decode(task.prompt_ids(tok, sum_row))
    ep = task.episodes(tok)
    (c,), (s,) = ep.run(EitherPolicy(tok, steps=(2, 3)).generate, [count_row, sum_row],
                        SamplingParams(n=1, max_tokens=300), n=1)
    assert (c.prompt[-1]["content"], c.reward, c.state["total"]) == ("Go. Reach 5.", 1.0, 5)
    assert (s.prompt[-1]["content"], s.reward, s.state["total"]) == ("Go. Sum to 9.", 1.0, 9)
    assert s.state["keys"] == ["prompt", "target"]  # no environment column handed to reset, as in TRL
    messages = ep.transcript(s.prompt_ids, s.token_ids, s.mask, s.record(), sum_row["prompt"], "sum")
    assert messages[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 2}}
    scorer = Scorer(task, tok)
    assert scorer.names == ["CounterEnv", "SumEnv"]
    for row, t in ((count_row, c), (sum_row, s)):
        rollout = Rollout(t.prompt_ids, Completion(t.token_ids, t.logprobs, t.finish_reason, t.mask), 0,
                          episode=t.record())
        (r,) = scorer.score(RolloutGroup(row=row, rollouts=[rollout])).rollouts
        own, other = ("CounterEnv", "SumEnv") if row is count_row else ("SumEnv", "CounterEnv")
        assert r.rewards[own] == 1.0 and math.isnan(r.rewards[other]) and r.reward == 1.0
    assert task.correct_when(sum_row) == ("SumEnv", 1.0)


def test_rows_must_name_one_of_the_tasks_environments(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "Go."}], "target": 5, "environment": "count"}\n'
                    '{"prompt": [{"role": "user", "content": "Go."}], "target": 9, "environment": "chess"}\n')
    envs = {"count": "own_envs:CounterEnv", "sum": "own_envs:SumEnv"}
    with pytest.raises(ValueError, match="rows name environment chess: not among"):
        DatasetTask(data_files=str(rows), eval_size=0, environment=envs).train_dataset()
    rows.write_text('{"prompt": [{"role": "user", "content": "Go."}], "target": 5}\n')
    with pytest.raises(ValueError, match="the dataset has none"):
        DatasetTask(data_files=str(rows), eval_size=0, environment=envs).train_dataset()
    with pytest.raises(ValueError, match="needs a dataset"):
        DatasetTask(environment=envs)
    with pytest.raises(TypeError, match="mixes the two contracts"):
        spec_for({"count": "own_envs:CounterEnv", "steps": "own_envs:StepsEnv"}, [], 300)


def test_several_skyrl_environments_picked_by_each_rows_env_class(tok, tmp_path):
    """SkyRL's way to mix environments: each row names its env_class, the generator makes that environment with its
    own env_config (skyrl_gym[env_class]). Before, a task ran one SkyRL environment and refused rows naming another."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": PROMPT, "env_class": c, "reward_spec": {"ground_truth": "7"}}) + "\n"
                            for c in ("steps", "verdict")))
    task = DatasetTask(data_files=str(rows), eval_size=0, reward_funcs=[], max_turns=2, max_completion_length=300,
                       environment={"steps": "own_envs:StepsEnv", "verdict": "own_envs:VerdictEnv"},
                       environment_config={"steps": {"suffix": "!"}})
    assert task.spec.contract == "skyrl" and task.spec.reward_columns() == ["StepsEnv", "VerdictEnv"]

    def gen(ids, params):  # answers "7" each turn
        return [[Completion(tok("7<|im_end|>", add_special_tokens=False)["input_ids"], [-0.1] * 2, "stop")]
                for _ in ids]

    ep = task.episodes(tok)
    steps_row, verdict_row = task.train_dataset()
    (s,), (v,) = ep.run(gen, [steps_row, verdict_row], SamplingParams(n=1, max_tokens=300), n=1)
    assert s.observations[0] == [{"role": "user", "content": "1!"}]  # its own env_config
    assert v.metrics and not s.metrics  # VerdictEnv's get_metrics: that row ran in its own environment
    scorer = Scorer(task, tok)
    for row, t, own, other in ((steps_row, s, "StepsEnv", "VerdictEnv"), (verdict_row, v, "VerdictEnv", "StepsEnv")):
        rollout = Rollout(t.prompt_ids, Completion(t.token_ids, t.logprobs, t.finish_reason, t.mask), 0,
                          episode=t.record())
        (r,) = scorer.score(RolloutGroup(row=row, rollouts=[rollout])).rollouts
        assert r.rewards[own] == 2.0 and math.isnan(r.rewards[other])
    rows.write_text(json.dumps({"prompt": PROMPT, "env_class": "aime", "reward_spec": {"ground_truth": "7"}}) + "\n")
    with pytest.raises(ValueError, match="rows name env_class aime: not among"):
        DatasetTask(data_files=str(rows), eval_size=0, reward_funcs=[],
                    environment={"steps": "own_envs:StepsEnv"}).train_dataset()
    ep.close()


def test_a_get_reward_that_is_not_a_number_ends_its_episode_not_the_batch(tok):
    """A get_reward() answering a string raised ValueError out of the episode loop (the whole batch failed, and the
    environment's thread was left running): now that episode ends with the reason, the others are scored, and every
    thread ends."""
    import threading

    from conftest import holds_within

    before = set(threading.enumerate())
    ep = episodes(tok, env="own_envs:OddRewardEnv")
    rows = [{"prompt": PROMPT, "target": 13}, {"prompt": PROMPT, "target": 5}]
    (odd,), (fine,) = ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, rows, SamplingParams(n=1, max_tokens=300), n=1)
    assert odd.error.startswith("get_reward returned str, not a number") and (fine.reward, fine.error) == (1.0, None)
    ep.close()
    assert holds_within(lambda: not [t for t in threading.enumerate() if t.name.startswith("env:")
                                     and t.is_alive() and t not in before], timeout=2)


def test_pooled_environments_made_before_the_loop_was_replaced_are_let_go(tok):
    """Their clients are bound to the abandoned loop: reusing them would fail every later async call."""
    import own_envs
    from echo2.tasks import rewards

    own_envs.CountedEnv.made = 0
    ep = episodes(tok, env="own_envs:CountedEnv")
    rows = [{"prompt": PROMPT, "target": 5}]
    params = SamplingParams(n=1, max_tokens=300)
    ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, rows, params, n=1)
    ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, rows, params, n=1)
    assert own_envs.CountedEnv.made == 1
    rewards._loop_generation += 1  # as replace_if_wedged does
    ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, rows, params, n=1)
    assert own_envs.CountedEnv.made == 2
    ep.close()
    ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, rows, params, n=1)  # closed: nothing kept from now on
    assert not ep._idle


def test_held_out_rows_of_an_environment_without_a_reward_of_its_own_are_not_correct(tok, tmp_path):
    """Several environments, one with get_reward and one without, no reward functions: a held-out row of the one
    without had no column to be judged by (KeyError, the evaluation failed); now it is not correct (NaN)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "Go."}], "target": 5, "environment": "count"}\n'
                    '{"prompt": [{"role": "user", "content": "Go."}], "target": 5, "environment": "plain"}\n')
    task = DatasetTask(data_files=str(rows), eval_size=0,
                       environment={"count": "own_envs:CounterEnv", "plain": "own_envs:PlainEnv"})
    scorer = Scorer(task, tok)
    assert scorer.names == ["CounterEnv"]
    ep = task.episodes(tok)
    for row, correct in zip(task.train_dataset(), (True, False), strict=True):
        (t,) = ep.run(ScriptedPolicy(tok, steps=(2, 3)).generate, [row], SamplingParams(n=1, max_tokens=300), n=1)[0]
        record = {**t.record(), "messages": ep.transcript(t.prompt_ids, t.token_ids, t.mask, t.record(),
                                                          row["prompt"], t.environment)}
        judged = scorer.judge_job({"row": row, "texts": ["x"], "completion_ids": [t.token_ids],
                                   "state": scorer.state, "episodes": [record]})
        assert judged["correct"] == [correct]
    ep.close()
