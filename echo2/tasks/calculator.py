"""Arithmetic with a calculator tool, in TRL's ``environment_factory`` contract: ``task=calculator``.

Each row asks "What is 437 * 86?" as a user message. The model may call the environment's ``calculator(expression)``
tool (a method of ``CalculatorEnv``, offered to the model as TRL offers it: its schema read from the type hints and
the docstring, rendered by the model's chat template), read the answer, and reply. The reward is recomputed from the
transcript where rewards are scored (``correct``: the number in the model's last message equals the row's
``answer``), never taken from the worker; ``used_calculator`` (weight ``tool_bonus``) counts a tool call whose
answer the reward function re-evaluates itself.

A model for it needs a chat template with a tool-call format TRL can parse (trl.chat_template_utils.
add_response_schema: Qwen2.5/Qwen3, Llama 3.1/3.2, GLM-4, gpt-oss, ...): Qwen3-0.6B, say, on a GPU with hub access::

    python train.py task=calculator model=qwen3_0.6b '+task.chat_template_kwargs.enable_thinking=false'

SmolLM2's template has no tool-call format, and given Qwen3's (TRL's ``qwen3_chat_template``) SmolLM2-135M made no
tool call in 32 samples at temperature 1 on a calculator question: with nothing to reinforce, RL cannot teach it one.
Offline, the tiny model built with Qwen3's template
(``model.path.tool_chat=true``) runs the same loop (it calls no tool: it is random), and the tests drive it with a
scripted policy that does.
"""

from __future__ import annotations

import ast
import operator
import random
from typing import Any

from echo2.tasks.dataset import DatasetTask

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_AST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**15


def evaluate(expression: str) -> int:
    """The value of an integer expression with +, -, * and parentheses (no names, no powers: nothing a model can make
    run long or large)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            out = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            out = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
            out = _AST_OPS[type(node.op)](value(node.left), value(node.right))
        else:
            raise ValueError(f"not an integer expression of +, -, *: {ast.unparse(node)!r}")
        if abs(out) > MAX_MAGNITUDE:
            raise ValueError("a value too large")
        return out

    return value(ast.parse(expression.strip(), mode="eval").body)


class CalculatorEnv:
    """TRL's contract: ``reset(**row)``, one tool, no reward of its own (the reward is recomputed from the
    transcript)."""

    def reset(self, **kwargs: Any) -> str | None:
        self.calls = 0
        self.last_result: int | None = None
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Integers with +, -, * and parentheses, e.g. "437 * 86".

        Returns:
            The value of the expression.
        """
        self.calls += 1
        self.last_result = evaluate(expression)
        return str(self.last_result)


def _last_answer(messages: list[dict]) -> int | None:
    from echo2.tasks.arith_chat import answer_number

    text = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
    return answer_number(text if isinstance(text, str) else "")


def correct(completions: list[list[dict]], answer: list[str], **kwargs: Any) -> list[float]:
    """1 when the model's last message answers the row's number (its last \\boxed{} or last number), else 0."""
    return [float(_last_answer(m) == int(a)) for m, a in zip(completions, answer, strict=True)]


def used_calculator(completions: list[list[dict]], **kwargs: Any) -> list[float]:
    """1 when the model called the calculator with an expression it could evaluate and was answered its true value
    (re-evaluated here: a tool result is the worker's claim), else 0."""
    out = []
    for messages in completions:
        ok = 0.0
        for call, reply in zip(messages, messages[1:]):
            for c in call.get("tool_calls") or []:
                expression = (c.get("function", {}).get("arguments") or {}).get("expression")
                try:
                    ok = max(ok, float(reply.get("role") == "tool" and reply.get("content") == str(evaluate(
                        str(expression)))))
                except (ValueError, SyntaxError):
                    pass
        out.append(ok)
    return out


class CalculatorTask(DatasetTask):
    def __init__(self, ops: str = "*", max_a: int = 1000, max_b: int = 100, train_size: int = 2000,
                 eval_size: int = 100, seed: int = 0, max_completion_length: int = 256, max_turns: int = 3,
                 tool_bonus: float = 0.1, system_prompt: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, environment_timeout_s: float = 10.0):
        bad = set(ops) - set(OPS)
        if not ops or bad:
            raise ValueError(f"task.ops={ops!r}: use some of {''.join(OPS)}")
        self.ops, self.max_a, self.max_b, self.train_size = ops, max_a, max_b, train_size
        super().__init__(reward_funcs=["echo2.tasks.calculator.correct", "echo2.tasks.calculator.used_calculator"],
                         reward_weights=[1.0, tool_bonus], eval_reward="correct", eval_size=eval_size,
                         eval_split="test", system_prompt=system_prompt, chat_template_kwargs=chat_template_kwargs,
                         max_completion_length=max_completion_length, seed=seed,
                         environment="echo2.tasks.calculator:CalculatorEnv", max_turns=max_turns,
                         environment_timeout_s=environment_timeout_s)
        self.name = "calculator"

    def _row(self, rng: random.Random) -> dict[str, Any]:
        op = rng.choice(self.ops)
        a, b = rng.randrange(2, self.max_a), rng.randrange(2, self.max_b)
        question = f"What is {a} {op} {b}? Use the calculator tool, then answer with just the number."
        return {"prompt": [{"role": "user", "content": question}], "answer": str(OPS[op](a, b))}

    def source(self) -> Any:
        from datasets import Dataset, DatasetDict

        def rows(n: int, seed: int) -> Dataset:
            rng = random.Random(seed)
            return Dataset.from_list([self._row(rng) for _ in range(n)])

        return DatasetDict(train=rows(self.train_size, self.seed), test=rows(self.eval_size, self.seed + 1_000_003))
