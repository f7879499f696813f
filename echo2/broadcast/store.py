"""The snapshots one relay node holds: each a buffer that fills while it is served, kept by (version, base).

    Fetcher ──arrived(n, span)──► Snapshot.buf [■■■■□□□□|■■■□□□□□]  ─► check_chunks(): sha256 of each whole chunk
                                               span 0     span 1          against the signed manifest (bad: re-fetch)
    RelayServer ◄──wait_filled(pos)────────────┘  serves children from the same buffer as bytes land (cut-through)

    Store: the newest ``keep`` versions (full snapshots and deltas), older ones collected unless pinned (a
           collected one is served on to the children already reading it, for at most MAX_RETAINED versions)

A complete snapshot (the learner's) is served from the caller's bytes; an arriving one lands in a memory file
(snapshot.MemoryFile) that the worker's engine maps to apply it: no copy in between. An arriving snapshot fills
one span per stripe (topology.py): each span from its low end up, all at once, from different parents; a byte is
served once it is filled, and a chunk is checked once all its bytes are, whichever spans they lie in.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time

from echo2.broadcast.manifest import FULL
from echo2.broadcast.snapshot import MemoryFile


class Snapshot:
    """A snapshot buffer that fills while it is served. ``spans``: [lo, hi, filled] per stripe, each filled from lo
    up to ``filled`` (one span, [0, size), unless fetched in stripes); ``received``: bytes filled in all; ``bad``:
    chunks that failed their digest."""

    def __init__(self, manifest: dict, blob: bytes | None = None, bounds: list[tuple[int, int]] | None = None):
        self.manifest, self.version, self.size = manifest, manifest["version"], manifest["size"]
        self.key = (self.version, manifest["base"])  # the full snapshot v, or the delta of v against a base
        self.chunk_bytes = manifest["chunk_bytes"]
        # A complete snapshot is served from the caller's bytes (no copy); an arriving one gets a memory file, zero
        # pages the kernel provides as bytes land: a bytearray would be zeroed up front (measured: ~0.3 s per relay
        # hop for 200 MB, added to every hop's first byte, since children wait for the parent's buffer). A worker's
        # vLLM engine maps the same file to apply it (snapshot.MemoryFile): no copy of the snapshot in between.
        self.buf = blob if blob is not None else (MemoryFile(self.size) if self.size else bytearray())
        bounds = bounds or [(0, self.size)]
        if bounds[0][0] != 0 or bounds[-1][1] != self.size or any(
                lo > hi or hi != nxt for (lo, hi), (nxt, _) in zip(bounds, bounds[1:] + [(self.size, 0)])):
            raise ValueError(f"stripes {bounds} do not tile [0, {self.size})")
        self.spans = [[lo, hi, hi if blob is not None else lo] for lo, hi in bounds]
        self.received = self.size if blob is not None else 0
        n_chunks = len(manifest["chunks"])
        self.checked = n_chunks if blob is not None else 0  # chunks digested so far
        # chunks not yet digested: per span, the next chunk lying wholly inside it; ``straddling``, those across a
        # span boundary (checked once both spans have them)
        self._next = [-(-lo // self.chunk_bytes) if self.chunk_bytes else 0 for lo, _ in bounds]
        self._straddling = set() if blob is not None else {
            lo // self.chunk_bytes for lo, _ in bounds[1:] if lo % self.chunk_bytes and lo < self.size}
        if blob is not None:
            self._next = [n_chunks] * len(bounds)
        self.bad: set[int] = set()
        self.complete = blob is not None
        self.failed = False
        # the store let it go for good (Store: collected and no longer read, or past MAX_RETAINED): no byte more is
        # served; ``readers``: a callable per child being served it, that ends the child's connection
        self.collected = False
        self.readers: set = set()
        self.first_byte_at: float | None = None  # time.monotonic() of the first byte received (diagnostics)
        self.cond = threading.Condition()

    def arrived(self, n: int, span: int = 0) -> None:
        """``n`` more bytes landed at the top of span ``span``."""
        with self.cond:
            if self.first_byte_at is None:
                self.first_byte_at = time.monotonic()
            self.spans[span][2] += n
            self.received += n
            self.cond.notify_all()

    def fill(self) -> None:
        """Every byte is in (written by the caller: a snapshot rebuilt from a delta)."""
        with self.cond:
            for sp in self.spans:
                sp[2] = sp[1]
            self.received = self.size
            self.cond.notify_all()

    def filled_to(self, pos: int) -> int:
        """The end of the run of filled bytes from ``pos`` (``pos`` itself if that byte is not in yet)."""
        end = pos
        for lo, hi, filled in self.spans:
            if hi <= end:
                continue
            if lo > end or filled <= end:
                break
            end = filled
            if filled < hi:
                break
        return end

    def wait_filled(self, pos: int, timeout_s: float) -> int:
        """``filled_to(pos)`` once it is past ``pos`` (or the timeout passes, the fetch failed, or the store let the
        snapshot go)."""
        with self.cond:
            self.cond.wait_for(lambda: self.filled_to(pos) > pos or self.failed or self.collected, timeout=timeout_s)
            return self.filled_to(pos)

    def check_chunks(self) -> list[int]:
        """Digest every newly filled whole chunk; returns those that failed (also added to ``bad``). Safe from
        several fetching threads at once (one per stripe): each chunk is claimed by one, and hashed outside the
        lock."""
        cb, n_chunks, todo = self.chunk_bytes, len(self.manifest["chunks"]), []
        with self.cond:
            for j, (lo, hi, filled) in enumerate(self.spans):
                while self._next[j] < n_chunks:
                    i = self._next[j]
                    end = min((i + 1) * cb, self.size)
                    if i * cb >= hi or end > hi or end > filled:
                        break  # a later span's, straddling into the next span (checked below), or not all in yet
                    todo.append(i)
                    self._next[j] += 1
            for i in [i for i in self._straddling if self.filled_to(i * cb) >= min((i + 1) * cb, self.size)]:
                self._straddling.discard(i)
                todo.append(i)
        failed = [i for i in todo if not self.chunk_ok(i)]
        with self.cond:
            self.checked += len(todo)
            self.bad.update(failed)
        return failed

    def chunk_ok(self, i: int) -> bool:
        lo = i * self.chunk_bytes
        return hashlib.sha256(memoryview(self.buf)[lo:lo + self.chunk_bytes]).hexdigest() == self.manifest["chunks"][i]


MAX_RETAINED = 2
"""Versions a node keeps past collection while a child is still being served them, beyond which the oldest one's
readers are dropped. A late child (slow link, a full snapshot) finishes the version it started, as an honest one
on a thin link must; a reader just fast enough never to stall cannot keep more than this many whole snapshots in
memory, whatever it opens (before, each connection could keep one)."""


class Store:
    """The snapshots a node holds, by (version, base): the newest ``keep`` versions' objects (full or delta);
    older ones are collected unless pinned: no longer handed out, and freed once their last reader is done (at most
    ``MAX_RETAINED`` versions are kept for readers; past that the oldest one's readers are dropped)."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.snaps: dict[tuple[int, int], Snapshot] = {}
        self.retained: dict[tuple[int, int], Snapshot] = {}  # collected, still being served (MAX_RETAINED)
        self.pinned: set[int] = set()  # versions still being broadcast: never collected
        self.expected: set[tuple[int, int]] = set()  # (version, base) this node started fetching
        self.abandoned: set[tuple[int, int]] = set()  # (version, base) this node's fetch of failed: not coming
        # snapshots let go under the lock, freed by the method that let them go once it has released it (_holding): a
        # whole snapshot's memory (unmapping it, closing its memory file) is not done while every other caller waits
        self._freed: list[Snapshot] = []
        self.cond = threading.Condition()

    def put(self, snap: Snapshot) -> Snapshot:
        with self._holding():
            replaced = self.snaps.get(snap.key)
            self.snaps[snap.key] = snap
            if replaced is not None and replaced is not snap:  # a full snapshot rebuilt from a delta, say
                self._let_go(replaced)
            self.abandoned.discard(snap.key)
            self._collect()
            self.cond.notify_all()
        return snap

    def clear(self) -> None:
        """Forget every snapshot (a worker re-joining a learner that may have resumed from a checkpoint: what it
        holds may be the dead run's versions, which must be neither served nor kept over the resumed ones)."""
        with self._holding():
            for snap in [*self.snaps.values(), *self.retained.values()]:
                self._free(snap)
            self.snaps.clear()
            self.retained.clear()
            self.expected.clear()
            self.abandoned.clear()
            self.cond.notify_all()

    def reading(self, snap: Snapshot, stop) -> bool:
        """A child starts reading ``snap``: ``stop()`` ends its connection if the version must go. False if it
        already has (the child is answered no further)."""
        with self.cond, snap.cond:
            if snap.collected:
                return False
            snap.readers.add(stop)
            return True

    def done_reading(self, snap: Snapshot, stop) -> None:
        """The child's answer ended: a collected version with no reader left is freed."""
        with self._holding():
            with snap.cond:
                snap.readers.discard(stop)
                idle = not snap.readers
            if idle and self.retained.get(snap.key) is snap:
                self._free(self.retained.pop(snap.key))

    def expect(self, version: int, base: int = FULL) -> None:
        """This node starts fetching (version, base): a child asking for it here may wait for its first bytes."""
        with self.cond:
            self.expected.add((version, base))
            self.abandoned.discard((version, base))
            self.cond.notify_all()

    def expects(self, version: int, base: int = FULL) -> bool:
        with self.cond:
            return (version, base) in self.snaps or (version, base) in self.expected

    def abandon(self, version: int, base: int = FULL) -> None:
        """This node's fetch of (version, base) failed: a child waiting for it here is told at once that it will not
        come (and turns to its next source)."""
        with self.cond:
            self.abandoned.add((version, base))
            self.cond.notify_all()

    def pin(self, version: int, pinned: bool = True) -> None:
        with self._holding():
            (self.pinned.add if pinned else self.pinned.discard)(version)
            self._collect()

    def _collect(self) -> None:
        keep = set(sorted({v for v, _ in self.snaps})[-self.keep:]) | self.pinned
        for key in [k for k in self.snaps if k[0] not in keep]:
            self._let_go(self.snaps.pop(key))
        oldest = min((v for v, _ in self.snaps), default=None)  # marks of older versions are collected too
        self.expected = {k for k in self.expected if oldest is None or k[0] >= oldest}
        self.abandoned = {k for k in self.abandoned if oldest is None or k[0] >= oldest}

    def _let_go(self, snap: Snapshot) -> None:
        """``snap`` is no longer handed out: freed now, or kept for the children reading it (MAX_RETAINED). Holds
        the lock."""
        with snap.cond:
            read = bool(snap.readers)
        if not read:
            self._free(snap)
            return
        kept = self.retained.get(snap.key)
        if kept is not None and kept is not snap:  # an older object under the same key: it must not escape the bound
            self._free(kept)
        self.retained[snap.key] = snap
        while len({v for v, _ in self.retained}) > MAX_RETAINED:
            oldest = min(v for v, _ in self.retained)
            for key in [k for k in self.retained if k[0] == oldest]:
                self._free(self.retained.pop(key))

    def _free(self, snap: Snapshot) -> None:
        """``snap`` is gone (``_drop``); its memory is freed once the lock is released (``_holding``)."""
        _drop(snap)
        self._freed.append(snap)

    @contextlib.contextmanager
    def _holding(self):
        """The lock, for a method that may let snapshots go: their last references are dropped after it is
        released."""
        with self.cond:
            yield
            freed, self._freed = self._freed, []
        del freed

    def get(self, version: int, wait_s: float = 0.0, base: int = FULL) -> Snapshot | None:
        """The buffer of ``version``, waiting up to ``wait_s`` for its manifest to arrive here (only for one that
        may still come: ``may_arrive``)."""
        with self.cond:
            key = (version, base)
            self.cond.wait_for(lambda: key in self.snaps or not self._may_arrive(version, base), timeout=wait_s)
            return self.snaps.get(key)

    def may_arrive(self, version: int, base: int = FULL) -> bool:
        """Whether (version, base) may still come here: not older than the newest held (those were collected), and
        not abandoned."""
        with self.cond:
            return self._may_arrive(version, base)

    def _may_arrive(self, version: int, base: int = FULL) -> bool:
        return (version, base) not in self.abandoned and (not self.snaps or version >= max(self.snaps)[0])

    def versions(self) -> set[int]:
        """The versions held here or being fetched."""
        with self.cond:
            return {v for v, _ in self.snaps} | {v for v, _ in self.expected}

    def serving(self) -> set[int]:
        """``versions()`` and the collected ones still served to the children reading them (MAX_RETAINED): a
        ticket for one of these still earns its connection's slot (relay_slots.py), so that a late child is not
        evicted from the version it is finishing."""
        with self.cond:
            return self.versions() | {v for v, _ in self.retained}

    def newest_complete(self) -> Snapshot | None:
        with self.cond:
            done = [s for s in self.snaps.values() if s.complete and s.key[1] == FULL]
            return max(done, key=lambda s: s.version) if done else None


def _drop(snap: Snapshot) -> None:
    """``snap`` is gone: its waiters wake, and each child still reading it is cut off at once (one blocked sending to
    a slow child too, not after its piece), so that nothing keeps its buffer."""
    with snap.cond:
        snap.collected = True
        for stop in snap.readers:  # under the lock: a reader discards its stop under it before closing its socket
            stop()
        snap.cond.notify_all()
