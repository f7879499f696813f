"""GSM8K (grade-school maths word problems) for real models on GPUs.

Loads ``openai/gsm8k`` (config ``main``) with ``datasets``, or the same JSON-lines format from a local
folder (``data_dir`` with ``train.jsonl`` and ``test.jsonl``; the tests use a small fixture). The gold
answer is the number after ``####``; a completion is scored with math-verify, which reads a
``\\boxed{}`` answer or the last number.

    python train.py experiment=gsm8k_qwen3_4b      # on a GPU box with hub access
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from datasets import Dataset, load_dataset

from echo2.tasks.base import RewardFunc, Task, completion_text
from echo2.tasks.dataset import plain

INSTRUCTION = "Solve the problem step by step, then give the final answer as \\boxed{N}."


def extract_gold(answer_field: str) -> str:
    """GSM8K answers end in ``#### 1,234``; return ``1234``."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer without '####': {answer_field[-80:]!r}")
    return answer_field.split("####")[-1].strip().replace(",", "").rstrip(".")


VERIFY_TIMEOUT_S = 1
"""math-verify's own limit per completion on parsing and on comparing, where it can apply it: its timeout uses SIGALRM,
which only works in a main thread (a reward process of the coordinator's pool, which also kills a group past its
own limit); elsewhere (a learner's thread) it runs without one. An honest GSM8K answer parses in milliseconds; a
crafted one (``\\boxed{10^{10^{9}}}``) runs to the limit and is then scored 0, so the limit is what a stranger can
make one completion cost a reward process: at 5 s (math-verify's default) a group of 8 cost 40 s, four times the
pool's limit per group; at 1 s a group costs at most 2 s per completion (parse, then compare), is charged to its
sender (coordinator/fair.py), and one past the pool's limit is dropped (reward_timeout)."""


def verify_answer(completion: str, gold: str) -> bool:
    from math_verify import parse, verify

    limit = VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    pred = parse(completion, parsing_timeout=limit)
    return bool(pred) and verify(parse(f"${gold}$", parsing_timeout=limit), pred, timeout_seconds=limit)


class Gsm8kTask(Task):
    def __init__(
        self,
        path: str = "openai/gsm8k",
        config_name: str = "main",
        data_dir: str | None = None,
        train_split: str = "train",
        eval_split: str = "test",
        eval_size: int = 200,
        max_completion_length: int = 512,
        chat: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        self.name = "gsm8k"
        self.path, self.config_name, self.data_dir = path, config_name, data_dir
        self.train_split, self.eval_split, self.eval_size = train_split, eval_split, eval_size
        self.max_completion_length = max_completion_length
        self.chat = chat
        # e.g. Qwen3's enable_thinking=False; applied wherever a prompt becomes token ids (Task.prompt_ids)
        self.chat_template_kwargs = dict(plain(chat_template_kwargs) or {})

    def _load(self, split: str) -> Dataset:
        if self.data_dir:
            f = Path(self.data_dir) / f"{split}.jsonl"
            if not f.exists():
                raise FileNotFoundError(f"task.data_dir: no {f} (expected GSM8K JSON lines: question, answer)")
            ds = load_dataset("json", data_files=str(f), split="train")
        else:
            ds = load_dataset(self.path, self.config_name, split=split)
        missing = {"question", "answer"} - set(ds.column_names)
        if missing:
            raise ValueError(f"GSM8K data lacks columns {sorted(missing)}; has {ds.column_names}")
        return ds.map(self._row, remove_columns=ds.column_names)

    def _row(self, ex: dict[str, Any]) -> dict[str, Any]:
        text = f"{ex['question']}\n{INSTRUCTION}"
        prompt = [{"role": "user", "content": text}] if self.chat else text + "\n"
        return {"prompt": prompt, "answer": extract_gold(ex["answer"])}

    def train_dataset(self) -> Dataset:
        return self._load(self.train_split)

    def eval_dataset(self) -> Dataset:
        ds = self._load(self.eval_split)
        return ds.select(range(min(self.eval_size, len(ds))))

    def is_correct(self, completion: str, row: dict[str, Any]) -> bool:
        return verify_answer(completion, row["answer"])

    def reward_funcs(self) -> list[RewardFunc]:
        def correct(prompts, completions, completion_ids=None, answer=None, **_):
            return [float(verify_answer(completion_text(c), a)) for c, a in zip(completions, answer, strict=True)]

        return [correct]
