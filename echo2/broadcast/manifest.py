"""What the learner signs: a snapshot's manifest (Ed25519, a key only the learner holds), and the MAC on every relay
request (HMAC-SHA256, the broadcast plane's shared key).

    make_manifest(signer, v, bytes) ──► {version, base, size, chunk_bytes, chunks: [sha256 …], root, probe, sig}
                                                                    │
    verify_manifest(key, m) ◄── every node, before it stores, forwards or applies a byte of version v

``root`` is the sha256 over the chunk digests (the whole-snapshot digest); ``base`` is FULL for a whole snapshot,
else the version a sparse delta (delta.py) applies to; ``probe`` holds the learner's logprobs of fixed tokens under
this version, which a worker compares with its engine's after applying it. Each chunk is checked against its digest
as it lands (store.py); a request for bytes carries ``request_mac`` so that only token holders pull weights.

Two keys, two jobs. Every worker holds the broadcast plane's shared key (transport.relay_key): it lets a node ask a
peer for bytes and serve them. Only the learner holds the signing key (derived from the run secret, which no
worker has); workers get its public half when they join. So a worker that relays can withhold or corrupt bytes
(its successors then fail a digest and turn to the next source) but cannot forge a manifest, nor the probe in it:
the weights a worker applies are the learner's or nothing.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

CHUNK_BYTES = 4 << 20
FULL = -1  # the ``base`` of a whole snapshot (a delta's base is the version it applies to)


class BadSnapshot(Exception):
    """A manifest or chunk that fails authentication; never applied."""


FIELDS = ("version", "base", "size", "chunk_bytes", "chunks", "root", "probe")


def signing_key(run_secret: str) -> Ed25519PrivateKey:
    """The learner's manifest-signing key, derived from the run secret (so every process of the run, restarted
    or resumed, signs with the same key, and nothing needs storing)."""
    return Ed25519PrivateKey.from_private_bytes(hmac.new(run_secret.encode(), b"echo2-manifest", hashlib.sha256).digest())


def verify_key(run_secret: str) -> str:
    """The public half of ``signing_key``, hex: what workers get when they join."""
    return signing_key(run_secret).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


@functools.lru_cache(maxsize=8)
def _public(key: str) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(bytes.fromhex(key))


def _canonical(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def _mac(token: str, payload: dict[str, Any]) -> str:
    return hmac.new(token.encode(), _canonical(payload), hashlib.sha256).hexdigest()


def make_manifest(signer: Ed25519PrivateKey, version: int, blob: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES,
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
    return {**body, "sig": signer.sign(_canonical(body)).hex()}


def verify_manifest(key: str | None, manifest: Any) -> dict:
    """``manifest`` if the learner whose public key is ``key`` (hex; ``verify_key``) signed it and its sizes and
    digests agree; else BadSnapshot."""
    if not isinstance(manifest, dict):
        raise BadSnapshot("manifest is not an object")
    if not key:
        raise BadSnapshot("no key to verify manifests with (a worker gets the learner's when it joins)")
    body = {k: manifest.get(k) for k in FIELDS}
    try:
        _public(key).verify(bytes.fromhex(str(manifest.get("sig", ""))), _canonical(body))
    except (InvalidSignature, ValueError, TypeError):
        raise BadSnapshot(f"manifest of v{body['version']}: not signed by this run's learner") from None
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
