"""Where a learner can be found: ``<run dir>/coordinator.json``, for workers that start before its address is known.

On a cluster the learner's node is known only once its job runs. The learner writes this file when its
coordinator is up; a worker given the file's path instead of a URL (``python -m echo2.worker --coordinator
runs/x/coordinator.json``, launchers/workers.sbatch) waits for it on the shared filesystem and reads the URL and
the context length the run needs, and the run CA's fingerprint to pin when the learner speaks TLS. The token is
never written here: workers take it from $ECHO2_TOKEN. A worker re-reads it while the learner is unreachable and
follows a new address only under the scheme and CA it joined with (``moved_to``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from echo2.net.http import reachable_host

log = logging.getLogger(__name__)

FILE = "coordinator.json"


def advertised_url(url: str) -> str:
    """``url`` with a wildcard host (``http://0.0.0.0:8700``) replaced by this machine's name."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{reachable_host(parts.hostname or '')}:{parts.port}"


def write(run_dir: str, url: str, requires: dict[str, Any], ca_hash: str | None = None) -> dict[str, Any]:
    """``ca_hash``: the run CA's fingerprint when the learner speaks TLS (public: it pins, it does not grant)."""
    info = {"url": advertised_url(url), "model": requires["model"], "max_model_len": requires["max_model_len"],
            "ca_hash": ca_hash, "written_at": time.time()}
    path = Path(run_dir) / FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, path)  # a reader never sees half of it
    log.info("workers can find this run in %s (%s)", path, info["url"])
    return info


def read(path: str, timeout_s: float, poll_s: float = 2.0) -> dict[str, Any]:
    """The learner's coordinator.json at ``path`` (or in the directory ``path``), waiting up to ``timeout_s``
    for the learner to write it."""
    target = Path(path) / FILE if Path(path).is_dir() else Path(path)
    deadline, said = time.monotonic() + timeout_s, 0.0
    while not target.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{target} did not appear within {timeout_s:.0f} s: is the learner's job running, "
                               "with this run directory (hydra.run.dir / hydra.sweep.dir)?")
        if time.monotonic() - said > 60:
            log.info("waiting for the learner to write %s", target)
            said = time.monotonic()
        time.sleep(poll_s)
    return json.loads(target.read_text())


def moved_to(current_url: str, info: dict[str, Any], pinned_ca_hash: str | None) -> str | None:
    """The address a worker talking to ``current_url`` may follow now that coordinator.json reads ``info``: its
    URL if it names another one, None if the same. Raises ValueError if following it would lower the worker's
    guard: another scheme (https to http would send the worker's credential in the clear) or, over https, another
    CA than the one the worker pinned when it joined (another run, or a file someone else wrote)."""
    url = str(info.get("url", "")).rstrip("/")
    if url == current_url.rstrip("/"):
        return None
    was, now = urlsplit(current_url).scheme, urlsplit(url).scheme
    if now != was:
        raise ValueError(f"{FILE} names {url}: {now or 'no scheme'}, not {was} as joined; not followed (restart the "
                         "worker with the learner's join command if the run really changed)")
    if was == "https" and info.get("ca_hash") != pinned_ca_hash:
        raise ValueError(f"{FILE} names {url} under CA {info.get('ca_hash')}, not the pinned {pinned_ca_hash}; "
                         "not followed")
    return url


def journal_path(run_dir: str) -> str:
    """The coordinator's journal of every rollout's fate (echo2/coordinator/ledger.py), kept in the run directory:
    a restarted coordinator and a resumed learner find it here."""
    return os.path.join(run_dir, "rollouts.journal")
