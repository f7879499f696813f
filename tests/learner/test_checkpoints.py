"""Checkpoint rotation (run.keep_checkpoints): a kill at any moment leaves a complete checkpoint to resume from."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import build_run
from echo2.learner.callbacks import CHECKPOINT_STATE, checkpoints_to_remove
from echo2.learner.trainer import Echo2GRPOTrainer  # noqa: F401  (TRL and DeepSpeed ask `uname` once, at import)


@pytest.mark.parametrize("found, keep, removed", [
    ({1: True}, 1, []),
    ({1: True, 2: True}, 1, [1]),  # called once 2 is complete: 1 goes
    ({1: True, 2: False}, 1, [2]),  # 2 never completed (its save failed): 1 stays, the wreck goes
    ({1: True, 2: True, 3: True}, 2, [1]),
    ({1: True, 2: True, 3: False, 4: True}, 2, [1, 3]),
    ({5: False, 2: True, 3: True}, 1, [2, 5]),  # a dead run's incomplete checkpoint past the newest complete one
    ({}, 1, []),
])
def test_checkpoints_to_remove(found, keep, removed):
    assert checkpoints_to_remove(found, keep) == removed


class KilledAtSave:
    """The sync source, but its checkpoint state at ``at`` cannot be had: the learner dies there, between HF's save
    of weights and optimizer and echo2's state, which completes the checkpoint (as a kill -9 or a full journal
    disk would leave it)."""

    def __init__(self, inner, at):
        self.inner, self.at, self.trainer = inner, at, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def checkpoint(self, kept=None):
        if self.trainer.state.global_step == self.at:
            raise OSError("killed while saving")
        return self.inner.checkpoint(kept)


def test_a_kill_while_saving_leaves_a_complete_checkpoint_with_one_kept(tmp_path):
    """keep_checkpoints=1: HF's rotation deleted the one complete checkpoint as soon as the new one's weights were
    written, before echo2's state completed it; a kill in between left nothing to resume from."""
    import train

    cfg, trainer, source, _ = build_run(tmp_path, ["rollout=sync", "run.steps=3", "run.save_every_steps=1",
                                                   "run.keep_checkpoints=1"])
    killed = KilledAtSave(source, at=2)
    killed.trainer = trainer
    trainer.rollout_source = killed
    with pytest.raises(OSError, match="killed while saving"):
        trainer.train()
    assert train.find_checkpoint(cfg, str(tmp_path)) == str(Path(tmp_path, "trainer", "checkpoint-1"))
    assert (Path(tmp_path, "trainer", "checkpoint-1") / CHECKPOINT_STATE).is_file()


def test_one_kept_means_one_left(tmp_path):
    cfg, trainer, source, _ = build_run(tmp_path, ["rollout=sync", "run.steps=3", "run.save_every_steps=1",
                                                   "run.keep_checkpoints=1"])
    trainer.train()
    assert sorted(p.name for p in Path(tmp_path, "trainer").glob("checkpoint-*")) == ["checkpoint-3"]


def test_each_save_tells_the_source_which_checkpoints_a_resume_may_still_use(tmp_path):
    """With keep_checkpoints=2 the rotation after a save keeps the new checkpoint and the newest complete one before
    it (or, if the save fails, the two newest complete ones): the source is told the two newest complete ones, an
    incomplete one never, so that what its journal drops no kept checkpoint needs."""
    import json
    from types import SimpleNamespace

    from echo2.learner.callbacks import SourceVersions

    told = []

    def checkpoint(kept):
        told.append(kept)
        return {"journal_offset": 10 * step}

    trainer = SimpleNamespace(rollout_source=SimpleNamespace(checkpoint=checkpoint))
    callback = SourceVersions(trainer, keep_checkpoints=2)
    for step in (1, 2, 3, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if step == 3:  # a wreck (killed while saving) beside the complete ones: never named
            (tmp_path / "checkpoint-9").mkdir()
        callback.on_save(SimpleNamespace(output_dir=str(tmp_path)),
                         SimpleNamespace(global_step=step, is_world_process_zero=True), None)
    offsets = [[k["journal_offset"] for k in kept] for kept in told]
    assert offsets == [[], [10], [10, 20], [20, 30]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    assert json.loads((tmp_path / "checkpoint-4" / CHECKPOINT_STATE).read_text())["source"] == {"journal_offset": 40}
    told.clear()
    SourceVersions(trainer, keep_checkpoints=None).on_save(  # every checkpoint kept: nothing may be dropped
        SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=4, is_world_process_zero=True), None)
    assert told == [None]


def test_the_async_source_asks_the_journal_to_keep_from_its_oldest_kept_checkpoint():
    from types import SimpleNamespace

    from echo2.learner.sources.async_source import AsyncRolloutSource

    asked = []
    coordinator = SimpleNamespace(mark=lambda keep_from: asked.append(keep_from) or 99)
    source = SimpleNamespace(version=5, _retry=lambda call: call(coordinator))
    for kept in (None, [], [{"version": 2, "journal_offset": 40}, {"version": 1, "journal_offset": 20}],
                 [{"version": 1}, {"version": 2, "journal_offset": 40}]):  # one saved by another source: keep all
        assert AsyncRolloutSource.checkpoint(source, kept) == {"version": 5, "journal_offset": 99}
    assert asked == [None, None, 20, None]


def test_a_checkpoint_state_that_cannot_be_read_keeps_the_whole_journal(tmp_path, caplog):
    """Rank 0 reads the kept checkpoints' states alone, before a call every rank joins: a damaged one must not raise
    there (the other ranks would wait in the collective); the source is told None (keep everything)."""
    from types import SimpleNamespace

    from echo2.learner.callbacks import SourceVersions

    told = []
    trainer = SimpleNamespace(rollout_source=SimpleNamespace(checkpoint=lambda kept: told.append(kept) or {}))
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / CHECKPOINT_STATE).write_text("{not json")
    (tmp_path / "checkpoint-2").mkdir()
    SourceVersions(trainer, keep_checkpoints=2).on_save(
        SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=2, is_world_process_zero=True), None)
    assert told == [None] and "keeps everything" in caplog.text


def test_a_stray_checkpoint_folder_is_passed_over_by_resume_and_export(tmp_path):
    """A folder named checkpoint-<not a number> (a copy, a backup) beside the real ones: resume and export stopped
    with ValueError on it (each globbed checkpoint-* and read the step as an int); now they skip it, as the rotation
    does. Export takes the newest complete checkpoint (one cut short by a kill may hold no weights, or torn ones)."""
    from omegaconf import OmegaConf

    import train
    from echo2.export import checkpoint_of

    trainer_dir = tmp_path / "trainer"
    for name in ("checkpoint-2", "checkpoint-10", "checkpoint-old", "checkpoint-11", "checkpoint-12"):
        (trainer_dir / name).mkdir(parents=True)
    for name in ("checkpoint-2", "checkpoint-10", "checkpoint-old", "checkpoint-11"):
        (trainer_dir / name / "model.safetensors").write_bytes(b"")
    for name in ("checkpoint-2", "checkpoint-10", "checkpoint-old"):  # checkpoint-11: weights, its save cut short
        (trainer_dir / name / CHECKPOINT_STATE).write_text("{}")
    cfg = OmegaConf.create({"run": {"resume": "auto"}})
    assert train.find_checkpoint(cfg, str(tmp_path)) == str(trainer_dir / "checkpoint-10")
    assert checkpoint_of(str(tmp_path)) == trainer_dir / "checkpoint-10"
