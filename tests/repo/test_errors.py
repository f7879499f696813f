"""Configuration errors as a user meets them: one clear message, no traceback, exit 1, and the same message in the
run's train.log (on SLURM the only log many users read); a sweep run without -m is called out; a pool that starts
no worker is refused before the learner waits for one."""

from __future__ import annotations

import pytest
from hydra.types import RunMode
from omegaconf import OmegaConf

from conftest import CONF, compose, run_train
from echo2.config import ConfigError, validate
from echo2.config_checks import sweep_warning


def test_a_local_pool_that_starts_no_worker_is_refused():
    with pytest.raises(ConfigError, match=r"pool.workers=0 with pool=local starts no worker.*pool=static"):
        validate(compose(["pool.workers=0"]))
    validate(compose(["pool.workers=0", "rollout=sync"]))  # the learner generates: no pool is used


def test_evaluation_on_workers_needs_workers():
    with pytest.raises(ConfigError, match=r"run.eval_on=workers: this rollout source generates in the learner"):
        validate(compose(["run.eval_on=workers", "rollout=sync"]))
    with pytest.raises(ConfigError, match=r"run.eval_on='gpu': expected learner or workers"):
        validate(compose(["run.eval_on=gpu"]))
    validate(compose(["run.eval_on=workers"]))  # rollout=async, the default


def test_a_sweep_run_without_multirun_is_called_out():
    params = OmegaConf.load(CONF / "experiment" / "staleness_sweep.yaml").hydra.sweeper.params
    assert "rollout.staleness" in params
    said = sweep_warning(OmegaConf.create({"mode": RunMode.RUN, "sweeper": {"params": params}}))
    assert "started without -m: it runs ONE job" in said and "rollout.staleness=0,1,2,4,6,8,11" in said
    assert sweep_warning(OmegaConf.create({"mode": RunMode.MULTIRUN, "sweeper": {"params": params}})) is None
    assert sweep_warning(OmegaConf.create({"mode": RunMode.RUN, "sweeper": {"params": None}})) is None


@pytest.mark.e2e
def test_config_errors_reach_train_log_without_a_traceback(tmp_path):
    """validate()'s errors and Hydra's own (a wrong type) are printed without a traceback, exit 1, and are in
    <run dir>/train.log; the sweep warning is logged there too."""
    run = tmp_path / "run"
    out = run_train(["experiment=staleness_sweep", "learner.loss_type=gspo", "run.completions_rows=0",
                     f"hydra.run.dir={run}"], run, timeout=300)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    printed = out.stdout + out.stderr
    assert "Traceback" not in printed, printed[-3000:]
    log = (run / "train.log").read_text()
    for said in ("learner.loss_type='gspo'", "completions_rows=0", "started without -m"):
        assert said in printed and said in log, said

    composed = tmp_path / "composed"
    out = run_train(["run.steps=abc", f"hydra.run.dir={composed}"], composed, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr
    assert "could not be converted to Integer" in out.stderr
    assert "could not be converted to Integer" in (composed / "train.log").read_text()


@pytest.mark.parametrize("group, real", [("model", "tiny"), ("task", "arith"), ("learner", "zero2"),
                                         ("rollout", "async"), ("broadcast", "pipelined"), ("activation", "default")])
def test_option_lists_show_no_internal_schemas(group, real):
    """Hydra's "Available options" (and --help) list the YAML files only: the structured configs that check them
    live outside the groups."""
    with pytest.raises(Exception) as failed:
        compose([f"{group}=no_such_option"])
    listed = str(failed.value)
    assert f"Available options in '{group}'" in listed and real in listed, listed
    assert "_schema" not in listed, listed
