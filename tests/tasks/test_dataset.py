"""task=dataset: TRL's dataset formats from local files, reward functions named by import path and handed what TRL
hands them, held-out rows and what counts as correct, and chat template arguments on every path."""

from __future__ import annotations

import math
import pickle

import pytest

from conftest import FIXTURES
from echo2.records import Completion, Rollout, RolloutGroup
from echo2.scoring import RewardsFailed, Scorer
from echo2.tasks.dataset import DatasetTask

DATA = FIXTURES / "datasets"


def task(**kw) -> DatasetTask:
    kw.setdefault("data_files", str(DATA / "sums.jsonl"))
    kw.setdefault("reward_funcs", ["own_rewards.exact"])
    kw.setdefault("eval_size", 2)
    return DatasetTask(**kw)


class Chars:
    """A tokenizer for scoring tests: one id per character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def group(row: dict, texts: list[str]) -> RolloutGroup:
    rollouts = [Rollout([1], Completion([ord(c) for c in t] or [32], [-1.0] * max(1, len(t)), "stop"), 0)
                for t in texts]
    return RolloutGroup(row=row, rollouts=rollouts, group_id="g1")


# ---------------------------------------------------------------------- formats


def test_standard_jsonl_holds_out_a_seeded_draw_and_forwards_the_other_columns():
    t = task()
    train, held_out = t.train_dataset(), t.eval_dataset()
    assert (len(train), len(held_out)) == (6, 2)
    assert set(train["prompt"]).isdisjoint(held_out["prompt"])  # held-out rows are not trained on
    assert set(train.column_names) == {"prompt", "answer", "difficulty"}
    assert list(task().eval_dataset()["prompt"]) == list(held_out["prompt"])  # the same seed, the same draw


@pytest.mark.parametrize("files, split", [
    (str(DATA / "sums.csv"), None),
    ({"train": str(DATA / "sums_train.parquet"), "test": str(DATA / "sums_test.parquet")}, "test"),
])
def test_csv_and_parquet_with_a_named_eval_split(files, split):
    t = task(data_files=files, eval_split=split, eval_size=2 if split is None else 200)
    assert (len(t.train_dataset()), len(t.eval_dataset())) == (6, 2)
    assert "2+3=" in list(t.train_dataset()["prompt"]) + list(t.eval_dataset()["prompt"])


def test_conversational_json_with_its_own_prompt_column_and_a_system_prompt():
    t = task(data_files=str(DATA / "sums_chat.json"), prompt_column="question", system_prompt="Be brief.",
             reward_funcs=["trl.rewards.accuracy_reward"])
    row = t.train_dataset()[0]
    assert row["prompt"][0] == {"role": "system", "content": "Be brief."} and row["prompt"][1]["role"] == "user"
    assert set(row) == {"prompt", "solution"}


def test_bad_data_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="task.path .* or task.data_files"):
        DatasetTask(reward_funcs=["own_rewards.exact"])
    with pytest.raises(ValueError, match=r"task.prompt_column='question'.*columns"):
        task(prompt_column="question").train_dataset()
    with pytest.raises(ValueError, match="task.eval_split='validation'"):
        task(eval_split="validation").train_dataset()
    with pytest.raises(ValueError, match="cannot tell the format"):
        task(data_files=str(tmp_path / "rows.xml")).train_dataset()


# ---------------------------------------------------------------------- reward functions by import path


def test_reward_functions_by_path_factory_and_partial_with_names_and_weights():
    t = task(reward_funcs=["own_rewards:exact", "trl.rewards.think_format_reward",
                           {"_target_": "trl.rewards.get_soft_overlong_punishment", "max_completion_len": 4,
                            "soft_punish_cache": 2},
                           {"_target_": "own_rewards.scaled", "_partial_": True, "scale": 0.5}],
             reward_weights=[1.0, 0.5, 1.0, 2.0])
    scorer = Scorer(t, Chars())
    assert scorer.names == ["exact", "think_format_reward", "soft_overlong_punishment_reward", "scaled"]
    chat = [{"role": "user", "content": "2+3="}]  # think_format_reward reads conversational completions
    g = scorer.score(group({"prompt": chat, "answer": "5", "difficulty": 0}, ["5", "4444"]))
    assert g.rollouts[0].rewards == {"exact": 1.0, "think_format_reward": 0.0, "soft_overlong_punishment_reward": 0.0,
                                     "scaled": 0.5}
    assert g.rollouts[1].rewards["soft_overlong_punishment_reward"] == -1.0  # 4 tokens: past 4 - 2
    assert g.rollouts[0].reward == 1.0 + 0.0 + 0.0 + 2.0 * 0.5
    assert pickle.loads(pickle.dumps(t)).reward_funcs()[2].max_completion_len == 4  # rebuilt where it is unpickled


def test_a_reward_function_that_does_not_import_or_a_wrong_weight_count_fails_at_construction():
    with pytest.raises(ImportError, match="own_rewards.nope"):
        task(reward_funcs=["own_rewards.nope"])
    with pytest.raises(ValueError, match="2 weights for 1 reward functions"):
        task(reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="task.reward_funcs is empty"):
        task(reward_funcs=[])
    with pytest.raises(TypeError, match="not a callable"):
        task(reward_funcs=["own_rewards.re"])  # a module, not a function


def test_trl_extras_state_metrics_extra_columns_and_async():
    """trainer_state, log_metric, log_extra and async functions, as TRL hands them; None abstains (NaN)."""
    scorer = Scorer(task(reward_funcs=["own_rewards.schedule", "own_rewards.judge", "own_rewards.exact"]), Chars(),
                    max_steps=50, steps_per_epoch=4.0)
    scorer.set_step(7)
    g = scorer.score(group({"prompt": "2+3=", "answer": "", "difficulty": 2}, ["12", "5"]))
    assert [r.rewards["schedule"] for r in g.rollouts] == [7.0, 7.0]
    assert [r.rewards["judge"] for r in g.rollouts] == [2.0, 1.0]
    assert all(math.isnan(r.rewards["exact"]) for r in g.rollouts)  # no answer: cannot score, left out
    assert [r.reward for r in g.rollouts] == [9.0, 8.0]
    assert g.reward_logs["metrics"] == {"schedule_step": [7.0]}
    assert g.reward_logs["extra"] == {"seen_step": [7, 7]} and g.reward_logs["errors"] == {}
    assert scorer.state.max_steps == 50 and scorer.state.epoch == 7 / 4


def test_async_rewards_run_on_one_event_loop_as_trl_runs_them():
    """A module-level async client (an LLM judge) works from one scored group to the next: TRL awaits async rewards
    on one loop of its own; before, each group ran asyncio.run, a new loop, and the judge failed from the second."""
    scorer = Scorer(task(reward_funcs=["own_rewards.llm_judge"]), Chars())
    for texts in (["12", "5"], ["123", "4"]):
        g = scorer.score(group({"prompt": "2+3=", "answer": "5"}, texts))
        assert [r.reward for r in g.rollouts] == [float(len(t)) for t in texts] and g.reward_logs["errors"] == {}


def test_a_failing_reward_function_abstains_and_is_booked_with_its_reason():
    scorer = Scorer(task(reward_funcs=["own_rewards.exact", "own_rewards.broken", "own_rewards.too_few"]), Chars())
    g = scorer.score(group({"prompt": "2+3=", "answer": "5"}, ["5", "6"]))
    assert [r.reward for r in g.rollouts] == [1.0, 0.0]  # the others still score
    assert g.reward_logs["errors"] == {"broken": "ZeroDivisionError: a bug in a reward function",
                                       "too_few": "ValueError: returned 1 rewards for 2 completions (one per "
                                                  "completion expected)"}
    only_broken = Scorer(task(reward_funcs=["own_rewards.broken"]), Chars())
    with pytest.raises(RewardsFailed, match="broken: ZeroDivisionError"):
        only_broken.score(group({"prompt": "2+3=", "answer": "5"}, ["5"]))
    assert only_broken.score_many([group({"prompt": "2+3=", "answer": "5"}, ["5"])]) == ["reward_error"]


def test_what_counts_as_correct_is_the_eval_reward_at_its_threshold():
    t = task(reward_funcs=["own_rewards.judge", "own_rewards.exact"], eval_reward="exact")
    row = {"prompt": "2+3=", "answer": "5", "difficulty": 0}
    assert t.is_correct("5", row) and not t.is_correct("6", row)
    assert not t.is_correct("5", {**row, "answer": ""})  # an abstention is not correct
    assert task(reward_funcs=["own_rewards.judge"], eval_threshold=2.0).is_correct("12", row)
    with pytest.raises(ValueError, match="task.eval_reward='nope'"):
        task(eval_reward="nope")


def test_a_standard_prompt_is_encoded_as_trl_encodes_it():
    """TRL encodes a standard-format (string) prompt with ``processing_class(text=prompts)``: the tokenizer's own
    special tokens included (a Llama tokenizer's BOS); echo2 encoded it without them, and counted it so."""
    from echo2.scoring import encode_prompt, longest_prompt

    class BosTokenizer:  # a tokenizer that puts BOS (id 1) first unless told not to, as Llama's does
        def __call__(self, text, add_special_tokens=True):
            one = lambda t: ([1] if add_special_tokens else []) + [ord(c) for c in t]  # noqa: E731
            return {"input_ids": [one(t) for t in text] if isinstance(text, list) else one(text)}

    assert encode_prompt(BosTokenizer(), "2+3=") == [1, 50, 43, 51, 61]
    assert longest_prompt(BosTokenizer(), ["2+3=", "10+1="]) == 6


def test_evaluation_rewards_see_the_learners_step():
    """TRL hands its state to the reward functions when it evaluates too: a reward with a schedule judges a held-out
    completion at the learner's step (before, evaluation always said global_step 0)."""
    from echo2.scoring import RewardFunctions

    judge = RewardFunctions(task(reward_funcs=["own_rewards.schedule"], eval_threshold=5.0))
    job = {"row": {"prompt": "2+3=", "answer": "5"}, "texts": ["5"], "completion_ids": [[53]]}
    judge.set_step(7)
    assert judge.judge_job({**job, "state": judge.state})["correct"] == [True]  # the schedule's reward: 7 >= 5
    judge.set_step(3)
    assert judge.judge_job({**job, "state": judge.state})["correct"] == [False]


def test_a_held_out_row_is_judged_at_the_version_that_generated_it():
    """A worker's evaluation may come back after the learner moved on: its rows are judged with trainer_state at the
    version that generated them, not the coordinator's current step (the learner's own evaluator says its step)."""
    from echo2.records import Completion, Rollout, RolloutGroup
    from echo2.scoring import RewardFunctions

    judge = RewardFunctions(task(reward_funcs=["own_rewards.schedule"], eval_threshold=5.0))
    group = RolloutGroup(row={"prompt": "2+3=", "answer": "5"}, rollouts=[
        Rollout(prompt_ids=[1], completion=Completion([53], [-0.1], "stop"), version=3)])
    group.rollouts[0].text = "5"
    judge.set_step(7)  # the coordinator's step now: 7 would pass the schedule, version 3 does not
    assert judge.job(group, judge=True)["state"].global_step == 3
    assert judge.judge_job(judge.job(group, judge=True))["correct"] == [False]
    assert judge.job(group)["state"].global_step == 7  # training groups: the step they are scored at
