"""The probe computed beside the coordinator (echo2/coordinator/prober.py): a published version whose probe the learner
left out gets it from the probe process before the broadcaster signs its manifest; a probe that fails twice leaves
that version unpublished and counted, and the next one goes; closing the coordinator ends the process."""

from __future__ import annotations

import os
import time

import pytest
import torch

from conftest import small_coordinator
from echo2.broadcast import snapshot
from echo2.coordinator.broadcaster import RelayBroadcaster
from echo2.metrics import BROADCAST_PROBE_FAILURES, BROADCAST_PROBE_S
from echo2.coordinator.prober import SnapshotProbe

pytestmark = pytest.mark.e2e  # the probe process is a process

IDS = list(range(3, 20))
PENDING = {"token_ids": IDS, "logprobs": None, "dtype": "float32", "compute_dtype": "float32", "adapter": False}


def trained_snapshot(model_dir: str, seed: int) -> bytes:
    """The tiny model's weights, moved as a training step would move them, as a full snapshot."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return snapshot.encode(model.state_dict())


def wait_for(cond, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_coordinator_computes_a_left_out_probe_from_the_snapshot_and_skips_a_version_whose_probe_fails(
        tiny_model_dir, capfd):
    bc = RelayBroadcaster("s3cret-for-tests", topology="chain", chunk_mb=1)
    coordinator = small_coordinator(tiny_model_dir, broadcaster=bc, probe_model=tiny_model_dir)
    try:
        blob = trained_snapshot(tiny_model_dir, 1)
        capfd.readouterr()
        coordinator.publish(1, blob, dict(PENDING), "float32")
        wait_for(lambda: bc.latest == 1)
        # the probe process loaded its model without a progress bar (it would cut through the learner's)
        assert "Loading weights" not in capfd.readouterr().err
        signed = bc.full_manifest["probe"]
        assert {k: v for k, v in signed.items() if k != "logprobs"} == {k: v for k, v in PENDING.items()
                                                                       if k != "logprobs"}
        expected = SnapshotProbe(tiny_model_dir, "float32")(blob, IDS)
        torch.testing.assert_close(signed["logprobs"], expected, atol=1e-6, rtol=0)
        assert coordinator.metrics()[BROADCAST_PROBE_S] > 0
        pid = coordinator.prober.proc.pid

        # bytes that are no snapshot of this model: the probe fails, in the process and in a fresh one; v2 is not
        # published, and v3 is, by a third process
        coordinator.publish(2, snapshot.encode({"nope": torch.zeros(3)}), dict(PENDING), "float32")
        wait_for(lambda: coordinator.metrics()[BROADCAST_PROBE_FAILURES] == 1)
        assert bc.latest == 1
        coordinator.publish(3, trained_snapshot(tiny_model_dir, 3), dict(PENDING), "float32")
        wait_for(lambda: bc.latest == 3)
        assert bc.full_manifest["probe"]["logprobs"] != signed["logprobs"]
        assert coordinator.prober.proc.pid != pid
        pid = coordinator.prober.proc.pid
    finally:
        coordinator.close()
    assert coordinator.prober.proc is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, not only killed


def test_a_coordinator_without_a_probe_model_refuses_a_left_out_probe(tiny_model_dir):
    bc = RelayBroadcaster("s3cret-for-tests", topology="chain", chunk_mb=1)
    coordinator = small_coordinator(tiny_model_dir, broadcaster=bc)
    try:
        with pytest.raises(ValueError, match="no prober"):
            coordinator.publish(1, trained_snapshot(tiny_model_dir, 1), dict(PENDING), "float32")
    finally:
        coordinator.close()
