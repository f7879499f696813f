"""What the learner signs: a snapshot's manifest, and the MAC on every relay request (HMAC-SHA256, the run's token).

    make_manifest(token, v, bytes) ──► {version, base, size, chunk_bytes, chunks: [sha256 …], root, probe, mac}
                                                                    │
    verify_manifest(token, m) ◄── every node, before it stores, forwards or applies a byte of version v

``root`` is the sha256 over the chunk digests (the whole-snapshot digest); ``base`` is FULL for a whole snapshot,
else the version a sparse delta (delta.py) applies to; ``probe`` holds the learner's logprobs of fixed tokens under
this version, which a worker compares with its engine's after applying it. Each chunk is checked against its digest
as it lands (store.py); a request for bytes carries ``request_mac`` so that only token holders pull weights.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

CHUNK_BYTES = 4 << 20
FULL = -1  # the ``base`` of a whole snapshot (a delta's base is the version it applies to)


class BadSnapshot(Exception):
    """A manifest or chunk that fails authentication; never applied."""


def _mac(token: str, payload: dict[str, Any]) -> str:
    msg = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def make_manifest(token: str, version: int, blob: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES,
                  base: int = FULL, probe: dict | None = None) -> dict:
    """``base``: FULL for a whole snapshot, else the version a sparse delta (delta.py) is taken against.
    ``probe``: the learner's logprobs of fixed tokens under this version (``{"token_ids", "logprobs", "dtype"}``),
    signed with the rest, which a worker compares with its engine's after applying the snapshot."""
    mv = memoryview(blob)
    # Chunks are digested in parallel (hashlib releases the GIL on big buffers): one core did 500 MB in 0.64 s,
    # all of it before the first byte could leave the learner.
    spans = [mv[i:i + chunk_bytes] for i in range(0, len(mv), chunk_bytes)]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, max(1, len(spans)))) as pool:
        chunks = list(pool.map(lambda span: hashlib.sha256(span).hexdigest(), spans))
    root = hashlib.sha256("".join(chunks).encode()).hexdigest()
    body = {"version": version, "base": base, "size": len(mv), "chunk_bytes": chunk_bytes, "chunks": chunks,
            "root": root, "probe": probe}
    return {**body, "mac": _mac(token, body)}


def verify_manifest(token: str, manifest: Any) -> dict:
    if not isinstance(manifest, dict):
        raise BadSnapshot("manifest is not an object")
    body = {k: manifest.get(k) for k in ("version", "base", "size", "chunk_bytes", "chunks", "root", "probe")}
    if not hmac.compare_digest(_mac(token, body), str(manifest.get("mac", ""))):
        raise BadSnapshot(f"manifest of v{body['version']}: signature does not match")
    size, cb, chunks = body["size"], body["chunk_bytes"], body["chunks"]
    ints = (body["version"], body["base"], size, cb)
    if not all(type(x) is int for x in ints) or size < 0 or cb <= 0 or len(chunks) != -(-size // cb):
        raise BadSnapshot("manifest sizes are inconsistent")
    if hashlib.sha256("".join(chunks).encode()).hexdigest() != body["root"]:
        raise BadSnapshot("manifest root does not match its chunk digests")
    return manifest


def request_mac(token: str, version: int, base: int, start: int, end: int) -> str:
    """The MAC a fetcher puts on its request for bytes [start, end) of (version, base); the server checks it."""
    return _mac(token, {"version": version, "base": base, "start": start, "end": end})
