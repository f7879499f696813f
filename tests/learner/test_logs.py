"""What a run logs: every record to each tracker of run.report_to (several at once), the sample-completions table to
completions.jsonl and the trackers, the truncation rate, completion lengths and token counts, and the mapping to
TRL's metric names."""

from __future__ import annotations

import importlib.machinery
import json
import re
import sys
import types

import pytest
import torch  # noqa: F401
from trl import GRPOTrainer  # noqa: F401 (here, at collection: its first import probes the platform)

from conftest import ROOT, build_run, read_jsonl
from echo2 import metrics
from echo2.trackers import resolve_report_to


def lengths_of(trainer):
    rollouts = [r for g in trainer.last_groups for r in g.rollouts]
    return [len(r.completion.token_ids) for r in rollouts], [r.completion.finish_reason for r in rollouts], rollouts


def test_every_tracker_gets_the_records_and_the_table(tmp_path, monkeypatch):
    """run.report_to=[wandb,tensorboard,trackio] with run.tags: each tracker has every step's reward and the
    completions table; metrics.jsonl and completions.jsonl have the same; summary.json names the trackers. (wandb is
    a stand-in at its import: the real one starts a process, wandb-core, even offline.)"""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from trackio.sqlite_storage import SQLiteStorage

    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    project = f"echo2-test-{tmp_path.name}"
    cfg, trainer, source, step_log = build_run(tmp_path, [
        "rollout=sync", "run.steps=2", "rollout.prompts_per_step=4", "run.wandb=offline", f"run.project={project}",
        "run.report_to=[wandb,tensorboard,trackio]", "run.tags=[baseline,s0]", "run.completions_every_steps=1",
        "run.completions_rows=6", "run.name=logs-test"])
    trainer.train()
    summary = step_log.summary()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    rewards = [r["reward/mean"] for r in records]

    table = read_jsonl(tmp_path / "completions.jsonl")
    assert [r["step"] for r in table] == [1] * 6 + [2] * 6
    assert set(table[0]) >= {"prompt", "completion", "reward", "worker", "lag", "group", "correct"}
    assert {r["worker"] for r in table} == {"learner"} and {r["lag"] for r in table} == {0}
    last = [(g.row["prompt"], r.text, r.reward) for g in trainer.last_groups for r in g.rollouts][:6]
    assert [(r["prompt"], r["completion"], r["reward"]) for r in table[6:]] == last

    saved = json.loads((tmp_path / "summary.json").read_text())
    assert set(saved["trackers"]) == {"wandb", "tensorboard", "trackio"} and summary["steps"] == 2
    assert wandb.init_kwargs["tags"] == ["baseline", "s0"] and wandb.init_kwargs["mode"] == "offline"
    assert [step for step, row in wandb.logged if "reward/mean" in row] == [1, 2]
    assert [row["reward/mean"] for _, row in wandb.logged if "reward/mean" in row] == pytest.approx(rewards)
    assert [step for step, row in wandb.logged if "completions" in row] == [1, 2] and wandb.finished

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2]
    assert [e.value for e in events.Scalars("reward/mean")] == pytest.approx(rewards)
    assert "completions/text_summary" in events.Tags()["tensors"]

    logs = SQLiteStorage.get_logs(project, "logs-test")
    assert [row["step"] for row in logs if "reward/mean" in row] == [1, 2]
    assert [row["reward/mean"] for row in logs if "reward/mean" in row] == pytest.approx(rewards)
    tables = [row for row in logs if "completions" in row]
    assert len(tables) == 2 and len(tables[0]["completions"]["_value"]) == 6


class FakeWandb(types.ModuleType):
    """wandb at its boundary: init returns a run that records what it is given."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.logged, self.finished, self.init_kwargs = [], False, None
        fake = self

        class Run:
            id, group, name, project = "fake1", None, "logs-test", "p"
            summary: dict = {}

            def log(self, row, step):
                fake.logged.append((step, row))

            def finish(self):
                fake.finished = True

        self.Run = Run

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return self.Run()

    def Table(self, columns, data):  # noqa: N802 (wandb's name)
        return {"columns": columns, "data": data}


def test_lengths_truncation_and_tokens(tmp_path):
    """rollout/truncated_frac is TRL's completions/clipped_ratio; lengths count every completion token, also with
    learner.mask_truncated_completions (which once made truncated completions count 0 tokens in the mean); tokens
    are prompt + completion tokens per step and cumulative (TRL's num_tokens)."""
    cfg, trainer, source, _ = build_run(tmp_path, ["rollout=sync", "run.steps=2", "rollout.prompts_per_step=4",
                                                   "learner.mask_truncated_completions=true"])
    tokens = []

    def keep(rows, version, policy=None, _collect=source.collect):
        groups = _collect(rows, version, policy)
        tokens.append(sum(len(r.prompt_ids) + len(r.completion.token_ids) for g in groups for r in g.rollouts))
        return groups

    source.collect = keep
    trainer.train()
    last = [h for h in trainer.state.log_history if "reward/mean" in h][-1]
    lengths, finish, _ = lengths_of(trainer)
    assert "length" in finish and "stop" in finish, "need both truncated and finished completions to test this"
    assert last[metrics.ROLLOUT_COMPLETION_LEN_MEAN] == pytest.approx(sum(lengths) / len(lengths))
    assert last[metrics.ROLLOUT_COMPLETION_LEN_MIN] == min(lengths)
    assert last[metrics.ROLLOUT_COMPLETION_LEN_MAX] == max(lengths)
    assert last[metrics.ROLLOUT_TRUNCATED_FRAC] == pytest.approx(finish.count("length") / len(finish))
    assert last[metrics.ROLLOUT_TOKENS] == tokens[-1]
    assert last[metrics.ROLLOUT_TOKENS_TOTAL] == sum(tokens) == trainer.state.num_input_tokens_seen


@pytest.mark.parametrize("report_to, result", [
    ("none", []), ([], []), ("wandb", ["wandb"]), (["tensorboard", "trackio"], ["tensorboard", "trackio"]),
    ("all", ["wandb", "tensorboard", "trackio"]),
    ("mlflow", "TRL's mlflow integration is not wired in echo2"),
    (["wandb", "wandbb"], "'wandbb': expected some of wandb, tensorboard, trackio"),
    (["all", "wandb"], "'all' stands alone"),
])
def test_report_to_reads_as_trls(report_to, result):
    if isinstance(result, list):
        assert resolve_report_to(report_to) == result
    else:
        with pytest.raises(ValueError, match=re.escape(result)):
            resolve_report_to(report_to)


def test_trls_names_are_mapped_in_the_docs():
    """docs/logging.md has a row for every echo2 key that TRL logs under another name (metrics.TRL_NAMES)."""
    doc = (ROOT / "docs" / "logging.md").read_text()
    for ours, theirs in metrics.TRL_NAMES.items():
        assert re.search(rf"\| `{re.escape(theirs)}` \| `{re.escape(ours)}` \|", doc), (theirs, ours)


def test_an_evaluation_on_the_learner_says_when_it_starts_and_what_it_found(tmp_path, caplog):
    """A multi-turn task's held-out episodes took minutes on this CPU with nothing in the log but a progress bar at
    0 %: each evaluation now says it starts, on how many rows, and what it measured in how long."""
    import logging

    cfg, trainer, source, step_log = build_run(tmp_path, ["rollout=sync", "run.steps=1", "run.eval_every_steps=1",
                                                          "rollout.prompts_per_step=2", "task.eval_size=3"])
    with caplog.at_level(logging.INFO, logger="echo2.learner.callbacks"):
        trainer.train()
    step_log.sink.close()
    said = [r.getMessage() for r in caplog.records]
    assert "evaluating v0 greedily on the learner: 3 held-out rows" in said
    assert any(re.fullmatch(r"v1: held-out accuracy \d\.\d{3} in \d+\.\d s", m) for m in said), said
