"""A crowd at the coordinator: N simulated workers and 200 idle or half-open connections against the coordinator of a
learner that trains, compared with the same run before the crowd arrives ("calm").

    python benchmarks/coordinator_crowd.py                          # N = 16 128 512 1024, 2,000 rollouts/s in all
    python benchmarks/coordinator_crowd.py --workers 128 --rate 0   # unpaced: as fast as the coordinator hands out
    python benchmarks/coordinator_crowd.py --quick                  # N = 16, short windows (tests/coordinator/test_crowd.py)

One fresh run (learner, coordinator, clients) per N, in a process of its own:

    run process: the learner (train.build: tiny model, rollout=async, pool=static, rollout.source.tls=on), trained
    │            in its main thread; its coordinator runs in its own process, as in every async run
    ├─ calm client: --calm-workers workers at --rate in all ── calm window (--duration-s) ── leave when the crowd is in
    └─ crowd clients (1, or 2 past 256 workers): N workers at --rate in all, + --half-open idle connections
                 ── register (a ramp), then the crowd window (--duration-s); the learner stops at its end

A simulated worker does over the network what the agent (echo2/worker/agent.py) does, with a credential of its own
(credential.worker_credential: what ``python -m echo2.credential NAME`` prints) and the run CA pinned by its
fingerprint (net.tls.fetch_ca): /certificate, /manifest-key, /register (declaring the learner's model), a heartbeat
every ``heartbeat_s``, and pull -> push paced to rate/N rollouts/s (the agent's 4 groups per pull; after a pull that
got nothing, which the coordinator held as a long poll, it waits ``wait_s``), over kept-alive connections of its own
(asyncio + aiohttp: thousands of workers in one process). Its engine is null: each group gets G completions of
random in-vocabulary token ids with logprobs in [-4, -0.05], at once or after --delay-s. The idle connections: a
third open TCP and send nothing, a third finish the TLS handshake and send nothing, a third send half of a request's
headers, a byte every 2 s; each reconnects as soon as the server drops it.

The broadcast plane is a stand-in (NullBroadcaster, in the coordinator's process): a published snapshot counts as
delivered to every registered worker at once, through the coordinator's own ``on_delivered`` hook, and no byte is
sent (1,024 relay receivers would measure the relay, which benchmarks/broadcast_sweep.py does). A worker claims the
newest version delivered to all that was published after it joined.

Measured over each window: per-route latency on the clients' side (a pull that got work and one that came back
empty apart: an empty one includes the coordinator's long poll, up to 2 s, by design; register and the other join
routes during the ramp), accepted rollouts/s (results the coordinator buffered) and consumed ones (the learner's),
the coordinator's CPU (its process's user + system time; its reward processes' apart), its garbage-collection
pauses and peak RSS, the clients' CPU and how late their event loops ran (what they add to the latencies they
measure), the learner's step (wall; busy = wall less its wait for rollouts; and its process's CPU per step, which
other jobs on a shared machine inflate far less than its wall time), and what the rest of the machine used. After
the run, the books: every dispatched rollout consumed, dropped or lost, with its reason. By default the learner is
pinned to core 0 and everything else to core 1, as a learner host with a core spare for its coordinator would run
(the clients stand in for remote machines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # the coordinator's process imports NullBroadcaster from here

HALF_OPEN_KINDS = ("tcp", "tls", "headers")
JOIN_ROUTES = ("certificate", "manifest-key", "register")  # timed whenever they happen (each worker's start)
GRACE_S = 2.0  # the crowd keeps working this long after its window, while the learner stops
JOIN_TIMEOUT_S = 60.0  # for a client process's workers to join (plus 1 s per 50 workers)


# ---------------------------------------------------------------------- in the coordinator's process


class Pauses:
    """Records this process's garbage collections of MIN_MS or more, as lines ``wall time, ms, generation`` appended
    to ``path``: a long one stops every thread of the process, so in the coordinator it is a tail in every route's
    latency, and in a client process it inflates what that process measures. (Made by NullBroadcaster in the
    coordinator's process, and by each client process.)"""

    MIN_MS = 5.0

    def __init__(self, path: str):
        import gc

        self.path, self.started = path, 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        ms = (time.perf_counter() - self.started) * 1e3
        if ms >= self.MIN_MS:
            with open(self.path, "a") as f:
                f.write(f"{time.time():.3f} {ms:.1f} {info['generation']}\n")

    @staticmethod
    def read(path: str, t0: float, t1: float) -> list[float]:
        """The pauses (ms) that ended inside [t0, t1]."""
        try:
            lines = Path(path).read_text().split("\n")
        except OSError:
            return []
        return [float(ms) for t, ms, _ in (line.split() for line in lines if line) if t0 <= float(t) < t1]


class NullBroadcaster:
    """seams.Broadcaster for simulated workers, in the coordinator's process: each published version is
    delivered (from a thread, as the relay's deliveries are) to every registered worker, by the coordinator's
    ``on_delivered``; a worker that registers later gets the latest. Nothing is sent. Once a version is delivered
    to all, its number is written to ``version_file``, where the simulated workers read what they hold (the
    relay's orders to each worker, in the real plane)."""

    def __init__(self, secret: str, version_file: str, **_relay_settings):
        self.version_file = version_file
        self.on_delivered, self.epoch = None, None
        self.peers: set[str] = set()
        self.latest: int | None = None
        self.pending: int | None = None
        self.bytes = self.deliveries = 0
        self.cond = threading.Condition()
        self.closed = False
        threading.Thread(target=self._deliver, name="null-broadcast", daemon=True).start()
        self.pauses = Pauses(version_file + ".gc")  # the coordinator process's garbage collections, for the report

    def publish(self, version: int, blob, probe: dict | None = None) -> None:
        with self.cond:
            self.bytes, self.pending = len(blob), version
            self.cond.notify()

    def _deliver(self) -> None:
        while True:
            with self.cond:
                while self.pending is None and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                version, self.pending = self.pending, None  # latest wins, as in the relay
                peers = list(self.peers)
            for peer in peers:
                self.on_delivered(peer, version)
            with self.cond:
                self.latest, self.deliveries = version, self.deliveries + len(peers)
            Path(self.version_file + ".tmp").write_text(str(version))
            os.replace(self.version_file + ".tmp", self.version_file)

    def add_peer(self, peer_id: str, url: str, relay_addr: str | None = None, server_name: str | None = None) -> None:
        with self.cond:
            self.peers.add(peer_id)
            latest = self.latest
        if latest is not None:
            self.on_delivered(peer_id, latest)

    def remove_peer(self, peer_id: str) -> None:
        with self.cond:
            self.peers.discard(peer_id)

    def use_tls(self, trust) -> None:
        pass

    def rekey(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {"broadcast/bytes": float(self.bytes), "broadcast/null_deliveries": float(self.deliveries)}

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()


# ---------------------------------------------------------------------- simulated workers (a client process)


class Record:
    """What one client process saw: latencies of requests started inside its window, statuses, answers."""

    def __init__(self):
        self.t0 = self.t1 = float("inf")
        self.ms: dict[str, list[float]] = defaultdict(list)
        self.codes: dict[str, Counter] = defaultdict(Counter)
        self.answered: Counter = Counter()  # worker -> 200 answers inside the window
        self.accepted = self.pushed = self.reregistered = 0
        self.refused: Counter = Counter()  # reasons the coordinator gave for results it did not accept
        self.held_s: list[float] = []  # how long each idle connection was kept before the server dropped it
        self.idle_connect_errors: Counter = Counter()
        self.lag_ms: list[float] = []  # the client's own event loop, late by >= 20 ms

    def inside(self, t: float) -> bool:
        return self.t0 <= t < self.t1


class Crowd:
    """The workers and idle connections of one client process (``spec``: see one_run)."""

    def __init__(self, spec: dict):
        self.spec, self.rec = spec, Record()
        self.url = spec["url"]
        self.host, port = self.url.split("://", 1)[1].rsplit(":", 1)
        self.port = int(port)
        self.stop = asyncio.Event()
        self.registered = self.failures = 0
        self.delivered = -1  # the newest version delivered to every worker (NullBroadcaster's file)
        self.ssl = None

    async def call(self, session, route: str, body: dict, name: str, worker: str, timeout_s: float = 60.0):
        """POST ``route``; the JSON answer, or None (counted either way under ``name``). Raises LookupError when
        the coordinator no longer knows the worker (``register first``)."""
        import aiohttp

        from echo2.net.tls import LEARNER_NAME

        start, t = time.time(), time.perf_counter()
        timed = self.rec.inside(start) or name in JOIN_ROUTES
        try:
            async with session.post(self.url + route, data=json.dumps(body).encode(), ssl=self.ssl,
                                    server_hostname=LEARNER_NAME, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                    headers={"Content-Type": "application/json"}) as r:
                payload, status = await r.read(), r.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self._say(f"{worker} {route}: {e!r}")
            if timed:
                self.rec.codes[name][type(e).__name__] += 1
            return None
        ms = (time.perf_counter() - t) * 1e3
        answer = json.loads(payload) if status == 200 else None
        if route == "/pull" and answer is not None:
            name = "pull (work)" if answer["work"] else "pull (empty)"
        if timed:
            self.rec.ms[name].append(ms)
            self.rec.codes[name][str(status)] += 1
        if answer is None:
            text = payload[:300].decode(errors="replace")
            self._say(f"{worker} {route}: HTTP {status}: {text}")
            if "register first" in text:
                raise LookupError(text)
        elif self.rec.inside(start):
            self.rec.answered[worker] += 1
        return answer

    def _say(self, line: str) -> None:
        """The first few failures, in full (every one is in the counts)."""
        self.failures += 1
        if self.failures <= 5:
            print(line, file=sys.stderr, flush=True)

    async def worker(self, i: int, delay_start_s: float) -> None:
        import aiohttp

        from echo2.credential import worker_credential

        name = f"{self.spec['prefix']}{i}"
        await asyncio.sleep(delay_start_s)
        credential = worker_credential(os.environ["ECHO2_TOKEN"], name)
        # as the agent's requests.Session: kept-alive connections, one for its work and one for its heartbeats
        connector = aiohttp.TCPConnector(limit=2, ssl=self.ssl)
        async with aiohttp.ClientSession(connector=connector, headers={"Authorization": f"Bearer {credential}"},
                                         skip_auto_headers=("User-Agent",)) as s:
            for route in ("/certificate", "/manifest-key"):  # what the agent's join asks for first
                while await self.call(s, route, {}, route.strip("/"), name) is None and not self.stop.is_set():
                    await asyncio.sleep(0.5)
            state = {"joined_at": 0, "wid": None}
            info = await self._register(s, name, state)
            if info is None:
                return
            self.registered += 1
            beat = asyncio.create_task(self._heartbeats(s, name, state, info["heartbeat_s"]))
            try:
                await self._work(s, name, state, info)
            finally:
                beat.cancel()
                await self.call(s, "/leave", {"worker_id": state["wid"]}, "leave", name, timeout_s=10)

    async def _register(self, s, name: str, state: dict) -> dict | None:
        spec = self.spec
        body = {"snapshot_url": "https://127.0.0.1:9", "relay": "127.0.0.1:9", "engine": "null", "usd_per_hour": 1.0,
                "down_mbit": 1000.0, "up_mbit": 1000.0, "rtt_ms": 20.0, "model": spec["model"],
                "max_model_len": spec["max_model_len"]}
        while not self.stop.is_set():
            info = await self.call(s, "/register", body, "register", name)
            if info is not None:
                state["wid"], state["joined_at"] = info["worker_id"], info["version"]
                return info
            await asyncio.sleep(0.5)
        return None

    def holds(self, state: dict) -> int:
        """The version a worker claims: the newest delivered to all, if it was published after the worker joined
        (so it was delivered to it too); else the initial weights, which every worker of a fresh run holds."""
        return self.delivered if self.delivered > state["joined_at"] else 0

    async def _newer_than(self, version: int, state: dict, timeout_s: float = 1.0) -> None:
        """Wait until the worker holds a version newer than ``version`` (at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while self.holds(state) <= version and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _heartbeats(self, s, name: str, state: dict, period_s: float) -> None:
        await asyncio.sleep(random.uniform(0, period_s))
        while True:
            try:
                await self.call(s, "/heartbeat", {"worker_id": state["wid"], "version": self.holds(state)},
                                "heartbeat", name)
            except LookupError:
                pass  # the work loop registers again
            await asyncio.sleep(period_s)

    async def _work(self, s, name: str, state: dict, info: dict) -> None:
        """Pull, answer with the null engine, push; paced to ``rate_per_worker`` rollouts/s (0: unpaced)."""
        spec, rec = self.spec, self.rec
        G, max_tokens, vocab = info["group_size"], int(info["sampling"]["max_tokens"]), spec["vocab_size"]
        rate, per_pull = spec["rate_per_worker"], spec["groups_per_pull"]
        next_at = time.monotonic() + (random.uniform(0, per_pull * G / rate) if rate else 0.0)
        while not self.stop.is_set():
            if rate:
                if next_at > time.monotonic():
                    await asyncio.sleep(next_at - time.monotonic())
                next_at = max(next_at, time.monotonic() - 1.0)  # at most a second of backlog, never a burst
            try:
                held = self.holds(state)
                reply = await self.call(s, "/pull", {"worker_id": state["wid"], "version": held,
                                                     "max_groups": per_pull}, "pull", name)
                if reply is None:
                    await asyncio.sleep(0.5)  # the agent's first backoff
                    continue
                if not reply["work"]:
                    if reply["wait_s"]:
                        await asyncio.sleep(reply["wait_s"])
                    else:  # a newer snapshot reached it: as the agent applies it before it asks again
                        await self._newer_than(held, state)
                    continue
                work, t = reply["work"], time.perf_counter()
                if spec["delay_s"]:
                    await asyncio.sleep(spec["delay_s"])
                results = [{"group_id": w["group_id"], "version": held, "completions": [
                    null_completion(max_tokens, vocab) for _ in range(G)]} for w in work]
                body = {"worker_id": state["wid"], "results": results,
                        "rollouts_per_s": len(work) * G / max(time.perf_counter() - t, 1e-3)}
                start = time.time()
                answer = await self.call(s, "/push", body, "push", name)
                if answer is not None and rec.inside(start):
                    rec.pushed += len(work) * G
                    rec.accepted += len(answer["accepted"]) * G
                    rec.refused.update(r["reason"] for r in answer["rejected"])
                next_at += len(work) * G / rate if rate else 0.0
            except LookupError:  # the coordinator forgot this worker (declared it dead): join again, as the agent
                rec.reregistered += 1
                if await self._register(s, name, state) is None:
                    return

    async def _watch_loop(self, tick_s: float = 0.01) -> None:
        """This process's own delays: a tick of its event loop late by 20 ms or more (inside the window) is added
        to every request it was timing then, and counted here."""
        while True:
            t = time.perf_counter()
            await asyncio.sleep(tick_s)
            late_ms = (time.perf_counter() - t - tick_s) * 1e3
            if late_ms >= 20 and self.rec.inside(time.time()):
                self.rec.lag_ms.append(late_ms)

    async def _follow_versions(self) -> None:
        path = Path(self.spec["version_file"])
        while True:
            try:
                self.delivered = int(path.read_text())
            except (OSError, ValueError):  # not written yet, or being replaced
                pass
            await asyncio.sleep(0.01)

    async def half_open(self, slot: int) -> None:
        """One idle connection, kept open: reconnected whenever the server drops it."""
        from echo2.net.tls import LEARNER_NAME

        kind = HALF_OPEN_KINDS[slot % len(HALF_OPEN_KINDS)]
        await asyncio.sleep(random.uniform(0, 2.0))
        while not self.stop.is_set():
            opened, writer = time.monotonic(), None
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    self.host, self.port, ssl=None if kind == "tcp" else self.ssl,
                    server_hostname=None if kind == "tcp" else LEARNER_NAME), 30)
                if kind == "headers":
                    writer.write(b"POST /pull HTTP/1.1\r\nHost: learner\r\nAuthorization: Bearer ")
                while not self.stop.is_set():
                    try:
                        data = await asyncio.wait_for(reader.read(1024), 2.0)
                    except asyncio.TimeoutError:
                        if kind == "headers":
                            writer.write(b"x")
                        continue
                    except ConnectionResetError:  # the server aborts a stalled connection (a reset, not a FIN)
                        break
                    if not data:
                        break
                if not self.stop.is_set():
                    self.rec.held_s.append(time.monotonic() - opened)
            except (OSError, asyncio.TimeoutError) as e:
                self.rec.idle_connect_errors[type(e).__name__] += 1
                await asyncio.sleep(1.0)
            finally:
                if writer is not None:
                    writer.close()

    async def main(self) -> None:
        """Join, say ``ready``; read the window (a line on stdin), time it; on the next line, leave and report."""
        import ssl

        from echo2.net.tls import fetch_ca

        spec, loop = self.spec, asyncio.get_running_loop()
        ca_pem = await loop.run_in_executor(None, fetch_ca, self.url, spec["ca_hash"])  # pinned, as the agent's join
        self.ssl = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_pem.decode())
        self.ssl.minimum_version = ssl.TLSVersion.TLSv1_2
        follower = asyncio.create_task(self._follow_versions())
        lag = asyncio.create_task(self._watch_loop())
        pauses_file = spec["path"] + ".gc"
        Pauses(pauses_file)
        ramp_s, ids = spec["ramp_s"], spec["ids"]
        tasks = [asyncio.create_task(self.worker(i, ramp_s * k / len(ids))) for k, i in enumerate(ids)]
        tasks += [asyncio.create_task(self.half_open(j)) for j in range(spec["half_open"])]
        while self.registered < len(ids):
            await asyncio.sleep(0.2)
        print(json.dumps({"ready": self.registered}), flush=True)
        window = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
        self.rec.t0, self.rec.t1 = window["t0"], window["t1"]
        await asyncio.sleep(max(0.0, self.rec.t0 - time.time()))
        cpu0 = _own_cpu_s()
        await asyncio.sleep(max(0.0, self.rec.t1 - time.time()))
        cpu1 = _own_cpu_s()
        await loop.run_in_executor(None, sys.stdin.readline)  # stop
        self.stop.set()
        await asyncio.wait(tasks, timeout=30)
        follower.cancel()
        lag.cancel()
        rec = self.rec
        print(json.dumps({"ms": rec.ms, "codes": rec.codes, "answered": rec.answered, "accepted": rec.accepted,
                          "pushed": rec.pushed, "refused": rec.refused, "reregistered": rec.reregistered,
                          "held_s": rec.held_s, "idle_connect_errors": rec.idle_connect_errors,
                          "cpu_s": cpu1 - cpu0, "lag_ms": rec.lag_ms,
                          "gc_ms": Pauses.read(pauses_file, rec.t0, rec.t1)}), flush=True)


def null_completion(max_tokens: int, vocab_size: int) -> dict:
    n = random.randint(1, max_tokens)
    return {"token_ids": [random.randrange(vocab_size) for _ in range(n)],
            "logprobs": [round(random.uniform(-4.0, -0.05), 4) for _ in range(n)],
            "finish_reason": "length" if n == max_tokens else "stop"}


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def client_main(spec_path: str) -> None:
    import resource

    import uvloop

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 2 connections per worker, plus the idle ones
    uvloop.run(Crowd(json.loads(Path(spec_path).read_text())).main())


# ---------------------------------------------------------------------- one run: the learner, calm, then crowded


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc; 0 once it is gone (a reward process
    the pool replaced)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def machine_busy_s() -> float:
    """CPU seconds all cores have been busy since boot (every process on the machine, everyone's)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def child_setup(core: int | None = None):
    """For a child process, before it runs: pin it to ``core`` (None: not), and have Linux SIGTERM it when its
    parent dies, however that died (a client of a killed run must not retry its coordinator for ever)."""
    def setup():
        if core is not None:
            os.sched_setaffinity(0, {core})
        if sys.platform.startswith("linux"):
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG

    return setup


class Clients:
    """A client process: its workers join; ``window(t0, t1)`` times them; ``stop()`` makes them leave and report."""

    def __init__(self, spec: dict, path: Path, core: int | None):
        spec["path"] = str(path)
        path.write_text(json.dumps(spec))
        self.proc = subprocess.Popen([sys.executable, __file__, "--client", str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, preexec_fn=child_setup(core))

    def ready(self, timeout_s: float) -> None:
        """Wait until every worker of the process has registered."""
        import select

        if not select.select([self.proc.stdout], [], [], timeout_s)[0] or not self.proc.stdout.readline():
            raise RuntimeError(f"the workers of client process {self.proc.pid} did not all join within "
                               f"{timeout_s:.0f} s (the first failures are in this run's log)")

    def window(self, t0: float, t1: float) -> None:
        self.proc.stdin.write(json.dumps({"t0": t0, "t1": t1}) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> dict:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())


def measure(coordinator_pid: int, t0: float, t1: float) -> dict:
    """CPU seconds over [t0, t1] (sleeps until t1): the coordinator's process, its reward processes, this process
    (the learner), the whole machine; and the coordinator's largest RSS, sampled every second."""
    from echo2.env import descendants

    rewards = sorted(descendants(coordinator_pid))

    def sample():
        return (proc_cpu_s(coordinator_pid), sum(proc_cpu_s(r) for r in rewards), _own_cpu_s(), machine_busy_s())

    time.sleep(max(0.0, t0 - time.time()))
    before, rss = sample(), []
    while time.time() < t1:
        rss.append(proc_rss_mb(coordinator_pid))
        time.sleep(min(1.0, max(0.0, t1 - time.time())))
    after = sample()
    keys = ("coordinator_cpu_s", "reward_cpu_s", "learner_cpu_s", "machine_cpu_s")
    return {**{k: a - b for k, a, b in zip(keys, after, before)}, "rss_mb": max(rss),
            "load": os.getloadavg()[0]}


def one_run(args) -> dict:
    """Train with --calm-workers workers (the calm window), then with the crowd (its window); the run's row."""
    os.environ["ECHO2_TOKEN"] = "crowd-" + os.urandom(12).hex()  # the run secret: the learner's, and the clients'
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    from transformers import TrainerCallback

    import train
    from echo2.env import configure_process
    from echo2.learner.sources.pool import terminate
    from step_time import compose

    configure_process()
    run_dir = tempfile.mkdtemp(prefix="echo2-crowd-")
    version_file = os.path.join(run_dir, "delivered_version")
    side = 1 if (os.cpu_count() or 1) > 1 else 0
    if args.pin:
        os.sched_setaffinity(0, {0})  # the learner on core 0; the coordinator and the clients on the other
    cfg = compose(["rollout=async", "pool=static", "rollout.source.tls=on", "run.steps=1000000", "run.wandb=disabled",
                   "run.progress=false", "run.eval_every_steps=0", "run.save_every_steps=0",
                   "rollout.source.take_timeout_s=120",  # clients that died end the run, not after 15 minutes
                   f"rollout.prompts_per_step={args.prompts_per_step}",
                   "broadcast.sender._target_=coordinator_crowd.NullBroadcaster",
                   f"+broadcast.sender.version_file={version_file}",
                   *([f"rollout.source.coordinator_cores=[{side}]"] if args.pin else [])])
    trainer, source, _ = train.build(cfg, run_dir, rank=0, world_size=1)
    remote = source.source
    coordinator = remote.coordinator
    base = {"url": coordinator.url, "ca_hash": remote.ca_hash, "version_file": version_file, "groups_per_pull": 4,
            "delay_s": args.delay_s, "vocab_size": len(trainer.processing_class),
            "model": {k: remote.requires["model"][k] for k in ("name", "digest")},
            "max_model_len": remote.requires["max_model_len"]}
    core = side if args.pin else None

    def clients(prefix: str, workers: int, half_open: int, procs: int) -> list[Clients]:
        return [Clients({**base, "prefix": f"{prefix}{k}-", "ids": list(range(k, workers, procs)),
                         "rate_per_worker": args.rate / workers, "ramp_s": max(2.0, workers / procs / 150),
                         "half_open": half_open // procs + (k < half_open % procs)},
                        Path(run_dir) / f"{prefix}{k}.json", core) for k in range(procs)]

    steps: list[tuple[float, float]] = []  # (wall time at its end, seconds it waited for rollouts: its log's)
    windows: dict[str, tuple[float, float]] = {}
    measured: dict[str, dict] = {}
    outs: dict[str, list[dict]] = {}
    stop_at = [float("inf")]

    class Clock(TrainerCallback):
        """Each step as it is logged (every step: logging_steps=1); stops the learner at the crowd window's end."""

        def on_log(self, _args, state, control, logs=None, **kw):
            if logs and "train/learner_idle_s" in logs:
                steps.append((time.time(), logs["train/learner_idle_s"]))
                control.should_training_stop = time.time() >= stop_at[0]

    def orchestrate(calm: list[Clients]):
        """calm joins -> calm window -> the crowd joins -> calm leaves -> crowd window -> the learner stops."""
        try:
            for c in calm:
                c.ready(JOIN_TIMEOUT_S)
            windows["calm"] = t0, t1 = time.time() + args.settle_s, time.time() + args.settle_s + args.duration_s
            for c in calm:
                c.window(t0, t1)
            measured["calm"] = measure(coordinator.proc.pid, t0, t1)
            crowd = clients("crowd", args.workers, args.half_open, args.client_procs)
            started.extend(crowd)
            for c in crowd:
                c.ready(JOIN_TIMEOUT_S + args.workers / 50)
            outs["calm"] = [c.stop() for c in calm]
            windows["crowd"] = t0, t1 = time.time() + args.settle_s, time.time() + args.settle_s + args.duration_s
            stop_at[0] = t1
            for c in crowd:
                c.window(t0, t1)
            measured["crowd"] = measure(coordinator.proc.pid, t0, t1)
            time.sleep(GRACE_S)
            outs["crowd"] = [c.stop() for c in crowd]
        except Exception as e:  # reported in the row; the learner stops at its next step
            measured["error"] = repr(e)
            stop_at[0] = time.time()

    calm = clients("calm", args.calm_workers, 0, 1)
    started = list(calm)  # every client process, to stop at the end
    trainer.add_callback(Clock())
    conductor = threading.Thread(target=orchestrate, args=(calm,), daemon=True)
    conductor.start()
    try:
        trainer.train()
        conductor.join(timeout=120)
    finally:
        accounting = source.close()
        terminate([c.proc for c in started], timeout_s=10)
        for phase, (t0, t1) in windows.items():
            measured.get(phase, {})["coordinator_gc_ms"] = Pauses.read(version_file + ".gc", t0, t1)
        shutil.rmtree(run_dir, ignore_errors=True)  # its coordinator.log went to this run's stderr too
    row = {"workers": args.workers, "calm_workers": args.calm_workers, "half_open": args.half_open,
           "rate": args.rate, "duration_s": args.duration_s, "rollouts_per_step": args.prompts_per_step * 8,
           "error": measured.pop("error", None), "books_balanced": balanced(accounting),
           "accounting": {k: v for k, v in accounting.items() if k != "by_worker"}}
    for phase in ("calm", "crowd"):
        if phase in windows and phase in outs:
            row[phase] = summarize(steps, windows[phase], measured[phase], outs[phase], row["rollouts_per_step"])
    return row


def balanced(acc: dict) -> bool:
    """Every dispatched rollout consumed, dropped or lost (the ledger's identity), nothing left open."""
    closed = acc.get("consumed", 0) + sum(acc.get("dropped", {}).values()) + sum(acc.get("lost", {}).values())
    return acc.get("dispatched", -1) == closed and acc.get("in_flight") == acc.get("buffered") == 0


def summarize(steps: list, window: tuple[float, float], measured: dict, outs: list[dict], per_step: int) -> dict:
    """One window's numbers, from the learner's steps, the CPU samples and the client processes' reports."""
    t0, t1 = window
    span = t1 - t0
    inside = [(end - start, idle) for (start, _), (end, idle) in zip(steps, steps[1:]) if t0 <= start and end <= t1]
    ms, codes, answered, refused, idle_errors, held = defaultdict(list), defaultdict(Counter), Counter(), Counter(), \
        Counter(), []
    for out in outs:
        for route, values in out["ms"].items():
            ms[route] += values
        for route, counts in out["codes"].items():
            codes[route].update(counts)
        answered.update(out["answered"])
        refused.update(out["refused"])
        idle_errors.update(out["idle_connect_errors"])
        held += out["held_s"]
    wall = sum(s for s, _ in inside)
    ours = sum(measured[k] for k in ("coordinator_cpu_s", "reward_cpu_s", "learner_cpu_s")) + sum(
        o["cpu_s"] for o in outs)
    return {
        "steps": len(inside), "step_s": _median([s for s, _ in inside]), "busy_s": _median([s - i for s, i in inside]),
        "learner_cpu_ms_per_step": 1e3 * measured["learner_cpu_s"] / max(1, len(inside)),
        "waiting": sum(i for _, i in inside) / max(wall, 1e-9),
        "accepted_per_s": sum(o["accepted"] for o in outs) / span,
        "consumed_per_s": len(inside) * per_step / max(wall, 1e-9),
        "routes": {r: {"n": len(v), "p50_ms": _pct(v, 50), "p99_ms": _pct(v, 99), "max_ms": max(v)}
                   for r, v in sorted(ms.items())},
        "codes": {r: dict(c) for r, c in sorted(codes.items())},
        "workers_answered": len(answered), "min_answers": min(answered.values(), default=0),
        "reregistered": sum(o["reregistered"] for o in outs), "refused": dict(refused),
        "idle_dropped_after_s": _median(held), "idle_drops": len(held), "idle_errors": dict(idle_errors),
        "client_cpu_s": sum(o["cpu_s"] for o in outs), "others_cpu_s": measured["machine_cpu_s"] - ours,
        "coordinator_gc": pauses(measured.pop("coordinator_gc_ms", [])),
        "client_gc": pauses([ms for o in outs for ms in o["gc_ms"]]),
        "client_lag": pauses([ms for o in outs for ms in o["lag_ms"]]),
        **measured,
    }


def pauses(ms: list[float]) -> dict:
    return {"n": len(ms), "max_ms": max(ms, default=0.0), "total_ms": sum(ms)}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# ---------------------------------------------------------------------- the sweep and its tables


def run_row(args, workers: int) -> dict:
    """One run in a fresh process (a fresh learner and coordinator); its row. Its output goes to a log beside
    --json (else in the temporary folder), which is kept."""
    fd, out = tempfile.mkstemp(suffix=".json", prefix="echo2-crowd-")
    os.close(fd)
    log = (Path(args.json).with_name(f"{Path(args.json).stem}-{workers}.log") if args.json
           else Path(out).with_suffix(".log"))
    cmd = [sys.executable, __file__, "--one", out, "--workers", str(workers), "--half-open", str(args.half_open),
           "--rate", str(args.rate), "--duration-s", str(args.duration_s), "--settle-s", str(args.settle_s),
           "--delay-s", str(args.delay_s), "--calm-workers", str(args.calm_workers),
           "--prompts-per-step", str(args.prompts_per_step), "--client-procs", str(args.client_procs),
           *([] if args.pin else ["--no-pin"])]
    print(f"# {workers} workers, {args.half_open} idle connections (log: {log})", file=sys.stderr, flush=True)
    try:
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, preexec_fn=child_setup())
            try:
                proc.wait(timeout=2 * args.duration_s + 300)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"the run with {workers} workers failed (exit {proc.returncode}; log {log})")
        return json.loads(Path(out).read_text())
    finally:
        os.unlink(out)


ROUTES = ("register", "heartbeat", "pull (work)", "pull (empty)", "push")


def print_tables(rows: list[dict]) -> None:
    r0 = rows[0]
    offered = f"{r0['rate']:.0f} rollouts/s offered in all" if r0["rate"] else "unpaced workers"
    print(f"\nlearner: tiny model, rollout=async (S = 2), {r0['rollouts_per_step']} rollouts/step, TLS on; {offered}; "
          f"windows of {r0['duration_s']:.0f} s; each cell calm → crowd, where calm is the same run with "
          f"{r0['calm_workers']} workers and no idle connections, before the crowd came")
    print("\n| workers | idle conns | load (1 min) | accepted rollouts/s | consumed rollouts/s | "
          "learner step s (ratio) | busy s (ratio) | learner CPU ms/step (ratio) | waiting for rollouts | "
          "dropped stale (run) | books |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, k = r["calm"], r["crowd"]
        both = lambda key, f: f"{f.format(c[key])} → {f.format(k[key])}"  # noqa: E731
        ratio = lambda key, f: f"{both(key, f)} ({k[key] / c[key]:.2f})"  # noqa: E731
        print(f"| {r['workers']} | {r['half_open']} | {both('load', '{:.1f}')} | {both('accepted_per_s', '{:.0f}')} | "
              f"{both('consumed_per_s', '{:.0f}')} | {ratio('step_s', '{:.3f}')} | {ratio('busy_s', '{:.3f}')} | "
              f"{ratio('learner_cpu_ms_per_step', '{:.0f}')} | {both('waiting', '{:.0%}')} | "
              f"{r['accounting'].get('dropped', {}).get('stale', 0)} | "
              f"{'balanced' if r['books_balanced'] else 'NOT BALANCED'} |")
    print("\nlatency on the clients' side, p50 / p99 ms (register: during the ramp; the rest: in the window)\n")
    print("| workers | " + " | ".join(ROUTES) + " | requests | not 200 | workers answered |")
    print("|" + "---|" * (len(ROUTES) + 4))
    for r in rows:
        for phase, label in (("calm", f"{r['calm_workers']} (calm, run {r['workers']})"), ("crowd", r["workers"])):
            p = r[phase]
            cells = [f"{p['routes'][n]['p50_ms']:.1f} / {p['routes'][n]['p99_ms']:.0f}" if n in p["routes"] else "-"
                     for n in ROUTES]
            total = sum(sum(c.values()) for c in p["codes"].values())
            bad = sum(n for c in p["codes"].values() for code, n in c.items() if code != "200")
            print(f"| {label} | " + " | ".join(cells) + f" | {total} | {bad} | "
                  f"{p['workers_answered']}, each >= {p['min_answers']} answers |")
    print("\nwhere the time went in the crowd window: CPU as a share of one core (calm → crowd); pauses as count, "
          "longest ms\n")
    print("| workers | coordinator | its reward processes | clients | learner | other jobs on the machine | "
          "coordinator GC pauses >= 5 ms | clients' event loop late >= 20 ms | coordinator RSS MB | "
          "idle conns dropped after s (n) |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, k, span = r["calm"], r["crowd"], r["duration_s"]
        share = lambda key: f"{c[key] / span:.0%} → {k[key] / span:.0%}"  # noqa: E731
        gaps = lambda p: f"{p['n']}, {p['max_ms']:.0f}"  # noqa: E731
        print(f"| {r['workers']} | {share('coordinator_cpu_s')} | {share('reward_cpu_s')} | {share('client_cpu_s')} | "
              f"{share('learner_cpu_s')} | {share('others_cpu_s')} | {gaps(c['coordinator_gc'])} → "
              f"{gaps(k['coordinator_gc'])} | {gaps(k['client_lag'])} | {c['rss_mb']:.0f} → {k['rss_mb']:.0f} | "
              f"{k['idle_dropped_after_s']:.1f} ({k['idle_drops']}) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[16, 128, 512, 1024],
                   help="simulated workers, one run each")
    p.add_argument("--rate", type=float, default=2000.0, help="rollouts/s the workers offer in all (0: unpaced)")
    p.add_argument("--duration-s", type=float, default=60.0, help="each window (calm, then crowd) of each run")
    p.add_argument("--half-open", type=int, default=200, help="idle or half-open connections held with the crowd")
    p.add_argument("--delay-s", type=float, default=0.0,
                   help="the null engine answers a pull after this long (a worker then gives at most 4 G / delay "
                        "rollouts/s, whatever --rate asks)")
    p.add_argument("--calm-workers", type=int, default=4, help="workers feeding the learner in the calm window")
    p.add_argument("--prompts-per-step", type=int, default=64,
                   help="P (rollout.prompts_per_step; G is 8): at 64, 2,000 rollouts/s is ~4 learner steps/s, each "
                        "with a snapshot published and the coordinator's metrics fetched (at the default 16: 16/s)")
    p.add_argument("--settle-s", type=float, default=5.0, help="after the last worker joined, before a window")
    p.add_argument("--client-procs", type=int, default=0,
                   help="crowd client processes (0: 1 up to 256 workers, else 2)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave every process to the scheduler (default: the learner on core 0, the rest on core 1)")
    p.add_argument("--quick", action="store_true", help="16 workers, 8 s windows (tests/coordinator/test_crowd.py runs this)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: be a client process
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: be one run, its row written to this file
    args = p.parse_args()
    if args.client:
        client_main(args.client)
        return
    if args.one:
        args.workers = args.workers[0]
        args.client_procs = args.client_procs or (1 if args.workers <= 256 else 2)
        Path(args.one).write_text(json.dumps(one_run(args)))
        return
    if args.quick:
        args.workers, args.duration_s, args.settle_s = [16], 8.0, 3.0
    rows = [run_row(args, n) for n in args.workers]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    failed = [r for r in rows if r["error"] or "crowd" not in r]
    print_tables([r for r in rows if r not in failed])
    for r in failed:
        print(f"the run with {r['workers']} workers did not finish its windows: {r['error']}")


if __name__ == "__main__":
    main()
