"""Fuzzing the parsers that face the network: the coordinator's routes and the relay's frames.

Whatever a peer sends, the answer is a clear error (HTTP 4xx / a refused frame), nothing crashes, and the
books still balance. Hypothesis drives the real route handlers and the real relay server over TCP.
"""

from __future__ import annotations

import json
import os
import socket
import struct

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import small_coordinator
from echo2.broadcast.manifest import make_manifest, signing_key, verify_key
from echo2.broadcast.relay import Fetcher, RelayServer
from echo2.broadcast.store import Snapshot, Store

G = 2
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20)
field_names = st.sampled_from(["worker_id", "version", "max_groups", "results", "group_id", "completions",
                               "token_ids", "logprobs", "finish_reason", "rollouts_per_s", "relay", "usd_per_hour",
                               "snapshot_url", "engine"])
bodies = st.dictionaries(field_names, json_values, max_size=6) | json_values


@pytest.fixture(scope="module")
def coord(tiny_model_dir):
    c = small_coordinator(tiny_model_dir, group_size=G)
    yield c
    c.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["/register", "/pull", "/push", "/heartbeat", "/leave"]), body=bodies,
       raw=st.one_of(st.none(), st.binary(max_size=64)))
def test_coordinator_routes_never_crash(coord, route, body, raw):
    data = raw if raw is not None else json.dumps(body).encode()
    r = requests.post(coord.url + route, data=data, headers={"Authorization": "Bearer secret"}, timeout=10)
    assert r.status_code in (200, 400), (r.status_code, r.text)
    assert "error" in r.json() if r.status_code == 400 else isinstance(r.json(), dict)
    if r.status_code == 400:
        assert coord.metrics()["rollout/rejected_requests"] >= 1  # logged and counted
    acc = coord.accounting()
    assert acc["dispatched"] == (acc["consumed"] + sum(acc["dropped"].values()) + sum(acc["lost"].values())
                                 + acc["in_flight"] + acc["buffered"])


@pytest.fixture(scope="module")
def origin():
    store = Store()
    blob = os.urandom(3 * 4096)
    store.put(Snapshot(make_manifest(signing_key("secret"), 1, blob, 4096), blob))
    server = RelayServer(store, "secret", manifest_wait_s=0.2).start()
    yield server
    server.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=st.one_of(st.binary(max_size=64), bodies.map(lambda b: _frame(b)),
                       st.dictionaries(st.sampled_from(["version", "base", "start", "end", "mac"]), json_values,
                                       max_size=5).map(lambda b: _frame(b))))
def test_relay_server_refuses_garbage_and_keeps_serving(origin, frame):
    refused = origin.refused
    data = b""
    with socket.create_connection(origin.addr, timeout=5) as s:
        s.sendall(frame)
        try:
            s.shutdown(socket.SHUT_WR)  # ENOTCONN when it already refused the frame and reset the connection
            while chunk := s.recv(65536):
                data += chunk
        except OSError:  # it closed on unread garbage (a reset); the refusal may be lost with it
            pass
    if data:  # whatever it answered is a refusal: no weights for anyone without the token
        (n,) = struct.unpack("!I", data[:4])
        assert "error" in json.loads(data[4:4 + n])
    if frame:
        assert origin.refused == refused + 1  # counted (and logged), whatever the frame was
    # and it still serves a proper request
    f = Fetcher(Store(), "secret", stall_timeout_s=2, manifest_key=verify_key("secret"))
    assert f.fetch(1, [origin.addr]).complete
    f.close()


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack("!I", len(data)) + data
