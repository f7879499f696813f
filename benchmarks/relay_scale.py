"""The relay at scale (issue 24, item 2): time to the last of N workers against the bound, chain, tree and the
layout broadcast=pipelined runs (topology auto: chain or stripes), N = 8..64, two RTTs.

    python benchmarks/relay_scale.py                       # the grid below, in-process links
    python benchmarks/relay_scale.py --workers 8 16 --scales 20:100 --rtts 20 --modes chain pipelined

Each cell is one ``python -m echo2.lab.bench`` run (its own N + 1 processes, a warm-up version that opens the
connections, then ``--reps`` versions; the median is reported). The ratio depends on M/B and the RTT, not on the
rate alone, so where 2 cores cannot carry N links at the nominal rate, a scale runs the same M/B at a lower rate:
``2:10`` is "200 MB at 1 Gbit/s" (M/B = 1.6 s) run as 2 MB at 10 Mbit/s, ``20:10`` is "200 MB at 100 Mbit/s"
(M/B = 16 s) as 20 MB at 10 Mbit/s. Every row says the rate it ran at and the 1-minute load average before it.

Columns: time (publish to the last worker holding the verified snapshot), bound = M/B + one one-way latency,
ratio; over = time − bound; the model's pipeline term (topology.added_s) for the layout that ran and for a
chain; MWW = (M/B)(1 + ⌊log₂N⌋/k), k = M / piece; first done = when the first worker held it (M/B plus a few
one-way latencies where the box held the rate: past that, the box's CPU, not the layout, set the pace); learner
uploads per version; the first (cold) version; load = the 1-minute load average before the cell; cores = CPU
seconds of the cell's processes over its wall time (start-up included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCALES = ["2:10", "20:10"]  # SIZE_MB:LINK_MBIT; M/B = 1.6 s and 16 s
HEADER = ("| M/B s | ran at | RTT ms | N | mode | layout | time s | bound s | ratio | over s | model term s | "
          "chain term s | MWW s | first done s | learner uploads | first version s | load | cores |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scales", nargs="+", default=SCALES, help="SIZE_MB:LINK_MBIT")
    p.add_argument("--rtts", nargs="+", type=float, default=[20, 80])
    p.add_argument("--workers", nargs="+", type=int, default=[8, 16, 32, 64])
    p.add_argument("--modes", nargs="+", default=["chain", "tree", "pipelined"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--testbed", default="inproc")
    p.add_argument("--max-load", type=float, default=None,
                   help="before each cell, wait until the 1-minute load average is below this (shared machines)")
    p.add_argument("--skip-slow", type=float, default=40.0,
                   help="skip a cell whose M/B alone, times the mode's copies, exceeds this many seconds per version "
                        "(a binary tree's inner nodes upload twice: at M/B = 16 s it adds nothing to learn)")
    p.add_argument("--json", help="append every cell's JSON here")
    args = p.parse_args()
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    for scale in args.scales:
        size_mb, mbit = (float(x) for x in scale.split(":"))
        transfer_s = size_mb * 8 / mbit
        for rtt in args.rtts:
            for n in args.workers:
                for mode in args.modes:
                    if transfer_s * (2 if mode == "tree" else 1) > args.skip_slow:
                        continue
                    _cell(args, size_mb, mbit, rtt, n, mode)


def _cell(args, size_mb: float, mbit: float, rtt: float, n: int, mode: str) -> None:
    if args.max_load is not None:
        while os.getloadavg()[0] >= args.max_load:
            time.sleep(30)
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "echo2.lab.bench", "--mode", mode, "--workers", str(n), "--size-mb", str(size_mb),
           "--link-mbit", str(mbit), "--rtt-ms", str(rtt), "--reps", str(args.reps), "--testbed", args.testbed,
           "--json"]
    cpu0, t0 = _children_cpu_s(), time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    cores = (_children_cpu_s() - cpu0) / (time.monotonic() - t0)
    if out.returncode:
        print(f"FAILED: {' '.join(cmd[3:])}\n{out.stderr[-2000:]}", flush=True)
        return
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["load_before"], r["cores"] = load, cores
    r["first_done_s"] = min(h[2] for h in r["hops"])
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(r) + "\n")
    transfer_s = r["size_bytes"] * 8 / (r["link_mbit"] * 1e6)
    print(f"| {transfer_s:g} | {r['size_bytes'] / 1e6:g} MB @ {r['link_mbit']:g} Mbit/s | {r['rtt_ms']:g} | "
          f"{r['workers']} | {r['mode']} | {r['layout']} | {r['time_s']:.3f} | {r['bound_s']:.3f} | "
          f"{r['ratio']:.3f} | {r['time_s'] - r['bound_s']:.3f} | {r['added_s']:.3f} | {r['chain_added_s']:.3f} | "
          f"{r['mww_s']:.2f} | {r['first_done_s']:.3f} | {r['origin_bytes_per_version'] / r['size_bytes']:.2f} x M | "
          f"{r['first_version_s']:.2f} | {load:.2f} | {cores:.2f} |", flush=True)


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's waited-for children and theirs."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


if __name__ == "__main__":
    main()
