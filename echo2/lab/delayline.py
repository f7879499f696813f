"""Packet-level one-way delay (and optional jitter) without netem: the WAN testbed's delay line.

As measured on this project's machines (RTTs accurate to +0.3-0.7 ms, 4 x 1 Gbit/s flows; docs/design.md);
run by testbed.py inside the switch namespace under SCHED_FIFO.

Binds an NFQUEUE with raw netlink (no extra packages), holds each queued IPv4
packet for the one-way delay of its (src, dst) pair, then issues NF_ACCEPT.
Packets stay in the kernel; only a 20-byte header copy and a verdict cross into
user space.  GSO packets are taken whole (NFQA_CFG_F_GSO), so a 1 Gbit/s TCP
flow costs a few thousand packets per second, not ~85 000.

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
    default = a.delay_ms / 1e3
    jit = a.jitter_ms / 1e3

    sk = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sk.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
    except OSError:
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sk.bind((0, 0))
    q = a.queue
    sk.send(nfmsg(NFQNL_MSG_CONFIG, q, nla(NFQA_CFG_CMD, struct.pack("=BBH", NFQNL_CFG_CMD_BIND, 0, socket.htons(socket.AF_INET)))))
    sk.send(nfmsg(NFQNL_MSG_CONFIG, q, nla(NFQA_CFG_PARAMS, struct.pack("!IB", 20, NFQNL_COPY_PACKET))))
    sk.send(nfmsg(NFQNL_MSG_CONFIG, q, nla(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", a.maxlen))))
    sk.send(nfmsg(NFQNL_MSG_CONFIG, q, nla(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))
                  + nla(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO))))
    sk.setblocking(False)

    heap = []            # (release_time, seq, packet_id)
    last_rel = {}        # pair -> last release time (keeps FIFO under jitter)
    seq = 0
    n_pkts = n_err = 0
    lateness_sum = lateness_max = 0.0
    late_hist = [0] * 8   # <0.5, <1, <2, <5, <10, <20, <50, >=50 ms
    stop = False
    t_start = time.monotonic()
    t_stats = t_start + a.stats_every if a.stats_every else None

    def on_sig(*_):
        nonlocal stop
        stop = True
    signal.signal(signal.SIGTERM, on_sig)
    signal.signal(signal.SIGINT, on_sig)
    vh = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_VERDICT
    pfx = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(q))
    cpu0 = time.process_time()

    while not stop:
        now = time.monotonic()
        # release due packets in one datagram
        if heap and heap[0][0] <= now:
            out = []
            while heap and heap[0][0] <= now:
                rel, _, pid = heapq.heappop(heap)
                late = now - rel
                lateness_sum += late
                if late > lateness_max:
                    lateness_max = late
                ms = late * 1e3
                late_hist[0 if ms < .5 else 1 if ms < 1 else 2 if ms < 2 else 3 if ms < 5 else 4 if ms < 10 else 5 if ms < 20 else 6 if ms < 50 else 7] += 1
                body = pfx + struct.pack("=HH", 12, NFQA_VERDICT_HDR) + struct.pack("!II", NF_ACCEPT, pid)
                out.append(struct.pack("=IHHII", 16 + len(body), vh, NLM_F_REQUEST, 0, 0) + body)
            buf = b"".join(out)
            while buf:  # netlink datagram limit: send in slices of whole messages (each 32 bytes)
                chunk, buf = buf[:32 * 1000], buf[32 * 1000:]
                sk.send(chunk)
        if a.duration and now - t_start > a.duration:
            break
        if t_stats and now >= t_stats:
            cpu = time.process_time() - cpu0
            print(f"[nfq_delay] t={now - t_start:.1f}s pkts={n_pkts} queued={len(heap)} err={n_err} "
                  f"mean_late={1e3 * lateness_sum / max(1, n_pkts - len(heap)):.3f}ms max_late={1e3 * lateness_max:.3f}ms "
                  f"cpu={cpu:.2f}s", flush=True)
            t_stats += a.stats_every
        timeout = max(0.0, heap[0][0] - time.monotonic()) if heap else 0.2
        r, _, _ = select.select([sk], [], [], timeout)
        if not r:
            continue
        # drain the socket, but come back to release due packets at least every 64 datagrams
        for _ in range(64):
            try:
                data = sk.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError as e:   # ENOBUFS: we lost packet notifications
                n_err += 1
                print(f"[nfq_delay] recv error {e}", file=sys.stderr, flush=True)
                break
            tnow = time.monotonic()
            off = 0
            while off + 16 <= len(data):
                mlen, mtype = struct.unpack_from("=IH", data, off)
                if mtype == NLMSG_ERROR:
                    err = struct.unpack_from("=i", data, off + 16)[0]
                    if err:
                        n_err += 1
                        olen, otype = struct.unpack_from("=IH", data, off + 20)
                        print(f"[nfq_delay] netlink error {err} for msg type {otype:#x} len {olen}", file=sys.stderr, flush=True)
                elif mtype == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    pid = None
                    src = dst = None
                    aoff = off + 20
                    end = off + mlen
                    while aoff + 4 <= end:
                        alen, atype = struct.unpack_from("=HH", data, aoff)
                        atype &= 0x3FFF
                        if atype == NFQA_PACKET_HDR:
                            pid = struct.unpack_from("!I", data, aoff + 4)[0]
                        elif atype == NFQA_PAYLOAD and alen >= 24:
                            src = data[aoff + 4 + 12: aoff + 4 + 16]
                            dst = data[aoff + 4 + 16: aoff + 4 + 20]
                        aoff += (alen + 3) & ~3
                    if pid is not None:
                        key = (src, dst)
                        d = pair_delay.get(key, default)
                        if jit:
                            d = max(0.0, d + random.uniform(-jit, jit))
                        rel = tnow + d
                        prev = last_rel.get(key)
                        if prev is not None and rel < prev:
                            rel = prev
                        last_rel[key] = rel
                        seq += 1
                        heapq.heappush(heap, (rel, seq, pid))
                        n_pkts += 1
                if mlen == 0:
                    break
                off += (mlen + 3) & ~3
    # release everything still held so nothing is stranded
    for _, _, pid in heap:
        body = pfx + struct.pack("=HH", 12, NFQA_VERDICT_HDR) + struct.pack("!II", NF_ACCEPT, pid)
        sk.send(struct.pack("=IHHII", 16 + len(body), vh, NLM_F_REQUEST, 0, 0) + body)
    sk.send(nfmsg(NFQNL_MSG_CONFIG, q, nla(NFQA_CFG_CMD, struct.pack("=BBH", NFQNL_CFG_CMD_UNBIND, 0, socket.htons(socket.AF_INET)))))
    cpu = time.process_time() - cpu0
    wall = time.monotonic() - t_start
    print(f"[nfq_delay] done pkts={n_pkts} err={n_err} mean_late={1e3 * lateness_sum / max(1, n_pkts):.3f}ms "
          f"max_late={1e3 * lateness_max:.3f}ms cpu={cpu:.2f}s wall={wall:.1f}s late_hist(<.5,<1,<2,<5,<10,<20,<50,>=50ms)={late_hist}", flush=True)


if __name__ == "__main__":
    main()
