"""Recovery from the rollout journal (echo2/coordinator/journal.py, ledger.py): it starts at the checkpoint's state
line, never at byte 0, survives any damage past the last fsynced state line, and refuses damage before it. Property
tests drive the ledger with any sequence of valid transitions and damage the journal past a checkpoint in any way."""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from echo2.coordinator import journal as jr
from echo2.coordinator.ledger import BUFFERED, IN_FLIGHT, Ledger

G, ROWS = 4, 7


def balanced(acc) -> bool:
    return acc["dispatched"] == (acc["consumed"] + sum(acc["dropped"].values()) + sum(acc["lost"].values())
                                 + acc["in_flight"] + acc["buffered"])


def step(led: Ledger, op: int, pick: int) -> None:
    """One valid transition, chosen by ``op`` (0-9) on the group ``pick`` selects: what a coordinator does."""
    flying = [g for g, (_, s) in led.open.items() if s == IN_FLIGHT]
    buffered = [g for g, (_, s) in led.open.items() if s == BUFFERED]
    if op <= 2 or not led.open:
        led.draw()
    elif op == 3 and flying:
        led.received(flying[pick % len(flying)], f"w{pick % 3}")
    elif op == 4 and flying:
        led.lose(flying[pick % len(flying)], "worker_dead")
    elif op == 5 and flying:
        led.drop(flying[pick % len(flying)], "invalid", requeue=True)
    elif op == 6 and buffered:
        take = buffered[: 1 + pick % 2]
        rows = [led.open[g][0] for g in take]
        led.consumed(take)
        if pick % 5 == 0:  # the learner's checks found them untrusted
            led.distrusted(take[:1], rows[:1], "untrusted")
    elif op == 7 and buffered:
        led.drop(buffered[pick % len(buffered)], "stale", requeue=False)
    elif op == 8:
        led.new_worker_id() if pick % 2 else led.retire(f"w{pick % 3}", "worker_left")
    elif op == 9:
        led.refuse("not_in_flight_for_this_worker", 1 + pick % 3)


def position_of(led: Ledger) -> dict:
    """The data position a resume from now must give back: the re-queue, then the open groups' rows, then the
    stream past ``drawn``."""
    open_rows = [row for _, (row, _) in sorted(led.open.items(), key=lambda kv: int(kv[0][1:]))]
    return {"drawn": led.drawn, "requeue": [*led.requeue, *open_rows]}


def run(path: str, ops: list[tuple[int, int]], mark_at: int) -> tuple[int, dict, dict]:
    """Drive a fresh ledger through ``ops`` with a checkpoint (sync) after op ``mark_at``; returns (the checkpoint's
    offset, its data position, its state)."""
    led = Ledger(G, ROWS, 0)
    led.open_journal(path)
    mark = None
    for i, (op, pick) in enumerate(ops):
        step(led, op, pick)
        if i == mark_at:
            mark = (led.sync(), position_of(led), json.loads(json.dumps(led.state())))
    if mark is None:
        mark = (led.sync(), position_of(led), json.loads(json.dumps(led.state())))
    led.close()
    return mark


def damage(path: str, offset: int, kind: str, at: float, size: int) -> None:
    """Damage the journal past byte ``offset`` as a machine crash can leave it."""
    data = bytearray(open(path, "rb").read())
    tail = len(data) - offset
    cut = offset + int(at * tail)
    if kind == "truncate":
        data = data[:cut]
    elif kind == "zeros":  # zeros over a span, newlines included: lines glued, later lines intact
        data[cut:cut + size] = bytes(len(data[cut:cut + size]))
    elif kind == "zero_page":  # a page of zeros ended by a newline, then whatever followed
        data[cut:cut] = bytes(size) + b"\n"
    elif kind == "garbage":
        data[cut:cut] = random.Random(size).randbytes(size) + b"\n"
    elif kind == "json":  # a line that parses but cannot apply: a consumed group nobody drew
        data[cut:cut] = b'["c",["g999999"]]\n["d","g1",0,0]\n'
    with open(path, "wb") as f:
        f.write(bytes(data))


OPS = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 1000)), min_size=1, max_size=120)
DAMAGE = st.tuples(st.sampled_from(["none", "truncate", "zeros", "zero_page", "garbage", "json"]),
                   st.floats(0, 1), st.integers(1, 5000))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, mark=st.floats(0, 1), harm=DAMAGE)
def test_resume_survives_any_damage_past_its_checkpoint(ops, mark, harm):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "j")
        offset, position, _ = run(path, ops, int(mark * len(ops)))
        damage(path, offset, *harm)
        led = Ledger.after_learner_resume(path, offset, G, ROWS, 0)
        acc = led.accounting()
        assert balanced(acc) and acc["in_flight"] == acc["buffered"] == 0
        assert position_of(led) == position  # the checkpoint's data position, whatever came after
        again = Ledger.after_coordinator_restart(path, G, ROWS, 0)  # and what the resume wrote replays
        assert balanced(again.accounting()) and again.drawn == led.drawn


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, mark=st.floats(0, 1), harm=DAMAGE)
def test_restart_survives_any_damage_past_the_last_checkpoint(ops, mark, harm):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "j")
        offset, _, state = run(path, ops, len(ops))  # the last checkpoint at the end: the damage comes after it
        damage(path, offset, *harm)
        led = Ledger.after_coordinator_restart(path, G, ROWS, 0)
        acc = led.accounting()
        assert balanced(acc) and acc["in_flight"] == acc["buffered"] == 0
        # nothing the checkpoint holds is lost; a line past it that could be real (the "json" damage's draw) counts
        assert led.drawn >= state["drawn"] and acc["dispatched"] >= state["rollouts"]["dispatched"]


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_a_replay_of_valid_transitions_gives_their_books(ops):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "j")
        led = Ledger(G, ROWS, 0)
        led.open_journal(path)
        for op, pick in ops:
            step(led, op, pick)
        led.close()
        assert balanced(led.accounting())
        assert Ledger.replay(path, G, ROWS, 0).state() == led.state()
        restarted = Ledger.after_coordinator_restart(path, G, ROWS, 0)
        assert balanced(restarted.accounting()) and restarted.next_group == led.next_group


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400), offset=st.integers(0, 500))
def test_no_bytes_make_recovery_fail_unhelpfully(data, offset):
    """Any file as a journal: a restart recovers balanced books (nothing in it was fsynced by a checkpoint); a
    resume does too, or says in one ValueError naming the journal what is wrong with the checkpoint's position."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "j")
        with open(path, "wb") as f:
            f.write(data)
        if data.startswith(jr.BASE_PREFIX):  # a rewritten journal's first line, fsynced: damage there is said
            with pytest.raises(ValueError, match=f"journal {path}: a damaged base line"):
                Ledger.after_coordinator_restart(path, G, ROWS, 0)
            return
        assert balanced(Ledger.after_coordinator_restart(path, G, ROWS, 0).accounting())
        with open(path, "wb") as f:
            f.write(data)
        try:
            led = Ledger.after_learner_resume(path, offset, G, ROWS, 0)
        except ValueError as e:
            assert path in str(e)
        else:
            assert balanced(led.accounting())


# ---------------------------------------------------------------------- the cases, one by one


def journal_with_checkpoint(tmp_path, after: int = 60):
    path = str(tmp_path / "j")
    rng = random.Random(7)
    ops = [(rng.randrange(10), rng.randrange(1000)) for _ in range(300)]
    offset, position, state = run(path, ops[: 300 - after] + ops[300 - after:], 300 - after - 1)
    return path, offset, position


@pytest.mark.parametrize("kind", ["zeros", "zero_page", "garbage"])
def test_a_machine_crash_leaves_garbage_past_the_checkpoint_and_both_recoveries_go_on(tmp_path, caplog, kind):
    """After a machine crash the part past the last fsync may hold zeros over a line with later lines intact, a
    zero page ended by a newline, or garbage: resume and restart go on from the checkpoint (the damaged lines
    skipped, counted and said), where one bad line used to block both."""
    path, offset, position = journal_with_checkpoint(tmp_path)
    damage(path, offset, kind, 0.3, 300)
    led = Ledger.after_learner_resume(path, offset, G, ROWS, 0)
    assert position_of(led) == position and balanced(led.accounting()) and led.damaged_lines >= 1
    assert "damaged lines" in caplog.text
    damage(path, os.path.getsize(path) - 1, kind, 0.0, 300)  # damage after the resume's own state line too
    again = Ledger.after_coordinator_restart(path, G, ROWS, 0)
    assert balanced(again.accounting()) and again.damaged_lines >= 1


def test_damage_inside_the_fsynced_part_is_an_error_not_skipped(tmp_path):
    path, offset, _ = journal_with_checkpoint(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[offset - 10:offset - 1] = bytes(9)  # the checkpoint's own state line
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=f"journal {path}: the checkpoint's state.*damaged"):
        Ledger.after_learner_resume(path, offset, G, ROWS, 0)


def test_recovery_never_reads_what_precedes_the_state_line_it_starts_from(tmp_path):
    """Replay starts at the checkpoint's state line: every byte before it could be garbage (here it is) and resume
    and restart give the same books as from the intact journal. Time to recover is then bounded by what happened
    since the last checkpoint, not by the run's length (benchmarks/journal_replay.py measures it)."""
    path, offset, _ = journal_with_checkpoint(tmp_path)
    original = open(path, "rb").read()
    line_start = original.rfind(b"\n", 0, offset - 1) + 1
    rng = random.Random(1)
    garbled = bytes(rng.choice(range(11, 256)) for _ in range(line_start - 1)) + original[line_start - 1:]
    copies = {}
    for name, data in [("intact", original), ("garbled", garbled)]:
        for use in ("resume", "restart"):
            copies[name, use] = str(tmp_path / f"{name}-{use}")
            with open(copies[name, use], "wb") as f:
                f.write(data)
    resumed = [Ledger.after_learner_resume(copies[name, "resume"], offset, G, ROWS, 0).state()
               for name in ("intact", "garbled")]
    restarted = [Ledger.after_coordinator_restart(copies[name, "restart"], G, ROWS, 0).state()
                 for name in ("intact", "garbled")]
    assert resumed[0] == resumed[1] and restarted[0] == restarted[1]
    with pytest.raises(ValueError):  # while a replay from byte 0 (the old recovery) cannot read it
        Ledger.replay(copies["garbled", "resume"], G, ROWS, 0)


def test_each_checkpoint_writes_one_state_line(tmp_path):
    path = tmp_path / "j"
    led = Ledger(G, ROWS, 0)
    led.open_journal(str(path))
    led.draw()
    first = led.sync()
    assert led.sync() == first  # nothing new: no second state line
    assert open(path, "rb").read().splitlines()[-1].startswith(b'["s",')
    led.draw()
    assert led.sync() > first
    led.close()
    assert [line[:5] for line in path.read_bytes().splitlines()] == [b'["d",', b'["s",', b'["d",', b'["s",']
    assert Ledger.replay(str(path), G, ROWS, 0).requeue == deque()


# ---------------------------------------------------------------------- compaction


def twins(d: str, ops: list[tuple[int, int]], marks: list[int], keep: int):
    """The same transitions into two journals, a checkpoint after each op in ``marks``; one of them compacted at
    every checkpoint (threshold 0) down to the oldest of its ``keep`` newest earlier checkpoints, as the learner's
    rotation asks. Returns (compacted path, plain path, [(offset, position, state) per checkpoint], compactions)."""
    paths = [os.path.join(d, "compacted"), os.path.join(d, "plain")]
    leds = [Ledger(G, ROWS, 0) for _ in paths]
    for led, path in zip(leds, paths):
        led.open_journal(path)
    checkpoints, compactions = [], 0
    for i, (op, pick) in enumerate(ops):
        for led in leds:
            step(led, op, pick)
        if i in marks:
            offsets = [c[0] for c in checkpoints[-keep:]]
            keep_from = min(offsets) if offsets else None
            compacted, plain = leds[0].sync(), leds[1].sync()
            assert compacted == plain  # offsets are the journal's own, rewritten or not
            if keep_from is not None:
                compactions += leds[0].compact(keep_from, threshold_bytes=0)
            checkpoints.append((plain, position_of(leds[1]), json.loads(json.dumps(leds[1].state()))))
    for op, pick in ops[:20]:  # and the journal goes on after the last rewrite
        for led in leds:
            step(led, op, pick)
    assert leds[0].position() == leds[1].position()
    for led in leds:
        led.close()
    return *paths, checkpoints, compactions


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 1000)), min_size=20, max_size=150),
       marks=st.sets(st.integers(0, 149), min_size=1, max_size=8), keep=st.integers(1, 3))
def test_a_compacted_journal_recovers_as_the_whole_one_does(ops, marks, keep):
    """Rewritten at every checkpoint, the journal keeps what every kept checkpoint needs: a resume from each of them,
    and a restart, give the books the whole journal gives; an older checkpoint is refused with a clear error."""
    with tempfile.TemporaryDirectory() as d:
        compacted, plain, checkpoints, _ = twins(d, ops, {m % len(ops) for m in marks}, keep)
        first = jr.first_and_shift(compacted)[0]
        for offset, position, _ in checkpoints:
            copies = []
            for name, src in (("c", compacted), ("p", plain)):
                copies.append(os.path.join(d, f"{name}-{offset}"))
                with open(src, "rb") as f, open(copies[-1], "wb") as g:
                    g.write(f.read())
            if offset <= first:
                with pytest.raises(ValueError, match="was compacted and starts at byte"):
                    Ledger.after_learner_resume(copies[0], offset, G, ROWS, 0)
                continue
            resumed = [Ledger.after_learner_resume(c, offset, G, ROWS, 0) for c in copies]
            assert resumed[0].state() == resumed[1].state() and position_of(resumed[0]) == position
            assert resumed[0].position() == resumed[1].position()
        assert checkpoints[-1][0] > first  # the newest checkpoint is always kept
        restarted = [Ledger.after_coordinator_restart(p, G, ROWS, 0).state() for p in (compacted, plain)]
        assert restarted[0] == restarted[1]
        assert Ledger.replay(compacted, G, ROWS, 0).state() == Ledger.replay(plain, G, ROWS, 0).state()


def test_compaction_bounds_the_file_and_keeps_offsets(tmp_path):
    """A long run's journal, rewritten at each checkpoint, stays near what its kept checkpoints span; each rewrite
    keeps the journal's offsets (a second rewrite of a rewritten journal too), and garbage past the last checkpoint
    still leaves both recoveries going."""
    rng = random.Random(3)
    ops = [(rng.randrange(10), rng.randrange(1000)) for _ in range(3000)]
    compacted, plain, checkpoints, compactions = twins(str(tmp_path), ops, set(range(199, 3000, 200)), keep=2)
    assert compactions == 13  # from the second checkpoint on, one each, but the third (its oldest kept is the same)
    assert os.path.getsize(compacted) < os.path.getsize(plain) / 5
    first = jr.first_and_shift(compacted)[0]
    assert first > 0 and open(compacted, "rb").read().startswith(jr.base_line(first))
    assert jr.read(compacted, first) == open(plain, "rb").read()[first:]
    damage(compacted, os.path.getsize(compacted) - 1, "garbage", 0.0, 300)
    offset = checkpoints[-2][0]
    led = Ledger.after_learner_resume(compacted, offset, G, ROWS, 0)
    assert position_of(led) == checkpoints[-2][1] and balanced(led.accounting())
    assert balanced(Ledger.after_coordinator_restart(compacted, G, ROWS, 0).accounting())


def test_compaction_waits_for_its_threshold_and_a_state_line(tmp_path):
    path = str(tmp_path / "j")
    led = Ledger(G, ROWS, 0)
    led.open_journal(path)
    for _ in range(5):
        led.draw()
    first = led.sync()
    for _ in range(5):
        led.draw()
    led.sync()
    size = os.path.getsize(path)
    assert not led.compact(first, 1 << 20)  # under its threshold: nothing rewritten
    assert not led.compact(first - 3, threshold_bytes=0)  # not a state line's end: refused, said
    assert os.path.getsize(path) == size
    assert led.compact(first, threshold_bytes=0)
    assert jr.first_and_shift(path)[0] == first - len(jr.line_ending_at(path, first)) - 1
    assert not led.compact(first, threshold_bytes=0)  # nothing left to drop: no rewrite that copies it all
    led.close()


def two_checkpoints(tmp_path):
    """A journal with a draw, a checkpoint, a draw, a checkpoint: (path, its open ledger, the two offsets)."""
    path = str(tmp_path / "j")
    led = Ledger(G, ROWS, 0)
    led.open_journal(path)
    led.draw()
    first = led.sync()
    led.draw()
    return path, led, first, led.sync()


def test_a_directory_that_refuses_fsync_after_the_rename_leaves_the_ledger_on_the_new_journal(tmp_path, monkeypatch,
                                                                                                 caplog):
    """Once the rewritten journal is renamed into place it is the journal, whatever follows: a directory fsync that
    fails (some network filesystems refuse it) is said, and the ledger goes on writing to the new file, not to the
    unlinked old one."""
    import echo2.coordinator.ledger as ledger_module

    path, led, first, _ = two_checkpoints(tmp_path)

    def refuse(directory):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(ledger_module, "_fsync_directory", refuse)
    assert led.compact(first, threshold_bytes=0)
    assert "could not be fsynced" in caplog.text
    led.draw()
    end = led.sync()
    led.close()
    assert jr.size(path) == end
    assert Ledger.replay(path, G, ROWS, 0).drawn == 3


def test_a_rewrite_the_disk_refuses_leaves_the_journal_whole(tmp_path, monkeypatch, caplog):
    path, led, first, second = two_checkpoints(tmp_path)
    before = (second, open(path, "rb").read())

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("shutil.copyfileobj", full)
    assert not led.compact(first, threshold_bytes=0)
    assert "not compacted" in caplog.text and not os.path.exists(path + ".compacting")
    assert open(path, "rb").read() == before[1]
    led.draw()  # and the journal goes on being written where it was
    assert led.sync() > before[0]
    led.close()
    assert Ledger.replay(path, G, ROWS, 0).drawn == 3
