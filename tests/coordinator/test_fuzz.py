"""Fuzzing the parsers that face the network: the coordinator's routes and the relay's frames.

Whatever a peer sends, on whichever route, with whichever credential (or none, or two), the answer is a clear error
(HTTP 4xx / a refused frame), never a 500; nothing crashes, the coordinator's memory and registry stay bounded, and
the books still balance. Hypothesis drives the real route handlers and the real relay server over TCP.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import struct

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import balanced, small_coordinator
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


ROUTES = ["POST /register", "POST /pull", "POST /push", "POST /heartbeat", "POST /leave", "POST /release",
          "POST /revoke", "POST /certificate", "POST /manifest-key", "GET /status", "GET /ca"]
deep = st.integers(1, 5000).map(lambda n: "[" * n + "]" * n)  # past the recursion limit, and below it
raw_bodies = st.one_of(bodies.map(lambda b: json.dumps(b).encode()), st.binary(max_size=64), deep.map(str.encode),
                       st.just(b'{"worker_id": "w0", "results": [' + b'{}, ' * 2000 + b'{}]}'))  # past the push limit
callers = st.sampled_from(["secret", "fuzz", "none", "junk+fuzz", "fuzz+secret"])


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


@pytest.fixture(scope="module")
def every_route(tiny_model_dir):
    c = small_coordinator(tiny_model_dir, group_size=G)
    requests.post(c.url + "/register", json={}, headers={"Authorization": "Bearer secret"}, timeout=10)  # w0
    yield c, rss_bytes()
    assert balanced(c.close())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), data=raw_bodies, caller=callers)
def test_no_body_on_any_route_from_any_caller_gives_a_500_or_unbalances_the_books(every_route, route, data, caller):
    """Every route, any body (JSON of the routes' fields, bytes, nesting past the recursion limit, a push past its
    limit), as the run secret, a worker credential, nobody, or with two Authorization headers: the answer is never a
    500, the coordinator's memory stays within a bound, its registry within its caps, and the books balance."""
    from echo2.credential import worker_credential

    coord, rss0 = every_route
    method, path = route.split()
    creds = {"secret": ["secret"], "fuzz": [worker_credential("secret", "fuzz")], "none": [],
             "junk+fuzz": ["junk", worker_credential("secret", "fuzz")],
             "fuzz+secret": [worker_credential("secret", "fuzz"), "secret"]}[caller]
    conn = http.client.HTTPConnection(*coord.server.address, timeout=30)
    conn.putrequest(method, path)
    for cred in creds:
        conn.putheader("Authorization", f"Bearer {cred}")
    if method == "POST":
        conn.putheader("Content-Length", str(len(data)))
    conn.endheaders(data if method == "POST" else None)
    r = conn.getresponse()
    body = r.read()
    conn.close()
    assert r.status in (200, 400, 401, 403, 404, 409, 411, 413, 429, 507), (r.status, body[:300])
    assert r.status != 200 or isinstance(json.loads(body), dict)
    if r.status >= 400:
        assert "error" in json.loads(body)
    if len(creds) > 1:
        assert r.status == 400  # two credentials: refused, whatever they are
    if caller == "none" and route != "GET /ca":
        assert r.status == 401
    acc = coord.accounting()
    assert acc["dispatched"] == (acc["consumed"] + sum(acc["dropped"].values()) + sum(acc["lost"].values())
                                 + acc["in_flight"] + acc["buffered"])
    principal = coord.reg.principals.get("fuzz")
    assert principal is None or len(principal.ids) <= 16
    assert rss_bytes() - rss0 < 64 << 20


@pytest.fixture(scope="module")
def origin():
    store = Store()
    blob = os.urandom(3 * 4096)
    store.put(Snapshot(make_manifest(signing_key("secret"), 1, blob, 4096), blob))
    server = RelayServer(store, "secret", manifest_wait_s=0.2).start()
    # hundreds of connections from one address within seconds: past the rate one address may open connections at
    # (tests/broadcast/test_slots.py tests that rate); here only what a garbage frame does is under test
    server.slots.rate_per_address = 1e9
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
