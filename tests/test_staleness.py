"""The staleness ablation's mechanism: the lagged source trains on rollouts exactly S versions old, the
staleness-aware learning rate scales the rate the optimizer applies, and the report groups a sweep's cells."""

from __future__ import annotations

import json

import pytest
import yaml
from transformers import TrainerCallback

from conftest import build_run, compose, read_jsonl
from echo2.config import validate
from echo2.learner.staleness_lr import lr_factor

FAST = ["rollout=lagged", "rollout.prompts_per_step=4", "rollout.group_size=4", "run.save_every_steps=0"]


class AppliedRates(TrainerCallback):
    """The learning rate each optimizer step applies (read after the step, before the scheduler resets it)."""

    def __init__(self):
        self.rates = []

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.rates.append(optimizer.param_groups[0]["lr"])


def test_the_lagged_source_trains_every_step_on_rollouts_exactly_S_versions_old(tmp_path):
    S = 3
    _, trainer, source, _ = build_run(tmp_path, [*FAST, f"rollout.staleness={S}", "run.steps=9"])
    trainer.train()
    source.close()
    steps = read_jsonl(tmp_path / "consumed.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 10))
    for s in steps:  # step t trains version t-1's weights on rollouts of version max(0, t-1-S)
        assert set(s["versions"]) == {max(0, s["step"] - 1 - S)}, s
    lags = [s["step"] - 1 - v for s in steps for v in s["versions"]]
    assert max(lags) == S and lags.count(S) == 6 * 4  # the bound is reached, every step from step S+1 on
    records = [h for h in trainer.state.log_history if "buffer/staleness_mean" in h]
    assert [r["buffer/staleness_mean"] for r in records] == [min(t - 1, S) for t in range(1, 10)]


def test_the_staleness_aware_rate_is_what_the_optimizer_applies(tmp_path):
    S, lr = 3, 3e-3
    _, trainer, source, _ = build_run(tmp_path, [*FAST, f"rollout.staleness={S}", "run.steps=6",
                                                 "learner.lr_staleness=inverse", "learner.lr_ref_lag=1",
                                                 f"learner.learning_rate={lr}"])
    applied = AppliedRates()
    trainer.add_callback(applied)
    trainer.train()
    source.close()
    lags = [min(t - 1, S) for t in range(1, 7)]
    assert applied.rates == pytest.approx([lr * min(1.0, 2 / (1 + lag)) for lag in lags])
    assert applied.rates[-1] == pytest.approx(lr / 2)
    logged = [h["train/lr_staleness_factor"] for h in trainer.state.log_history if "train/lr_staleness_factor" in h]
    assert logged == pytest.approx([lr_factor(lag, 1.0) for lag in lags])


def test_staleness_settings_that_cannot_run_are_refused():
    with pytest.raises(ValueError, match="rollout=lagged"):
        validate(compose(["rollout=sync", "rollout.staleness=2"]))
    with pytest.raises(ValueError, match="DeepSpeed"):
        validate(compose(["rollout=sync", "learner=zero2", "learner.lr_staleness=inverse"]))
    with pytest.raises(ValueError, match="lr_staleness"):
        validate(compose(["learner.lr_staleness=sqrt"]))
    validate(compose(["rollout=lagged", "rollout.staleness=11", "learner.lr_staleness=inverse"]))


def fake_run(root, name, staleness, seed, rewards, lag):
    """A run directory as train.py writes one, with just what the report reads."""
    d = root / name
    d.mkdir()
    (d / "resolved_config.yaml").write_text(yaml.safe_dump({"rollout": {"staleness": staleness, "correction": "none"},
                                                            "seed": seed}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "time_s": 0.5 * (i + 1), "reward/mean": r,
                                                         "train/grad_norm": 1.0 + i}) + "\n"
                                             for i, r in enumerate(rewards)))
    (d / "consumed.jsonl").write_text("".join(json.dumps({"step": i + 1, "versions": [max(0, i - lag)] * 2}) + "\n"
                                              for i in range(len(rewards))))
    return d


def test_the_report_groups_a_sweeps_cells_and_times_the_threshold(tmp_path):
    from echo2 import report

    dirs = [fake_run(tmp_path, "a", 0, 0, [0.0] * 5 + [1.0] * 25, 0),
            fake_run(tmp_path, "b", 0, 1, [0.0] * 10 + [1.0] * 20, 0),
            fake_run(tmp_path, "c", 4, 0, [0.0] * 30, 4)]
    runs = [report.load(d) for d in dirs]
    groups = report.grouped(runs, "rollout.staleness", "rollout.correction")
    assert list(groups) == [("none", 0), ("none", 4)] and len(groups[("none", 0)]) == 2
    fresh = report.cell_row(groups[("none", 0)], threshold=0.5, window=10)
    assert fresh["reward"] == (1.0, 0.0) and fresh["reached"] == "2/2"
    assert fresh["steps_to"] == pytest.approx((10 + 15) / 2)  # the 10-step average first reaches 0.5 at 10 / 15
    assert fresh["lag_mean"] == 0 and fresh["grad_max"] == 30.0
    stale = report.cell_row(groups[("none", 4)], threshold=0.5, window=10)
    assert stale["reached"] == "0/1" and stale["steps_to"] is None and stale["lag_max"] == 4
    report.main([str(d) for d in dirs] + ["--out", str(tmp_path / "out"), "--by", "rollout.staleness", "--panels",
                                           "rollout.correction", "--threshold", "0.5"])
    assert (tmp_path / "out" / "reward_by_staleness.png").stat().st_size > 0
    assert "| none | 4 | 1 |" in (tmp_path / "out" / "report.md").read_text()
