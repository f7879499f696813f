"""A learner resumed from a checkpoint, with a remote worker ahead of the resumed version or behind it: the worker
is told the new epoch, gets the resumed weights over the relay, and goes on; it never exits, never pushes with
the dead run's weights, and never serves them."""

from __future__ import annotations

import threading
import time

import pytest
from transformers import AutoTokenizer

from conftest import wait_until
from echo2.coordinator.broadcaster import RelayBroadcaster
from echo2.net import rendezvous
from echo2.worker.agent import Agent
from echo2.coordinator.coordinator import Coordinator
from echo2.settings import CoordinatorSettings
from echo2.scoring import Scorer
from echo2.records import Completion
from echo2.tasks.arith import ArithTask

G = 2


class RecordingEngine:
    """Generates fixed completions and records every weight load (version, first bytes) and, for every batch, the
    weights it was generated with and the epoch its agent had joined."""

    name = "recording"

    def __init__(self):
        self.loads: list[tuple[int, bytes]] = []
        self.batches: list[tuple[bytes, str | None]] = []
        self.agent = None

    def load_weights(self, version, blob):
        self.loads.append((version, bytes(blob[:8])))

    def generate(self, prompts, params):
        self.batches.append((self.loads[-1][1] if self.loads else b"initial", self.agent.joined_epoch))
        return [[Completion([5, 1], [-1.0, -0.2], "stop") for _ in range(params.n)] for _ in prompts]

    def close(self):
        pass


def learner(tiny_model_dir, epoch, version, port=0):
    """A coordinator + broadcaster as one learner process holds them (in this process; S = 2, P = 2)."""
    task = ArithTask(level="copy", train_size=20)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    bc = RelayBroadcaster("secret", topology="chain", chunk_mb=1, retry_s=0.5)
    coord = Coordinator(task.train_dataset(), Scorer(task, tok), tok, CoordinatorSettings(
        token="secret", staleness=2, prompts_per_step=2, group_size=G, vocab_size=len(tok), port=port, epoch=epoch,
        version=version, heartbeat_timeout_s=4.0, long_poll_s=0.2,
        sampling={"max_tokens": 3, "temperature": 1.0, "top_p": 1.0, "top_k": 0}), bc).start()
    return coord, bc


def blob(tag: bytes) -> bytes:
    return tag.ljust(8, b".") + bytes(4096)


def advance(coord, bc, to_version, tag):
    """The learner's steps up to ``to_version``: take a batch, bump the version, publish."""
    while coord.version < to_version:
        coord.take(2, timeout_s=30)
        coord.set_version(coord.version + 1)
        bc.publish(coord.version, blob(tag))


def point_to(run_dir, coord) -> None:
    """The learner's coordinator.json, as the learner writes it when its coordinator is up."""
    rendezvous.write(str(run_dir), coord.url, {"model": {"name": "tiny"}, "max_model_len": 16})


# ahead: the dead run reached v5, the checkpoint was v3. behind: the worker comes back when the resumed run is at
# v6; its v5 is within S = 2 of it, so only the epoch tells that v5 is the dead run's. moved: as ahead, but the
# resumed learner comes back at another address (a requeued job on another node), which only its coordinator.json
# tells the worker.
@pytest.mark.parametrize("dead_at, resumed_at, moved", [(5, 3, False), (5, 6, False), (5, 3, True)],
                         ids=["ahead", "behind", "moved"])
def test_a_remote_worker_follows_a_resumed_learner(tiny_model_dir, tmp_path, dead_at, resumed_at, moved, caplog):
    coord, bc = learner(tiny_model_dir, "dead", 0)
    port = coord.server.address[1]
    point_to(tmp_path, coord)
    engine = RecordingEngine()
    agent = Agent(coord.url, "secret", engine, reconnect_timeout_s=60,
                  rendezvous=str(tmp_path / rendezvous.FILE) if moved else None)
    engine.agent = agent
    failed = []
    thread = threading.Thread(target=lambda: _run(agent, failed), daemon=True)
    thread.start()
    try:
        wait_until(lambda: coord.status()["registered"] == 1, timeout_s=30)
        advance(coord, bc, dead_at, b"dead")
        wait_until(lambda: agent.version == dead_at, timeout_s=30)
        assert engine.loads[-1] == (dead_at, blob(b"dead")[:8])
        # the learner dies; the same command resumes it from its checkpoint at ``resumed_at``, on the same port
        bc.close()
        coord.abort()
        time.sleep(1.0)
        coord, bc = learner(tiny_model_dir, "resumed", resumed_at, port=0 if moved else port)
        assert (coord.server.address[1] != port) == moved
        point_to(tmp_path, coord)
        bc.publish(resumed_at, blob(b"resumed"))  # AsyncRolloutSource.on_resume
        wait_until(lambda: agent.version == resumed_at and agent.epoch == "resumed", timeout_s=60)
        assert engine.loads[-1] == (resumed_at, blob(b"resumed")[:8]), engine.loads
        assert not failed and thread.is_alive(), failed
        # it works for the resumed run, with the resumed weights, and follows its next versions
        advance(coord, bc, resumed_at + 2, b"next")
        wait_until(lambda: agent.version == resumed_at + 2, timeout_s=30)
        acc = coord.accounting()
        assert acc["by_worker"].get("w0", 0) >= 2 * 2 * G and "future_version" not in acc["dropped"], acc
        # refused only as unknown ("register first", which made it re-join), never for its version
        assert set(coord.server.rejected) <= {"BadRequest"} and "'version' must be" not in caplog.text, caplog.text
        assert agent.reconnects >= 1
        assert agent.client.base_url == coord.url and ("the learner moved" in caplog.text) == moved
        held = [bytes(snap.buf[:8]) for snap in agent.receiver.store.snaps.values()]
        assert held and blob(b"dead")[:8] not in held, held  # it cannot serve the dead run's weights to peers
        assert not failed and thread.is_alive(), failed
        # not one batch for the resumed run was generated with the dead run's weights
        assert (blob(b"dead")[:8], "resumed") not in engine.batches and (blob(b"next")[:8], "resumed") in engine.batches
    finally:
        agent.stop.set()
        thread.join(timeout=10)
        agent.shutdown()
        bc.close()
        coord.close()


def _run(agent, failed):
    try:
        agent.run()
    except BaseException as e:  # the agent would exit here: the test fails on it
        failed.append(repr(e))
