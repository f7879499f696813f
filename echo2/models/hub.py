"""Hub models: the name is passed through to `from_pretrained`, which downloads (or reads the HF cache)."""

from __future__ import annotations


def from_hub(name_or_path: str) -> str:
    """Return the hub id or local path as is; TRL's trainer and the engines load it."""
    return name_or_path
