"""Arithmetic questions as chat messages: a task a small pretrained instruct model can learn on a CPU.

Each row asks ``"What is 14 * 7? Answer with just the number."`` as a user message (the model's chat template
wraps it), with ``a`` in ``[2, max_a)``, ``b`` in ``[2, max_b)`` and the operator drawn from ``ops``. The reward
reads the answer the way a researcher would score a short maths answer: the number in the last ``\\boxed{}`` if
there is one, else the last number in the text ("The answer is 98." and "14 * 7 = 98" both count; "98, or 99"
does not). A completion cut off by the length limit is still scored on what it says (learner.
mask_truncated_completions drops it from the loss if wanted).

SmolLM2-135M-Instruct (model=smollm2_135m) answers 31 % of these greedily at the start, mostly with chatty text
that runs past 12 tokens; with GRPO it learns to answer briefly and correctly (experiment=smollm2_arith).
The held-out split is drawn from another seed; with the default ranges (3 operators x 18 x 8 = 432 problems)
it overlaps the training problems, so eval accuracy measures the policy, not generalisation.
"""

from __future__ import annotations

import random
import re
from typing import Any

from datasets import Dataset

from echo2.tasks.base import RewardFunc, Task, completion_text

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_BOXED = re.compile(r"\\boxed\{\s*(-?\d[\d,]*)\s*\}")
_NUMBER = re.compile(r"-?\d[\d,]*")


def answer_number(text: str) -> int | None:
    """The completion's answer: the last ``\\boxed{N}`` if any, else the last integer (commas as thousands
    separators are dropped); None if it has no number."""
    found = _BOXED.findall(text) or _NUMBER.findall(text)
    if not found:
        return None
    digits = found[-1].replace(",", "")
    return int(digits) if digits.lstrip("-") else None


class ArithChatTask(Task):
    def __init__(self, ops: str = "+-*", max_a: int = 20, max_b: int = 10, train_size: int = 10_000,
                 eval_size: int = 100, seed: int = 0, max_completion_length: int = 12,
                 instruction: str = "Answer with just the number.", system: str | None = None):
        bad = set(ops) - set(OPS)
        if not ops or bad:
            raise ValueError(f"task.ops={ops!r}: use some of {''.join(OPS)}")
        if max_a < 3 or max_b < 3:
            raise ValueError(f"task.max_a={max_a}, max_b={max_b}: operands are drawn from [2, max), so max >= 3")
        self.name = "arith_chat"
        self.ops, self.max_a, self.max_b, self.seed = ops, max_a, max_b, seed
        self.train_size, self.eval_size = train_size, eval_size
        self.max_completion_length = max_completion_length
        self.instruction, self.system = instruction, system

    def _row(self, rng: random.Random) -> dict[str, Any]:
        op = rng.choice(self.ops)
        a, b = rng.randrange(2, self.max_a), rng.randrange(2, self.max_b)
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": f"What is {a} {op} {b}? {self.instruction}".strip()})
        return {"prompt": messages, "answer": str(OPS[op](a, b))}

    def _rows(self, n: int, seed: int) -> Dataset:
        rng = random.Random(seed)
        return Dataset.from_list([self._row(rng) for _ in range(n)])

    def train_dataset(self) -> Dataset:
        return self._rows(self.train_size, self.seed)

    def eval_dataset(self) -> Dataset:
        return self._rows(self.eval_size, self.seed + 1_000_003)

    def is_correct(self, completion: str, row: dict[str, Any]) -> bool:
        return answer_number(completion) == int(row["answer"])

    def reward_funcs(self) -> list[RewardFunc]:
        def correct(prompts, completions, completion_ids=None, answer=None, **_):
            return [float(answer_number(completion_text(c)) == int(a)) for c, a in zip(completions, answer, strict=True)]

        return [correct]
