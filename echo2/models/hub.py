"""Hub models: a hub id resolved to a local snapshot (the Hugging Face cache), downloaded first if need be.

Resolving here, once, rather than in every ``from_pretrained`` gives one clear error when the hub cannot be
reached, instead of minutes of retries from huggingface_hub, and hands learner, engines and local workers a
local directory.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlsplit


class HubUnavailable(RuntimeError):
    pass


def from_hub(name_or_path: str) -> str:
    """A local directory for ``name_or_path``: itself if it is one, else the hub id's snapshot in the cache,
    downloaded if missing and the hub is reachable; HubUnavailable (what to do instead) otherwise."""
    if Path(name_or_path).is_dir():
        return name_or_path
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import ENDPOINT, HF_HUB_OFFLINE

    try:
        return snapshot_download(name_or_path, local_files_only=True)
    except Exception:  # not (completely) in the cache
        pass
    why = "HF_HUB_OFFLINE is set" if HF_HUB_OFFLINE else _unreachable(ENDPOINT)
    if why is None:
        try:
            return snapshot_download(name_or_path)
        except Exception as e:
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    cache = os.environ.get("HF_HOME", "~/.cache/huggingface")
    raise HubUnavailable(
        f"model {name_or_path!r} is not in the local Hugging Face cache ({cache}) and cannot be downloaded: {why}. Download it where the hub is reachable (`hf download "
        f"{name_or_path}`) and copy the cache here (or set HF_HOME), or give a local directory: "
        f"model.path.name_or_path=DIR for the learner, --model DIR for a worker.")


def _unreachable(endpoint: str, timeout_s: float = 5.0) -> str | None:
    """Why the hub's endpoint cannot be reached (DNS, refused, timeout), or None if a TCP connection opens."""
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout_s):
            return None
    except OSError as e:
        return f"{endpoint} is unreachable ({e})"
