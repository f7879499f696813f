"""The checks of a composed config beyond its schema that validate() (echo2/config.py) runs for TRL's side of the
learner, the pool and the run's outputs, and what train.py says about a config Hydra could not compose or a sweep
started without ``-m``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.utils import get_class

from echo2.config import CONF_DIR


def learner_errors(cfg: Any) -> list[str]:
    """TRL's side of the learner: the loss TRL computes, the GRPOConfig pass-through (echo2/learner/trl_fields.py),
    and μ passes per batch."""
    from omegaconf import OmegaConf

    from echo2.learner import trl_fields

    lc, errors = cfg.learner, []
    if lc.loss_type not in trl_fields.loss_types():
        errors.append(f"learner.loss_type={lc.loss_type!r}: TRL {_trl_version()} computes "
                      f"{', '.join(trl_fields.loss_types())}")
    trl = OmegaConf.to_container(lc.trl, resolve=True) if lc.trl else {}
    errors += trl_fields.check(trl)
    mu = lc.num_iterations
    if mu < 1:
        errors.append(f"learner.num_iterations={mu}: must be >= 1 (optimizer steps, PPO-style passes, per batch)")
    elif mu > 1 and cfg.run.save_every_steps % mu:
        errors.append(f"run.save_every_steps={cfg.run.save_every_steps} with learner.num_iterations={mu}: checkpoints "
                      f"lie between batches, so save every multiple of {mu} steps")
    return errors


def _trl_version() -> str:
    import trl

    return trl.__version__


def pool_errors(cfg: Any, remote: bool) -> list[str]:
    """A pool that cannot feed a remote source."""
    from echo2.learner.sources.pool import LocalPool

    pool = cfg.pool
    target = pool.get("_target_") if hasattr(pool, "get") else None
    if remote and target and get_class(target) is LocalPool and pool.get("workers", 1) < 1:
        return [f"pool.workers={pool.workers} with pool=local starts no worker: the learner would wait "
                f"rollout.source.take_timeout_s for rollouts that never come. Set pool.workers=N (N >= 1), or "
                "pool=static to join workers of your own (launchers/join.sh)"]
    return []


def run_errors(cfg: Any, remote: bool = True) -> list[str]:
    """Logs and outputs: evaluation, trackers, the completions table, the hub push."""
    import os

    from echo2.trackers import resolve_report_to

    run, errors = cfg.run, []
    if run.eval_every_steps < 0:
        errors.append(f"run.eval_every_steps={run.eval_every_steps}: must be >= 0 (0: never)")
    if run.eval_on not in ("learner", "workers"):
        errors.append(f"run.eval_on={run.eval_on!r}: expected learner or workers")
    elif run.eval_on == "workers" and not remote:
        errors.append("run.eval_on=workers: this rollout source generates in the learner's process, so there is no "
                      "worker to evaluate on; use rollout=async (remote workers) or run.eval_on=learner")
    try:
        resolve_report_to(run.report_to)
    except ValueError as e:
        errors.append(str(e))
    if run.completions_every_steps < 0 or run.completions_rows < 1:
        errors.append(f"run.completions_every_steps={run.completions_every_steps}, completions_rows="
                      f"{run.completions_rows}: need completions_every_steps >= 0 (0: never) and completions_rows >= 1")
    if run.push_to_hub:
        if not run.hub_model_id:
            errors.append("run.push_to_hub=true needs run.hub_model_id (the repository, e.g. my-org/qwen3-grpo)")
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            errors.append("run.push_to_hub=true but HF_HUB_OFFLINE is set: the final model could not be pushed. "
                          "Unset HF_HUB_OFFLINE, or push later: hf upload REPO <run dir>/trainer")
    return errors


def sweep_warning(hydra_config: Any) -> str | None:
    """What to say when a configuration that defines a sweep (``hydra.sweeper.params``, e.g. experiment=
    staleness_sweep) runs without ``-m``: one job with the file's defaults, not its grid."""
    from hydra.types import RunMode

    sweeper = hydra_config.get("sweeper") if hasattr(hydra_config, "get") else None
    params = (sweeper.get("params") if sweeper is not None else None) or {}
    if hydra_config.mode != RunMode.RUN or not params:
        return None
    grid = ", ".join(f"{k}={v}" for k, v in params.items())
    return (f"this configuration defines a sweep ({grid}) but was started without -m: it runs ONE job with the "
            "defaults, not the grid. Add -m to run every job of the grid (python train.py -m ...)")


def log_composition_error(argv: list[str], conf_dir: Path = CONF_DIR) -> str | None:
    """After Hydra failed to compose the config of ``argv`` (it printed why): when the command line names the run
    directory (``hydra.run.dir=...``, as a scheduled or resumed run does), append the same error to its train.log,
    where the run's other messages would be. Returns the error, or None if it cannot be reproduced here."""
    import datetime

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    run_dir = next((a.split("=", 1)[1] for a in overrides if a.lstrip("+").startswith("hydra.run.dir=")), None)
    if run_dir is None:
        return None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            compose(config_name="config", overrides=[o for o in overrides if not o.lstrip("+").startswith("hydra.")])
        return None
    except Exception as e:  # noqa: BLE001 - whatever Hydra refused, it goes to the run's log as it was printed
        error = f"{e}\n{e.__cause__}" if e.__cause__ is not None else str(e)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    with open(Path(run_dir) / "train.log", "a") as f:
        f.write(f"[{stamp}][echo2][ERROR] - invalid config: {error}\n")
    return error
