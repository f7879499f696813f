"""Snapshot bytes and their authentication.

A snapshot is the policy's state dict as safetensors bytes (no code runs on load, unlike pickle). The
learner signs ``version || sha256(bytes)`` with HMAC-SHA256 under the run's token; a worker applies a
snapshot only if the signature checks and the version is newer than what it serves.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

VERSION_HEADER = "X-Echo2-Version"
DIGEST_HEADER = "X-Echo2-Digest"


def encode(state_dict: dict[str, Any]) -> bytes:
    import safetensors.torch

    return safetensors.torch.save({k: v.detach().cpu().contiguous() for k, v in state_dict.items()})


def decode(blob: bytes) -> dict[str, Any]:
    import safetensors.torch

    return safetensors.torch.load(blob)


def sign(token: str, version: int, blob: bytes) -> str:
    msg = f"{version}:".encode() + hashlib.sha256(blob).digest()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def verify(token: str, version: int, blob: bytes, digest: str) -> bool:
    return hmac.compare_digest(sign(token, version, blob), digest)
