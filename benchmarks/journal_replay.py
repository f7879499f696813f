"""Recovery time from the rollout journal: from byte 0 (every restart did that) against from the last checkpoint's
state line (echo2/coordinator/journal.py), on one synthetic journal of a long run.

The journal is written by the ledger itself: draws, receipts, consumptions, some drops and losses, in the
proportions of a run at S=1 (groups of G=8), with a checkpoint (``Ledger.sync``) every ``--checkpoint-every``
transitions; the run then goes on for ``--tail`` transitions past the last one and dies. Measured: a full replay
(what a coordinator restart and a learner resume cost before: their time grew with the run's length, against the
learner's 120 s start limit for a coordinator), and today's restart and resume. The ratio is the figure; seconds
depend on the machine.

With ``--compact-mb M`` the same journal is also written a second time as a run writes it, rewritten at each
checkpoint once what precedes the oldest of the ``--keep`` newest earlier checkpoints passes M MiB (what
``rollout.source.journal_compact_mb`` and ``run.keep_checkpoints`` do): its final size against the whole journal's,
and how long each rewrite held the ledger (the coordinator's lock), against the recovery times.

    python benchmarks/journal_replay.py --transitions 2000000 --checkpoint-every 50000 --tail 20000
    python benchmarks/journal_replay.py --transitions 6000000 --checkpoint-every 50000 --compact-mb 64 --keep 2
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_journal(path: str, transitions: int, every: int, tail: int, seed: int = 0, keep: int = 2,
                  compact_bytes: int | None = None, rewrites: list[float] | None = None) -> int:
    """A journal of ``transitions`` + ``tail`` transitions; returns the last checkpoint's offset. With
    ``compact_bytes``, each checkpoint may rewrite it (down to the oldest of the ``keep`` newest earlier checkpoints),
    each rewrite's seconds appended to ``rewrites``."""
    from echo2.coordinator.ledger import Ledger

    rng = random.Random(seed)
    led = Ledger(8, 10_000, seed)
    led.open_journal(path)
    led.journal.close()
    led.journal = open(path, "ab")  # noqa: SIM115  buffered, to write a long journal quickly (same bytes)
    flying: deque[str] = deque()
    buffered: deque[str] = deque()
    offset = 0
    marks: list[int] = []
    for i in range(transitions + tail):
        op = rng.random()
        if op < 0.32 or not flying:
            flying.append(led.draw()[0])
        elif op < 0.62:
            gid = flying.popleft()
            led.received(gid, f"w{rng.randrange(64)}")
            buffered.append(gid)
        elif op < 0.64:
            led.lose(flying.popleft(), "worker_dead")
        elif len(buffered) >= 4:
            led.consumed([buffered.popleft() for _ in range(4)])
        if i < transitions and (i + 1) % every == 0:
            offset = led.sync()
            if compact_bytes is not None and marks:
                led.journal.flush()  # this benchmark's buffer (the coordinator's journal is unbuffered)
                t0 = time.perf_counter()
                if led.compact(min(marks[-keep:]), compact_bytes):
                    rewrites.append(time.perf_counter() - t0)
                    led.journal.close()
                    led.journal = open(path, "ab")  # noqa: SIM115  buffered again (the rewrite reopens it unbuffered)
            marks.append(offset)
    led.close()
    return offset


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transitions", type=int, default=2_000_000)
    p.add_argument("--checkpoint-every", type=int, default=50_000)
    p.add_argument("--tail", type=int, default=20_000, help="transitions past the last checkpoint")
    p.add_argument("--compact-mb", type=float, default=None, help="also write it rewritten at checkpoints past this")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept (run.keep_checkpoints)")
    args = p.parse_args()
    from echo2.coordinator.ledger import Ledger

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rollouts.journal")
        t0 = time.perf_counter()
        offset = write_journal(path, args.transitions, args.checkpoint_every, args.tail)
        t_write = time.perf_counter() - t0
        size = os.path.getsize(path)

        def on_copy(fn):
            copy = os.path.join(d, "copy")
            shutil.copyfile(path, copy)
            return lambda: fn(copy)

        full = timed(lambda: Ledger.replay(path, 8, 10_000, 0))
        restart = timed(on_copy(lambda p: Ledger.after_coordinator_restart(p, 8, 10_000, 0)))
        resume = timed(on_copy(lambda p: Ledger.after_learner_resume(p, offset, 8, 10_000, 0)))
        if args.compact_mb is not None:
            os.unlink(path)
            rewrites: list[float] = []
            write_journal(path, args.transitions, args.checkpoint_every, args.tail, keep=args.keep,
                          compact_bytes=int(args.compact_mb * (1 << 20)), rewrites=rewrites)
            compacted = os.path.getsize(path)
            resume_compacted = timed(on_copy(lambda p: Ledger.after_learner_resume(p, offset, 8, 10_000, 0)))
    print(f"journal: {size / 1e6:.1f} MB, {args.transitions + args.tail} transitions, a checkpoint every "
          f"{args.checkpoint_every}, {args.tail} after the last (written in {t_write:.1f} s)")
    print(f"{'recovery':<34}{'seconds':>9}{'vs from byte 0':>16}")
    print(f"{'from byte 0 (before)':<34}{full:>9.3f}{1.0:>16.2f}")
    print(f"{'coordinator restart (now)':<34}{restart:>9.3f}{restart / full:>16.4f}")
    print(f"{'learner resume, last checkpoint':<34}{resume:>9.3f}{resume / full:>16.4f}")
    if args.compact_mb is not None:
        times = sorted(rewrites)
        print(f"rewritten at checkpoints past {args.compact_mb:g} MiB, {args.keep} kept: {compacted / 1e6:.1f} MB at the "
              f"end ({compacted / size:.3f} of the whole journal), {len(times)} rewrites holding the ledger "
              + (f"{times[len(times) // 2]:.3f} s median, {times[-1]:.3f} s at most" if times else "(none)")
              + f"; learner resume from it {resume_compacted:.3f} s")


if __name__ == "__main__":
    main()
