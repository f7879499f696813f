"""The coordinator process's heap (echo2/coordinator/heap.py): arenas capped, freed memory handed back."""

from __future__ import annotations

import threading

import pytest

from conftest import holds_within
from echo2.coordinator import heap


class Recording:
    """A C library that records what it is asked."""

    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))
        return 1


def test_arenas_are_capped_first_and_the_heap_is_trimmed_on_a_period_until_stopped():
    lib, stop = Recording(), threading.Event()
    assert heap.keep(every_s=0.05, lib=lib, stop=stop)
    assert lib.calls[0] == ("mallopt", heap.M_ARENA_MAX, heap.ARENAS)
    assert holds_within(lambda: lib.calls.count(("malloc_trim", 0)) >= 3, 5), lib.calls
    stop.set()
    seen = len(lib.calls)
    assert not holds_within(lambda: len(lib.calls) > seen + 1, 0.5)  # one trim may have been under way


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


@pytest.mark.skipif(heap.libc() is None, reason="require_glibc: malloc_trim")
def test_a_trim_hands_back_what_threads_freed():
    """What the trim thread calls does what heap.py says: memory that threads allocated in small pieces and freed
    stays in their arenas (RssAnon) until malloc_trim(0) hands it back."""
    def churn():
        pieces = [bytearray(1000) for _ in range(40_000)]  # ~40 MB in pieces below the mmap threshold
        pieces[-1][0] = 1
        del pieces

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = rss_anon()
    heap.libc().malloc_trim(0)
    assert rss_anon() < held - (16 << 20), (held, rss_anon())  # 27-40 MB here
