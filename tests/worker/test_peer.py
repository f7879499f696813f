"""The worker's control server (echo2/worker/peer.py): it takes the learner's orders, each judged on exactly one
credential."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from conftest import post_with_credentials
from echo2.broadcast.manifest import order_credential, signing_key
from echo2.worker.peer import SnapshotReceiver

SECRET = "secret"
SIGNER = signing_key(SECRET)


def post(url: str, path: str, body: dict, credentials: list[str]) -> tuple[int, dict]:
    parts = urlsplit(url)
    return post_with_credentials(parts.hostname, parts.port, path, body, credentials)


@pytest.fixture
def receiver():
    r = SnapshotReceiver.of_run(SECRET, lambda *a: None).start()
    yield r
    r.close()


def test_an_order_with_two_credentials_is_refused(receiver):
    """The server judges a credential before the body is read and the route checks the order against one again:
    with two headers those could be two different credentials. Refused, whatever the two are; one is taken."""
    body_a, body_b = {"epoch": None, "key": "ab" * 32}, {"epoch": None, "key": "cd" * 32}
    a = order_credential(SIGNER, receiver.url, 100, body_a)
    b = order_credential(SIGNER, receiver.url, 101, body_b)
    for credentials, body in [([a, a], body_a), ([a, b], body_a), ([b, a], body_a), (["junk", b], body_b)]:
        status, answer = post(receiver.url, "/key", body, credentials)
        assert status == 400 and "Authorization" in answer["error"], (credentials, answer)  # the wire refuses it
    assert receiver.token is None  # none of them was taken
    assert post(receiver.url, "/key", body_a, [a]) == (200, {"ok": True}) and receiver.token == "ab" * 32
