"""The broadcast figures of BENCHMARKS.md: ``python -m echo2.lab.bench`` over a grid, one table.

Each cell is one CLI run (its own testbed, calibrated first) broadcasting a warm-up version (it opens the
connections; its time is the "first version" column) and ``--reps`` versions; the median of these is
reported. Per grid row: pipelined and one-to-many for each N, ratio = time / physical bound, and
time(N) / time(1) for each mode.

    python benchmarks/broadcast_sweep.py                                  # the grid below, namespace testbed
    python benchmarks/broadcast_sweep.py --grid 50:100:40 --workers 1 8 --testbed inproc
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# size MB : link Mbit/s : RTT ms. Aggregate emulated traffic is kept at <= ~2 Gbit/s for N = 8 (2 cores; see
# docs/design.md §5), so the 1 Gbit/s rows stop at N = 4 here.
GRID = ["50:100:40", "50:100:150", "200:250:100", "500:1000:20"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", nargs="+", default=GRID, help="SIZE_MB:LINK_MBIT:RTT_MS")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--modes", nargs="+", default=["pipelined", "one_to_many"])
    p.add_argument("--max-aggregate-mbit", type=float, default=2000, help="skip cells over this emulated total")
    p.add_argument("--testbed", default="netns")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="append every cell's JSON here")
    args = p.parse_args()
    rows = []
    for cell in args.grid:
        size, link, rtt = (float(x) for x in cell.split(":"))
        for mode in args.modes:
            for n in args.workers:
                if n * link > args.max_aggregate_mbit and n > 1:
                    print(f"skip {mode} N={n} at {link:g} Mbit/s: {n * link:g} Mbit/s aggregate", flush=True)
                    continue
                cmd = [sys.executable, "-m", "echo2.lab.bench", "--mode", mode, "--workers", str(n),
                       "--size-mb", str(size), "--link-mbit", str(link), "--rtt-ms", str(rtt), "--reps",
                       str(args.reps), "--testbed", args.testbed, "--json"]
                out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if out.returncode:
                    print(f"FAILED: {' '.join(cmd[3:])}\n{out.stderr[-2000:]}", flush=True)
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(r)
                print(f"{mode:<12} N={n} {size:g} MB {link:g} Mbit/s RTT {rtt:g} ms: {r['time_s']:.2f} s "
                      f"(bound {r['bound_s']:.2f}, ratio {r['ratio']:.2f})", flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(r) + "\n")
    print("\n| size MB | link Mbit/s | RTT ms | mode | N | time s | bound s | ratio | time(N)/time(1) | "
          "learner uploads | learner informed s | first version s | calibrated RTT ms / goodput Mbit/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next((b for b in rows if b["workers"] == 1 and b["mode"] == r["mode"] and b["size_bytes"] ==
                     r["size_bytes"] and b["link_mbit"] == r["link_mbit"] and b["rtt_ms"] == r["rtt_ms"]), None)
        cal = r.get("calibration") or {}
        print(f"| {r['size_bytes'] / 1e6:g} | {r['link_mbit']:g} | {r['rtt_ms']:g} | {r['mode']} | {r['workers']} | "
              f"{r['time_s']:.2f} | {r['bound_s']:.2f} | {r['ratio']:.2f} | "
              f"{r['time_s'] / base['time_s'] if base else float('nan'):.2f} | "
              f"{r['origin_bytes_per_version'] / r['size_bytes']:.2f} x M | {r['informed_s']:.2f} | "
              f"{r['first_version_s']:.2f} | "
              f"{cal.get('rtt_ms', float('nan')):.1f} / {cal.get('goodput_mbit', float('nan')):.0f} |")


if __name__ == "__main__":
    main()
