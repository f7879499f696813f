"""A fetcher's memory of the sources that failed it (broadcast/relay.py's Fetcher): which it tries last, and what it
tells the learner about each, with evidence the learner can check (coordinator/blame.py).

    source failed a fetch ──► evidence {why: silent | failed | slow | bad_answer, at: byte} ──► the learner
          │                   and tried after the others for SUSPECT_S
    source served a chunk ──► evidence {why: bad_chunk, chunk: i} ──► the learner; tried last only if it did so
          that failed its digest                                     in an earlier fetch too

Why a bad chunk alone does not make a source a suspect here: relays forward bytes as they land (cut-through), before
a chunk is complete and checked, so an honest relay below a poisoning one forwards the poison once; its children
must not then route around it for two minutes (each would fetch from the origin instead: one-to-many in disguise).
The learner checks the claim (it asks the blamed relay for that chunk itself) and plans the poisoner last; a
source that serves bad bytes again in a later fetch is a suspect here too.
"""

from __future__ import annotations

import threading
import time

Source = tuple[str, int]

SUSPECT_S = 120.0
"""How long a source that failed a fetch (dead, silent, refusing, too slow, or serving bad bytes twice) is tried after
the others, the origin included: a relay that accepts connections and never answers otherwise cost its successor the
answer timeout on every version, and every round waited for that successor."""


class Suspects:
    def __init__(self):
        self.lock = threading.Lock()  # every lane of a fetch reports here
        self.until: dict[Source, float] = {}  # source -> until when it is tried after the others
        self.poisoned: dict[Source, tuple[int, float]] = {}  # source -> (fetch, when) it last served a bad chunk
        self.last_failed: list[Source] = []  # the sources that failed the last fetch, in order
        self.evidence: dict[Source, dict] = {}  # what each of them did

    def new_fetch(self) -> None:
        with self.lock:
            self.last_failed, self.evidence = [], {}

    def failed(self, src: Source, evidence: dict, suspect: bool = True) -> None:
        """``src`` failed this fetch (``evidence``: what it did, told to the learner); unless ``suspect`` is False,
        it is tried after the others for SUSPECT_S."""
        with self.lock:
            if suspect:
                self.until[src] = time.monotonic() + SUSPECT_S
            if src not in self.last_failed:
                self.last_failed.append(src)
                self.evidence[src] = evidence

    def bad_chunk(self, src: Source, chunk: int, fetch: int) -> None:
        """``src`` served all of chunk ``chunk`` in fetch number ``fetch``, and it failed its digest."""
        now = time.monotonic()
        with self.lock:
            before = self.poisoned.get(src)
            self.poisoned = {s: (f, t) for s, (f, t) in self.poisoned.items() if now - t < SUSPECT_S}
            self.poisoned[src] = (fetch, now)
        again = before is not None and before[0] != fetch and now - before[1] < SUSPECT_S
        self.failed(src, {"why": "bad_chunk", "chunk": chunk}, suspect=again)

    def ranked(self, sources: list[Source]) -> list[Source]:
        """``sources`` with those that failed a fetch within SUSPECT_S moved after the others, otherwise in the order
        given (the last one given, the origin, still gets no deadline wherever it lands)."""
        now = time.monotonic()
        with self.lock:
            self.until = {src: t for src, t in self.until.items() if t > now}
            suspect = set(self.until)
        return [s for s in sources if s not in suspect] + [s for s in sources if s in suspect]
