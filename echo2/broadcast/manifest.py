"""What the learner signs, and the MACs of the relay: a snapshot's manifest and every order to a worker (Ed25519, a
key only the learner holds); each request for bytes and each answer to one (HMAC-SHA256, the relay key).

    make_manifest(signer, v, bytes) ──► {version, base, size, chunk_bytes, chunks: [sha256 …], root, probe, epoch, sig}
                                                                    │
    verify_manifest(key, m) ◄── every node, before it stores, forwards or applies a byte of version v

``root`` is the sha256 over the chunk digests (the whole-snapshot digest); ``base`` is FULL for a whole snapshot,
else the version a sparse delta (delta.py) applies to; ``probe`` holds the learner's logprobs of fixed tokens under
this version, which a worker compares with its engine's after applying it; ``epoch`` names the learner process
that published it (a resumed learner is a new epoch, whose versions are not the dead one's). Each chunk is checked
against its digest as it lands (store.py).

Two keys, two jobs. Only the learner holds the signing key (derived from the run secret, which no worker has);
workers get its public half when they join. It signs manifests, so a worker that relays can withhold or corrupt
bytes (its successors then fail a digest and turn to the next source) but cannot forge a manifest, nor the probe
in it: the weights a worker applies are the learner's or nothing. It also signs every order a worker obeys
(``order_credential``: fetch this version from these sources; here is the relay key), bound to that worker and
newer than the last order it took, so that no worker, live or revoked, can send another one to fetch anything.

The relay key (``new_relay_key``) is random, made by the learner's broadcaster, handed to live workers inside
its orders and replaced when a worker credential is revoked: a request for bytes carries ``request_mac`` under
it, and the answer ``serve_proof``, so a revoked worker can neither pull from a peer nor pass for a source. A
worker answering an order proves it holds the snapshot (``possession_proof`` over a slice the learner picks at
random), so it cannot claim one it never fetched to look fast. Each order also carries tickets
(``relay_ticket``), one per source: the learner's signature that this worker may fetch this version from that
source, which the source checks before it gives the worker a connection slot that lasts (broadcast/relay_slots.py).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

CHUNK_BYTES = 4 << 20
FULL = -1  # the ``base`` of a whole snapshot (a delta's base is the version it applies to)
MAX_SOURCES = 16
"""Sources one order may name: the broadcaster names a few ancestors, two holders and the origin."""


class BadSnapshot(Exception):
    """A manifest or chunk that fails authentication; never applied."""


FIELDS = ("version", "base", "size", "chunk_bytes", "chunks", "root", "probe", "epoch")


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
                  base: int = FULL, probe: dict | None = None, epoch: str | None = None) -> dict:
    """``base``: FULL for a whole snapshot, else the version a sparse delta (delta.py) is taken against.
    ``probe``: the learner's logprobs of fixed tokens under this version (``{"token_ids", "logprobs", "dtype"}``),
    signed with the rest, which a worker compares with its engine's after applying the snapshot. ``epoch``: the
    learner process publishing it (None outside a run: the lab, tests)."""
    mv = memoryview(blob)
    # Chunks are digested in parallel (hashlib releases the GIL on big buffers): one core did 500 MB in 0.64 s,
    # all of it before the first byte could leave the learner.
    spans = [mv[i:i + chunk_bytes] for i in range(0, len(mv), chunk_bytes)]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, max(1, len(spans)))) as pool:
        chunks = list(pool.map(lambda span: hashlib.sha256(span).hexdigest(), spans))
    root = hashlib.sha256("".join(chunks).encode()).hexdigest()
    body = {"version": version, "base": base, "size": len(mv), "chunk_bytes": chunk_bytes, "chunks": chunks,
            "root": root, "probe": probe, "epoch": epoch}
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


# ---------------------------------------------------------------------- the relay key


def new_relay_key() -> str:
    """A fresh relay key: made by the broadcaster when it starts and after each revocation, never derived from
    anything a worker holds or held."""
    return secrets.token_hex(32)


def key_id(token: str) -> str:
    """A public name of a relay key (put on requests, so that a node can tell a key it has yet to receive from one
    it has replaced)."""
    return hashlib.sha256(b"echo2-relay-key-id:" + token.encode()).hexdigest()[:16]


def request_mac(token: str, version: int, base: int, start: int, end: int) -> str:
    """The MAC a fetcher puts on its request for bytes [start, end) of (version, base); the server checks it."""
    return _mac(token, {"version": version, "base": base, "start": start, "end": end})


def serve_proof(token: str, mac: str) -> str:
    """What a source answers a request (whose MAC is ``mac``) with: that it holds the relay key too, so a revoked
    worker, or any process at an address a plan once named, is not taken for a source."""
    return _mac(token, {"serves": mac})


POSSESSION_SPAN_BYTES = 64 << 10
"""Bytes of the snapshot a worker hashes to prove it holds it: a slice at an offset the learner picks at random
per order, so that only a node holding (nearly) all of it can answer at once; small, since the learner checks
every worker's answer in the coordinator's process."""


def possession_proof(challenge: str, blob: bytes | memoryview) -> str:
    """sha256 of ``challenge`` and the POSSESSION_SPAN_BYTES of ``blob`` at the offset the challenge selects."""
    mv = memoryview(blob)
    start = int(challenge, 16) % max(1, len(mv) - POSSESSION_SPAN_BYTES + 1)
    return hashlib.sha256(challenge.encode() + mv[start:start + POSSESSION_SPAN_BYTES]).hexdigest()


# ---------------------------------------------------------------------- relay tickets


def source_tag(source: tuple[str, int]) -> str:
    """How a ticket names the relay source it is for: that source's ``host:port`` as the learner's orders name it,
    hashed (32 hex digits, so that no host name or IPv6 address can break a ticket's dotted form)."""
    host, port = source
    return hashlib.sha256(f"{host}:{int(port)}".encode()).hexdigest()[:32]


def relay_ticket(signer: Ed25519PrivateKey, holder: str, version: int, base: int, lanes: int,
                 source: tuple[str, int]) -> str:
    """The learner's word, in an order, that ``holder`` may fetch ``version`` (``base``) over ``lanes`` connections
    from ``source``: shown with each request for its bytes there, it earns a lasting connection slot
    (broadcast/relay_slots.py). One per source, so a source cannot show what it was shown to another source and
    take the holder's slots there. ``holder.version.base.lanes.source_tag.signature``."""
    tag = source_tag(source)
    body = {"ticket": holder, "version": version, "base": base, "lanes": lanes, "source": tag}
    return f"{holder}.{version}.{base}.{lanes}.{tag}.{signer.sign(_canonical(body)).hex()}"


def relay_tickets(signer: Ed25519PrivateKey, holder: str, version: int, base: int, lanes: int,
                  sources: Iterable[tuple[str, int]]) -> list[list]:
    """An order's tickets: ``[host, port, ticket]`` for each of its sources (``Fetcher.fetch(tickets=)``)."""
    return [[host, port, relay_ticket(signer, holder, version, base, lanes, (host, port))] for host, port in sources]


@functools.lru_cache(maxsize=4096)
def check_ticket(key: str | None, ticket: str) -> tuple[str, int, int, int, str]:
    """(holder, version, base, lanes, source_tag) of a ticket the learner (public key ``key``) signed; else
    BadSnapshot. Cached: a fetcher shows the same ticket with every request of its fetch."""
    try:
        holder, version, base, lanes, tag, sig = ticket.rsplit(".", 5)
        version, base, lanes = int(version), int(base), int(lanes)
        body = {"ticket": holder, "version": version, "base": base, "lanes": lanes, "source": tag}
        if not key:
            raise ValueError("no key")
        _public(key).verify(bytes.fromhex(sig), _canonical(body))
    except (InvalidSignature, ValueError, TypeError):
        raise BadSnapshot("not a ticket of this run's learner") from None
    return holder, version, base, lanes, tag


# ---------------------------------------------------------------------- the learner's orders


def manifest_digest(manifest: Any) -> str:
    """sha256 of a manifest's canonical JSON."""
    return hashlib.sha256(_canonical(manifest)).hexdigest()


def order_digest(body: dict[str, Any], full_manifest_digest: str | None = None) -> str:
    """The digest of an order's body (canonical JSON), which its credential signs. A delta order's full manifest
    (its chunk digests: a megabyte for a large model) counts by its own digest, which a learner ordering many
    workers with the same manifest computes once (``full_manifest_digest``)."""
    if "full_manifest" in body:
        body = {**body, "full_manifest": full_manifest_digest or manifest_digest(body["full_manifest"])}
    return hashlib.sha256(_canonical(body)).hexdigest()


def order_credential(signer: Ed25519PrivateKey, to: str, seq: int, body: dict[str, Any],
                     full_manifest_digest: str | None = None) -> str:
    """The learner's credential on order ``body`` to the worker whose control URL is ``to``: ``Authorization:
    Bearer order.<seq>.<digest>.<sig>``. It is checked before the body is read (``check_order``), and the body
    then against the digest. ``seq`` orders the learner's orders (a worker takes none older than its last)."""
    digest = order_digest(body, full_manifest_digest)
    sig = signer.sign(_canonical({"to": to, "seq": seq, "digest": digest})).hex()
    return f"order.{seq}.{digest}.{sig}"


def check_order(key: str | None, to: str, credential: str) -> tuple[int, str]:
    """(seq, body digest) of an order credential the learner (public key ``key``) signed for the worker at ``to``;
    else BadSnapshot."""
    kind, _, rest = credential.partition(".")
    seq, _, rest = rest.partition(".")
    digest, _, sig = rest.partition(".")
    if kind != "order" or not seq.isdigit() or len(digest) != 64 or not key:
        raise BadSnapshot("not an order of this run's learner")
    try:
        _public(key).verify(bytes.fromhex(sig), _canonical({"to": to, "seq": int(seq), "digest": digest}))
    except (InvalidSignature, ValueError, TypeError):
        raise BadSnapshot("not an order of this run's learner, or not for this worker") from None
    return int(seq), digest
