"""Process-wide settings that every echo2 process applies first."""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path
from typing import Any


def configure_process() -> None:
    """Defaults measured to matter on small CPU machines (docs/design.md §5); each can be overridden.

    ``OMP_NUM_THREADS=1``: with 2 OpenMP threads on a busy 2-core box a tiny fwd+bwd went from 16 ms to 1.3 s.
    """
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("WANDB_SILENT", "true")
    # DeepSpeed's ZeRO gathers call a torch.distributed function torch deprecates: without this, every rank logs
    # the same FutureWarning at every step, burying the run's own messages.
    warnings.filterwarnings("ignore", message=r"`torch.distributed.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    if not _has_cuda():
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def world() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment (torchrun / accelerate), before torch.distributed."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def run_token() -> tuple[str, str]:
    """The secret workers join with: $ECHO2_TOKEN if set (workers started elsewhere need it), else a fresh one.
    Returns (token, where it came from); the token itself is never logged or written to the run directory."""
    import secrets

    if os.environ.get("ECHO2_TOKEN"):
        return os.environ["ECHO2_TOKEN"], "from $ECHO2_TOKEN"
    return secrets.token_urlsafe(24), "generated for this run"


def descendants(pid: int) -> set[int]:
    """PIDs of every live descendant of ``pid`` (from /proc): to measure a process tree, or to check that none of
    it outlived its root."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def run_named(target: str, *args: Any) -> Any:
    """Call ``module:function`` with ``args``: a spawned process's entry point given by name, so that the process
    that spawns it need not import what the child runs."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(*args)
