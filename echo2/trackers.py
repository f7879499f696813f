"""Experiment trackers: where each per-step record goes beside ``metrics.jsonl`` (``run.report_to``).

``run.report_to`` takes what TRL's ``report_to`` takes: a name, a list of names, ``all`` (every tracker below that is
installed) or ``none``. echo2 writes its own namespaced records (echo2/metrics.py) to each tracker, rather than
letting transformers' integration callbacks log TRL's raw dict, so that every tracker and ``metrics.jsonl`` carry the
same keys; resume continues the same run where the tracker can:

* ``wandb``: ``run.wandb`` is its mode (offline by default; ``disabled`` drops it); a resumed run continues the same
  wandb run (its id is kept in ``<run dir>/wandb_id``).
* ``tensorboard``: event files in ``<run dir>/tensorboard`` (``tensorboard --logdir <run dir>/tensorboard``); a
  resumed run purges the events written after its checkpoint.
* ``trackio``: a local trackio project named ``run.project`` (``trackio show --project echo2``; where trackio keeps
  it: ``$TRACKIO_DIR``, by default ``~/.cache/huggingface/trackio``); a resumed run continues the same run.

Each tracker takes ``log`` (one record per step), ``table`` (the sample-completions table), ``summary`` and ``close``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TRACKERS = ("wandb", "tensorboard", "trackio")  # what run.report_to may name
PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "trackio": "trackio"}  # the module each one needs


def resolve_report_to(report_to: Any) -> list[str]:
    """The trackers ``run.report_to`` names, as TRL reads ``report_to``: a name, a list, ``all`` (the installed
    ones) or ``none``. Raises ValueError, saying what is possible, for a name echo2 does not log to."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if names == ["none"] or not names:
        return []
    if names == ["all"]:
        return [t for t in TRACKERS if importlib.util.find_spec(PACKAGES[t])]
    errors = []
    for name in names:
        if name in ("all", "none"):
            errors.append(f"run.report_to: {name!r} stands alone (run.report_to={name})")
        elif name not in TRACKERS and name in trl_integrations():
            errors.append(f"run.report_to: {name}: TRL's {name} integration is not wired in echo2, which logs to "
                          f"{', '.join(TRACKERS)} (metrics.jsonl in the run dir has every record)")
        elif name not in TRACKERS:
            errors.append(f"run.report_to: {name!r}: expected some of {', '.join(TRACKERS)}, or all, or none")
        elif not importlib.util.find_spec(PACKAGES[name]):
            errors.append(f"run.report_to: {name} is not installed (requirements-common.txt pins it: "
                          f"pip install -c constraints.txt -r requirements.txt)")
    if errors:
        raise ValueError("; ".join(errors))
    return list(dict.fromkeys(names))


def trl_integrations() -> tuple[str, ...]:
    """The names TRL's report_to takes (transformers' integrations); imported only to explain a refusal."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    return tuple(INTEGRATION_TO_CALLBACK)


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class WandbTracker:
    def __init__(self, run_dir: Path, mode: str, project: str, group: str | None, name: str | None,
                 config: dict | None, tags: list[str], resumed: bool):
        import wandb

        self.wandb = wandb
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if resumed and id_file.exists() else None
        self.run = wandb.init(project=project, group=group, name=name, dir=str(run_dir), mode=mode, config=config,
                              tags=tags or None, reinit="finish_previous", id=run_id,
                              resume="allow" if run_id else None)
        id_file.write_text(self.run.id + "\n")
        self.info = {"id": self.run.id, "group": self.run.group, "name": self.run.name,
                     "project": self.run.project, "mode": mode, "tags": list(tags)}
        log.info("wandb run %s (%s) in %s", self.run.id, mode, run_dir)

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log(record, step=step)

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(summary)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    def __init__(self, run_dir: Path, config: dict | None, tags: list[str], resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = run_dir / "tensorboard"
        # a resumed run: the events of the steps after its checkpoint were thrown away with those steps
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=None if resume_step is None else resume_step + 1)
        if resume_step is None:
            self.writer.add_text("config", "```\n" + json.dumps(config or {}, indent=2, default=str) + "\n```", 0)
            if tags:
                self.writer.add_text("tags", ", ".join(tags), 0)
        self.info = {"log_dir": str(self.dir)}
        log.info("tensorboard events in %s", self.dir)

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in _scalars(record).items():
            if key not in ("step",):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.writer.add_text(name, markdown_table(columns, rows), step)
        self.writer.flush()

    def summary(self, summary: dict[str, Any]) -> None:
        self.writer.add_text("summary", "```\n" + json.dumps(summary, indent=2, default=str) + "\n```")

    def close(self) -> None:
        self.writer.close()


class TrackioTracker:
    def __init__(self, run_dir: Path, project: str, group: str | None, name: str | None, config: dict | None,
                 tags: list[str], resumed: bool):
        import trackio

        self.trackio = trackio
        name_file = run_dir / "trackio_run"
        if resumed and name_file.exists():
            name = name_file.read_text().strip()
        self.run = trackio.init(project=project, name=name, group=group, config={**(config or {}), "tags": tags},
                                resume="allow" if resumed else "never", embed=False)
        name_file.write_text(self.run.name + "\n")
        self.info = {"project": project, "name": self.run.name}
        log.info("trackio run %s in project %s", self.run.name, project)

    def log(self, record: dict[str, Any], step: int) -> None:
        self.trackio.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=step)

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.trackio.log({name: self.trackio.Table(columns=columns, data=rows)}, step=step)

    def summary(self, summary: dict[str, Any]) -> None:
        pass  # trackio keeps no run summary apart from its logs; summary.json in the run dir has it

    def close(self) -> None:
        self.trackio.finish()


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A markdown table (tensorboard's text panel renders it); cells on one line each."""
    def cell(v: Any) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "⏎")

    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(cell(v) for v in row) + " |\n" for row in rows)


def open_trackers(names: list[str], run_dir: Path, wandb_mode: str, project: str, group: str | None,
                  name: str | None, config: dict | None, tags: list[str], resume_step: int | None) -> list[Any]:
    """The trackers ``names`` (resolve_report_to's), opened for this run; wandb only where its mode is not
    ``disabled``."""
    out: list[Any] = []
    for tracker in names:
        if tracker == "wandb" and wandb_mode != "disabled":
            out.append(WandbTracker(run_dir, wandb_mode, project, group, name, config, tags, resume_step is not None))
        elif tracker == "tensorboard":
            out.append(TensorBoardTracker(run_dir, config, tags, resume_step))
        elif tracker == "trackio":
            out.append(TrackioTracker(run_dir, project, group, name, config, tags, resume_step is not None))
    return out
