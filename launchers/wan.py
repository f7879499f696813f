#!/usr/bin/env python3
"""The learner plus N local worker agents, each in its own emulated WAN host (network namespaces, shaped links,
a delay line: echo2/lab/testbed.py). Needs root and iptables (Linux).

    sudo .venv/bin/python launchers/wan.py --workers 3 --link-mbit 100 --rtt-ms 40 --engine hf -- run.steps=100
    sudo .venv/bin/python launchers/wan.py --workers 4 --link-mbit 50 --learner-uplink-mbit 200 -- broadcast=one_to_many

The learner (train.py with pool=static) runs on host 0, worker i (python -m echo2.worker) on host i; every
worker's up- and downlink is shaped to --link-mbit, the learner's to --learner-uplink-mbit, and every pair of
hosts is --rtt-ms apart. Arguments after ``--`` go to train.py. Ctrl-C or SIGTERM stops the learner after its
step (it writes its summary; a second one stops it at once), then the workers; the namespaces are removed on
exit, also on failure and on SIGTERM. Worker logs go to <run dir>/workers/.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_model(train_args: list[str]) -> str:
    """The weights the learner will train, resolved as train.py resolves them (model=..., an experiment's model): the
    workers must serve the same (registration refuses another)."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from echo2.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[a for a in train_args if not a.startswith("hydra.")])
    return str(instantiate(cfg.model.path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--link-mbit", type=float, default=100.0, help="each worker's uplink and downlink")
    p.add_argument("--learner-uplink-mbit", type=float, default=None, help="default: --link-mbit")
    p.add_argument("--rtt-ms", type=float, default=40.0, help="between any two hosts")
    p.add_argument("--model", default=None, help="the workers' weights (default: the run's model.path, as train.py "
                                                  "resolves it from the overrides after --)")
    p.add_argument("--engine", default=None, choices=["vllm", "hf"], help="workers' engine (default: vllm if installed)")
    p.add_argument("--port", type=int, default=29600, help="the coordinator's port on the learner host")
    p.add_argument("train_args", nargs="*", help="after --: hydra overrides for train.py")
    args = p.parse_args(argv)

    from echo2.lab import testbed
    from echo2.learner.sources.pool import engine_core

    def stop_now(signum, _frame):  # a SIGTERM before the learner runs: unwind, so the namespaces are removed
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop_now)

    why = testbed.available()
    if why:
        p.error(f"the emulated WAN {why}; run without it: launchers/local.sh N")
    model = args.model or run_model(args.train_args)
    run_dir = next((a.split("=", 1)[1] for a in args.train_args if a.startswith("hydra.run.dir=")),
                   str(ROOT / "outputs" / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S-wan")))
    (Path(run_dir) / "workers").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, ECHO2_TOKEN=os.environ.get("ECHO2_TOKEN") or secrets.token_urlsafe(24))
    up = args.learner_uplink_mbit or args.link_mbit
    links = [testbed.HostLink(up, up)] + [testbed.HostLink(args.link_mbit, args.link_mbit)] * args.workers
    from echo2.net.tls import RunCA

    ca = RunCA(str(Path(run_dir) / "tls"))  # made here, so that its fingerprint is known; the learner reuses it
    with testbed.NetnsTestbed(links, rtt_ms=args.rtt_ms) as tb:
        host0 = tb.addr(0)
        learner = tb.popen(0, [sys.executable, "train.py", "pool=static", f"rollout.source.host={host0}",
                               f"rollout.source.port={args.port}", f"rollout.source.min_workers={args.workers}",
                               f"broadcast.sender.host={host0}", "rollout.source.tls=on",  # 127/8: as on a WAN
                               f"hydra.run.dir={run_dir}", f"activation.learner_uplink_mbit={up}",
                               *[a for a in args.train_args if not a.startswith("hydra.run.dir=")]],
                           cwd=ROOT, env=env)
        workers = []
        for i in range(1, args.workers + 1):
            cmd = [sys.executable, "-m", "echo2.worker", "--coordinator", f"https://{host0}:{args.port}",
                   "--ca-hash", ca.fingerprint,
                   "--model", model, "--listen-host", tb.addr(i), "--downlink-mbit", str(args.link_mbit),
                   "--uplink-mbit", str(args.link_mbit), "--rtt-ms", str(args.rtt_ms)]
            if args.engine:
                cmd += ["--engine", args.engine]
            log = open(Path(run_dir) / "workers" / f"worker{i - 1}.log", "wb")  # noqa: SIM115 (closed at exit)
            # each worker's vLLM threads on a core of their own, as a local pool spreads them
            own = dict(env, VLLM_CPU_OMP_THREADS_BIND=str(engine_core(i - 1)))
            workers.append(tb.popen(i, cmd, cwd=ROOT, env=own, stdout=log, stderr=subprocess.STDOUT))
        print(f"wan: learner on {host0} (run dir {run_dir}), {args.workers} workers at {args.link_mbit} Mbit/s, "
              f"RTT {args.rtt_ms} ms", flush=True)

        def on_term(signum, _frame):  # pass it on: the learner stops (after its step, with its summary), we clean up
            if learner.poll() is None:
                learner.send_signal(signum)

        signal.signal(signal.SIGTERM, on_term)
        try:
            code = learner.wait()
        except KeyboardInterrupt:  # our Ctrl-C reached the learner too: it stops after its step
            code = learner.wait()
        finally:
            from echo2.learner.sources.pool import terminate

            terminate(workers)
            if learner.poll() is None:
                learner.kill()
    return code


if __name__ == "__main__":
    sys.exit(main())
