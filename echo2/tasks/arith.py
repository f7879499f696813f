"""Synthetic arithmetic, generated locally: the task the tiny CPU model can learn from scratch.

Levels (``level``):
  * ``copy``  — ``"7="`` → ``7``: a single lookup; a random-init model learns it in ~100 GRPO steps.
  * ``mod10`` — ``"3+5="`` → ``(3+5) mod 10``: needs two inputs combined; a few hundred steps.
  * ``add``   — ``"23+45="`` → ``68`` with ``digits``-digit operands: multi-token answers.

The reward reads the leading integer of the completion (so ``"8<eos>"`` and ``"8="`` count, ``"81"`` does not).
The held-out split is drawn with another seed from the same distribution; for ``copy`` and ``mod10`` the
input space is so small (10 and 100 problems) that it overlaps the training inputs, for ``add`` with
3+ digits it mostly does not.
"""

from __future__ import annotations

import random
import re
from typing import Any

from datasets import Dataset

from echo2.tasks.base import RewardFunc, Task

LEVELS = ("copy", "mod10", "add")
_LEADING_INT = re.compile(r"\s*(-?\d+)")


def leading_int(text: str) -> int | None:
    m = _LEADING_INT.match(text)
    return int(m.group(1)) if m else None


class ArithTask(Task):
    def __init__(
        self,
        level: str = "copy",
        digits: int = 2,
        train_size: int = 10_000,
        eval_size: int = 200,
        seed: int = 0,
        max_completion_length: int = 2,
    ):
        if level not in LEVELS:
            raise ValueError(f"task.level={level!r}: expected one of {LEVELS}")
        if digits < 1:
            raise ValueError(f"task.digits={digits}: must be >= 1")
        self.name = f"arith-{level}"
        self.level, self.digits, self.seed = level, digits, seed
        self.train_size, self.eval_size = train_size, eval_size
        self.max_completion_length = max_completion_length

    def _problem(self, rng: random.Random) -> dict[str, Any]:
        if self.level == "copy":
            a = rng.randrange(10)
            return {"prompt": f"{a}=", "answer": str(a)}
        if self.level == "mod10":
            a, b = rng.randrange(10), rng.randrange(10)
            return {"prompt": f"{a}+{b}=", "answer": str((a + b) % 10)}
        hi = 10**self.digits
        a, b = rng.randrange(hi), rng.randrange(hi)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}

    def _rows(self, n: int, seed: int) -> Dataset:
        rng = random.Random(seed)
        rows = [self._problem(rng) for _ in range(n)]
        return Dataset.from_list(rows)

    def train_dataset(self) -> Dataset:
        return self._rows(self.train_size, self.seed)

    def eval_dataset(self) -> Dataset:
        # A different stream: seed offset far from any training seed a sweep would use.
        return self._rows(self.eval_size, self.seed + 1_000_003)

    def is_correct(self, completion: str, row: dict[str, Any]) -> bool:
        return leading_int(completion) == int(row["answer"])

    def reward_funcs(self) -> list[RewardFunc]:
        def correct(prompts, completions, completion_ids=None, answer=None, **_):
            return [float(leading_int(c) == int(a)) for c, a in zip(completions, answer, strict=True)]

        return [correct]
