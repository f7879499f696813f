"""Metric names and the one place they are written from: ``metrics.jsonl`` in the run dir, and wandb.

Every key is namespaced (``train/ reward/ rollout/ buffer/ broadcast/ activation/ cost/ eval/``). TRL's own
log keys (``loss``, ``grad_norm``, ``clip_ratio/...``) are moved under ``train/``. Only rank 0 writes; the
same calls work with wandb off (``run.wandb=disabled``).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NAMESPACES = ("train/", "reward/", "rollout/", "buffer/", "broadcast/", "activation/", "cost/", "eval/")
# TRL log keys with an obvious better name; the rest go under train/ as they are.
_RENAME = {"step_time": "train/step_time_s", "learning_rate": "train/lr", "epoch": None, "total_flos": None}


def namespaced(logs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in logs.items():
        if key in _RENAME:
            if _RENAME[key]:
                out[_RENAME[key]] = value
        elif key.startswith(NAMESPACES):
            out[key] = value
        else:
            out["train/" + key.removeprefix("train_")] = value
    return out


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsSink:
    """Writes one JSON object per learner step to ``metrics.jsonl`` and mirrors it to wandb."""

    def __init__(self, run_dir: str | Path, wandb_mode: str = "offline", project: str = "echo2",
                 group: str | None = None, name: str | None = None, config: dict | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._wandb = None
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=project, group=group, name=name, dir=str(self.run_dir),
                                     mode=wandb_mode, config=config, reinit="finish_previous")
            log.info("wandb run %s (%s) in %s", self._wandb.id, wandb_mode, self.run_dir)

    def log(self, record: dict[str, Any]) -> None:
        record = {k: _json_safe(v) for k, v in record.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=int(record["step"]))

    def summary(self, summary: dict[str, Any]) -> None:
        summary = {k: _json_safe(v) for k, v in summary.items()}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self._wandb is not None:
            self._wandb.summary.update(summary)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
