"""TLS pinned to the run: the CA and its fingerprint, the pinned join, names, the relay over TLS, and a run with
TLS forced on over loopback (rollout.source.tls=on)."""

from __future__ import annotations

import os
import socket
import ssl
import threading

import pytest
import requests

from conftest import balanced, slow_until, small_coordinator, train, wait_until
from echo2.net.http import Client, JsonServer, RemoteError
from echo2.net.tls import (LEARNER_NAME, PEER_NAME, RunCA, Trust, fetch_ca, fingerprint, is_loopback, join,
                           server_context)


@pytest.fixture
def ca(tmp_path):
    return RunCA(str(tmp_path / "ca"))


@pytest.fixture
def tls_coord(tiny_model_dir, ca):
    c = small_coordinator(tiny_model_dir, tls_dir=ca.dir)
    yield c
    c.close()


def test_the_ca_is_kept_for_the_run_and_its_fingerprint_is_of_its_key(ca, tmp_path):
    again = RunCA(ca.dir)  # a restarted coordinator or a resumed learner: the same CA, the same pin
    assert again.fingerprint == ca.fingerprint == fingerprint(ca.ca_pem) and ca.fingerprint.startswith("sha256:")
    assert RunCA(str(tmp_path / "other")).fingerprint != ca.fingerprint
    assert oct(os.stat(os.path.join(ca.dir, "ca.key")).st_mode & 0o777) == "0o600"


def test_loopback_is_recognised():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.2") and not is_loopback("learner.example")


@pytest.mark.parametrize("mode, host, sender_host, tls, warns", [
    ("auto", "127.0.0.1", "127.0.0.1", False, False),   # all on loopback: plain HTTP, nothing to say
    ("auto", "0.0.0.0", "127.0.0.1", True, False),      # the coordinator is exposed: TLS
    ("auto", "127.0.0.1", "0.0.0.0", True, False),      # the snapshot sender is exposed: TLS
    ("on", "127.0.0.1", "127.0.0.1", True, False),
    ("off", "127.0.0.1", "127.0.0.1", False, False),    # off, but nothing exposed: nothing crosses a network
    ("off", "0.0.0.0", "0.0.0.0", False, True),         # the explicit opt-out off loopback is logged
])
def test_the_learner_decides_tls_from_its_addresses_and_logs_the_opt_out(tmp_path, caplog, mode, host, sender_host,
                                                                        tls, warns):
    import logging
    from types import SimpleNamespace

    from echo2.learner.sources.async_source import AsyncRolloutSource

    source = SimpleNamespace(broadcaster={"host": sender_host}, run_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="echo2.learner.sources.async_source"):
        pin, tls_dir = AsyncRolloutSource._tls(source, mode, host)
    assert (pin is not None) == tls and (tls_dir is not None) == tls
    if tls:
        assert pin == RunCA(tls_dir).fingerprint
    opted_out = [r.getMessage() for r in caplog.records if "tls=off" in r.getMessage()]
    assert bool(opted_out) == warns, opted_out
    if warns:
        assert "0.0.0.0" in opted_out[0] and "in the clear" in opted_out[0]
    with pytest.raises(ValueError, match="expected auto, on or off"):
        AsyncRolloutSource._tls(source, "maybe", host)


def test_a_worker_joins_with_the_pin_and_is_refused_without_it(tls_coord, ca, tmp_path):
    assert tls_coord.url.startswith("https://")
    trust = join(tls_coord.url, "secret", ca.fingerprint, str(tmp_path / "w"))
    client = Client(tls_coord.url, "secret", ca_file=trust.ca_file, server_name=LEARNER_NAME)
    assert client.post("/register", {})["worker_id"] == "w0"
    with pytest.raises(ssl.SSLError, match="not the pinned"):  # a wrong pin (or a man in the middle)
        fetch_ca(tls_coord.url, RunCA(str(tmp_path / "mitm")).fingerprint)
    with pytest.raises(RemoteError, match="401"):  # the CA is public, a certificate is not
        join(tls_coord.url, "wrong-token", ca.fingerprint, str(tmp_path / "w2"))
    with pytest.raises(ValueError, match="--ca-hash"):
        Client(tls_coord.url, "secret")
    with pytest.raises(requests.exceptions.ConnectionError):  # plain HTTP to a TLS server gets nowhere
        requests.post(tls_coord.url.replace("https", "http") + "/register", json={}, timeout=5)


def test_clients_verify_against_the_run_ca_and_the_role_name(tls_coord, ca, tmp_path):
    other = RunCA(str(tmp_path / "other"))
    with pytest.raises(requests.exceptions.SSLError):  # another run's CA
        Client(tls_coord.url, "secret", ca_file=other.ca_file, server_name=LEARNER_NAME).post("/register", {})
    with pytest.raises(requests.exceptions.SSLError):  # the right CA, a name the learner's certificate lacks
        Client(tls_coord.url, "secret", ca_file=ca.ca_file, server_name="other.echo2.invalid").post("/register", {})
    # a worker's certificate (as issued by /certificate) names a peer, not the learner: it cannot pose as one
    cert, key = ca.issue([PEER_NAME])
    fake = JsonServer("127.0.0.1", 0, "secret", routes={"POST /register": lambda b, h: {"worker_id": "evil"}},
                      tls=server_context(cert, key)).start()
    try:
        with pytest.raises(requests.exceptions.SSLError):
            Client(fake.url(), "secret", ca_file=ca.ca_file, server_name=LEARNER_NAME).post("/register", {})
        assert Client(fake.url(), "secret", ca_file=ca.ca_file, server_name=PEER_NAME).post(
            "/register", {})["worker_id"] == "evil"
    finally:
        fake.close()


def test_a_snapshot_travels_the_relay_over_tls(ca, tmp_path):
    """Learner origin -> peer A -> peer B, every link TLS: B gets the verified snapshot; a fetcher that does not
    speak TLS is refused by the origin."""
    from echo2.coordinator.broadcaster import RelayBroadcaster
    from echo2.worker.peer import SnapshotReceiver
    from echo2.broadcast.relay import Fetcher
    from echo2.broadcast.store import Store

    got, done = {}, threading.Event()
    peers = []
    for name in ("A", "B"):
        trust = Trust(ca.ca_pem, ca.ca_file, server_context(*ca.issue([PEER_NAME])))
        peers.append(SnapshotReceiver.of_run("t0k", lambda v, blob, _m, n=name: (got.setdefault(n, bytes(blob)),
                                                                           len(got) == 2 and done.set()),
                                      trust=trust).start())
    bc = RelayBroadcaster("t0k", topology="chain", chunk_mb=1)
    bc.use_tls(ca.trust())
    delivered, round_done = set(), threading.Event()
    bc.on_delivered = lambda peer, v: (delivered.add(peer), len(delivered) == 2 and round_done.set())
    try:
        for name, p in zip("AB", peers, strict=True):
            assert p.url.startswith("https://")
            bc.add_peer(name, p.url, p.relay_addr)
        blob = os.urandom(3 << 20)
        bc.publish(1, blob)
        assert done.wait(60) and round_done.wait(60) and got == {"A": blob, "B": blob}
        wait_until(lambda: len(bc.last_results) == 2, timeout_s=10)
        assert max(r["depth"] for r in bc.last_results.values()) == 1  # B pulled through A
        plain = Fetcher(Store(), "t0k", connect_timeout_s=5, stall_timeout_s=5)
        with pytest.raises(ConnectionError):
            plain.fetch(1, [bc.origin])
    finally:
        bc.close()
        for p in peers:
            p.close()


def test_a_plain_socket_to_a_tls_relay_is_dropped_and_the_server_goes_on(ca):
    from echo2.broadcast.framing import recv_frame, send_frame
    from echo2.broadcast.relay import RelayServer
    from echo2.broadcast.store import Store

    server = RelayServer(Store(), "t0k", tls=ca.trust().server).start()
    try:
        with socket.create_connection(server.addr, timeout=5) as s:
            s.sendall(b"\x00\x00\x00\x02{}")  # a plain frame where a TLS ClientHello belongs
            try:
                data = s.recv(100)
            except ConnectionResetError:
                data = b""
            assert data == b"" or data[0] == 0x15, data  # closed, or a TLS alert record: never a frame
        trust = Trust(ca.ca_pem, ca.ca_file, None)
        conn = trust.connect(socket.create_connection(server.addr, timeout=5))
        send_frame(conn, {"version": 1})
        assert "error" in recv_frame(conn)  # still serving, over TLS
        conn.close()
    finally:
        server.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_with_tls_forced_on_over_loopback(tmp_path, worker_tmp):
    """rollout.source.tls=on: the coordinator, the relay origin and the two local workers' servers all speak TLS;
    workers join with the CA fingerprint the learner hands them; snapshots reach them; the books balance; the
    workers' copies of the CA are gone when they stop."""
    ev = {}

    def hook(step, source):
        if step == 3:
            wait_until(lambda: source.coordinator.status()["registered"] >= 2, timeout_s=120)
            ev["url"], ev["hash"] = source.coordinator.url, source.ca_hash
        if step >= 3:  # a worker registered late may not have delivered in a 12-step run (a CI run): slow down for it
            slow_until(lambda: len(source.coordinator.status()["by_worker"]) >= 2, at_most_s=2.0)

    _, trainer, source, acc, records = train(tmp_path, ["pool.engine=hf", "run.steps=12", "rollout.source.tls=on"],
                                             hook)
    assert trainer.state.global_step == 12 and ev["url"].startswith("https://") and ev["hash"].startswith("sha256:")
    assert ev["hash"] == RunCA(str(tmp_path / "tls")).fingerprint
    assert records[-1]["broadcast/rounds"] >= 1 and records[-1]["broadcast/failures"] == 0, records[-1]
    assert len(acc["by_worker"]) == 2 and balanced(acc), acc
    logs = "".join(p.read_text() for p in (tmp_path / "workers").glob("worker?.log"))
    assert "applied snapshot" in logs
    assert logs.count("worker stopped") == 2, logs[-3000:]
    assert not list(worker_tmp.glob("echo2-tls-*")), list(worker_tmp.iterdir())


def test_certificates_name_their_credential_and_orders_go_only_to_its_holder(tls_coord, ca, tmp_path):
    """A worker's certificate (from /certificate) names its credential besides the peer role, and the learner sends
    a worker's orders only to a server holding its credential's certificate. Before, any certificate of the run
    passed: a revoked worker, whose certificate stays valid until it expires, that took over another worker's
    address received that worker's orders and, in them, the current relay key."""
    from cryptography import x509

    from echo2.coordinator.broadcaster import RelayBroadcaster
    from echo2.credential import worker_credential
    from echo2.net.tls import credential_peer_name
    from echo2.worker.peer import SnapshotReceiver

    trust = join(tls_coord.url, worker_credential("secret", "alice"), ca.fingerprint, str(tmp_path / "alice"))
    issued = Client(tls_coord.url, worker_credential("secret", "alice"), ca_file=trust.ca_file,
                    server_name=LEARNER_NAME).post("/certificate", {})
    names = x509.load_pem_x509_certificate(issued["cert"].encode()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert names == [PEER_NAME, credential_peer_name("alice")]
    assert credential_peer_name("alice") not in (credential_peer_name("mallory"), credential_peer_name(None))

    got: dict[str, int] = {}
    receivers = {}
    for name in ("alice", "mallory"):
        t = Trust(ca.ca_pem, ca.ca_file, server_context(*ca.issue([PEER_NAME, credential_peer_name(name)])))
        receivers[name] = SnapshotReceiver.of_run("t0k", lambda v, blob, _m, n=name: got.setdefault(n, v),
                                                  trust=t).start()
    bc = RelayBroadcaster("t0k", topology="star", chunk_mb=1)
    bc.use_tls(ca.trust())
    try:
        bc.add_peer("w-alice", receivers["alice"].url, receivers["alice"].relay_addr, credential_peer_name("alice"))
        # mallory's server at the address a worker of credential bob registered
        bc.add_peer("w-bob", receivers["mallory"].url, receivers["mallory"].relay_addr, credential_peer_name("bob"))
        bc.publish(1, os.urandom(1 << 20))
        wait_until(lambda: "alice" in got, timeout_s=30)
        slow_until(lambda: "mallory" in got, at_most_s=3)
        assert got == {"alice": 1}
        assert receivers["alice"].token == bc.token and receivers["mallory"].token is None  # no relay key for it
    finally:
        bc.close()
        for r in receivers.values():
            r.close()


def test_a_fetcher_takes_bytes_only_from_a_source_holding_the_certificate_its_order_names(ca):
    """Each of an order's sources comes with the name its certificate must carry (its worker's credential's, the
    learner's for the origin): a relay at a source's address holding another credential's certificate is not
    read from, and the fetch goes on from the next source."""
    from echo2.broadcast.manifest import FULL, make_manifest, relay_ticket, signing_key, verify_key
    from echo2.broadcast.relay import Fetcher, RelayServer
    from echo2.broadcast.store import Snapshot, Store
    from echo2.net.tls import credential_peer_name

    signer, token = signing_key("t0k"), "7e" * 32
    blob = os.urandom(1 << 20)

    def server(names):
        store = Store()
        store.put(Snapshot(make_manifest(signer, 1, blob, 256 << 10), blob))
        return RelayServer(store, token, tls=server_context(*ca.issue(names))).start()

    origin, mallory = server([LEARNER_NAME, PEER_NAME]), server([PEER_NAME, credential_peer_name("mallory")])
    trust = Trust(ca.ca_pem, ca.ca_file, None)
    try:
        for expected, served_by in ((credential_peer_name("bob"), origin), (credential_peer_name("mallory"), mallory)):
            fetcher = Fetcher(Store(), token, trust=trust, manifest_key=verify_key("t0k"), connect_timeout_s=5)
            before = served_by.served_bytes
            tickets = [[*mallory.addr, relay_ticket(signer, "w1", 1, FULL, 1, mallory.addr), expected],
                       [*origin.addr, relay_ticket(signer, "w1", 1, FULL, 1, origin.addr), LEARNER_NAME]]
            try:
                snap = fetcher.fetch(1, [mallory.addr, origin.addr], tickets=tickets)
            finally:
                fetcher.close()
            assert bytes(snap.buf) == blob and served_by.served_bytes - before == len(blob), expected
    finally:
        origin.close()
        mallory.close()


def test_a_worker_registered_at_anothers_relay_address_does_not_change_what_its_fetchers_check():
    """Each source in an order carries the name of the worker the plan took it from. Bob registering at alice's relay
    address (any credential holder can, and cannot be refused without letting a squatter lock alice out) makes
    orders that name bob's entry fail there, and nothing else: an order through alice still expects alice's
    certificate at that address, whoever registered it since."""
    from echo2.broadcast.manifest import FULL, manifest_digest
    from echo2.coordinator.broadcaster import RelayBroadcaster
    from echo2.net.tls import credential_peer_name
    from echo2.worker.peer import SnapshotReceiver

    bc = RelayBroadcaster("t0k", topology="chain", chunk_mb=1)
    receivers = [SnapshotReceiver.of_run("t0k", lambda v, b, m: None).start() for _ in range(3)]
    alice, bob = credential_peer_name("alice"), credential_peer_name("bob")
    try:
        at = receivers[0].relay_addr
        bc.add_peer("w-alice", receivers[0].url, at, alice)
        bc.add_peer("w-bob", receivers[1].url, at, bob)  # bob's own control server, alice's relay address
        bc.add_peer("w-carol", receivers[2].url, receivers[2].relay_addr, credential_peer_name("carol"))
        bc.publish(1, os.urandom(1 << 20))
        wait_until(lambda: bc.store.get(1) is not None and bc.store.get(1).complete, timeout_s=10)
        full = bc.store.get(1)
        host, _, port = at.rpartition(":")
        for lanes, holders, expected in (([["w-alice"]], [((host, int(port)), bob)], alice),
                                         ([["w-bob"]], [((host, int(port)), alice)], bob)):
            _, body, _, _ = bc._order("w-carol", 1, FULL, lanes, holders, full, manifest_digest(full.manifest))
            bc.peers["w-carol"].busy = None
            names = {(h, p): n for h, p, _, n in body["tickets"]}
            assert names[(host, int(port))] == expected
            assert names[bc.origin] == LEARNER_NAME
    finally:
        bc.close()
        for r in receivers:
            r.close()
