"""Hostile clients for the soak (``benchmarks/soak.py --hostile``): one process per kind, against a real learner's
coordinator (TLS on, even over loopback), each with a worker credential of its own in $ECHO2_TOKEN (made with
``python -m echo2.credential NAME`` or credential.worker_credential) except the outsider, which has none.

    ECHO2_TOKEN=<credential> python benchmarks/hostile.py KIND --run-dir RUN_DIR --report OUT.json \
        [--go FILE] [--victim https://127.0.0.1:PORT]

Once imported it writes REPORT's ``.ready`` file, then waits for ``--go`` to exist (the soak's calm phase comes
first), finds the learner in RUN_DIR/coordinator.json
(URL, CA fingerprint, model, context), attacks until SIGTERM, then writes what it was told to ``--report``.

    absurd        /register with absurd declarations (down_mbit 0, up_mbit 0, usd_per_hour 1e308 or -1, NaN,
                  Infinity, rtt_ms 1e308, max_model_len -1), over and over; and every --silent-every-s one valid
                  registration that then goes silent: the reaper must retire it (liveness goes on)
    hoarder       one credential registering worker ids until refused (the coordinator's cap is 16), two of them
                  with snapshot receivers of their own (a worker is handed work only once it holds recent
                  weights); every id pulls as much as it may and never pushes; registers again every few seconds
    invalid       a worker pushing invalid results: fewer completions than G, token ids outside the vocabulary,
                  positive logprobs, token and logprob lists of different lengths, too many tokens, results for
                  groups it was never handed
    liar          a worker claiming, for well-formed results, versions it was never delivered: the learner's
                  newest, or the one after it; its snapshot receiver declines every version it has claimed, so
                  the claim stays a lie
    forger        a worker answering every group with the same fabricated completion and made-up logprobs
                  (-0.05 a token), claiming the version it holds; the learner's rollout checks must retire it
    outsider      no credential: Content-Length -1, 400 MiB bodies (streamed until answered) and a small POST, to
                  the coordinator and to a worker's snapshot-control port (--victim), while holding --half-open
                  connections on each (half of them TCP only, half a TLS handshake and half a request's headers),
                  re-opened as the servers drop them
    relay_orders  an honest-looking worker (it takes its snapshots, it holds the relay key) that POSTs orders to
                  another worker (--victim): /fetch under the relay key, its own order from the learner replayed,
                  an order signed with a key of its own, a /key order; only the learner's orders may be taken
    hung_relay    a worker that takes its snapshots like any other (so it is measured and placed like one) but
                  advertises a relay that accepts connections and never answers
    slow_reward   a worker pushing well-formed groups whose every completion is slow to score and then scores 0
                  (the stand-in for math-verify on a crafted answer: benchmarks/slow_task.py, which the soak's
                  learner runs), as many as it is handed
    slow_relay_reader
                  a worker that takes its snapshots, and also reads every version (full or delta) it is ordered to
                  fetch from each of the order's sources (with the order's tickets) on connections of its own, one piece every
                  --read-every-s, never stalling out: the sources must not keep more than store.MAX_RETAINED collected
                  versions in memory for such readers
    smuggler, ca_bomb, ca_trickler, churner, bulk_pusher
                  two Authorization headers on every route; GET /ca with a 16 MiB or chunked body; connections that
                  trickle GET /ca from another address; register/leave in a loop; many pushes of the largest body
                  at once under one credential (benchmarks/hostile_wire.py)

Every agent-based kind (invalid, liar, forger, relay_orders, hung_relay, slow_relay_reader) is echo2's own worker agent
(echo2/worker/agent.py) with a fake engine and the one behaviour changed; it joins over TLS with the pinned CA,
holds a certificate, heartbeats, and once refused keeps knocking: a registration every few seconds (without a
snapshot address, and left at once if let in), to see whether the refusal sticks to its credential.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import select
import shutil
import signal
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from echo2.broadcast.manifest import order_credential, signing_key  # noqa: E402
from echo2.worker.peer import SnapshotReceiver  # noqa: E402
from echo2.worker.agent import Agent  # noqa: E402
from echo2.records import Completion, SamplingParams  # noqa: E402
from echo2.net.http import BadRequest, Client, RemoteError  # noqa: E402
from echo2.net.tls import LEARNER_NAME, PEER_NAME, join  # noqa: E402
from benchmarks.hostile_wire import BulkPusher, CaBomb, CaTrickler, Churner, Smuggler  # noqa: E402

RETRY_S = 5.0  # a refused client knocks again this often
HUGE_BYTES = 400 << 20  # the body an outsider declares
STREAM_BYTES = 16 << 20  # the most of it an outsider sends before it gives up waiting for an answer
MAX_READERS = 256  # slow_relay_reader: relay connections it keeps at once (past that it closes its oldest)


def status_of(call) -> str:
    """``call()``'s HTTP status as a string ("200", "400", ...), or the kind of failure ("ConnectionError")."""
    try:
        call()
        return "200"
    except RemoteError as e:
        return str(e.status)
    except Exception as e:  # noqa: BLE001 (a network boundary: what happened is the result)
        return type(e).__name__


class Run:
    """The learner as a joining worker finds it: RUN_DIR/coordinator.json (URL, CA fingerprint, model, context)."""

    def __init__(self, run_dir: str, token: str | None):
        info = json.loads((Path(run_dir) / "coordinator.json").read_text())
        self.url, self.ca_hash, self.token = info["url"], info["ca_hash"], token
        self.declared = {"engine": "hostile", "model": {k: info["model"][k] for k in ("name", "digest")},
                         "max_model_len": info["max_model_len"]}
        self.tls_dir = tempfile.mkdtemp(prefix="echo2-hostile-tls-")
        self.trust = join(self.url, token, self.ca_hash, self.tls_dir) if token else None

    def client(self, timeout_s: float = 30.0) -> Client:
        return Client(self.url, self.token, timeout_s=timeout_s, ca_file=self.trust.ca_file, server_name=LEARNER_NAME)


# ---------------------------------------------------------------------- absurd declarations


class Absurd:
    BODIES = {"down_mbit=0": {"down_mbit": 0}, "up_mbit=0": {"up_mbit": 0},
              "usd_per_hour=1e308": {"usd_per_hour": 1e308}, "usd_per_hour=-1": {"usd_per_hour": -1.0},
              "rtt_ms=1e308": {"rtt_ms": 1e308}, "down_mbit=NaN": {"down_mbit": math.nan},
              "usd_per_hour=Infinity": {"usd_per_hour": math.inf},
              "max_model_len=-1": {"max_model_len": -1}}

    def __init__(self, run: Run, args):
        self.run, self.args, self.client = run, args, run.client()
        self.statuses: dict[str, Counter] = defaultdict(Counter)
        self.silent: list[dict] = []  # valid registrations that never speak again: the reaper must retire them

    def serve(self, stop: threading.Event) -> None:
        next_silent = time.monotonic()
        while not stop.is_set():
            for name, absurd in self.BODIES.items():
                body = json.dumps({**self.run.declared, **absurd}).encode()  # NaN / Infinity as Python writes them
                try:
                    reply = self.client.post("/register", data=body, headers={"Content-Type": "application/json"})
                    self.statuses[name]["200"] += 1  # accepted: a finding; leave at once
                    self.client.post("/leave", {"worker_id": reply["worker_id"]})
                except RemoteError as e:
                    self.statuses[name][str(e.status)] += 1
                except OSError as e:
                    self.statuses[name][type(e).__name__] += 1
                stop.wait(self.args.period_s)
            if time.monotonic() >= next_silent:
                try:
                    wid = self.client.post("/register", self.run.declared)["worker_id"]
                    self.silent.append({"worker_id": wid, "at": time.time()})
                except (RemoteError, OSError) as e:
                    self.silent.append({"error": str(e), "at": time.time()})
                next_silent = time.monotonic() + self.args.silent_every_s

    def report(self) -> dict:
        return {"statuses": {k: dict(v) for k, v in self.statuses.items()}, "silent_ids": self.silent}


# ---------------------------------------------------------------------- one credential, many ids, work hoarded


class Hoarder:
    RECEIVERS = 2  # ids with a snapshot receiver (the others get no weights, so no work: they only take room)

    def __init__(self, run: Run, args):
        self.run, self.args = run, args
        self.ids: list[str] = []
        self.register_statuses: Counter = Counter()  # after the first refusal: every later try
        self.first_refusal: str | None = None
        self.groups: Counter = Counter()  # worker id -> groups handed to it
        self.pull_statuses: Counter = Counter()
        self.newest: dict[str, int] = {}  # worker id -> newest version its receiver holds

    def serve(self, stop: threading.Event) -> None:
        client = self.run.client()
        keys = client.post("/manifest-key", {})
        receivers = []
        for _ in range(self.RECEIVERS):
            r = SnapshotReceiver(None, lambda v, _b, _m: None, trust=self.run.trust)
            r.trust_learner(keys["manifest_key"])
            receivers.append(r.start())
        try:
            while not stop.is_set():  # register until refused
                r = receivers[len(self.ids)] if len(self.ids) < len(receivers) else None
                body = {**self.run.declared, **({"snapshot_url": r.url, "relay": r.relay_addr} if r else {})}
                try:
                    wid = client.post("/register", body)["worker_id"]
                except RemoteError as e:
                    self.first_refusal = f"{e.status}: {e}"
                    break
                self.ids.append(wid)
                if r is not None:
                    r.on_snapshot = lambda v, _b, _m, wid=wid: self.newest.__setitem__(
                        wid, max(v, self.newest.get(wid, -1)))
            threads = [threading.Thread(target=self._pull_loop, args=(wid, stop), daemon=True) for wid in self.ids]
            for t in threads:
                t.start()
            while not stop.wait(RETRY_S):  # knocking: a new id, while the ids it has may hold nothing
                self.register_statuses[status_of(lambda: client.post("/register", self.run.declared))] += 1
            for t in threads:
                t.join(timeout=10)
        finally:
            for r in receivers:
                r.close()

    def _pull_loop(self, wid: str, stop: threading.Event) -> None:
        client = self.run.client(timeout_s=10)
        while not stop.is_set():
            body = {"worker_id": wid, "max_groups": 1024}
            if wid in self.newest:
                body["version"] = self.newest[wid]
            try:
                work = client.post("/pull", body)["work"]
                self.groups[wid] += len(work)
                self.pull_statuses["200"] += 1
            except RemoteError as e:
                self.pull_statuses[str(e.status)] += 1
                if "register first" in str(e):
                    return  # retired: its record stays with the credential
                stop.wait(1.0)
            except OSError as e:
                self.pull_statuses[type(e).__name__] += 1
                stop.wait(1.0)

    def report(self) -> dict:
        return {"ids": self.ids, "first_refusal": self.first_refusal, "register_later": dict(self.register_statuses),
                "groups_handed": dict(self.groups), "pulls": dict(self.pull_statuses)}


# ---------------------------------------------------------------------- echo2's own agent, one behaviour changed


class FakeEngine:
    """No model: ``fabricate(prompt_ids, params)`` makes each prompt's completions; weights are taken and ignored."""

    name = "hostile"

    def __init__(self, fabricate):
        self.fabricate = fabricate

    def generate(self, prompts, params: SamplingParams):
        return [self.fabricate(list(p), params) for p in prompts]

    def load_weights(self, version: int, blob) -> dict:
        return {}

    def probe_logprobs(self, token_ids) -> list[float]:
        return [0.0] * max(1, len(token_ids) - 1)  # wrong, and believed by no one: --probe-tolerance is inf here

    def close(self) -> None:
        pass


class HostileAgent(Agent):
    """echo2's agent with a fake engine; ``act`` is one turn of its loop (by default the honest one: pull, generate,
    push). Refusals are counted, not fatal: it keeps knocking."""

    pulls = True

    def __init__(self, run: Run, args, stop: threading.Event):
        super().__init__(run.url, run.token, FakeEngine(self.fabricate), stop=stop, declared=run.declared,
                         trust=run.trust, probe_tolerance=math.inf, reconnect_timeout_s=30.0)
        self.args, self.counts, self.ids = args, Counter(), []
        self.pushed: Counter = Counter()  # how the coordinator answered each result: accepted, or its reason
        self.fabricated: list[int] | None = None
        self.last_work = time.monotonic()

    def fabricate(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        """The same completion for every prompt: the first prompt's first tokens, each at logprob -0.05."""
        self.fabricated = self.fabricated or (prompt_ids * params.max_tokens)[:params.max_tokens]
        return [Completion(list(self.fabricated), [-0.05] * len(self.fabricated), "length") for _ in range(params.n)]

    def serve(self, stop: threading.Event) -> None:
        keys = self._retrying(lambda: self.client.post("/manifest-key", {}))
        self.receiver.trust_learner(keys["manifest_key"])
        self.receiver.start()
        info = self._join()
        params = SamplingParams(n=info["group_size"], **info["sampling"])
        threading.Thread(target=self._heartbeat_loop, args=(info["heartbeat_s"],), daemon=True).start()
        while not stop.is_set():
            try:
                self.act(params) if self.pulls else self.idle()
            except RemoteError as e:
                self.counts[f"refused {e.status}"] += 1
                if e.status == 400 and "register first" in str(e):  # retired (dead, or left): join again
                    self.counts[f"joined again: {status_of(self._join)}"] += 1
                elif e.status in (403, 409):  # revoked, or benched: knock again later
                    stop.wait(RETRY_S)
                    self._knock()
                else:
                    stop.wait(1.0)
            except (OSError, ConnectionError) as e:
                self.counts[type(e).__name__] += 1
                stop.wait(1.0)

    def _join(self) -> dict:
        info = self._register()
        self.worker_id = info["worker_id"]
        self.ids.append(self.worker_id)
        return info

    def _knock(self) -> None:
        """Register again (no snapshot address, and left at once if let in): is the credential still refused?"""
        def probe():
            wid = self.client.post("/register", self.declared)["worker_id"]
            self.client.post("/leave", {"worker_id": wid})

        self.counts[f"register again: {status_of(probe)}"] += 1

    def idle(self) -> None:
        self._apply_pending()
        self.stop.wait(1.0)

    def act(self, params: SamplingParams) -> None:
        self._apply_pending()
        reply = self.client.post("/pull", {"worker_id": self.worker_id, "version": self.version, "max_groups": 4})
        if not reply["work"]:
            refused = set(self.pushed) - {"accepted"}
            if refused and time.monotonic() - self.last_work > RETRY_S:  # no work since its results were refused:
                self.last_work = time.monotonic()  # benched? a new worker id would shed the record
                self._knock()
            self.stop.wait(max(reply["wait_s"], 0.2))
            return
        self.last_work = time.monotonic()
        self.push([self.result(w, params) for w in reply["work"]], reply["version"])

    def result(self, work: dict, params: SamplingParams) -> dict:
        comps = self.fabricate(work["prompt_ids"], params)
        return {"group_id": work["group_id"], "version": self.version, "completions": [
            {"token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason} for c in comps]}

    def push(self, results: list[dict], _learner_version: int) -> None:
        reply = self.client.post("/push", {"worker_id": self.worker_id, "results": results})
        self.pushed["accepted"] += len(reply["accepted"])
        for r in reply["rejected"]:
            self.pushed[r["reason"].split(":")[0][:60]] += 1

    def report(self) -> dict:
        return {"ids": self.ids, "counts": dict(self.counts), "pushed": dict(self.pushed), "version": self.version}


class Forger(HostileAgent):
    """The honest loop, fabricated completions (HostileAgent.fabricate), the version it holds claimed."""


class Invalid(HostileAgent):
    FORMS = ("fewer_completions", "token_outside_vocabulary", "positive_logprob", "lengths_differ", "too_many_tokens",
             "group_never_handed")

    def __init__(self, *a):
        super().__init__(*a)
        self.sent: Counter = Counter()

    def result(self, work: dict, params: SamplingParams) -> dict:
        form = self.FORMS[sum(self.sent.values()) % len(self.FORMS)]
        self.sent[form] += 1
        out = super().result(work, params)
        comp = out["completions"][0]
        if form == "fewer_completions":
            out["completions"] = out["completions"][:-1]
        elif form == "token_outside_vocabulary":
            comp["token_ids"] = [10 ** 6] * len(comp["token_ids"])
        elif form == "positive_logprob":
            comp["logprobs"] = [0.5] * len(comp["logprobs"])
        elif form == "lengths_differ":
            comp["logprobs"] = comp["logprobs"][:-1] or []
        elif form == "too_many_tokens":
            comp["token_ids"], comp["logprobs"] = comp["token_ids"] * 40, comp["logprobs"] * 40
        else:
            out["group_id"] = "g9" + work["group_id"][1:] + "0000"
        out["completions"] = [comp, *out["completions"][1:]]
        return out

    def report(self) -> dict:
        return {**super().report(), "sent": dict(self.sent)}


class Liar(HostileAgent):
    """Well-formed fabricated results claiming a version it was never delivered: the learner's newest when its
    receiver has not taken it, else the one after (from the future, until the learner gets there); its receiver
    then declines that version's order (so no delivery makes the claim true after the fact)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.lock = threading.Lock()
        self.received: set[int] = set()
        self.claimed: set[int] = set()

    def _received(self, version: int, blob, manifest: dict) -> None:
        with self.lock:
            if version in self.claimed:
                self.counts["orders declined"] += 1
                raise BadRequest(f"v{version} declined")  # the broadcaster counts a failed fetch: not delivered
            self.received.add(version)
        super()._received(version, blob, manifest)

    def push(self, results: list[dict], learner_version: int) -> None:
        with self.lock:
            # never 0: every worker of a fresh run holds the initial weights without a delivery
            claim = learner_version if learner_version not in self.received and learner_version else learner_version + 1
            self.claimed.add(claim)
        for r in results:
            r["version"] = claim
        super().push(results, learner_version)


class RelayOrders(HostileAgent):
    """Takes its snapshots (it holds the relay key) and sends another worker orders only the learner may give."""

    pulls = False

    def __init__(self, *a):
        super().__init__(*a)
        self.statuses: dict[str, Counter] = defaultdict(Counter)
        self.latency_s: list[float] = []
        self.own_order: tuple[str, dict] | None = None
        self.hole = socket.create_server(("127.0.0.1", 0))  # a source that never answers
        take = self.receiver._take

        def keep(route, body, headers):  # the learner's orders to this worker, kept to replay elsewhere
            epoch = take(route, body, headers)
            if route == "POST /fetch":
                self.own_order = (headers.get("authorization", ""), dict(body))
            return epoch

        self.receiver._take = keep

    def idle(self) -> None:
        self._apply_pending()
        key, victim = self.receiver.token, self.args.victim
        if key:
            ca = self.trust.ca_file
            body = {"epoch": self.receiver.epoch, "key": key, "version": 10 ** 6, "base": -1,
                    "sources": [["127.0.0.1", self.hole.getsockname()[1]]], "deadline_s": 600.0, "challenge": "0" * 32}
            forged = order_credential(signing_key(key), victim, time.time_ns() // 1000 + 10 ** 9, body)
            tries = {"fetch_under_relay_key": (f"Bearer {key}", "/fetch", body),
                     "fetch_signed_by_itself": (f"Bearer {forged}", "/fetch", body),
                     "key_under_relay_key": (f"Bearer {key}", "/key", {"epoch": self.receiver.epoch, "key": "ab" * 32})}
            if self.own_order is not None:
                tries["own_order_replayed"] = (self.own_order[0], "/fetch", self.own_order[1])
            for name, (auth, path, sent) in tries.items():
                client = Client(victim, "", timeout_s=30, ca_file=ca, server_name=PEER_NAME)
                t0 = time.monotonic()
                self.statuses[name][status_of(lambda: client.post(path, sent, headers={"Authorization": auth}))] += 1
                self.latency_s.append(time.monotonic() - t0)
                client.close()
        self.stop.wait(self.args.period_s)

    def report(self) -> dict:
        return {**super().report(), "statuses": {k: dict(v) for k, v in self.statuses.items()},
                "max_answer_s": max(self.latency_s, default=None)}


class HungRelay(HostileAgent):
    """Fetches like any worker, but the relay it advertises accepts connections and never answers."""

    pulls = False

    def __init__(self, *a):
        super().__init__(*a)
        self.hole = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.receiver.relay_addr = f"127.0.0.1:{self.hole.getsockname()[1]}"
        self.accepted: list[float] = []
        self.held: list[socket.socket] = []
        threading.Thread(target=self._hold, daemon=True).start()

    def _hold(self) -> None:
        while True:
            try:
                conn, _ = self.hole.accept()
            except OSError:
                return
            self.accepted.append(time.time())
            self.held = [c for c in self.held[-200:] if c.fileno() >= 0] + [conn]

    def report(self) -> dict:
        return {**super().report(), "relay_connections": len(self.accepted), "relay_connection_times": self.accepted}


class SlowRelayReader(HostileAgent):
    """Takes its snapshots like any worker (so it holds the relay key and each order's tickets), and also asks every
    source of every order for the whole version on connections of its own, kept open: one piece read every
    --read-every-s, under the relay's stall timeout, so that it is never dropped for stalling. Each such reader used
    to keep its whole version in its source's memory (the learner's origin included) for as long as it read; now a
    source serves at most store.MAX_RETAINED collected versions on, and cuts the oldest one's readers."""

    pulls = False

    def __init__(self, *a):
        super().__init__(*a)
        self.lock = threading.Lock()
        self.readers: dict[socket.socket, list[int]] = {}  # -> [version, bytes read, bytes asked for]
        self.outcomes: Counter = Counter()  # opened, refused, read_to_the_end, cut_off, closed_by_it
        self.most_open = self.most_versions = self.snapshot_bytes = 0
        take = self.receiver._take

        def keep(route, body, headers):  # each order of the learner's: its sources are read slowly too
            epoch = take(route, body, headers)
            if route == "POST /fetch":  # a full snapshot or a delta: each is a buffer its sources keep while read
                threading.Thread(target=self._open_all, args=(dict(body),), daemon=True).start()
            return epoch

        self.receiver._take = keep
        threading.Thread(target=self._trickle, daemon=True).start()

    def _open_all(self, order: dict) -> None:
        from echo2.broadcast.framing import recv_frame, send_frame
        from echo2.broadcast.manifest import key_id, request_mac

        v, base, key = order["version"], order.get("base", -1), order["key"]
        for host, port, ticket, *name in order.get("tickets") or [[*s, None] for s in order["sources"]]:
            try:
                sock = socket.create_connection((host, port), timeout=10)
                if self.trust is not None:
                    sock = self.trust.connect(sock, name[0] if name else PEER_NAME)
                frame = {"version": v, "base": base, "start": 0, "end": -1, "key": key_id(key),
                         "mac": request_mac(key, v, base, 0, -1)}
                send_frame(sock, {**frame, "ticket": ticket} if ticket else frame)
                while (reply := recv_frame(sock)).get("wait") is True:
                    pass
            except (OSError, ConnectionError):
                self.outcomes["refused"] += 1
                continue
            if "manifest" not in reply:
                self.outcomes["refused"] += 1
                sock.close()
                continue
            sock.settimeout(0.2)
            with self.lock:
                if len(self.readers) >= MAX_READERS:  # its own file descriptors: the oldest goes
                    oldest = next(iter(self.readers))
                    self.readers.pop(oldest)
                    oldest.close()
                    self.outcomes["closed_by_it"] += 1
                self.readers[sock] = [v, 0, reply["manifest"]["size"]]
                self.snapshot_bytes = max(self.snapshot_bytes, reply["manifest"]["size"])
                self.outcomes["opened"] += 1
                self.most_open = max(self.most_open, len(self.readers))
                self.most_versions = max(self.most_versions, len({r[0] for r in self.readers.values()}))

    def _trickle(self) -> None:
        from echo2.broadcast.framing import PIECE_BYTES

        while not self.stop.wait(self.args.read_every_s):
            with self.lock:
                readers = list(self.readers.items())
            for sock, r in readers:
                try:
                    got = len(sock.recv(PIECE_BYTES))
                except TimeoutError:
                    continue
                except OSError:
                    got = 0
                r[1] += got
                if got and r[1] < r[2]:
                    continue
                self.outcomes["read_to_the_end" if r[1] >= r[2] else "cut_off"] += 1
                with self.lock:
                    self.readers.pop(sock, None)
                sock.close()

    def report(self) -> dict:
        return {**super().report(), "outcomes": dict(self.outcomes), "most_open_at_once": self.most_open,
                "most_versions_read_at_once": self.most_versions, "snapshot_bytes": self.snapshot_bytes}


class SlowReward(HostileAgent):
    """The honest loop, but every completion of a group is the model's end-of-sequence token twice: well-formed (no
    honest engine makes it, as generation stops at the first), and slow to score (benchmarks/slow_task.py:
    ECHO2_SLOW_REWARD_S a completion, then 0)."""

    def __init__(self, run: Run, args, stop: threading.Event):
        super().__init__(run, args, stop)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(run.declared["model"]["name"])
        self.token = tok.eos_token_id

    def fabricate(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        return [Completion([self.token] * 2, [-0.05, -0.05], "length") for _ in range(params.n)]


# ---------------------------------------------------------------------- the outsider


class Outsider:
    def __init__(self, run_dir: str, args):
        info = json.loads((Path(run_dir) / "coordinator.json").read_text())
        self.args = args
        self.targets = {"coordinator": info["url"], **({"worker_control": args.victim} if args.victim else {})}
        self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # no CA, no credential: it verifies nothing
        self.tls.check_hostname, self.tls.verify_mode = False, ssl.CERT_NONE
        self.flood: dict[str, dict[str, Counter]] = {t: defaultdict(Counter) for t in self.targets}
        self.answer_s: dict[str, list[float]] = defaultdict(list)
        self.sent_bytes: dict[str, int] = Counter()
        self.held_s: dict[str, list[float]] = defaultdict(list)
        self.open_max: Counter = Counter()

    def _connect(self, url: str, handshake: bool = True, timeout_s: float = 10.0) -> socket.socket:
        host, port = url.split("://")[1].rsplit(":", 1)
        source = (self.args.source_address, 0) if self.args.source_address else None  # another host, as seen
        sock = socket.create_connection((host, int(port)), timeout=timeout_s, source_address=source)
        return self.tls.wrap_socket(sock, server_hostname="x") if handshake and url.startswith("https") else sock

    def serve(self, stop: threading.Event) -> None:
        threads = [threading.Thread(target=self._keep_half_open, args=(t, stop), daemon=True) for t in self.targets]
        for t in threads:
            t.start()
        while not stop.is_set():
            for target, url in self.targets.items():
                for kind in ("content_length_-1", "huge_body", "small_post"):
                    self._flood(target, url, kind)
            stop.wait(self.args.period_s)
        for t in threads:
            t.join(timeout=5)

    def _flood(self, target: str, url: str, kind: str) -> None:
        head = {"content_length_-1": "Content-Length: -1\r\n", "huge_body": f"Content-Length: {HUGE_BYTES}\r\n",
                "small_post": "Content-Length: 2\r\n"}[kind]
        t0, sent, status = time.monotonic(), 0, "no answer"
        try:
            sock = self._connect(url)
            sock.sendall(f"POST /register HTTP/1.1\r\nHost: x\r\n{head}Content-Type: application/json\r\n\r\n".encode())
            chunk = b"{}" if kind == "small_post" else b"x" * (1 << 20)
            while sent < (STREAM_BYTES if kind == "huge_body" else len(chunk)):
                if select.select([sock], [], [], 0)[0]:
                    break  # an answer (or a close) before the body is sent: read it
                try:
                    sock.sendall(chunk)
                    sent += len(chunk)
                except OSError:
                    break
            sock.settimeout(5.0)
            try:
                data = sock.recv(4096)
                status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/1.1 ") else "closed"
            except OSError as e:
                status = "closed" if isinstance(e, (ConnectionError, ssl.SSLError)) else type(e).__name__
            sock.close()
        except OSError as e:
            status = type(e).__name__
        self.flood[target][kind][status] += 1
        self.answer_s[target].append(time.monotonic() - t0)
        self.sent_bytes[target] += sent

    def _keep_half_open(self, target: str, stop: threading.Event) -> None:
        """--half-open connections on ``target`` at all times: one in two stops after TCP's handshake, the other
        completes TLS's and sends half a request's headers; a connection the server drops is replaced."""
        url, opened = self.targets[target], {}  # socket -> when it was opened
        while not stop.is_set():
            while len(opened) < self.args.half_open and not stop.is_set():
                try:
                    sock = self._connect(url, handshake=len(opened) % 2 == 0, timeout_s=5.0)
                    if isinstance(sock, ssl.SSLSocket):
                        sock.sendall(b"POST /push HTTP/1.1\r\nHost: x\r\nAuthoriz")
                    sock.setblocking(False)
                    opened[sock] = time.monotonic()
                except OSError:
                    stop.wait(0.5)
                    break
            self.open_max[target] = max(self.open_max[target], len(opened))
            readable = select.select(list(opened), [], [], 0.5)[0] if opened else []
            for sock in readable:  # the server closed it (or answered, then closed)
                try:
                    while sock.recv(65536):
                        pass
                except (BlockingIOError, ssl.SSLWantReadError):
                    continue  # still open
                except OSError:
                    pass
                self.held_s[target].append(time.monotonic() - opened.pop(sock))
                sock.close()
        for sock in opened:
            sock.close()

    def report(self) -> dict:
        return {t: {"flood": {k: dict(v) for k, v in self.flood[t].items()},
                    "max_answer_s": max(self.answer_s[t], default=None), "body_bytes_sent": self.sent_bytes[t],
                    "half_open_held": self.open_max[t], "half_open_dropped": len(self.held_s[t]),
                    "held_s_median": statistics.median(self.held_s[t]) if self.held_s[t] else None}
                for t in self.targets}


KINDS = {"absurd": Absurd, "hoarder": Hoarder, "invalid": Invalid, "liar": Liar, "forger": Forger,
         "outsider": Outsider, "relay_orders": RelayOrders, "hung_relay": HungRelay, "slow_reward": SlowReward,
         "smuggler": Smuggler, "ca_bomb": CaBomb, "ca_trickler": CaTrickler, "churner": Churner,
         "bulk_pusher": BulkPusher, "slow_relay_reader": SlowRelayReader}
OUTSIDERS = ("outsider", "ca_bomb", "ca_trickler")  # no credential: they find the run in its directory only


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("--run-dir", required=True)
    p.add_argument("--report", required=True)
    p.add_argument("--go", default=None, help="wait for this file before attacking")
    p.add_argument("--victim", default=None, help="an honest worker's snapshot-control URL (outsider, relay_orders)")
    p.add_argument("--period-s", type=float, default=1.0, help="pause between two rounds of an attack")
    p.add_argument("--half-open", type=int, default=100, help="outsider: half-open connections held per target")
    p.add_argument("--silent-every-s", type=float, default=30.0, help="absurd: a silent registration this often")
    p.add_argument("--source-address", default=None,
                   help="ca_bomb, ca_trickler: connect from this local address (127.0.0.2: another host, as the "
                        "coordinator sees it)")
    p.add_argument("--trickle-s", type=float, default=2.0, help="ca_trickler: one byte a connection this often")
    p.add_argument("--bulk", type=int, default=16, help="bulk_pusher: pushes of the largest body at once")
    p.add_argument("--read-every-s", type=float, default=20.0,
                   help="slow_relay_reader: one piece read from each of its relay connections this often (under the "
                        "relay's 30 s stall timeout)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][hostile %(name)s][%(levelname)s] %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    Path(args.report).with_suffix(".ready").touch()  # imported: the soak's calm phase may begin
    while args.go and not os.path.exists(args.go) and not stop.wait(0.2):
        pass
    client, run, out = None, None, {"kind": args.kind, "started_at": time.time()}
    try:
        if not stop.is_set():
            if args.kind in OUTSIDERS:
                client = KINDS[args.kind](args.run_dir, args)
            else:
                run = Run(args.run_dir, os.environ["ECHO2_TOKEN"])
                cls = KINDS[args.kind]
                client = cls(run, args, stop) if issubclass(cls, HostileAgent) else cls(run, args)
            client.serve(stop)
    except Exception as e:  # noqa: BLE001 (reported: the soak says which client failed, and why)
        import traceback

        out["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        if client is not None:
            out.update(client.report())
            if isinstance(client, HostileAgent):
                client.shutdown()
        out["stopped_at"] = time.time()
        Path(args.report).write_text(json.dumps(out, indent=1, default=str) + "\n")
        if run is not None:
            shutil.rmtree(run.tls_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
