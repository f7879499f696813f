"""The worker agent's own rules (echo2/worker/agent.py), without an engine or a learner."""

from __future__ import annotations

import json

import pytest

from echo2.net import rendezvous
from echo2.net.tls import RunCA, Trust
from echo2.worker.agent import Agent


def write(path, url: str, ca_hash: str | None) -> None:
    path.write_text(json.dumps({"url": url, "model": {"name": "tiny"}, "max_model_len": 16, "ca_hash": ca_hash}))


@pytest.mark.parametrize("url, ca, follows", [
    ("https://b.example:9000", "pinned", True),  # the learner moved, same run: followed
    ("https://a.example:8700", "pinned", False),  # unchanged
    ("http://b.example:9000", "pinned", False),  # https -> http: the credential would cross in the clear
    ("http://b.example:9000", None, False),
    ("https://b.example:9000", "other", False),  # another CA: another run, or a file someone else wrote
    ("https://b.example:9000", None, False),
])
def test_coordinator_json_never_moves_a_worker_off_its_scheme_or_ca(tmp_path, url, ca, follows):
    run_ca = RunCA(str(tmp_path / "ca"))
    trust = Trust(run_ca.ca_pem, run_ca.ca_file, None)
    hashes = {"pinned": run_ca.fingerprint, "other": RunCA(str(tmp_path / "other")).fingerprint, None: None}
    path = tmp_path / rendezvous.FILE
    agent = Agent("https://a.example:8700", "t0k", engine=None, trust=trust, rendezvous=str(path))
    try:
        write(path, url, hashes[ca])
        assert agent._learner_moved() is follows
        assert agent.client.base_url == (url if follows else "https://a.example:8700")
    finally:
        agent.client.close()


def test_a_plain_http_worker_stays_on_http(tmp_path):
    """A worker of a run without TLS (loopback, or rollout.source.tls=off) follows a move over http, not to https
    (it holds no CA to verify one with)."""
    path = tmp_path / rendezvous.FILE
    agent = Agent("http://127.0.0.1:8700", "t0k", engine=None, rendezvous=str(path))
    try:
        write(path, "http://127.0.0.1:9000", None)
        assert agent._learner_moved() and agent.client.base_url == "http://127.0.0.1:9000"
        write(path, "https://127.0.0.1:9100", "sha256:" + "0" * 64)
        assert not agent._learner_moved() and agent.client.base_url == "http://127.0.0.1:9000"
    finally:
        agent.client.close()


@pytest.mark.parametrize("engine, snapshot, probe, nats", [
    ("float32", "float32", "float32", 1e-3),    # float32 everywhere: float noise only
    ("float32", "bfloat16", "float32", 0.25),   # a bf16 snapshot served in float32: its weights' rounding
    ("bfloat16", "bfloat16", "float32", 0.5),   # a bf16 engine rounds every activation too
    ("float32", "bfloat16", "bfloat16", 0.5),   # so does a bf16 probe (ZeRO-3 in DeepSpeed's bf16 mode)
    ("float32", "float32", "bfloat16", 0.5),
])
def test_the_probe_tolerance_allows_for_half_precision_on_either_side(engine, snapshot, probe, nats):
    """A probe computed in bf16 (a bf16 LoRA base's, before it was read in float32) was 0.26 nats from a float32
    vLLM engine on SmolLM2-135M: past 0.25, the worker refused the first version and the run stopped. The manifest
    states the probe's compute dtype (bf16 under ZeRO-3 in DeepSpeed's bf16 mode), and the worker allows for it as
    for its own engine's."""
    from echo2.worker.agent import default_probe_tolerance

    assert default_probe_tolerance(engine, snapshot, probe) == nats
    agent = Agent.__new__(Agent)
    agent.probe_tolerance, agent.engine_dtype = None, engine
    assert agent._tolerance({"dtype": snapshot, "compute_dtype": probe}) == nats
    if probe == "float32":
        assert agent._tolerance({"dtype": snapshot}) == nats  # a manifest without it: a float32 probe
