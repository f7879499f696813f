"""Packet-level one-way delay (and optional jitter) without netem: the WAN testbed's delay line.

As measured on this project's machines (RTTs accurate to +0.3-0.7 ms, 4 x 1 Gbit/s flows; docs/design.md);
run by testbed.py inside the switch namespace under SCHED_FIFO.

Binds an NFQUEUE with raw netlink (no extra packages), holds each queued IPv4
packet for the one-way delay of its (src, dst) pair, then issues NF_ACCEPT.
Packets stay in the kernel; only a 20-byte header copy and a verdict cross into
user space.  GSO packets are taken whole (NFQA_CFG_F_GSO), so a 1 Gbit/s TCP
flow costs a few thousand packets per second, not ~85 000.

    DelayLine.receive():  packet notifications ──► heap of (release time, packet id), FIFO per (src, dst) pair
    DelayLine.release():  every packet due ──► NF_ACCEPT verdicts, batched in one datagram
    main():               select on the queue until the next release is due; stats; release all on exit

Usage: python -m echo2.lab.delayline --queue 0 --delay-ms 10 [--pair 127.100.0.10,127.100.0.11,40 ...]
       [--stats-every 5] [--duration SECONDS]
"""
import argparse, heapq, select, signal, socket, struct, sys, time, random

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND = 1, 2
NFQNL_COPY_PACKET = 2
NFQA_CFG_F_GSO = 4
NFQA_PACKET_HDR, NFQA_VERDICT_HDR, NFQA_PAYLOAD = 1, 2, 10
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
SO_RCVBUFFORCE = 33


def nla(t, payload):
    ln = 4 + len(payload)
    return struct.pack("=HH", ln, t) + payload + b"\0" * ((4 - ln % 4) % 4)


def nfmsg(msg_type, res_id, attrs, flags=NLM_F_REQUEST, seq=0):
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(res_id)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, seq, 0) + body


LATE_BOUNDS_MS = (0.5, 1, 2, 5, 10, 20, 50)  # the late-release histogram's buckets: <0.5, <1, ..., >=50 ms


def _open(queue: int, maxlen: int) -> socket.socket:
    """A netlink socket bound to NFQUEUE ``queue``: 20-byte header copies, GSO packets whole, non-blocking."""
    sk = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sk.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
    except OSError:
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sk.bind((0, 0))
    q = queue
    sk.send(nfmsg(NFQNL_MSG_CONFIG, q, nla(NFQA_CFG_CMD, struct.pack("=BBH", NFQNL_CFG_CMD_BIND, 0, socket.htons(socket.AF_INET)))))
    sk.send(nfmsg(NFQNL_MSG_CONFIG, q, nla(NFQA_CFG_PARAMS, struct.pack("!IB", 20, NFQNL_COPY_PACKET))))
    sk.send(nfmsg(NFQNL_MSG_CONFIG, q, nla(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen))))
    sk.send(nfmsg(NFQNL_MSG_CONFIG, q, nla(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))
                  + nla(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO))))
    sk.setblocking(False)
    return sk


class DelayLine:
    """Holds each queued packet for its pair's one-way delay, then accepts it; counts how late releases were."""

    def __init__(self, queue: int, pair_delay: dict, default_s: float, jitter_s: float, maxlen: int):
        self.queue, self.pair_delay, self.default_s, self.jitter_s = queue, pair_delay, default_s, jitter_s
        self.sk = _open(queue, maxlen)
        self.heap = []            # (release_time, seq, packet_id)
        self.last_rel = {}        # pair -> last release time (keeps FIFO under jitter)
        self.seq = 0
        self.n_pkts = self.n_err = 0
        self.lateness_sum = self.lateness_max = 0.0
        self.late_hist = [0] * (len(LATE_BOUNDS_MS) + 1)
        self.vh = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_VERDICT
        self.pfx = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue))

    def _verdict(self, pid: int) -> bytes:
        body = self.pfx + struct.pack("=HH", 12, NFQA_VERDICT_HDR) + struct.pack("!II", NF_ACCEPT, pid)
        return struct.pack("=IHHII", 16 + len(body), self.vh, NLM_F_REQUEST, 0, 0) + body

    def release(self, now: float) -> None:
        """Accept every packet due by ``now``, in one datagram (sliced to the netlink limit)."""
        out = []
        while self.heap and self.heap[0][0] <= now:
            rel, _, pid = heapq.heappop(self.heap)
            late = now - rel
            self.lateness_sum += late
            self.lateness_max = max(self.lateness_max, late)
            self.late_hist[sum(late * 1e3 >= b for b in LATE_BOUNDS_MS)] += 1
            out.append(self._verdict(pid))
        buf = b"".join(out)
        while buf:  # netlink datagram limit: send in slices of whole messages (each 32 bytes)
            chunk, buf = buf[:32 * 1000], buf[32 * 1000:]
            self.sk.send(chunk)

    def receive(self) -> None:
        """Drain the socket, but come back to release due packets at least every 64 datagrams."""
        for _ in range(64):
            try:
                data = self.sk.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError as e:   # ENOBUFS: we lost packet notifications
                self.n_err += 1
                print(f"[nfq_delay] recv error {e}", file=sys.stderr, flush=True)
                break
            self._messages(data, time.monotonic())

    def _messages(self, data: bytes, tnow: float) -> None:
        off = 0
        while off + 16 <= len(data):
            mlen, mtype = struct.unpack_from("=IH", data, off)
            if mtype == NLMSG_ERROR:
                err = struct.unpack_from("=i", data, off + 16)[0]
                if err:
                    self.n_err += 1
                    olen, otype = struct.unpack_from("=IH", data, off + 20)
                    print(f"[nfq_delay] netlink error {err} for msg type {otype:#x} len {olen}", file=sys.stderr, flush=True)
            elif mtype == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                self._packet(data, off + 20, off + mlen, tnow)
            if mlen == 0:
                break
            off += (mlen + 3) & ~3

    def _packet(self, data: bytes, aoff: int, end: int, tnow: float) -> None:
        """One packet notification (attributes in ``data[aoff:end]``): hold it until its pair's release time."""
        pid = src = dst = None
        while aoff + 4 <= end:
            alen, atype = struct.unpack_from("=HH", data, aoff)
            atype &= 0x3FFF
            if atype == NFQA_PACKET_HDR:
                pid = struct.unpack_from("!I", data, aoff + 4)[0]
            elif atype == NFQA_PAYLOAD and alen >= 24:
                src = data[aoff + 4 + 12: aoff + 4 + 16]
                dst = data[aoff + 4 + 16: aoff + 4 + 20]
            aoff += (alen + 3) & ~3
        if pid is None:
            return
        key = (src, dst)
        d = self.pair_delay.get(key, self.default_s)
        if self.jitter_s:
            d = max(0.0, d + random.uniform(-self.jitter_s, self.jitter_s))
        rel = max(tnow + d, self.last_rel.get(key, 0.0))
        self.last_rel[key] = rel
        self.seq += 1
        heapq.heappush(self.heap, (rel, self.seq, pid))
        self.n_pkts += 1

    def stats(self, elapsed_s: float, cpu_s: float) -> str:
        return (f"[nfq_delay] t={elapsed_s:.1f}s pkts={self.n_pkts} queued={len(self.heap)} err={self.n_err} "
                f"mean_late={1e3 * self.lateness_sum / max(1, self.n_pkts - len(self.heap)):.3f}ms "
                f"max_late={1e3 * self.lateness_max:.3f}ms cpu={cpu_s:.2f}s")

    def close(self) -> None:
        """Release everything still held so nothing is stranded, and unbind the queue."""
        for _, _, pid in self.heap:
            self.sk.send(self._verdict(pid))
        self.sk.send(nfmsg(NFQNL_MSG_CONFIG, self.queue, nla(NFQA_CFG_CMD, struct.pack("=BBH", NFQNL_CFG_CMD_UNBIND, 0, socket.htons(socket.AF_INET)))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--queue", type=int, default=0)
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay for pairs not listed")
    ap.add_argument("--pair", action="append", default=[], help="SRC,DST,MS (directional)")
    ap.add_argument("--jitter-ms", type=float, default=0.0, help="uniform +-; per-pair order is kept")
    ap.add_argument("--maxlen", type=int, default=100000)
    ap.add_argument("--stats-every", type=float, default=0)
    ap.add_argument("--duration", type=float, default=0, help="exit after this many seconds (0 = run until signal)")
    a = ap.parse_args()

    pair_delay = {}
    for p in a.pair:
        s, d, ms = p.split(",")
        pair_delay[(socket.inet_aton(s), socket.inet_aton(d))] = float(ms) / 1e3
    line = DelayLine(a.queue, pair_delay, a.delay_ms / 1e3, a.jitter_ms / 1e3, a.maxlen)
    stop = False
    t_start = time.monotonic()
    t_stats = t_start + a.stats_every if a.stats_every else None

    def on_sig(*_):
        nonlocal stop
        stop = True
    signal.signal(signal.SIGTERM, on_sig)
    signal.signal(signal.SIGINT, on_sig)
    cpu0 = time.process_time()

    while not stop:
        now = time.monotonic()
        if line.heap and line.heap[0][0] <= now:
            line.release(now)
        if a.duration and now - t_start > a.duration:
            break
        if t_stats and now >= t_stats:
            print(line.stats(now - t_start, time.process_time() - cpu0), flush=True)
            t_stats += a.stats_every
        timeout = max(0.0, line.heap[0][0] - time.monotonic()) if line.heap else 0.2
        r, _, _ = select.select([line.sk], [], [], timeout)
        if r:
            line.receive()
    line.close()
    cpu = time.process_time() - cpu0
    wall = time.monotonic() - t_start
    print(f"[nfq_delay] done pkts={line.n_pkts} err={line.n_err} mean_late={1e3 * line.lateness_sum / max(1, line.n_pkts):.3f}ms "
          f"max_late={1e3 * line.lateness_max:.3f}ms cpu={cpu:.2f}s wall={wall:.1f}s "
          f"late_hist(<.5,<1,<2,<5,<10,<20,<50,>=50ms)={line.late_hist}", flush=True)


if __name__ == "__main__":
    main()
