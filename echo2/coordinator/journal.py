"""Reading the rollout journal (written by ledger.py) for recovery: where to start, and which lines to believe.

    ... lines ... ["s",{state}]\\n ... lines ... ["s",{state}]\\n ... lines (some damaged?) ... [torn]
                  └ a checkpoint's mark: fsynced,    └ the last mark: a restart    └ best effort: each line is
                    its offset is the line's end        replays from here             checked before it applies

Every checkpoint (``Ledger.sync``) and every recovery ends the journal with a state line (the whole books and data
position) and fsyncs it, so recovery never reads the journal from byte 0: a learner resume takes the state line
that ends at its checkpoint's offset, a coordinator restart the last intact state line, and each replays only the
lines after it. Recovery time is bounded by what happened since the last checkpoint, not by the run's length.

The file's length is bounded too: at a checkpoint, once what precedes the state line of the oldest checkpoint a
resume may still use is long (``Ledger.compact_bytes``), the journal is rewritten without it (``Ledger.sync``). Offsets stay
the journal's own (a checkpoint's offset still names the same line): a rewritten journal's first line is a base
line, ``["b","<offset>"]``, the offset its next byte had, and every reader here takes and gives offsets in the
journal's numbering, never the file's (``shift``).

What lies before that state line is the fsynced truth: a state line that does not parse, or a prefix that does not
replay, is a clear error, never skipped. What follows it was not fsynced, and after a machine crash it may hold a
zero page or garbage with intact lines after it: there every line is checked (``check``: its shape, and that it
can apply to the books as they stand) before it is applied, and one that is not whole or not applicable is
skipped, counted and logged, so that the books stay balanced and recovery goes on.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

STATE_PREFIX = b'["s",'  # how a state line starts (ledger.Event.STATE, compact separators)
BASE_PREFIX = b'["b","'  # how a rewritten journal's base line starts (its offset: 20 digits, so one fixed length)
SCAN_BYTES = 1 << 20  # the first window searched backwards for a state line; grown 4x until one is found
_GROUP = re.compile(r"g\d{1,18}\Z")
_WORKER = re.compile(r"w\d{1,18}\Z")
log = logging.getLogger(__name__)

_STATE_KEYS = ("drawn", "next_group", "next_worker", "requeue", "open", "rollouts", "dropped", "lost", "by_worker")


def base_line(offset: int) -> bytes:
    """The first line of a rewritten journal: the offset its next byte had (so that offsets never change)."""
    return BASE_PREFIX + b"%020d" % offset + b'"]\n'


BASE_LINE_BYTES = len(base_line(0))


def first_and_shift(path: str) -> tuple[int, int]:
    """(the journal's first offset it still holds, file position minus journal offset): (0, 0) for a journal never
    rewritten. A first line that starts as a base line but is not one is an error (it is the fsynced part)."""
    with open(path, "rb") as f:
        head = f.read(BASE_LINE_BYTES)
    if not head.startswith(BASE_PREFIX):
        return 0, 0
    digits = head[len(BASE_PREFIX):len(BASE_PREFIX) + 20]
    if not (digits.isdigit() and head == base_line(int(digits))):
        raise ValueError(f"journal {path}: a damaged base line {head[:40]!r}")
    return int(digits), BASE_LINE_BYTES - int(digits)


def size(path: str) -> int:
    """The journal's length in its own numbering (the file's, for one never rewritten)."""
    return os.path.getsize(path) - first_and_shift(path)[1]


def read(path: str, start: int = 0, end: int | None = None) -> bytes:
    """The journal's bytes from offset ``start`` (to ``end``); ValueError if the rewrite dropped them."""
    first, shift = first_and_shift(path)
    if start < first:
        raise ValueError(f"journal {path}: byte {start} was compacted away (it now starts at byte {first}, the "
                         "state line of the oldest checkpoint kept when it was rewritten)")
    with open(path, "rb") as f:
        f.seek(start + shift)
        return f.read() if end is None else f.read(end - start)


def line_ending_at(path: str, offset: int) -> bytes:
    """The whole line whose newline is the byte before journal offset ``offset`` (without it)."""
    first, shift = first_and_shift(path)
    if offset <= first:
        raise ValueError(f"journal {path}: byte {offset} was compacted away (it now starts at byte {first})")
    offset += shift
    with open(path, "rb") as f:
        window = 4096
        while True:
            lo = max(0, offset - 1 - window)
            f.seek(lo)
            data = f.read(offset - 1 - lo)
            nl = data.rfind(b"\n")
            if nl >= 0 or lo == 0:
                return data[nl + 1:]
            window *= 4


def last_state(path: str, group_size: int) -> tuple[int, dict] | None:
    """(the offset just past it, the state) of the journal's last state line that parses and balances; None if it
    has none. Searches backwards from the end, reading only as much of the file as it must."""
    shift = first_and_shift(path)[1]
    end = os.path.getsize(path)
    with open(path, "rb") as f:
        window = SCAN_BYTES
        while True:
            lo = max(0, end - window)
            f.seek(lo)
            data = f.read(end - lo)
            i = data.rfind(STATE_PREFIX)
            while i >= 0:
                starts_line = data[i - 1:i] == b"\n" if i > 0 else lo == 0
                nl = data.find(b"\n", i)
                if starts_line and nl >= 0:
                    state = state_of(data[i:nl], group_size, strict=False)
                    if state is not None:
                        return lo + nl + 1 - shift, state
                i = data.rfind(STATE_PREFIX, 0, i)
            if lo == 0:
                return None
            window *= 4


def state_of(line: bytes, group_size: int, strict: bool = True) -> dict | None:
    """The state a state line holds; None if ``line`` is not a state line. A line that starts like one but does not
    parse or balance raises ValueError (``strict``) or gives None."""
    if not line.startswith(STATE_PREFIX):
        return None
    try:
        kind, state = json.loads(line)
        problem = state_problem(state, group_size)
    except (ValueError, TypeError) as e:
        problem = f"{type(e).__name__}: {e}"
    if problem is None:
        return state
    if strict:
        raise ValueError(f"a damaged state line ({problem})")
    return None


def lines(data: bytes, base: int) -> Iterator[tuple[int, bytes]]:
    """(offset in the journal, line) for each whole line of ``data``, which starts at journal offset ``base``."""
    pos = 0
    while (nl := data.find(b"\n", pos)) >= 0:
        yield base + pos, data[pos:nl]
        pos = nl + 1


def replay_tail(led: Any, path: str, start: int) -> None:
    """Apply to the ledger ``led`` what follows byte ``start`` of the journal (past the last fsynced state line),
    best effort: each line is checked before it applies (``check``), and one that is not whole, or cannot apply, is
    skipped and counted (``led.damaged_lines``); a torn last line is left for ``Ledger.open_journal`` to cut."""
    data = read(path, start)
    led.valid_bytes = start + data.rfind(b"\n") + 1
    if led.valid_bytes < start + len(data):
        log.warning("journal %s: ignoring a torn last line (%d bytes)", path, start + len(data) - led.valid_bytes)
    damaged: list[tuple[int, str]] = []
    for offset, line in lines(data, start):
        try:
            kind, args = parse(line)
        except ValueError as e:  # also a zero page: not JSON
            damaged.append((offset, f"unreadable ({str(e)[:60]})"))
            continue
        problem = check(led, kind, args)
        if problem is not None:
            damaged.append((offset, problem))
            continue
        led._apply(kind, args)
    if damaged:
        led.damaged_lines += len(damaged)
        log.error("journal %s: %d damaged lines after byte %d (past the last checkpoint, not fsynced) skipped; the "
                  "first at byte %d: %s", path, len(damaged), start, *damaged[0])


def parse(line: bytes) -> tuple[str, list]:
    """(event letter, arguments) of a journal line; ValueError if it is not a JSON list led by a string."""
    value = json.loads(line)
    if not (isinstance(value, list) and value and isinstance(value[0], str)):
        raise ValueError("not a journal line")
    return value[0], value[1:]


def check(led: Any, kind: str, args: list) -> str | None:
    """Why the line (``kind``, ``args``) cannot apply to the ledger ``led`` as it stands (None: it can). Checked
    before a best-effort line applies, so that a line is applied whole or not at all and the books stay
    balanced."""
    opened = led.open
    try:
        if kind == "d":
            gid, row, requeued = args
            if not (_is_group(gid) and _is_row(row, led) and requeued in (0, 1)):
                return "malformed draw"
            if gid in opened or int(gid[1:]) < led.next_group:
                return f"{gid} was drawn already"
            if requeued and (not led.requeue or led.requeue[0] != row):
                return f"row {row} is not next in the re-queue"
        elif kind == "r":
            gid, worker = args
            if not (_is_group(gid) and isinstance(worker, str)) or gid not in opened:
                return "receipt of a group that is not open"
        elif kind == "c":
            (gids,) = args
            if not (isinstance(gids, list) and all(_is_group(g) and g in opened for g in gids)
                    and len(set(gids)) == len(gids)):
                return "consumption of groups that are not open"
        elif kind in ("x", "l"):
            gid, reason, requeue = args
            if not (_is_group(gid) and isinstance(reason, str) and requeue in (0, 1)) or gid not in opened:
                return "closing a group that is not open"
        elif kind == "w":
            (worker,) = args
            if not (isinstance(worker, str) and _WORKER.match(worker)):
                return "malformed worker id"
        elif kind == "t":
            worker, reason = args
            if not (isinstance(worker, str) and isinstance(reason, str)):
                return "malformed retirement"
        elif kind == "f":
            if not (1 <= len(args) <= 2 and isinstance(args[0], str)
                    and (len(args) == 1 or _is_count(args[1]))):
                return "malformed refusal"
        elif kind == "u":
            gids, rows, reason = args
            if not (isinstance(gids, list) and isinstance(rows, list) and len(gids) == len(rows)
                    and all(_is_group(g) for g in gids) and all(_is_row(r, led) for r in rows)
                    and isinstance(reason, str)):
                return "malformed distrust"
            if len(gids) * led.group_size > led.rollouts["consumed"]:
                return "distrust of more rollouts than were consumed"
        elif kind == "s":
            (state,) = args
            return state_problem(state, led.group_size)
        else:
            return f"unknown event {kind!r}"
    except (TypeError, ValueError) as e:  # the wrong number of arguments, an unhashable id, ...
        return f"{type(e).__name__}: {e}"
    return None


def state_problem(s: Any, group_size: int) -> str | None:
    """Why ``s`` is not a whole, balanced state of the books (None: it is)."""
    if not (isinstance(s, dict) and all(k in s for k in _STATE_KEYS)):
        return "not a state"
    if not all(_is_count(s[k]) for k in ("drawn", "next_group", "next_worker")):
        return "malformed counters"
    if not (isinstance(s["requeue"], list) and all(_is_count(r) for r in s["requeue"])):
        return "malformed re-queue"
    opened = s["open"]
    if not (isinstance(opened, dict) and all(
            _is_group(g) and isinstance(v, list) and len(v) == 2 and _is_count(v[0]) and v[1] in ("in_flight",
                                                                                               "buffered")
            for g, v in opened.items())):
        return "malformed open groups"
    books = [s[k] for k in ("rollouts", "dropped", "lost", "by_worker")] + [s.get(k, {}) for k in ("retired",
                                                                                                  "refused")]
    if not all(isinstance(b, dict) and all(isinstance(k, str) and isinstance(v, int) for k, v in b.items())
               for b in books):
        return "malformed books"
    r = s["rollouts"]
    closed = r.get("consumed", 0) + sum(s["dropped"].values()) + sum(s["lost"].values())
    if r.get("dispatched", 0) != closed + len(opened) * group_size:
        return "books that do not balance"
    return None


def _is_group(gid: Any) -> bool:
    return isinstance(gid, str) and bool(_GROUP.match(gid))


def _is_row(row: Any, led: Any) -> bool:
    return _is_count(row) and row < led.n_rows


def _is_count(n: Any) -> bool:
    return type(n) is int and n >= 0
