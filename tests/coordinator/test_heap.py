"""The coordinator process's heap (echo2/coordinator/heap.py): arenas capped, freed memory handed back."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from conftest import ROOT, holds_within
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


CHURN = """
import sys, threading
from echo2.coordinator import heap

def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

pins = []

def churn():
    pieces = [bytearray(1000) for _ in range(40_000)]  # ~40 MB in pieces below the mmap threshold
    # One piece allocated after them and kept: free() hands back only what reaches the top of an arena, so without it
    # the freed pieces could be returned at once (in 3 of 12 runs, a CI run's among them)
    pins.append(bytearray(1000))
    del pieces

threads = [threading.Thread(target=churn) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
held = rss_anon()
heap.libc().malloc_trim(0)
print(held, rss_anon())
"""


@pytest.mark.e2e
@pytest.mark.skipif(heap.libc() is None, reason="require_glibc: malloc_trim")
def test_a_trim_hands_back_what_threads_freed():
    """What the trim thread calls does what heap.py says: memory that threads allocated in small pieces and freed
    stays in their arenas (RssAnon) until malloc_trim(0) hands it back. In a fresh interpreter, whose heap holds
    nothing else (in a test process the churn may land in holes other tests left)."""
    out = subprocess.run([sys.executable, "-c", CHURN], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    held, after = map(int, out.stdout.split())
    assert after < held - (64 << 20), (held, after)  # ~155 MB of ~165 MB here (4 threads x 40 MB)
