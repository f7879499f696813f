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
                 group: str | None = None, name: str | None = None, config: dict | None = None,
                 resume_step: int | None = None):
        """``resume_step``: a run resumed from the checkpoint at that step: records after it (written by steps
        that were thrown away) are cut from ``metrics.jsonl`` and ``consumed.jsonl``, and wandb continues the
        same run."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.consumed_path = self.run_dir / "consumed.jsonl"
        self.previous: list[dict] = []  # records kept from before a resume
        if resume_step is not None:
            self.previous = _truncate(self.path, resume_step)
            _truncate(self.consumed_path, resume_step)
        else:  # a fresh run in a used directory starts its logs afresh
            for p in (self.path, self.consumed_path):
                p.unlink(missing_ok=True)
        self._file = self.path.open("a")
        self._consumed = self.consumed_path.open("a")
        self._wandb = None
        self.wandb_info: dict[str, Any] | None = None  # as wandb has it (read back from the run)
        if wandb_mode != "disabled":
            import wandb

            id_file = self.run_dir / "wandb_id"
            run_id = id_file.read_text().strip() if resume_step is not None and id_file.exists() else None
            self._wandb = wandb.init(project=project, group=group, name=name, dir=str(self.run_dir),
                                     mode=wandb_mode, config=config, reinit="finish_previous", id=run_id,
                                     resume="allow" if run_id else None)
            id_file.write_text(self._wandb.id + "\n")
            self.wandb_info = {"id": self._wandb.id, "group": self._wandb.group, "name": self._wandb.name,
                               "project": self._wandb.project, "mode": wandb_mode}
            log.info("wandb run %s (%s) in %s", self._wandb.id, wandb_mode, self.run_dir)

    def log(self, record: dict[str, Any]) -> None:
        record = {k: _json_safe(v) for k, v in record.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=int(record["step"]))

    def consumed(self, step: int, groups: list[Any]) -> None:
        """One line per learner step: the groups it trained on (ids, training-set rows, policy versions)."""
        self._consumed.write(json.dumps({"step": step, "groups": [g.group_id for g in groups],
                                         "rows": [g.row_index for g in groups],
                                         "versions": [g.version for g in groups]}) + "\n")
        self._consumed.flush()

    def summary(self, summary: dict[str, Any]) -> None:
        summary = {**{k: _json_safe(v) for k, v in summary.items()}, "wandb": self.wandb_info}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self._wandb is not None:
            self._wandb.summary.update(summary)

    def close(self) -> None:
        self._file.close()
        self._consumed.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _truncate(path: Path, step: int) -> list[dict]:
    """Keep the records of ``path`` (JSON lines with a ``step``) up to ``step``; returns them."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a torn last line of a killed run
            continue
        if record.get("step", 0) <= step:
            kept.append(record)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)
    return kept
