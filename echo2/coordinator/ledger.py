"""The rollout books, the data position, and their journal: what survives a coordinator or learner restart.

Every prompt group the coordinator hands out has one life, and the ledger records each transition:

    draw ──► in flight ──► received ──► buffered ──► consumed            (a learner step trained on it)
                 │             │            └──────► dropped[reason]     (stale, discarded_by_resume, ...)
                 │             └───────────────────► dropped[reason]     (invalid, future_version)
                 └─────────────────────────────────► lost[reason]        (worker_dead, coordinator_restart, ...)

so that, in rollouts (G per group), ``dispatched = consumed + Σ dropped + Σ lost + in flight + buffered``
always. The data position is the row stream (a seeded shuffle per epoch of the training set's indices) plus
the queue of rows handed back for another try (a lost or invalid group's prompt is generated again).

**The journal** (``<run dir>/rollouts.journal``): one JSON line per transition, appended under the
coordinator's lock and written to the OS *before* the transition is applied (a killed process loses nothing it
acted on; a crashed machine may lose the tail since the last checkpoint, where the journal is fsynced). A
write that fails (ENOSPC, EIO) is cut back to the last whole line and its line kept in memory with every later
one, in order, until the file takes them: the books in memory stay exact and always add up, the file stays a
prefix of them, and a checkpoint (``sync``) that cannot write them all fails loudly instead of recording an
offset the journal does not reach. Replaying it rebuilds the exact books, the data position and the open
groups. Each checkpoint ends with a ``state`` line (the whole books), fsynced, and recovery replays from the state
line that applies, never from byte 0: what follows the last fsynced state line is checked line by line, and a
damaged line there (a zero page after a machine crash) is skipped and counted (journal.py). Two uses:

* **coordinator restart** (its process died): replay; the groups still open were in the dead process's memory,
  so in-flight ones are lost and buffered ones dropped, with reason ``coordinator_restart``; their prompts
  go back to the queue.
* **learner resume** from the checkpoint at step k, which records the journal's length at that moment: the
  data position goes back to step k's (rows drawn after it are drawn again; groups open at k have their
  prompts re-queued), while the books keep everything the dead run did after k: its consumed rollouts
  trained steps that were thrown away (dropped, ``discarded_by_resume``), its open groups at death are
  lost / dropped with reason ``learner_restart``. The journal must reach that length, at a line's end (else a
  clear error: it is another run's, or was cut); a torn last line (the process died mid-write) is cut off.

Either way a ``state`` line records the recovered state, so replaying the whole journal again gives it back.
At a checkpoint the learner names the oldest checkpoint it still keeps, and once what precedes that one's state
line is long (``compact_bytes``) the journal is rewritten without it (``compact``), offsets unchanged.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import shutil
from collections import Counter, deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from echo2.coordinator import journal as jr

log = logging.getLogger(__name__)

IN_FLIGHT, BUFFERED = "in_flight", "buffered"


class Event(str, Enum):
    """A transition, as the first field of a journal line; the value is what is written (one letter, as in
    journals written before these names existed). The rest of the line: the arguments noted here."""

    DRAW = "d"  # group id, row index, 1 if the row came from the re-queue
    RECEIVED = "r"  # group id, worker id: its results came back, were scored and buffered
    CONSUMED = "c"  # [group ids]: a learner step trained on them
    DROPPED = "x"  # group id, reason, 1 to re-queue its row
    LOST = "l"  # group id, reason, 1 to re-queue its row
    WORKER = "w"  # worker id: a worker id was issued
    RETIRED = "t"  # worker id, reason
    REFUSED = "f"  # reason[, n]: n results refused unread (one line per reason per push, not per result)
    DISTRUSTED = "u"  # [group ids], [rows], reason: consumed, then found untrusted by the learner's checks (not
    #                   trained on): dropped, rows re-queued
    STATE = "s"  # the whole state (after a recovery): replay restarts from it


class JournalError(OSError):
    """The journal cannot be written, so a checkpoint would record a position it does not reach."""


def index_stream(n_rows: int, seed: int, skip: int = 0):
    """Row indices in a fresh seeded shuffle each epoch, forever, without the first ``skip``."""
    rng = random.Random(seed)
    for _epoch in itertools.count():
        order = list(range(n_rows))
        rng.shuffle(order)
        for i in order:
            if skip:
                skip -= 1
                continue
            yield i


@dataclass
class Ledger:
    group_size: int
    n_rows: int
    seed: int = 0
    drawn: int = 0  # rows taken from the stream so far
    next_group: int = 0
    next_worker: int = 0
    requeue: deque = field(default_factory=deque)  # row indices to hand out again, before new ones
    open: dict = field(default_factory=dict)  # group id -> [row index, IN_FLIGHT | BUFFERED]
    rollouts: Counter = field(default_factory=Counter)  # dispatched, received, consumed
    dropped: Counter = field(default_factory=Counter)  # reason -> rollouts
    lost: Counter = field(default_factory=Counter)  # reason -> rollouts
    by_worker: Counter = field(default_factory=Counter)  # worker id -> rollouts received from it
    retired: Counter = field(default_factory=Counter)  # reason -> workers removed (dead, left)
    refused: Counter = field(default_factory=Counter)  # reason -> results refused unread (replays, ...)
    journal: Any = None  # an open binary file (unbuffered), or None
    journal_path: str = ""  # its name
    valid_bytes: int | None = None  # set by replay: the journal's length up to its last whole line
    written_bytes: int = 0  # the journal's length: whole lines only (journal offsets, as every offset here)
    shift: int = 0  # file position minus journal offset: not 0 once the journal was rewritten (journal.py)
    compact_bytes: int | None = None  # rewrite at a checkpoint once this much precedes the oldest kept (None: never)
    pending: list = field(default_factory=list)  # lines applied but not yet written (the disk refused them)
    journal_errors: int = 0  # failed writes
    damaged_lines: int = 0  # lines skipped by a recovery: past the last fsynced state line, and not whole
    state_last: bool = False  # the last line written (or pending) is a state line: a checkpoint adds none

    def __post_init__(self):
        self._stream = index_stream(self.n_rows, self.seed, self.drawn)

    # ------------------------------------------------------------------ transitions (the caller holds its lock)
    # Each one is an event: checked, journaled, then applied here exactly as replay applies it (``_apply``).

    def draw(self) -> tuple[str, int]:
        """A new group: (group id, row index), the row from the re-queue first, else the stream."""
        requeued = bool(self.requeue)
        row = self.requeue[0] if requeued else next(self._stream)
        gid = f"g{self.next_group}"
        self._event(Event.DRAW, gid, row, int(requeued))
        return gid, row

    def received(self, gid: str, worker_id: str) -> None:
        self._event(Event.RECEIVED, gid, worker_id)

    def consumed(self, gids: list[str]) -> None:
        self._event(Event.CONSUMED, gids)

    def drop(self, gid: str, reason: str, requeue: bool) -> None:
        """A group that came back but will not be trained on (stale, invalid, ...)."""
        self._event(Event.DROPPED, gid, reason, int(requeue))

    def lose(self, gid: str, reason: str, requeue: bool = True) -> None:
        """A group that never came back (its worker died, the coordinator died, the run ended)."""
        self._event(Event.LOST, gid, reason, int(requeue))

    def retire(self, worker_id: str, reason: str) -> None:
        self._event(Event.RETIRED, worker_id, reason)

    def refuse(self, reason: str, n: int = 1) -> None:
        if n > 0:
            self._event(Event.REFUSED, reason, *([n] if n > 1 else []))

    def distrusted(self, gids: list[str], rows: list[int], reason: str) -> None:
        """Groups of a batch already taken (consumed) that the learner found untrusted and did not train on: dropped
        after all, their ``rows`` re-queued."""
        if gids:
            self._event(Event.DISTRUSTED, list(gids), list(rows), reason)

    def new_worker_id(self) -> str:
        wid = f"w{self.next_worker}"
        self._event(Event.WORKER, wid)
        return wid

    def _event(self, event: Event, *args: Any) -> None:
        self._check(event, args)  # a transition that cannot apply is refused before it is written
        self._write(event, *args)
        self._apply(event, list(args))

    def _check(self, event: Event, args: tuple) -> None:
        """Raise (writing and changing nothing) if ``event`` would not apply: the groups it moves must be open."""
        if event in (Event.RECEIVED, Event.DROPPED, Event.LOST):
            gids = [args[0]]
        elif event is Event.CONSUMED:
            gids = args[0]
        else:
            return
        missing = [g for g in gids if g not in self.open]
        if missing:
            raise KeyError(f"{event.name.lower()}: groups {missing[:5]} are not open")

    # ------------------------------------------------------------------ the books

    def accounting(self) -> dict[str, Any]:
        states = Counter(s for _, s in self.open.values())
        return {"dispatched": self.rollouts["dispatched"], "received": self.rollouts["received"],
                "consumed": self.rollouts["consumed"], "dropped": _nonzero(self.dropped), "lost": _nonzero(self.lost),
                "in_flight": states[IN_FLIGHT] * self.group_size, "buffered": states[BUFFERED] * self.group_size,
                "by_worker": dict(self.by_worker), "workers_retired": _nonzero(self.retired),
                "results_refused": _nonzero(self.refused)}

    # ------------------------------------------------------------------ journal

    def open_journal(self, path: str) -> int:
        """Append transitions to ``path`` from now on; returns its length (a resume point). A replayed ledger
        first cuts off a torn last line, so that what follows it is not glued to it."""
        self.shift = jr.first_and_shift(path)[1] if os.path.exists(path) else 0
        size = os.path.getsize(path) - self.shift if os.path.exists(path) else 0
        if self.valid_bytes is not None and size > self.valid_bytes:
            log.warning("journal %s: cutting off a torn last line (%d bytes) before appending", path,
                        size - self.valid_bytes)
            os.truncate(path, self.valid_bytes + self.shift)
            size = self.valid_bytes
        self.journal = open(path, "ab", buffering=0)  # noqa: SIM115 (closed by close())
        self.journal_path = path
        self.written_bytes = size
        return self.position()

    def position(self) -> int:
        """The journal's length in bytes: everything up to here is a state a checkpoint can return to (once
        ``pending`` is empty: ``sync`` first)."""
        return self.written_bytes if self.journal is not None else 0

    def sync(self, keep_from: int | None = None) -> int:
        """A checkpoint's point: a state line (the one a resume from here starts from, and a restart too while it is
        the last), everything pending written, fsynced. Raises JournalError if the disk refuses. ``keep_from``: the
        offset of the oldest checkpoint a resume may still use (None: every one): what precedes its state line may
        go (``compact``)."""
        if self.journal is None:
            return 0
        if not self.state_last:
            self.checkpoint()
        self._flush()
        if self.pending:
            raise JournalError(f"the rollout journal {self.journal_path!r} cannot be written ({len(self.pending)} "
                               "lines held in memory; a full disk?): a checkpoint now could not be resumed from")
        os.fsync(self.journal.fileno())
        if keep_from is not None and self.compact_bytes is not None:
            self.compact(keep_from, self.compact_bytes)
        return self.written_bytes

    def compact(self, keep_from: int, threshold_bytes: int) -> bool:
        """Rewrite the journal without what precedes the state line ending at offset ``keep_from`` (a kept
        checkpoint's), once that is at least ``threshold_bytes``: the rewrite goes to a new
        file, fsynced, then renamed over the journal, so a crash leaves the old journal or the new one, whole. Offsets
        do not change (the new file's base line). A disk that refuses the copy leaves the journal as it was (said);
        returns whether it was rewritten."""
        path = self.journal_path
        first, shift = jr.first_and_shift(path)
        line = jr.line_ending_at(path, keep_from) if first < keep_from <= self.written_bytes else b""
        if jr.state_of(line, self.group_size, strict=False) is None:
            log.warning("journal %s: not compacted: byte %d does not end a state line (not a checkpoint's)", path,
                        keep_from)
            return False
        cut = keep_from - len(line) - 1
        if cut <= first or cut - first < threshold_bytes:
            return False
        tmp, new = path + ".compacting", None
        try:
            with open(path, "rb") as src, open(tmp, "wb") as dst:
                dst.write(jr.base_line(cut))
                src.seek(cut + shift)
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
            new = open(tmp, "ab", buffering=0)  # noqa: SIM115 (the journal from the rename on; closed by close())
            os.replace(tmp, path)
        except OSError as e:
            log.error("journal %s: not compacted (%s); it goes on growing until a checkpoint can", path, e)
            if new is not None:
                new.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        # renamed: from here on the journal is the new file, whatever follows
        self.journal, old = new, self.journal
        self.shift = jr.BASE_LINE_BYTES - cut
        old.close()
        try:
            _fsync_directory(os.path.dirname(os.path.abspath(path)))
        except OSError as e:  # a crash before the directory reaches the disk may find the old journal: still whole
            log.warning("journal %s: the directory of the rewritten journal could not be fsynced (%s)", path, e)
        log.info("journal %s: compacted, %.1f MB before byte %d dropped (before the oldest kept checkpoint's state)",
                 path, (cut - first) / 1e6, cut)
        return True

    def close(self) -> None:
        if self.journal is not None:
            self._flush()
            if self.pending:
                log.error("journal %s: %d transitions could not be written (a full disk?); the books in "
                          "summary.json are complete, the journal is not", self.journal_path, len(self.pending))
            self.journal.close()
            self.journal = None

    def _write(self, event: Event, *args: Any) -> None:
        if self.journal is not None:
            self.state_last = event is Event.STATE
            self.pending.append(json.dumps([event.value, *args], separators=(",", ":")).encode() + b"\n")
            self._flush()

    def _flush(self) -> None:
        """Write the pending lines in order; on failure cut the file back to its last whole line and keep them."""
        while self.pending:
            line = self.pending[0]
            try:
                done = 0
                while done < len(line):
                    done += self.journal.write(line[done:])
            except OSError as e:
                self.journal_errors += 1
                if self.journal_errors == 1 or self.journal_errors % 1000 == 0:
                    log.error("journal %s: write failed (%s; %d failures); %d lines held in memory until it "
                              "succeeds", self.journal_path, e, self.journal_errors, len(self.pending))
                try:
                    os.ftruncate(self.journal.fileno(), self.written_bytes + self.shift)
                except OSError:
                    log.exception("journal %s: could not cut a partial line off", self.journal_path)
                return
            self.written_bytes += len(line)
            self.pending.pop(0)

    def checkpoint(self) -> None:
        """Write the whole state as one line (replay restarts from it)."""
        self._write(Event.STATE, self.state())

    def state(self) -> dict[str, Any]:
        return {"drawn": self.drawn, "next_group": self.next_group, "next_worker": self.next_worker,
                "requeue": list(self.requeue), "open": self.open, "rollouts": self.rollouts,
                "dropped": self.dropped, "lost": self.lost, "by_worker": self.by_worker, "retired": self.retired,
                "refused": self.refused}

    @classmethod
    def replay(cls, path: str, group_size: int, n_rows: int, seed: int, upto: int | None = None) -> "Ledger":
        """The ledger as the journal at ``path`` left it (up to offset ``upto`` only, if given)."""
        first = jr.first_and_shift(path)[0]
        led = cls(group_size, n_rows, seed)
        led._replay(jr.read(path, first, upto), path, warn_torn=upto is None)
        led.valid_bytes += first
        return led._restream()

    def _replay(self, data: bytes, path: str, warn_torn: bool = True, first_line: int = 1) -> None:
        """Apply the whole lines of ``data`` (a piece of the journal at ``path``, from line ``first_line``), every
        one of them: a line that does not apply is an error."""
        lines = data.split(b"\n")
        self.valid_bytes = len(data) - len(lines[-1])
        if lines[-1] and warn_torn:  # no newline at the end: the process died mid-write; that line never happened
            log.warning("journal %s: ignoring a torn last line (%d bytes)", path, len(lines[-1]))
        for lineno, line in enumerate(lines[:-1], first_line):
            try:
                kind, *args = json.loads(line)
                self._apply(kind, args)
            except Exception as e:
                raise ValueError(f"journal {path} line {lineno}: {type(e).__name__}: {e}") from e

    def _apply(self, kind: str | Event, args: list) -> None:
        """Apply one event to the books (a new transition, or a journal line being replayed)."""
        try:
            event = Event(kind)
        except ValueError:
            raise ValueError(f"unknown event {kind!r}") from None
        _APPLY[event](self, *args)

    def _on_draw(self, gid: str, row: int, requeued: int) -> None:
        if requeued:
            if not self.requeue or self.requeue.popleft() != row:
                raise ValueError(f"group {gid}: row {row} was not next in the re-queue")
        else:
            self.drawn += 1
        self.next_group = max(self.next_group, int(gid[1:]) + 1)
        self.open[gid] = [row, IN_FLIGHT]
        self.rollouts["dispatched"] += self.group_size

    def _on_received(self, gid: str, worker: str) -> None:
        self.open[gid][1] = BUFFERED
        self.rollouts["received"] += self.group_size
        self.by_worker[worker] += self.group_size

    def _on_consumed(self, gids: list[str]) -> None:
        for gid in gids:
            del self.open[gid]
        self.rollouts["consumed"] += len(gids) * self.group_size

    def _on_dropped(self, gid: str, reason: str, requeue: int) -> None:
        self._close(gid, self.dropped, reason, requeue)

    def _on_lost(self, gid: str, reason: str, requeue: int) -> None:
        self._close(gid, self.lost, reason, requeue)

    def _close(self, gid: str, book: Counter, reason: str, requeue: int) -> None:
        row, _ = self.open.pop(gid)
        book[reason] += self.group_size
        if requeue:
            self.requeue.append(row)

    def _on_worker(self, worker: str) -> None:
        self.next_worker = max(self.next_worker, int(worker[1:]) + 1)

    def _on_retired(self, worker: str, reason: str) -> None:
        self.retired[reason] += 1

    def _on_refused(self, reason: str, n: int = 1) -> None:
        self.refused[reason] += n

    def _on_distrusted(self, gids: list[str], rows: list[int], reason: str) -> None:
        self.rollouts["consumed"] -= len(gids) * self.group_size
        self.dropped[reason] += len(gids) * self.group_size
        self.requeue.extend(rows)

    def _on_state(self, s: dict[str, Any]) -> None:
        self.drawn, self.next_group, self.next_worker = s["drawn"], s["next_group"], s["next_worker"]
        self.requeue, self.open = deque(s["requeue"]), {k: list(v) for k, v in s["open"].items()}
        self.rollouts, self.dropped = Counter(s["rollouts"]), Counter(s["dropped"])
        self.lost, self.by_worker = Counter(s["lost"]), Counter(s["by_worker"])
        self.retired, self.refused = Counter(s.get("retired", {})), Counter(s.get("refused", {}))

    def _restream(self) -> "Ledger":
        self._stream = index_stream(self.n_rows, self.seed, self.drawn)
        return self

    # ------------------------------------------------------------------ recovery

    @classmethod
    def after_coordinator_restart(cls, path: str, group_size: int, n_rows: int, seed: int) -> "Ledger":
        """The books a new coordinator starts from after its predecessor died: open groups are gone. Replayed from
        the journal's last intact state line on (a checkpoint's or a recovery's), best effort past it."""
        led = cls(group_size, n_rows, seed)
        found = jr.last_state(path, group_size)
        start = 0
        if found is not None:
            start, state = found
            led._apply(Event.STATE, [state])
        jr.replay_tail(led, path, start)
        led._restream().open_journal(path)
        for gid, (_row, state) in sorted(led.open.items(), key=lambda kv: int(kv[0][1:])):
            if state == IN_FLIGHT:
                led.lose(gid, "coordinator_restart")
            else:
                led.drop(gid, "coordinator_restart", requeue=True)
        led.mark_recovered()
        return led

    def mark_recovered(self) -> None:
        """End a recovery with a state line, fsynced, from which the next recovery starts; a disk that refuses it
        is said (the lines wait in memory, as any others) rather than stopping the coordinator from starting."""
        try:
            self.sync()
        except JournalError as e:
            log.error("%s", e)

    @classmethod
    def after_learner_resume(cls, path: str, offset: int, group_size: int, n_rows: int, seed: int) -> "Ledger":
        """The books and data position for a learner resuming from the checkpoint taken at journal length
        ``offset`` (see the module doc)."""
        size = jr.size(path)
        first = jr.first_and_shift(path)[0]
        if offset and offset <= first:
            raise ValueError(f"journal {path} was compacted and starts at byte {first}: the checkpoint's position, "
                             f"byte {offset}, is no longer in it (that checkpoint was older than the oldest one kept "
                             "when it was rewritten); resume from a newer checkpoint")
        if offset > size or (offset and jr.read(path, offset - 1, offset) != b"\n"):
            where = "past its end" if offset > size else "inside a line"
            raise ValueError(f"journal {path} is {size} bytes and the checkpoint's position, byte {offset}, is "
                             f"{where}: it is another run's journal, or was cut or rewritten; resume from the "
                             "checkpoint this journal belongs to, or start afresh in a new run directory")
        at = cls(group_size, n_rows, seed)
        if offset:  # the checkpoint's state line ends at its offset (a journal written before those: replayed)
            try:
                state = jr.state_of(jr.line_ending_at(path, offset), group_size)
            except ValueError as e:  # inside the fsynced part: never skipped
                raise ValueError(f"journal {path}: the checkpoint's state, the line ending at byte {offset}, is "
                                 f"damaged: {e}") from None
            if state is not None:
                at._apply(Event.STATE, [state])
            else:
                at._replay(jr.read(path, 0, offset), path, warn_torn=False)
        led = cls(group_size, n_rows, seed)
        led._apply(Event.STATE, [at.state()])  # copies every container
        jr.replay_tail(led, path, offset)
        after = led.rollouts["consumed"] - at.rollouts["consumed"]
        if after:
            led.dropped["discarded_by_resume"] += after
            led.rollouts["consumed"] -= after
        for _gid, (_row, state) in led.open.items():
            (led.lost if state == IN_FLIGHT else led.dropped)["learner_restart"] += group_size
        led.open = {}
        # The data position is the checkpoint's: its queue, then the prompts of the groups open then, in order.
        led.drawn = at.drawn
        open_at = sorted(at.open.items(), key=lambda kv: int(kv[0][1:]))
        led.requeue = deque([*at.requeue, *(row for _, (row, _) in open_at)])
        led._restream().open_journal(path)
        led.mark_recovered()
        return led


_APPLY = {Event.DRAW: Ledger._on_draw, Event.RECEIVED: Ledger._on_received, Event.CONSUMED: Ledger._on_consumed,
          Event.DROPPED: Ledger._on_dropped, Event.LOST: Ledger._on_lost, Event.WORKER: Ledger._on_worker,
          Event.RETIRED: Ledger._on_retired, Event.REFUSED: Ledger._on_refused,
          Event.DISTRUSTED: Ledger._on_distrusted, Event.STATE: Ledger._on_state}


def _nonzero(counter: Counter) -> dict[str, int]:
    return {k: v for k, v in counter.items() if v}


def open_ledger(journal: str | None, recover: dict | None, group_size: int, n_rows: int, seed: int) -> Ledger:
    """A coordinator's ledger: fresh (a used journal at ``journal`` is another run's and is removed), or
    recovered (``{"restart": True}`` after a coordinator died, ``{"resume_offset": N}`` for a resumed learner)."""
    if recover and journal is None:
        raise ValueError("recovering the coordinator needs its journal")
    if recover and recover.get("restart"):
        led = Ledger.after_coordinator_restart(journal, group_size, n_rows, seed)
        log.warning("coordinator restarted from %s: %s", journal, led.accounting())
        return led
    if recover:
        led = Ledger.after_learner_resume(journal, int(recover["resume_offset"]), group_size, n_rows, seed)
        log.info("coordinator resumed from %s at byte %d: %s", journal, recover["resume_offset"], led.accounting())
        return led
    led = Ledger(group_size, n_rows, seed)
    if journal is not None:
        if os.path.exists(journal):
            os.unlink(journal)  # a fresh run in a used directory: the old journal is not this run's
        led.open_journal(journal)
    return led


def _fsync_directory(path: str) -> None:
    """Make a rename in directory ``path`` durable (a crash after it then finds the new name)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
