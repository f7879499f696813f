"""Snapshot bytes: the policy's state dict as safetensors (no code runs on load, unlike pickle).

Their authentication (a manifest of chunk digests signed by the learner) is the relay's: relay.py.
"""

from __future__ import annotations

from typing import Any


def encode(state_dict: dict[str, Any]) -> bytes:
    import safetensors.torch

    return safetensors.torch.save({k: v.detach().cpu().contiguous() for k, v in state_dict.items()})


def save(state_dict: dict[str, Any], path: str) -> None:
    """The bytes ``encode`` would return, written straight to ``path`` (no in-memory copy of the whole snapshot)."""
    import safetensors.torch

    safetensors.torch.save_file({k: v.detach().cpu().contiguous() for k, v in state_dict.items()}, path)


def decode(blob: bytes) -> dict[str, Any]:
    import safetensors.torch

    return safetensors.torch.load(blob)
