"""Which of a peer's claims that its sources failed it the learner believes (the broadcaster plans a blamed relay
last for a while: coordinator/broadcaster.py). Pure: the check of a claim is handed a function that reads bytes
from the blamed relay.

A peer's answer to an order lists the sources that failed it, each with what it says happened
(broadcast/suspects.py): ``[host, port, {why, chunk | at}]``. A peer could name every source its order gave it, and
push honest peers to the back of every plan; so a claim counts only if

* the source was one its order named, and the claim is well formed; and
* the learner, asking that source itself, finds it bears the claim out: for ``bad_chunk`` the source's bytes of
  that chunk differ from the learner's own (or it will not serve them); for ``silent``, ``failed``, ``bad_answer`` it
  cannot serve one byte of the version now. ``slow`` is not checked here (a probe of a few bytes says nothing of a
  rate): the accuser's own fetcher leaves that source for its next, and the learner's plan follows measured rates.

A relay that serves the learner correctly and its children badly is not blamed here; a child it serves bad chunks
in two fetches tries it last by itself (suspects.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from echo2.broadcast.manifest import BadSnapshot

CHECKED = ("bad_chunk", "silent", "failed", "bad_answer")
MAX_CLAIMS = 16  # per answer: an order names at most MAX_SOURCES sources


@dataclass(frozen=True)
class Claim:
    source: tuple[str, int]
    why: str
    chunk: int = -1


def claims(failed: object, named: set[tuple[str, int]]) -> list[Claim]:
    """The checkable claims of a peer's ``failed_sources`` about sources its order ``named``; malformed entries,
    unnamed sources and unchecked reasons are dropped."""
    if not isinstance(failed, list):
        return []
    out: list[Claim] = []
    for entry in failed[:MAX_CLAIMS]:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and type(entry[1]) is int
                and isinstance(entry[2], dict)):
            continue
        source, evidence = (entry[0], entry[1]), entry[2]
        why, chunk = evidence.get("why"), evidence.get("chunk", -1)
        if source not in named or why not in CHECKED or (why == "bad_chunk" and not (type(chunk) is int
                                                                                     and chunk >= 0)):
            continue
        claim = Claim(source, why, chunk if why == "bad_chunk" else -1)
        if claim not in out:
            out.append(claim)
    return out


def probe_range(claim: Claim, size: int, chunk_bytes: int) -> tuple[int, int] | None:
    """The bytes of the object (the version the order was for) the learner reads from the blamed source to check
    ``claim``; None if the claim names a chunk the object does not have."""
    if claim.why == "bad_chunk":
        lo = claim.chunk * chunk_bytes
        return (lo, min(lo + chunk_bytes, size)) if lo < size else None
    return (0, min(1, size))


def borne_out(claim: Claim, read: Callable[[int, int], bytes], own: bytes | memoryview, chunk_bytes: int) -> bool:
    """Whether the blamed source, read through ``read(start, end)``, bears ``claim`` out against the learner's own
    copy ``own`` of the object."""
    span = probe_range(claim, len(own), chunk_bytes)
    if span is None:
        return False
    try:
        got = read(*span)
    except (OSError, ConnectionError, BadSnapshot):
        return True  # it cannot serve it now either
    return got != bytes(memoryview(own)[span[0]:span[1]])
