"""The ledger's journal: replay gives back the exact books and data position, at any prefix; recovery after a
coordinator restart or a learner resume keeps the accounting identity and the checkpoint's data position."""

from __future__ import annotations

import json
import os
import random

import pytest

from echo2.coordinator.ledger import BUFFERED, IN_FLIGHT, Ledger, index_stream

G, ROWS = 4, 7


def balanced(acc):
    return acc["dispatched"] == (acc["consumed"] + sum(acc["dropped"].values()) + sum(acc["lost"].values())
                                 + acc["in_flight"] + acc["buffered"])


def drive(led: Ledger, rng: random.Random, n: int, marks: list | None = None) -> None:
    """``n`` random transitions, as a coordinator would make them; ``marks`` collects (position, state)."""
    for _ in range(n):
        flying = [g for g, (_, s) in led.open.items() if s == IN_FLIGHT]
        buffered = [g for g, (_, s) in led.open.items() if s == BUFFERED]
        op = rng.random()
        if op < 0.35 or not led.open:
            led.draw()
        elif op < 0.55 and flying:
            led.received(rng.choice(flying), f"w{rng.randrange(3)}")
        elif op < 0.65 and flying:
            led.lose(rng.choice(flying), "worker_dead")
        elif op < 0.7 and flying:
            led.drop(rng.choice(flying), "invalid", requeue=True)
        elif op < 0.85 and len(buffered) >= 2:
            rows = [led.open[g][0] for g in buffered[:2]]
            led.consumed(buffered[:2])
            if rng.random() < 0.2:  # the learner's checks found the batch's groups untrusted
                led.distrusted(buffered[:1], rows[:1], "untrusted")
        elif op < 0.9 and buffered:
            led.drop(buffered[0], "stale", requeue=False)
        elif op < 0.92:
            led.new_worker_id()
        elif op < 0.93:
            led.retire(f"w{rng.randrange(3)}", rng.choice(["worker_dead", "worker_left"]))
        elif op < 0.94:
            led.refuse("not_in_flight_for_this_worker", rng.randrange(1, 4))
        if marks is not None and rng.random() < 0.1:
            marks.append((led.position(), json.loads(json.dumps(led.state()))))


@pytest.mark.parametrize("seed", range(5))
def test_replay_of_any_prefix_gives_back_the_state_then(tmp_path, seed):
    path = str(tmp_path / "j")
    led = Ledger(G, ROWS, seed)
    led.open_journal(path)
    marks = []
    drive(led, random.Random(seed), 400, marks)
    marks.append((led.position(), json.loads(json.dumps(led.state()))))
    assert len(marks) > 5
    for position, state in marks:
        assert json.loads(json.dumps(Ledger.replay(path, G, ROWS, seed, upto=position).state())) == state
    # the stream goes on where it was: the next rows drawn are the same
    again = Ledger.replay(path, G, ROWS, seed)
    led.requeue.clear(), again.requeue.clear()
    assert [led.draw()[1] for _ in range(10)] == [again.draw()[1] for _ in range(10)]
    assert balanced(led.accounting())


def test_a_torn_last_line_is_ignored_and_a_corrupt_one_is_an_error(tmp_path):
    path = tmp_path / "j"
    led = Ledger(G, ROWS)
    led.open_journal(str(path))
    led.draw(), led.draw()
    led.close()
    with open(path, "a") as f:
        f.write('["d","g2",')  # the process died mid-line
    assert Ledger.replay(str(path), G, ROWS, 0).accounting()["dispatched"] == 2 * G
    new = Ledger.after_coordinator_restart(str(path), G, ROWS, 0)  # cuts the torn line off before appending
    new.close()
    assert Ledger.replay(str(path), G, ROWS, 0).state() == new.state()
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], '["?"]', *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="line 2: ValueError: unknown event"):
        Ledger.replay(str(path), G, ROWS, 0)


@pytest.mark.parametrize("seed", range(5))
def test_coordinator_restart_counts_what_was_open_and_requeues_its_prompts(tmp_path, seed):
    path = str(tmp_path / "j")
    led = Ledger(G, ROWS, seed)
    led.open_journal(path)
    drive(led, random.Random(seed), 300)
    open_before = dict(led.open)
    requeue_before = list(led.requeue)
    led.close()  # the process dies

    new = Ledger.after_coordinator_restart(path, G, ROWS, seed)
    acc = new.accounting()
    assert balanced(acc) and acc["in_flight"] == acc["buffered"] == 0
    n_flying = sum(s == IN_FLIGHT for _, s in open_before.values())
    assert acc["lost"].get("coordinator_restart", 0) == n_flying * G
    assert acc["dropped"].get("coordinator_restart", 0) == (len(open_before) - n_flying) * G
    assert sorted(new.requeue) == sorted(requeue_before + [r for r, _ in open_before.values()])
    assert new.next_group == led.next_group and new.next_worker == led.next_worker
    drive(new, random.Random(seed + 100), 50)  # carries on; a second replay sees all of it
    assert Ledger.replay(path, G, ROWS, seed).state() == new.state()


@pytest.mark.parametrize("seed", range(5))
def test_learner_resume_rewinds_the_data_position_and_books_the_dead_runs_work(tmp_path, seed):
    path = str(tmp_path / "j")
    rng = random.Random(seed)
    led = Ledger(G, ROWS, seed)
    led.open_journal(path)
    drive(led, rng, 200)
    offset, at = led.position(), Ledger.replay(path, G, ROWS, seed)  # the checkpoint
    drive(led, rng, 150)  # the run goes on, then is killed
    final = led.accounting()
    led.close()

    new = Ledger.after_learner_resume(path, offset, G, ROWS, seed)
    acc = new.accounting()
    assert balanced(acc) and acc["in_flight"] == acc["buffered"] == 0
    assert acc["dispatched"] == final["dispatched"]  # nothing the dead run handed out is forgotten
    assert acc["consumed"] == at.rollouts["consumed"]  # trained-on rollouts: those of the steps kept
    assert acc["dropped"].get("discarded_by_resume", 0) == final["consumed"] - at.rollouts["consumed"]
    assert acc["lost"].get("learner_restart", 0) == final["in_flight"]
    assert acc["dropped"].get("learner_restart", 0) == final["buffered"]
    # data position: the checkpoint's re-queue, then the prompts of the groups open then, then its stream
    expect = [*at.requeue, *(at.open[g][0] for g in sorted(at.open, key=lambda g: int(g[1:])))]
    stream = index_stream(ROWS, seed, skip=at.drawn)
    expect += [next(stream) for _ in range(10)]
    assert [new.draw()[1] for _ in range(len(expect))] == expect
    assert int(new.draw()[0][1:]) > int(max(led.state()["open"] or ["g0"], key=lambda g: int(g[1:]))[1:])


class _FullDisk:
    """The journal's file while the disk is full: every write fails after writing half its bytes (ENOSPC)."""

    def __init__(self, f):
        self.f, self.full = f, True

    def write(self, data):
        if self.full:
            self.f.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_never_loses_a_transition_and_the_journal_stays_whole(tmp_path):
    """Writes that fail (ENOSPC) change nothing on disk but leave the transitions applied and held in memory: the
    books stay exact, the file a whole-line prefix of them, a checkpoint (sync) refuses to name a point it does not
    reach, and once the disk takes them again the journal replays to the very same state."""
    path = tmp_path / "j"
    led = Ledger(G, ROWS, 0)
    led.open_journal(str(path))
    drive(led, random.Random(1), 50)
    before = (led.position(), json.loads(json.dumps(led.state())))
    led.journal = disk = _FullDisk(led.journal)
    drive(led, random.Random(2), 50)  # every one of these writes fails
    assert balanced(led.accounting()) and led.journal_errors > 0 and led.pending
    assert path.stat().st_size == before[0]  # the half-written lines were cut off again
    assert json.loads(json.dumps(Ledger.replay(str(path), G, ROWS, 0).state())) == before[1]
    from echo2.coordinator.ledger import JournalError

    with pytest.raises(JournalError, match="cannot be written"):
        led.sync()
    disk.full = False
    offset = led.sync()  # everything held is written, in order, and fsynced
    assert offset == path.stat().st_size and not led.pending
    assert Ledger.replay(str(path), G, ROWS, 0).state() == led.state()


def test_each_transition_is_journaled_before_it_is_applied(tmp_path):
    """A write that fails outright (the journal file is gone bad) still leaves a consistent ledger, and a transition
    that cannot apply (a group that is not open) is refused before anything is written."""
    path = tmp_path / "j"
    led = Ledger(G, ROWS, 0)
    led.open_journal(str(path))
    gid, _ = led.draw()
    size = path.stat().st_size
    with pytest.raises(KeyError, match="not open"):
        led.received("g99", "w0")
    assert path.stat().st_size == size and led.open == {gid: [led.open[gid][0], IN_FLIGHT]}


def test_many_refusals_are_one_journal_line(tmp_path):
    path = tmp_path / "j"
    led = Ledger(G, ROWS, 0)
    led.open_journal(str(path))
    led.refuse("not_in_flight_for_this_worker", 200_000)
    led.close()
    assert len(path.read_text().splitlines()) == 1
    assert Ledger.replay(str(path), G, ROWS, 0).refused == {"not_in_flight_for_this_worker": 200_000}


def test_a_resume_checks_the_journal_reaches_the_checkpoint(tmp_path):
    """A checkpoint's offset past the journal's end (another run's journal, or one cut short) or inside a line is a
    clear error, not a resume that re-queues rows already consumed and glues its lines to a torn one."""
    path = tmp_path / "j"
    led = Ledger(G, ROWS, 0)
    led.open_journal(str(path))
    drive(led, random.Random(3), 100)
    offset = led.position()
    led.close()
    with open(path, "ab") as f:  # the process died mid-write
        f.write(b'["d","g9')
    path.write_bytes(path.read_bytes()[: offset - 40] + path.read_bytes()[offset:])  # the file lost 40 bytes
    with pytest.raises(ValueError, match="checkpoint's position.*(past its end|inside a line)"):
        Ledger.after_learner_resume(str(path), offset, G, ROWS, 0)


def test_a_resume_cuts_a_torn_last_line_so_that_a_later_restart_works(tmp_path, caplog):
    path = tmp_path / "j"
    led = Ledger(G, ROWS, 0)
    led.open_journal(str(path))
    drive(led, random.Random(4), 100)
    offset = led.position()
    drive(led, random.Random(5), 50)
    led.close()
    with open(path, "ab") as f:
        f.write(b'["c",["g1",')  # torn
    resumed = Ledger.after_learner_resume(str(path), offset, G, ROWS, 0)
    drive(resumed, random.Random(6), 30)
    resumed.close()
    assert "torn last line" in caplog.text
    again = Ledger.after_coordinator_restart(str(path), G, ROWS, 0)  # the journal is whole: it replays
    assert balanced(again.accounting())


def test_the_journal_is_fsynced_at_a_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    from conftest import small_coordinator

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    coord = small_coordinator(tiny_model_dir, journal=str(tmp_path / "rollouts.journal"))
    try:
        offset = coord.mark()
        assert synced and offset == (tmp_path / "rollouts.journal").stat().st_size
    finally:
        coord.close()


def test_a_coordinators_mark_compacts_its_journal_down_to_the_oldest_kept_checkpoint(tiny_model_dir, tmp_path):
    """Through the coordinator's own mark (what the learner's checkpoint calls): the journal's prefix before the
    kept checkpoint's state line goes, its offsets stay, and a resume from that checkpoint gives the same books."""
    from conftest import small_coordinator
    from echo2.coordinator import journal as jr

    path = str(tmp_path / "rollouts.journal")
    coord = small_coordinator(tiny_model_dir, journal=path, journal_compact_mb=0)
    try:
        for _ in range(3):
            coord.ledger.draw()
        kept = coord.mark()
        whole = open(path, "rb").read()
        for _ in range(3):
            coord.ledger.draw()
        end = coord.mark(keep_from=kept)
        assert jr.first_and_shift(path)[0] == whole.rfind(b"\n", 0, kept - 1) + 1 > 0
        assert jr.size(path) == end and jr.read(path, end - 1, end) == b"\n"
        assert os.path.getsize(path) < end
    finally:
        coord.close()
    resumed = Ledger.after_learner_resume(path, kept, 2, 20, 0)
    assert resumed.drawn == 3 and len(resumed.requeue) == 3 and resumed.rollouts["dispatched"] == 6 * 2
    never = str(tmp_path / "never.journal")  # rollout.source.journal_compact_mb=null: the whole history kept
    coord = small_coordinator(tiny_model_dir, journal=never, journal_compact_mb=None)
    try:
        coord.ledger.draw()
        kept = coord.mark()
        coord.ledger.draw()
        coord.mark(keep_from=kept)
        assert jr.first_and_shift(never) == (0, 0)
    finally:
        coord.close()


def test_the_checkpoint_state_file_is_fsynced(tmp_path, monkeypatch):
    """echo2_state.json (the version and journal offset a resume starts from) reaches the disk before its name."""
    from types import SimpleNamespace

    from echo2.learner.callbacks import CHECKPOINT_STATE, SourceVersions

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    (tmp_path / "checkpoint-3").mkdir()
    trainer = SimpleNamespace(rollout_source=SimpleNamespace(checkpoint=lambda kept: {"version": 3, "journal_offset": 7}))
    SourceVersions(trainer).on_save(SimpleNamespace(output_dir=str(tmp_path)),
                                    SimpleNamespace(global_step=3, is_world_process_zero=True), None)
    assert json.loads((tmp_path / "checkpoint-3" / CHECKPOINT_STATE).read_text())["source"]["journal_offset"] == 7
    assert len(synced) == 2  # the file, then its directory
