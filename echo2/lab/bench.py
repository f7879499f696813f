"""How long until every worker holds a verified snapshot: pipelined relay against one-to-many, on emulated WAN links.

    python -m echo2.lab.bench --mode pipelined --workers 8 --size-mb 50 --link-mbit 100 --rtt-ms 40
    python -m echo2.lab.bench --mode one_to_many --workers 4 --size-mb 50 --link-mbit 100 --rtt-ms 40 --json
    python -m echo2.lab.bench --mode chain|stripes|tree ...   # one layout, whatever auto would pick
    python -m echo2.lab.bench ... --testbed inproc      # no root: token buckets + latency around each connection
    python -m echo2.lab.bench ... --tls both            # the same broadcast over plain TCP, then over TLS

Every worker is a separate process running the worker agent's own snapshot receiver (worker/peer.py); the
learner is a process running the coordinator's broadcaster (coordinator/broadcaster.py). ``--testbed netns``
(default where root and iptables are available) puts each in its own network namespace behind HTB-shaped links and
a delay line, and checks the shaped RTT and rate before measuring; ``inproc`` shapes in the application instead (it knows no slow
start, no header overhead: an optimistic model for tests, not the benchmark).

time_s: from ``publish`` until the last worker holds the snapshot, every chunk verified (its own clock reading
when its fetch returned; all processes share this machine's monotonic clock), so it includes digesting and
signing (prepare_s, also reported); informed_s adds the worker's answer reaching the learner (one more path
latency); the median of ``--reps`` versions, after ``--warmup`` versions that open the relay's persistent
connections (handshakes, TCP slow start: a run pays that once; reported as first_version_s). bound_s:
max(M / learner uplink, M / worker downlink) + one path latency (RTT/2), the physical floor of any broadcast;
ratio = time_s / bound_s. ``--tls on`` runs every relay link and control call over TLS with a run CA made for
the bench (as a run off loopback does); ``both`` measures plain then TLS and prints the slowdown.

Modes: ``pipelined`` is what ``broadcast=pipelined`` runs (topology ``auto``: chain or stripes, picked per round by
topology.choose); ``chain``, ``stripes`` (up to ``--fanout`` stripes) and ``tree`` force one layout;
``one_to_many`` is the star. Beside each time: the layout the last round ran (``layout``), the pipeline's own term
the model predicts for it and for a chain (``added_s``, ``chain_added_s``: topology.added_s, the time past M/B),
and Mundinger, Weber and Weiss's optimum (M/B)(1 + ⌊log₂N⌋/k) for k = M / piece, the relay's forwarding unit
(``mww_s``; no latency in it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from echo2.broadcast.topology import FANOUT

ROOT = Path(__file__).resolve().parents[2]
MODES = {"pipelined": "auto", "one_to_many": "star", "chain": "chain", "stripes": "stripes", "tree": "tree"}


# ---------------------------------------------------------------------- roles (each its own process)


def role_peer(args) -> None:
    from echo2.worker.peer import SnapshotReceiver
    from echo2.lab.link import Link

    link = Link(up_mbit=args.up_mbit, down_mbit=args.down_mbit, latency_s=args.latency_ms / 1e3)
    cls = _late_control(SnapshotReceiver, args.latency_ms / 1e3) if args.latency_ms else SnapshotReceiver
    trust = None
    if args.tls_dir:
        from echo2.net.tls import PEER_NAME, RunCA, Trust, server_context

        ca = RunCA(args.tls_dir)
        trust = Trust(ca.ca_pem, ca.ca_file, server_context(*ca.issue([PEER_NAME])))
    r = cls.of_run(os.environ["ECHO2_TOKEN"], lambda v, blob, manifest: None, host=args.host, link=link,
                   trust=trust).start()
    print(json.dumps({"url": r.url, "relay": r.relay_addr}), flush=True)
    sys.stdin.read()  # until the driver closes our stdin
    r.close()


def _late_control(base: type, one_way_s: float) -> type:
    """``base`` (SnapshotReceiver) whose control routes take an order one one-way latency after it was sent and
    answer one later: the in-process link shapes only relay connections, and the learner measures a peer's RTT
    by its key orders (topology ``auto`` plans by it), as it does over a real or namespace link."""

    class LateControl(base):
        def _fetch(self, body, headers):
            time.sleep(one_way_s)
            try:
                return super()._fetch(body, headers)
            finally:
                time.sleep(one_way_s)

        def _key(self, body, headers):
            time.sleep(2 * one_way_s)
            return super()._key(body, headers)

    return LateControl


def role_learner(args) -> None:
    from echo2.coordinator.broadcaster import RelayBroadcaster
    from echo2.lab.link import Link

    peers = json.loads(args.peers)
    done = threading.Condition()
    delivered: dict[int, set] = {}

    def on_delivered(peer, version):
        with done:
            delivered.setdefault(version, set()).add(peer)
            done.notify_all()

    bc = RelayBroadcaster(os.environ["ECHO2_TOKEN"], topology=MODES[args.mode], fanout=args.fanout,
                          host=args.host, link=Link(up_mbit=args.uplink_mbit), chunk_mb=args.chunk_mb,
                          sparse_delta=args.changed < 1)
    bc.on_delivered = on_delivered
    if args.tls_dir:
        from echo2.net.tls import RunCA

        bc.use_tls(RunCA(args.tls_dir).trust())
    for i, p in enumerate(peers):
        bc.add_peer(f"w{i}", p["url"], p["relay"])
    blob = bytearray(os.urandom(args.size_bytes))
    rng = random.Random(0)
    rows = []
    for v in range(1, args.reps + 1):
        # a new snapshot each version: every byte new (full), or a fraction of the words changed (--changed)
        if args.changed >= 1 or v == 1:
            blob = bytearray(os.urandom(args.size_bytes))
        else:
            for i in rng.sample(range(0, len(blob) - 1, 2), int(args.changed * len(blob) / 2)):
                blob[i] ^= 0x01
        data = bytes(blob)
        origin_before = bc.server.served_bytes
        t0 = time.monotonic()  # one clock for every process of the run: they all run on this machine
        bc.publish(v, data)
        with done:
            if not done.wait_for(lambda: len(delivered.get(v, ())) == len(peers), timeout=args.timeout_s):
                sys.exit(f"v{v}: only {len(delivered.get(v, ()))} of {len(peers)} workers got it in {args.timeout_s} s")
        informed_s = time.monotonic() - t0
        hops = sorted((r["depth"], (r.get("first_byte_at") or t0) - t0, r["done_at"] - t0, r.get("rtt_s"),
                       r["done_at"] - r["seconds"] - t0) for r in bc.last_results.values())
        layout = bc.last_layout
        rows.append({"time_s": max(h[2] for h in hops), "informed_s": informed_s, "prepare_s": bc.last_prepare_s,
                     "hops": hops, "origin_bytes": bc.server.served_bytes - origin_before,
                     "delta_ratio": bc.last_delta_ratio, "layout": [layout.kind, layout.fanout] if layout else None})
    bc.close()
    print(json.dumps(rows), flush=True)


def role_probe_server(args) -> None:
    """Echo for RTT probes; a sink that acknowledges for the rate probe."""
    srv = socket.create_server((args.host, args.port))
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        kind = conn.recv(1)
        if kind == b"p":
            while data := conn.recv(64):
                conn.sendall(data)
        elif kind == b"s":  # goodput after the first quarter of the bytes: past TCP's slow start
            n = int.from_bytes(conn.recv(8), "big")
            got, t_quarter = 0, None
            while got < n:
                got += len(conn.recv(1 << 20))
                if t_quarter is None and got >= n // 4:
                    t_quarter, at = time.perf_counter(), got
            rate = (got - at) * 8 / max(time.perf_counter() - t_quarter, 1e-9) / 1e6
            conn.sendall(json.dumps({"goodput_mbit": rate}).encode() + b"\n")
        conn.close()


def role_probe(args) -> None:
    """RTT (median of 20 ping-pongs) and steady goodput of one ~3 s transfer to the probe server."""
    c = socket.create_connection((args.host, args.port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.sendall(b"p")
    rtts = []
    for _ in range(20):
        t0 = time.perf_counter()
        c.sendall(b"x" * 32)
        got = 0
        while got < 32:
            got += len(c.recv(64))
        rtts.append(time.perf_counter() - t0)
    c.close()
    n = int(args.rate_mbit * 1e6 / 8 * 3.0)
    c = socket.create_connection((args.host, args.port))
    c.sendall(b"s" + n.to_bytes(8, "big"))
    chunk = b"\0" * (1 << 20)
    sent = 0
    while sent < n:
        sent += c.send(chunk[: min(len(chunk), n - sent)])
    reply = json.loads(c.makefile().readline())
    print(json.dumps({"rtt_ms": statistics.median(rtts) * 1e3, **reply}), flush=True)


# ---------------------------------------------------------------------- the driver


def _py(*argv) -> list[str]:
    return [sys.executable, "-m", "echo2.lab.bench", *map(str, argv)]


def measure(args) -> dict:
    env = dict(os.environ, ECHO2_TOKEN=os.environ.get("ECHO2_TOKEN") or os.urandom(16).hex(),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    size = int(args.size_mb * 1e6)
    uplink = args.learner_uplink_mbit or args.link_mbit
    procs: list[subprocess.Popen] = []
    calibration = None
    testbed = None
    try:
        if args.testbed == "netns":
            from echo2.lab.testbed import HostLink, NetnsTestbed

            links = [HostLink(uplink, uplink)] + [HostLink(args.link_mbit, args.link_mbit)] * args.workers
            testbed = NetnsTestbed(links, args.rtt_ms).__enter__()
            calibration = calibrate(testbed, min(uplink, args.link_mbit), args.rtt_ms, env)

            def start(i, argv):
                return testbed.popen(i, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                                     cwd=ROOT)
            hosts = [testbed.addr(i) for i in range(args.workers + 1)]
            shaping: list[str] = []
        else:
            def start(i, argv):
                return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                                        cwd=ROOT)
            hosts = ["127.0.0.1"] * (args.workers + 1)
            shaping = ["--latency-ms", args.rtt_ms / 2]
        peers = []
        tls = ["--tls-dir", args.tls_dir] if args.tls_dir else []
        for i in range(1, args.workers + 1):
            extra = ["--down-mbit", args.link_mbit, "--up-mbit", args.link_mbit, *shaping] if shaping else []
            p = start(i, _py("--role", "peer", "--host", hosts[i], *extra, *tls))
            procs.append(p)
            peers.append(json.loads(p.stdout.readline()))
        extra = ["--uplink-mbit", uplink, *shaping] if shaping else []
        learner = start(0, _py("--role", "learner", "--host", hosts[0], "--peers", json.dumps(peers), "--mode",
                               args.mode, "--fanout", args.fanout, "--size-bytes", size, "--reps",
                               args.warmup + args.reps,
                               "--chunk-mb", args.chunk_mb,
                               "--changed", args.changed,
                               "--timeout-s", args.timeout_s, *extra, *tls))
        procs.append(learner)
        out, _ = learner.communicate(timeout=args.timeout_s * (args.warmup + args.reps) + 60)
        if learner.returncode:
            raise SystemExit(f"learner process failed (exit {learner.returncode})")
        rows = json.loads(out.strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if testbed is not None:
            testbed.down()
    first, rows = rows[0], rows[args.warmup:]
    times = [r["time_s"] for r in rows]
    bound = max(size * 8 / (uplink * 1e6), size * 8 / (args.link_mbit * 1e6)) + args.rtt_ms / 2e3
    med = statistics.median(times)
    median_row = min(rows, key=lambda r: abs(r["time_s"] - med))
    return {"mode": args.mode, "workers": args.workers, "size_bytes": size, "time_s": med, "bound_s": bound,
            "ratio": med / bound, "times_s": times, "informed_s": statistics.median(r["informed_s"] for r in rows),
            "prepare_s": statistics.median(r["prepare_s"] for r in rows),
            "delta_ratio": statistics.median(r["delta_ratio"] for r in rows), "changed": args.changed,
            # per worker: depth, first byte s, done s, TCP RTT to its source s, when its order took effect s
            "hops": median_row["hops"],
            "origin_bytes_per_version": statistics.median(r["origin_bytes"] for r in rows),
            "testbed": args.testbed, "link_mbit": args.link_mbit, "learner_uplink_mbit": uplink,
            "rtt_ms": args.rtt_ms, "reps": args.reps, "warmup": args.warmup, "first_version_s": first["time_s"],
            "tls": bool(args.tls_dir),
            "calibration": calibration, **_model_terms(median_row, args.workers, size, min(uplink, args.link_mbit),
                                                      args.rtt_ms)}


def _model_terms(row: dict, n: int, size_bytes: int, mbit: float, rtt_ms: float) -> dict:
    """What the planning model says of the round ``row`` ran (see the module doc): its layout, the pipeline's own
    term for it and for a chain, and the MWW optimum for its chunks."""
    from echo2.broadcast import topology

    rate, one_way_s = mbit * 1e6 / 8, rtt_ms / 2e3
    layout = topology.Layout(*row["layout"]) if row.get("layout") else None
    return {"layout": f"{layout.kind}({layout.fanout})" if layout and layout.kind in ("stripes", "tree")
            else layout.kind if layout else None,
            "added_s": topology.added_s(layout, n, size_bytes, rate, one_way_s) if layout else None,
            "chain_added_s": topology.added_s(topology.Layout("chain"), n, size_bytes, rate, one_way_s),
            "mww_s": topology.mww_optimum_s(n, size_bytes, rate, -(-size_bytes // topology.PIECE_BYTES))}


def calibrate(testbed, rate_mbit: float, rtt_ms: float, env: dict) -> dict:
    """Measure RTT and goodput learner -> worker 1 on the shaped links; refuse to go on if they are off."""
    server = testbed.popen(1, _py("--role", "probe-server", "--host", testbed.addr(1), "--port", 9),
                           stdout=subprocess.PIPE, env=env, text=True, cwd=ROOT)
    try:
        server.stdout.readline()
        out = testbed.run(0, _py("--role", "probe", "--host", testbed.addr(1), "--port", 9, "--rate-mbit", rate_mbit))
    finally:
        server.kill()
        server.wait()
    got = json.loads(out)
    # HTB shapes the wire rate: TCP goodput tops out at 1448/1514 = 95.6 % of it (MTU 1500); slow start eats more.
    if abs(got["rtt_ms"] - rtt_ms) > max(2.0, 0.05 * rtt_ms):
        raise SystemExit(f"testbed RTT {got['rtt_ms']:.1f} ms, configured {rtt_ms} ms: delay line not working")
    if not 0.85 * rate_mbit <= got["goodput_mbit"] <= 1.02 * rate_mbit:
        raise SystemExit(f"testbed goodput {got['goodput_mbit']:.0f} Mbit/s on a {rate_mbit} Mbit/s link")
    return got


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m echo2.lab.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=sorted(MODES), default="pipelined",
                   help="pipelined (auto: chain or stripes, as broadcast=pipelined runs), chain, stripes, tree "
                        "(relay tree), one_to_many (star)")
    p.add_argument("--fanout", type=int, default=FANOUT,
                   help="tree: children per node; stripes: the most stripes (broadcast.sender.fanout; pipelined, "
                        "topology auto, picks its own)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--size-mb", type=float, default=50)
    p.add_argument("--link-mbit", type=float, default=100, help="every worker's uplink and downlink")
    p.add_argument("--rtt-ms", type=float, default=40)
    p.add_argument("--learner-uplink-mbit", type=float, default=None, help="default: --link-mbit")
    p.add_argument("--testbed", choices=["netns", "inproc"], default=None,
                   help="default: netns where it can run (root, iptables), else inproc")
    p.add_argument("--reps", type=int, default=3, help="versions broadcast; the median is reported")
    p.add_argument("--warmup", type=int, default=1,
                   help="versions broadcast first and not counted: they open the persistent connections")
    p.add_argument("--chunk-mb", type=float, default=4)
    p.add_argument("--changed", type=float, default=1.0,
                   help="fraction of 16-bit words that change between versions; < 1 turns sparse deltas on (the "
                        "first version, a warm-up by default, is always sent whole)")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--tls", choices=["off", "on", "both"], default="off",
                   help="relay and control links over TLS with a run CA (both: plain, then TLS, and the slowdown)")
    p.add_argument("--tls-dir", help=argparse.SUPPRESS)
    # internal roles
    p.add_argument("--role", choices=["peer", "learner", "probe-server", "probe"], help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--peers", help=argparse.SUPPRESS)
    p.add_argument("--size-bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--up-mbit", type=float, help=argparse.SUPPRESS)
    p.add_argument("--down-mbit", type=float, help=argparse.SUPPRESS)
    p.add_argument("--uplink-mbit", type=float, help=argparse.SUPPRESS)
    p.add_argument("--latency-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--rate-mbit", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        {"peer": role_peer, "learner": role_learner, "probe-server": role_probe_server, "probe": role_probe}[
            args.role](args)
        return
    if args.testbed is None:
        from echo2.lab.testbed import available

        args.testbed = "inproc" if available() else "netns"
    if args.workers < 1 or args.reps < 1 or args.warmup < 0:
        p.error("need --workers >= 1, --reps >= 1, --warmup >= 0")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` unwinds too: the testbed is torn down
    results = []
    for tls in (["off", "on"] if args.tls == "both" else [args.tls]):
        import tempfile

        args.tls_dir = tempfile.mkdtemp(prefix="echo2-bench-ca-") if tls == "on" else None
        results.append(measure(args))
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results))
        return
    for r in results:
        _print(r)
    if len(results) == 2:
        plain, tls = results
        print(f"TLS against plain TCP: time x{tls['time_s'] / plain['time_s']:.3f} "
              f"({(tls['time_s'] / plain['time_s'] - 1) * 100:+.1f} %), first version (handshakes) "
              f"{plain['first_version_s']:.2f} -> {tls['first_version_s']:.2f} s")


def _print(r: dict) -> None:
    print(f"{'TLS ' if r['tls'] else ''}{r['mode']} x {r['workers']} workers, {r['size_bytes'] / 1e6:.0f} MB, links {r['link_mbit']:g} Mbit/s, "
          f"learner uplink {r['learner_uplink_mbit']:g} Mbit/s, RTT {r['rtt_ms']:g} ms, testbed {r['testbed']}")
    if r["calibration"]:
        print(f"calibration: RTT {r['calibration']['rtt_ms']:.1f} ms, goodput {r['calibration']['goodput_mbit']:.0f} "
              f"Mbit/s")
    print(f"{'time_s':>8} {'bound_s':>8} {'ratio':>6} {'prepare_s':>9} {'learner uploaded':>17}  all times "
          f"(first version, opening connections: {r['first_version_s']:.2f} s)")
    print(f"{r['time_s']:>8.2f} {r['bound_s']:>8.2f} {r['ratio']:>6.2f} {r['prepare_s']:>9.2f} "
          f"{r['origin_bytes_per_version'] / r['size_bytes']:>15.2f}xM  {', '.join(f'{t:.2f}' for t in r['times_s'])}")
    if r.get("layout"):
        print(f"layout {r['layout']}: the model's pipeline term {r['added_s']:.3f} s (a chain's "
              f"{r['chain_added_s']:.3f} s); MWW optimum {r['mww_s']:.2f} s")


if __name__ == "__main__":
    main()
