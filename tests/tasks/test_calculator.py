"""task=calculator: a calculator tool in TRL's environment_factory contract, offered by a tool-calling chat template
(Qwen3's, on the tiny model), called by a policy, answered, and rewarded from the transcript."""

from __future__ import annotations

import json

import pytest
from trl import GRPOTrainer  # noqa: F401 (TRL's tool layout code; importing it runs DeepSpeed's `uname`: at collection)

from echo2.models.tokenizer import load_tokenizer
from echo2.records import Completion, Rollout, RolloutGroup, SamplingParams
from echo2.scoring import Scorer
from echo2.tasks.calculator import CalculatorTask, evaluate


def test_the_calculator_evaluates_integer_arithmetic_and_nothing_else():
    assert evaluate("437 * 86") == 37582 and evaluate("-(2 + 3) * 4 - 1") == -21
    for bad in ("__import__('os')", "2 ** 100", "1 / 2", "x + 1", "9" * 20 + " * " + "9" * 20, "1+" * 200):
        with pytest.raises((ValueError, SyntaxError)):
            evaluate(bad)


class Calls:
    """A policy that calls calculator(expression) on the question, then answers with what it was told (or with
    ``wrong``)."""

    def __init__(self, tok, wrong=None):
        self.tok, self.wrong = tok, wrong

    def generate(self, prompt_ids, params):
        out = []
        for ids in prompt_ids:
            text = self.tok.decode(ids)
            asked = text[text.rfind("What is ") + 8:].split("?")[0]
            if "<tool_response>" not in text[text.find("<|im_start|>user"):]:
                reply = f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": {"expression": asked}})}\n' \
                        "</tool_call><|im_end|>"
            else:
                told = text[text.rfind("<tool_response>\n") + 16:].split("\n")[0]
                reply = f"{self.wrong or told}<|im_end|>"
            new = self.tok(reply, add_special_tokens=False)["input_ids"]
            out.append([Completion(new, [-0.3] * len(new), "stop")])
        return out


def test_a_calculator_episode_is_rewarded_from_its_transcript(echo2_cache):
    from echo2.models.tiny import build_tiny

    tok = load_tokenizer(build_tiny(tool_chat=True, max_position_embeddings=2048))
    task = CalculatorTask(train_size=4, eval_size=2)
    row = task.train_dataset()[0]
    assert "calculator" in tok.decode(task.prompt_ids(tok, row))  # the tool's schema in the prompt
    scorer = Scorer(task, tok)
    for policy, expected in ((Calls(tok), {"correct": 1.0, "used_calculator": 1.0}),
                             (Calls(tok, wrong="7"), {"correct": 0.0, "used_calculator": 1.0})):
        (t,) = task.episodes(tok).run(policy.generate, [row], SamplingParams(n=1, max_tokens=256), n=1)[0]
        assert t.tool_calls == 1 and t.state["calls"] == 1 and t.turns == 2
        rollout = Rollout(t.prompt_ids, Completion(t.token_ids, t.logprobs, t.finish_reason, t.mask), 0,
                          episode=t.record())
        (scored,) = scorer.score(RolloutGroup(row=row, rollouts=[rollout])).rollouts
        assert scored.rewards == expected and scored.reward == expected["correct"] + 0.1 * expected["used_calculator"]
