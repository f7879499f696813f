"""An emulated WAN in network namespaces: one learner host and N worker hosts behind shaped access links.

    <p>-h0 (learner) ─wan0══p0─┐
    <p>-h1 (worker)  ─wan0══p1─┤  bridge br0 in <p>-sw: the "internet"; the delay line (delayline.py) holds every
    ...                        │  forwarded packet for its one-way delay (NFQUEUE; this kernel has no netem)
    <p>-hN (worker)  ─wan0══pN─┘

Host i has address 127.100.0.(10+i) with route_localnet, so a command run outside its namespace by mistake can
only ever reach loopback. Upload cap: HTB on the host's wan0; download cap: HTB on its switch port. Everything
has a unique prefix (``e2b<pid>``) and is deleted on exit, also on failure (context manager + atexit).
Needs root, iproute2 and the ``iptables`` binary (docs/design.md §5, has the measurements).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


def available() -> str | None:
    """None if the testbed can run here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} binary (apt-get install -y iproute2 iptables)"
    return None


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@dataclass
class HostLink:
    up_mbit: float
    down_mbit: float


class NetnsTestbed:
    def __init__(self, links: list[HostLink], rtt_ms: float, prefix: str | None = None, tcp_buf_bytes: int = 64 << 20):
        """``links[0]`` is the learner's; RTT is the same between every pair of hosts (one-way = rtt/2)."""
        why = available()
        if why:
            raise RuntimeError(f"namespace testbed: {why}")
        self.links, self.rtt_ms, self.tcp_buf = links, rtt_ms, tcp_buf_bytes
        self.prefix = prefix or f"e2b{os.getpid()}"
        self.sw = f"{self.prefix}-sw"
        self.hosts = [f"{self.prefix}-h{i}" for i in range(len(links))]
        self.delay: subprocess.Popen | None = None
        self.up = False

    def addr(self, i: int) -> str:
        return f"127.100.0.{10 + i}"

    def __enter__(self) -> "NetnsTestbed":
        atexit.register(self.down)
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def _build(self) -> None:
        self.up = True
        _sh("ip", "netns", "add", self.sw)
        _sh("ip", "-n", self.sw, "link", "set", "lo", "up")
        _sh("ip", "-n", self.sw, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.sw, "link", "set", "br0", "up")
        bdp = int(max(l.down_mbit for l in self.links) * 1e6 / 8 * self.rtt_ms / 1e3)
        queue = max(2_000_000, 2 * bdp)
        for i, (h, link) in enumerate(zip(self.hosts, self.links)):
            _sh("ip", "netns", "add", h)
            # Loopback up (a worker's engine listens on 127.0.0.1) but as 127.0.0.1/32 only: the default /8 would
            # make every host's 127.100.0.x address local here, and hosts could not reach each other.
            _sh("ip", "-n", h, "link", "set", "lo", "up")
            _sh("ip", "-n", h, "addr", "del", "127.0.0.1/8", "dev", "lo")
            _sh("ip", "-n", h, "addr", "add", "127.0.0.1/32", "dev", "lo")
            _sh("ip", "netns", "exec", h, "sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1",
                "net.ipv4.conf.default.route_localnet=1", f"net.ipv4.tcp_wmem=4096 16384 {self.tcp_buf}",
                f"net.ipv4.tcp_rmem=4096 131072 {self.tcp_buf}", "net.ipv4.tcp_congestion_control=bbr",
                # a persistent relay connection idles between snapshots; without this its window restarts from
                # slow start every time (measured: 50 MB at 100 Mbit/s, RTT 150 ms: 5.8 s instead of ~4.5)
                "net.ipv4.tcp_slow_start_after_idle=0")
            _sh("ip", "link", "add", "wan0", "netns", h, "type", "veth", "peer", "name", f"p{i}", "netns", self.sw)
            _sh("ip", "-n", self.sw, "link", "set", f"p{i}", "master", "br0")
            _sh("ip", "-n", self.sw, "link", "set", f"p{i}", "up")
            _sh("ip", "-n", h, "addr", "add", f"{self.addr(i)}/24", "dev", "wan0")
            _sh("ip", "-n", h, "link", "set", "wan0", "up")
            self._shape(h, "wan0", link.up_mbit, queue)
            self._shape(self.sw, f"p{i}", link.down_mbit, queue)
        if self.rtt_ms > 0:
            _sh("ip", "netns", "exec", self.sw, "iptables", "-A", "FORWARD", "-j", "NFQUEUE", "--queue-num", "0",
                "--queue-bypass")
            cmd = ["ip", "netns", "exec", self.sw, sys.executable, "-m", "echo2.lab.delayline", "--queue", "0",
                   "--delay-ms", str(self.rtt_ms / 2)]
            if shutil.which("chrt"):
                cmd[4:4] = ["chrt", "-f", "10"]
            self.delay = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
            time.sleep(0.3)
            if self.delay.poll() is not None:
                raise RuntimeError(f"delay line failed: {self.delay.stderr.read().decode()[-500:]}")

    @staticmethod
    def _shape(ns: str, dev: str, mbit: float, queue_bytes: int) -> None:
        if not mbit:
            return
        _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
        _sh("tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate",
            f"{mbit}mbit", "ceil", f"{mbit}mbit", "burst", "256k", "cburst", "256k", "quantum", "60000")
        _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "bfifo", "limit",
            str(queue_bytes))

    def set_link(self, i: int, up: bool) -> None:
        """Cut host i off the network (its switch port down: nothing in or out) or reconnect it."""
        _sh("ip", "-n", self.sw, "link", "set", f"p{i}", "up" if up else "down")

    def popen(self, i: int, cmd: list[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` on host i."""
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[i], *cmd], **kw)

    def run(self, i: int, cmd: list[str], timeout_s: float = 120) -> str:
        return subprocess.run(["ip", "netns", "exec", self.hosts[i], *cmd], check=True, capture_output=True,
                              text=True, timeout=timeout_s).stdout

    def down(self) -> None:
        if not self.up:
            return
        self.up = False
        if self.delay is not None and self.delay.poll() is None:
            self.delay.terminate()
            try:
                self.delay.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.delay.kill()
                self.delay.wait()
        for ns in [*self.hosts, self.sw]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        atexit.unregister(self.down)
