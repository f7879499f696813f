"""The namespace WAN testbed and the broadcast benchmark CLI on it (root + iptables; CI has both).

Small on purpose (a few MB, 3 workers): these check that the testbed shapes what it says (calibration), that
the CLI's JSON holds what the issue asks for, that a broadcast over real shaped links delivers verified bytes
with the learner uploading once (chain) or N times (star), and that nothing is left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from echo2.lab import testbed

why = testbed.available()
require_netns = pytest.mark.skipif(why is not None, reason=f"require_netns: {why}")


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.e2e
@require_netns
@pytest.mark.slow
@pytest.mark.parametrize("mode, copies", [("pipelined", 1), ("one_to_many", 3)])
def test_bench_cli_on_shaped_links(mode, copies):
    before = namespaces()
    for _ in range(2):
        out = subprocess.run([sys.executable, "-m", "echo2.lab.bench", "--mode", mode, "--workers", "3",
                              "--size-mb", "4", "--link-mbit", "100", "--rtt-ms", "20", "--reps", "2", "--testbed",
                              "netns", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        # the bench refuses links its calibration finds off: the user-space delay line, starved of CPU by the
        # other test process's load, once gave 61 Mbit/s of 100 in CI; a second try, then a failure
        if out.returncode == 0 or not out.stderr.startswith(("testbed goodput", "testbed RTT")):
            break
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"mode", "workers", "size_bytes", "time_s", "bound_s", "ratio", "first_version_s"} <= set(r)
    assert len(r["times_s"]) == 2 and r["warmup"] == 1  # the warm-up version is not among the measured
    assert r["informed_s"] >= r["time_s"] > 0  # a worker holds it before the learner hears so
    assert all(0.018 <= h[3] < 1.0 for h in r["hops"])  # TCP's RTT to its source, for topology order: >= 20 ms
    assert r["mode"] == mode and r["workers"] == 3 and r["size_bytes"] == 4_000_000
    assert abs(r["calibration"]["rtt_ms"] - 20) < 2 and r["calibration"]["goodput_mbit"] > 75
    assert r["origin_bytes_per_version"] == copies * r["size_bytes"]
    assert r["ratio"] > 1.0  # nothing beats the physical bound: a ratio below 1 would mean the shaping is off
    assert namespaces() == before, "testbed namespaces left behind"


@pytest.mark.e2e
@require_netns
def test_testbed_cleans_up_after_a_failure():
    before = namespaces()
    with pytest.raises(RuntimeError, match="boom"):
        with testbed.NetnsTestbed([testbed.HostLink(50, 50)] * 2, rtt_ms=10, prefix="e2bt-fail") as tb:
            assert {"e2bt-fail-sw", "e2bt-fail-h0", "e2bt-fail-h1"} <= namespaces()
            assert tb.addr(1) == "127.100.0.11"
            assert "127.100.0.11" in tb.run(1, ["ip", "-br", "addr"])
            raise RuntimeError("boom")
    assert namespaces() == before


@pytest.mark.e2e
@require_netns
def test_a_host_has_loopback_and_still_reaches_the_others():
    """A worker's vLLM server binds 127.0.0.1 in its host (free_port()); host-to-host traffic still crosses the
    shaped links (127.100.0.x is not swallowed by loopback)."""
    before = namespaces()
    bind = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print('bound', s.getsockname()[1])"
    with testbed.NetnsTestbed([testbed.HostLink(50, 50)] * 2, rtt_ms=10, prefix="e2bt-i17lo") as tb:
        assert tb.run(1, [sys.executable, "-c", bind]).startswith("bound")
        serve = "import socket; s = socket.create_server(('127.100.0.10', 29777)); c, a = s.accept(); " \
                "c.sendall(a[0].encode())"
        server = tb.popen(0, [sys.executable, "-c", serve], stdout=subprocess.PIPE)
        client = ("import socket, time\nfor _ in range(50):\n    try:\n"
                  "        c = socket.create_connection(('127.100.0.10', 29777), timeout=5); break\n"
                  "    except OSError: time.sleep(0.1)\nprint(c.recv(100).decode())")
        assert tb.run(1, [sys.executable, "-c", client]).strip() == tb.addr(1)  # it came from host 1's address
        server.wait(timeout=30)
    assert namespaces() == before
