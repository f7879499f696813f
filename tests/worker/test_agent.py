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
