"""Task adapters: data generation, answer extraction, rewards."""

from __future__ import annotations

import pytest

from conftest import FIXTURES
from echo2.tasks.arith import ArithTask, leading_int
from echo2.tasks.gsm8k import Gsm8kTask, extract_gold


@pytest.mark.parametrize("level", ["copy", "mod10", "add"])
def test_arith_answers_are_right(level):
    task = ArithTask(level=level, digits=3, train_size=50)
    for row in task.train_dataset():
        lhs = row["prompt"].rstrip("=")
        if level == "copy":
            expected = int(lhs)
        else:
            a, b = map(int, lhs.split("+"))
            expected = (a + b) % 10 if level == "mod10" else a + b
        assert int(row["answer"]) == expected


def test_arith_is_deterministic_and_eval_differs():
    a, b = ArithTask(level="add", digits=3), ArithTask(level="add", digits=3)
    assert a.train_dataset()["prompt"][:20] == b.train_dataset()["prompt"][:20]
    assert a.train_dataset()["prompt"][:20] != a.eval_dataset()["prompt"][:20]


def test_arith_reward_reads_the_leading_integer():
    (correct,) = ArithTask(level="mod10").reward_funcs()
    out = correct(prompts=["3+5="] * 5, completions=["8", "8=", " 8", "81", "x8"], answer=["8"] * 5)
    assert out == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert leading_int("") is None


def test_arith_rejects_unknown_level():
    with pytest.raises(ValueError, match="task.level"):
        ArithTask(level="calculus")


def test_gsm8k_gold_extraction():
    assert extract_gold("so 3 * 4 = 12\n#### 1,200") == "1200"
    with pytest.raises(ValueError, match="####"):
        extract_gold("no marker")


def test_gsm8k_fixture_loads_and_rewards_with_math_verify():
    task = Gsm8kTask(data_dir=str(FIXTURES / "gsm8k"))
    train, held_out = task.train_dataset(), task.eval_dataset()
    assert len(train) == 4 and len(held_out) == 2
    assert train[0]["prompt"][0]["role"] == "user" and "\\boxed" in train[0]["prompt"][0]["content"]
    assert held_out[1]["answer"] == "1000"
    (correct,) = task.reward_funcs()
    completions = ["3*12=36, 36-7=29. \\boxed{29}", "The answer is 29.", "\\boxed{30}", ""]
    assert correct(prompts=[None] * 4, completions=completions, answer=["29"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert task.is_correct("so \\boxed{1000}", held_out[1])


def test_gsm8k_missing_fixture_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        Gsm8kTask(data_dir=str(tmp_path)).train_dataset()


def test_a_crafted_gsm8k_answer_costs_a_reward_process_about_a_second():
    """math-verify spends its whole limit on ``\\boxed{10^{10^{9}}}`` and then scores it 0: that limit is what one
    stranger's completion costs a reward process (where it applies: a main thread, as in the reward pool). At
    math-verify's default of 5 s a group of 8 such completions held a process for 40 s; it is 1 s per call now."""
    import time

    from echo2.tasks.gsm8k import VERIFY_TIMEOUT_S, verify_answer

    assert VERIFY_TIMEOUT_S <= 1
    t0 = time.monotonic()
    assert verify_answer("The answer is \\boxed{10^{10^{9}}}", "72") is False
    assert time.monotonic() - t0 < 2 * VERIFY_TIMEOUT_S + 2  # parse and compare, each cut at the limit
    assert verify_answer("so it is \\boxed{72}", "72") is True
