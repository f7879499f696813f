"""The coordinator process's heap under glibc: two malloc arenas, and freed memory handed back to the system.

Why. The coordinator answers many requests on many threads (route handlers started on demand, a thread per relay
connection, a broadcast round's pool). glibc gives threads arenas of their own, up to 8 per core, and keeps what is
freed in each for reuse: a burst of connections (a stranger's half-open TLS connections, each with uvloop's 256 KiB
read buffer; long-polling workers; pushes) leaves RssAnon at its high-water mark for good, and the high-water marks
of many arenas add up. In the hostile soak (tiny model, 2026-12-06) the coordinator's threads went from 18 to ~80,
Python's own allocations grew ~15 MiB, RssAnon ~45 MiB, and one malloc_trim(0) handed back 20-25 MiB of it each time.
On the real model, the same soak on the same day: RssAnon +89 MiB over calm by median without this, +19 with it, the
learner's pace the same (BENCHMARKS.md, "The coordinator's heap under attack").

What. ``keep()`` caps the arenas at ``ARENAS`` (mallopt(M_ARENA_MAX); before other threads exist, since a thread keeps
the arena it got) and starts a daemon thread that calls malloc_trim(0) every ``TRIM_EVERY_S``: free pages at the top
of each heap and whole free pages inside it go back to the kernel. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's malloc.h

ARENAS = 2
"""malloc arenas for the whole process: its Python threads take turns on the GIL, so that more arenas buy little
concurrency and each keeps its own freed memory."""

TRIM_EVERY_S = 30.0
"""How often freed heap memory is handed back. A trim walks each arena's free lists under that arena's lock (not the
GIL: ctypes releases it): 40-57 ms on a fragmented 490-700 MiB heap here, so ~0.2 % of the time at this period."""


def libc():
    """The process's C library if it is glibc (it has malloc_trim and mallopt), else None."""
    try:
        lib = ctypes.CDLL(None)
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None


def keep(every_s: float = TRIM_EVERY_S, lib=None, stop: threading.Event | None = None) -> bool:
    """Cap the arenas and trim the heap every ``every_s`` from a daemon thread (until ``stop``). False where the C
    library is not glibc: nothing is done."""
    lib = lib if lib is not None else libc()
    if lib is None:
        log.info("heap: not glibc, the allocator's own policy applies")
        return False
    if not lib.mallopt(M_ARENA_MAX, ARENAS):
        log.warning("heap: mallopt(M_ARENA_MAX, %d) refused", ARENAS)
    stop = stop or threading.Event()

    def trim() -> None:
        while not stop.wait(every_s):
            lib.malloc_trim(0)

    threading.Thread(target=trim, name="heap-trim", daemon=True).start()
    log.info("heap: %d malloc arenas, freed memory handed back every %.0f s", ARENAS, every_s)
    return True
