"""``python train.py`` as a user runs it: the run directory, the metrics file, sweeps, errors, learning."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import read_jsonl, run_train

REQUIRED = {"step", "version", "time_s", "reward/mean", "train/loss", "buffer/staleness_max"}


@pytest.mark.e2e
def test_run_dir_holds_config_metrics_summary_and_wandb(tmp_path):
    out = run_train(["rollout=sync", "run.steps=4", "run.eval_every_steps=2", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    resolved = yaml.safe_load((tmp_path / "resolved_config.yaml").read_text())
    assert resolved["run"]["steps"] == 4 and resolved["model"]["path"]["_target_"].endswith("build_tiny")
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(REQUIRED <= r.keys() for r in records)
    assert all(r["version"] == r["step"] for r in records)
    assert [r["step"] for r in records if "eval/accuracy" in r] == [2, 4]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["rollouts_consumed"] == 4 * 16 * 8
    assert set(summary["eval_accuracy_by_step"]) == {"0", "2", "4"}
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline wandb run"


@pytest.mark.e2e
def test_wandb_can_be_off(tmp_path):
    out = run_train(["rollout=sync", "run.steps=1", "run.wandb=disabled", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (tmp_path / "wandb").exists() and (tmp_path / "metrics.jsonl").exists()


@pytest.mark.e2e
def test_multirun_gives_each_job_its_own_dir(tmp_path):
    out = run_train(["-m", "seed=0,1", "rollout=sync", "run.steps=2", "run.eval_every_steps=0", "run.wandb=disabled",
                     f"hydra.sweep.dir={tmp_path}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    dirs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert len(dirs) == 2, dirs
    for num, d in enumerate(dirs):  # named <job number>_<overrides>, e.g. 0_run.steps=2,...,seed=0
        assert d.startswith(f"{num}_") and f"seed={num}" in d
        assert len(read_jsonl(tmp_path / d / "metrics.jsonl")) == 2
        assert yaml.safe_load((tmp_path / d / "resolved_config.yaml").read_text())["seed"] == num


@pytest.mark.e2e
@pytest.mark.parametrize("typo", ["rollout.stalenes=4", "+rollout.stalenes=4"])
def test_typo_is_a_clear_error(tmp_path, typo):
    """With or without Hydra's ``+`` (which adds a key unchecked), and even when only composing (--cfg job)."""
    for extra in ([f"hydra.run.dir={tmp_path}"], ["--cfg", "job"]):
        out = run_train([typo, *extra], tmp_path)
        assert out.returncode != 0, out.stdout[-500:]
        assert "rollout.stalenes" in out.stderr and "did you mean rollout.staleness" in out.stderr
        assert "Traceback" not in out.stderr and "+rollout" not in out.stderr


@pytest.mark.e2e
def test_experiment_runs_one_step(tmp_path):
    out = run_train(["experiment=mod10", "pool.engine=hf", "run.steps=1", "run.eval_every_steps=0",
                     f"hydra.run.dir={tmp_path}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    record = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert record["rollout/consumed"] == 32 * 16  # the experiment's P x G


@pytest.mark.e2e
def test_sync_copy_task_reward_rises(tmp_path):
    """The on-policy baseline (rollout=sync, copy task, 150 steps) learns the lookup.

    Chance: the reward needs the right digit (1 of 20 tokens) followed by a non-digit, about 1/20 x 1/2 =
    2.5 %; measured first-step reward on the initial weights is 1.6 %. A policy that has learned the lookup
    scores 0.8-1.0 (sampling at temperature 1 still errs); seeds 0-3 end at a last-20 mean of 0.79-1.00
    (BENCHMARKS.md). The threshold 0.5 is 20x chance and below every seed measured.
    """
    out = run_train(["rollout=sync", "run.wandb=disabled", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rewards = [r["reward/mean"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert len(rewards) == 150
    assert sum(rewards[:5]) / 5 < 0.1, "should start near chance"
    assert sum(rewards[-20:]) / 20 > 0.5
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_accuracy_by_step"]["150"] > summary["eval_accuracy_by_step"]["0"] + 0.3


def run_deepspeed(tmp_path, stage: int, steps: int, eval_every: int) -> dict:
    """launchers/learner.sh with 2 CPU processes (accelerate launch, gloo); returns summary.json."""
    out = run_train(["2", f"learner=zero{stage}", "rollout=sync", f"run.steps={steps}",
                     f"run.eval_every_steps={eval_every}", "run.wandb=disabled", "run.progress=false"],
                    tmp_path, launcher=["launchers/learner.sh"], timeout=900)
    assert out.returncode == 0, out.stderr[-5000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["learner_backend"] == f"deepspeed-zero{stage}" and summary["learner_processes"] == 2
    assert summary["steps"] == steps
    return summary


@pytest.mark.e2e
@pytest.mark.slow
def test_deepspeed_zero2_on_two_cpu_processes_trains(tmp_path):
    """ZeRO-2: 2 ranks, each with half of every batch; reward rises over 40 steps."""
    run_deepspeed(tmp_path, stage=2, steps=40, eval_every=0)
    rewards = [r["reward/mean"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert len(rewards) == 40
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.1


@pytest.mark.e2e
@pytest.mark.slow
def test_deepspeed_zero3_on_two_cpu_processes_runs(tmp_path):
    """ZeRO-3 shards parameters; the sync source generates inside a full-parameter gather on every rank."""
    summary = run_deepspeed(tmp_path, stage=3, steps=3, eval_every=3)
    assert "3" in summary["eval_accuracy_by_step"]
