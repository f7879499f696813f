"""``task.chat_template_kwargs`` reach the chat template on every path a prompt becomes token ids: the learner's own
generation (rollout=sync) and evaluation, the coordinator's dispatch to workers (vLLM and hf engines take these ids
as they are), and the context a worker must hold."""

from __future__ import annotations

import functools

import pytest

from echo2.learner.evaluate import Evaluator
from echo2.learner.sources.async_source import run_needs
from echo2.learner.sources.sync import SyncRolloutSource
from echo2.records import Completion, SamplingParams
from echo2.scoring import Scorer
from echo2.seams import RunParts
from echo2.tasks.dataset import DatasetTask

# The tiny tokenizer knows digits and "+-*=% ": the template marks a turned-off "thinking" with "%%", as Qwen3's
# renders an empty think block when enable_thinking=False.
TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}="
            "{% if enable_thinking is defined and enable_thinking is false %}%%{% endif %}{% endif %}")


@pytest.fixture
def tok(tiny_model_dir):
    from echo2.models.tokenizer import load_tokenizer

    t = load_tokenizer(tiny_model_dir)
    t.chat_template = TEMPLATE
    return t


@pytest.fixture
def chat_task(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": [{{"role": "user", "content": "{a}+{a}"}}], "answer": "{2 * a}"}}\n'
                            for a in range(6)))
    return DatasetTask(data_files=str(rows), reward_funcs=["own_rewards.exact"], eval_size=2,
                       chat_template_kwargs={"enable_thinking": False}, max_completion_length=2)


class Recorder:
    """An engine that records the prompt ids it is asked to generate from, and answers '0' each time."""

    def __init__(self):
        self.prompts = []

    def generate(self, policy, prompt_ids, params, greedy=False):
        self.prompts += [list(p) for p in prompt_ids]
        return [[Completion([4], [-0.1], "stop")] * (1 if greedy else params.n) for _ in prompt_ids]


def test_every_path_encodes_with_the_kwargs(tok, chat_task, tiny_model_dir):
    row = chat_task.train_dataset()[0]
    plain = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
    plain = list(plain["input_ids"] if hasattr(plain, "keys") else plain)
    want = chat_task.prompt_ids(tok, row)
    assert want == plain + tok.convert_tokens_to_ids(["%", "%"])  # the kwarg changed the prompt

    engine = Recorder()  # the learner's own generation
    parts = RunParts(task=chat_task, tokenizer=tok, scorer=Scorer(chat_task, tok), sampling=SamplingParams(n=2),
                     engine=engine, model_path=tiny_model_dir, run_dir="", seed=0, staleness=0, prompts_per_step=1,
                     publish_interval=1, token="", broadcaster=None, pool=None, activation=None,
                     broadcast_shape=None)
    SyncRolloutSource(parts).collect([row], version=0, policy=object())
    assert engine.prompts == [want]

    evaluator = Evaluator(chat_task, tok, Recorder())  # held-out rows
    held = chat_task.eval_dataset()[0]
    assert evaluator.prompt_ids[0] == chat_task.prompt_ids(tok, held)
    assert evaluator.prompt_ids[0][-2:] == tok.convert_tokens_to_ids(["%", "%"])

    need = run_needs(chat_task, tok, tiny_model_dir, max_tokens=2)  # the context a worker must hold
    assert need["max_model_len"] == max(len(chat_task.prompt_ids(tok, r)) for r in chat_task.train_dataset()) + 2


def test_the_coordinator_dispatches_the_task_encoding(tok, chat_task):
    """What a worker is handed to generate from (the coordinator's dispatch) is the task's own encoding."""
    from echo2.coordinator.coordinator import Coordinator
    from echo2.net.http import Client
    from echo2.settings import CoordinatorSettings

    settings = CoordinatorSettings(token="secret", staleness=1, prompts_per_step=2, group_size=2, vocab_size=len(tok),
                                   long_poll_s=0.0, sampling={"max_tokens": 2, "temperature": 1.0, "top_p": 1.0,
                                                              "top_k": 0})
    rows = chat_task.train_dataset()
    coord = Coordinator(rows, Scorer(chat_task, tok), tok, settings,
                        encode=functools.partial(chat_task.prompt_ids, tok)).start()
    try:
        client = Client(coord.url, "secret")
        wid = client.post("/register", {"engine": "test"})["worker_id"]
        work = client.post("/pull", {"worker_id": wid, "version": 0, "max_groups": 2})["work"]
        assert work and all(w["prompt_ids"][-2:] == tok.convert_tokens_to_ids(["%", "%"]) for w in work)
        sent = {tuple(w["prompt_ids"]) for w in work}
        assert sent <= {tuple(chat_task.prompt_ids(tok, r)) for r in rows}
    finally:
        coord.close()
