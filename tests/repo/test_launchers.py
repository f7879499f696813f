"""Launchers and the researcher's view: sweeps (own dirs, one wandb group, job names from overrides), submitit,
SLURM config, join and local launchers, the end-of-run table, and ``python -m echo2.report``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, build_run, descendants, read_jsonl, run_train, small_coordinator, wait_until


@pytest.mark.e2e
@pytest.mark.slow
def test_a_sweep_has_one_wandb_group_job_names_from_overrides_and_a_report(tmp_path):
    """The issue's sweep shape, shrunk to two jobs (one swept key of two values, one key fixed; CI time): async runs
    with a local hf worker (one, not the default two: CI time), one wandb group, each job named by its swept value
    only, and one report of both."""
    sweep = tmp_path / "sweep"
    out = run_train(["-m", "broadcast=pipelined,one_to_many", "rollout.staleness=2", "pool.engine=hf", "pool.workers=1",
                     "run.steps=3", "run.eval_every_steps=0", "run.progress=false", f"hydra.sweep.dir={sweep}"],
                    tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "summary.json").exists())
    assert len(jobs) == 2, [p.name for p in sweep.iterdir()]
    infos = [json.loads((j / "summary.json").read_text())["wandb"] for j in jobs]
    assert len({i["group"] for i in infos}) == 1 and infos[0]["group"] == f"{sweep.parent.name}_{sweep.name}"
    assert {i["name"] for i in infos} == {"broadcast=one_to_many", "broadcast=pipelined"}  # not the fixed key
    for job, info in zip(jobs, infos, strict=True):  # the run dir is named from the same overrides (and the rest)
        assert set(info["name"].split(",")) <= set(job.name.split("_", 1)[1].split(",")), (job.name, info["name"])
        assert "rollout.staleness=2" in job.name
    assert out.stdout.count("echo2 run summary") == 2, out.stdout[-2000:]

    report = tmp_path / "report"
    rep = subprocess.run([sys.executable, "-m", "echo2.report", *map(str, jobs), "--out", str(report)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr[-3000:]
    for png in ("reward.png", "staleness.png", "utilization.png", "broadcast.png"):
        assert (report / png).stat().st_size > 10_000, png
    table = (report / "report.md").read_text().splitlines()
    assert len(table) == 2 + 2 and "broadcast=one_to_many" in "\n".join(table)
    assert all(row.count("|") == table[0].count("|") for row in table)


@pytest.mark.e2e
@pytest.mark.slow
def test_submitit_runs_a_sweep_as_separate_jobs(tmp_path):
    """hydra/launcher=submitit_local: the SLURM path (submitit pickles each job and runs it in a process of its
    own), on this machine."""
    sweep = tmp_path / "sweep"
    out = run_train(["-m", "hydra/launcher=submitit_local", "seed=0,1", "rollout=sync", "run.steps=2",
                     "run.eval_every_steps=0", "run.wandb=disabled", "run.progress=false",
                     f"hydra.sweep.dir={sweep}"], tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit())
    assert [len(read_jsonl(j / "metrics.jsonl")) for j in jobs] == [2, 2]
    assert list((sweep / ".submitit").glob("*/*_result.pkl")), "not run through submitit"


@pytest.mark.e2e
def test_the_slurm_launcher_config_composes(tmp_path):
    out = run_train(["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "--cfg", "hydra"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SlurmLauncher" in out.stdout and "partition: gpu" in out.stdout and "max_num_timeout: 3" in out.stdout


@pytest.mark.e2e
def test_join_needs_a_token_and_then_joins_a_running_learner(tiny_model_dir, tmp_path):
    env = dict(os.environ, ECHO2_PYTHON=sys.executable)
    env.pop("ECHO2_TOKEN", None)
    refused = subprocess.run(["launchers/join.sh", "http://127.0.0.1:1"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode != 0 and "ECHO2_TOKEN" in refused.stderr
    coord = small_coordinator(tiny_model_dir)
    agent = subprocess.Popen(["launchers/join.sh", coord.url, "--model", tiny_model_dir, "--engine", "hf"], cwd=ROOT,
                             env=dict(env, ECHO2_TOKEN="secret"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: coord.status()["registered"] == 1, timeout_s=120, what="the joined agent to register")
        assert coord.status()["registered"] == 1
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
        coord.close()
    assert agent.returncode == 0


@pytest.mark.e2e
@pytest.mark.slow
def test_local_launcher_runs_the_learner_with_n_agents(tmp_path):
    out = run_train(["3", "pool.engine=hf", "run.steps=3", "run.eval_every_steps=0", "run.wandb=disabled",
                     f"hydra.run.dir={tmp_path}"], tmp_path, launcher=["launchers/local.sh"], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(list((tmp_path / "workers").glob("worker?.log"))) == 3


@pytest.mark.e2e
def test_report_refuses_a_directory_that_is_not_a_run(tmp_path):
    out = subprocess.run([sys.executable, "-m", "echo2.report", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "metrics.jsonl" in out.stderr


def test_progress_fields_show_lag_utilization_and_dollars():
    from echo2.learner.callbacks import progress_fields

    f = progress_fields({"reward/mean": 0.5, "buffer/staleness_mean": 1.5, "train/learner_utilization": 0.8,
                         "cost/usd": 0.0123}, [(10, 0.75)])
    assert f == {"reward": "0.500", "lag": "1.5", "util": "0.80", "$": "0.0123", "eval": "0.750"}


@pytest.mark.e2e
@pytest.mark.slow
def test_wan_launcher_puts_each_vllm_worker_in_its_own_shaped_host_both_deliver_early_and_sigterm_stops_it(tmp_path):
    """Two vLLM workers behind the WAN launcher both deliver by step 30 (in steps, not seconds: this box is shared).
    Each engine's threads get a core of their own: with vLLM-CPU's default (every engine on core 0) the second
    worker's first snapshot apply waited until the first worker stopped, and it never generated in 60 steps. Then a
    SIGTERM to the launcher: the run stops after its step, writes its summary, and every namespace goes."""
    from echo2.lab import testbed

    why = testbed.available()
    if why:
        pytest.skip(f"require_netns: {why}")
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    metrics = tmp_path / "metrics.jsonl"

    def records() -> list[dict]:  # the lines written so far (the last may be half written)
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def both(rs: list[dict]) -> dict | None:  # the first step at which both workers had pushed (a rate is 0 until then)
        return next((r for r in rs if sum(v > 0 for k, v in r.items() if k.startswith("rollout/throughput/")) == 2),
                    None)

    proc = subprocess.Popen([sys.executable, "launchers/wan.py", "--workers", "2", "--link-mbit", "50", "--rtt-ms",
                             "20", "--port", "29611", "--", "run.steps=1000", "run.eval_every_steps=0",
                             "run.wandb=disabled", "run.progress=false", f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: both(records()) is not None or len(records()) > 30 or proc.poll() is not None,
                   timeout_s=500, what="both workers' first pushes, or step 31")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    rs = records()
    first = both(rs)
    assert first is not None and first["step"] <= 30, [(r["step"], r["time_s"], {
        k: v for k, v in r.items() if k.startswith("rollout/throughput/")}) for r in rs]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and first["step"] <= summary["steps"] < 1000
    assert len(summary["rollout_accounting"]["by_worker"]) == 2
    logs = [(tmp_path / "workers" / f"worker{i}.log").read_text() for i in (0, 1)]
    assert all("registered as" in log for log in logs)
    coordinator = (tmp_path / "coordinator.log").read_text()  # each worker joined from its own host's address
    assert "snapshots at https://127.100.0.11:" in coordinator and "snapshots at https://127.100.0.12:" in coordinator
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before


@pytest.mark.e2e
def test_min_workers_times_out_with_a_clear_error_and_stops_its_coordinator(tmp_path):
    before = descendants(os.getpid())
    _, _, source, _ = build_run(tmp_path, ["rollout=async", "pool=static", "rollout.source.min_workers=2",
                                           "rollout.source.take_timeout_s=1"])
    try:  # the first step waits for them
        with pytest.raises(TimeoutError, match=r"2 workers to register \(rollout.source.min_workers=2; 0 so far\)"
                                               r".*take_timeout_s.*pool=static starts no worker"):
            source.collect([{}] * 16, 0)
    finally:
        source.close()
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
            for pid in descendants(os.getpid()) - before}
    left = {pid: cmd for pid, cmd in left.items() if b"resource_tracker" not in cmd}  # multiprocessing's, for life
    assert not left, left  # the coordinator process it started was stopped


@pytest.mark.e2e
def test_install_puts_the_checkout_on_the_venv_path_so_modules_run_from_anywhere(tmp_path):
    """``python -m echo2.report`` from outside the checkout: install.sh's .pth step, run on a bare venv."""
    step = next(line for line in (ROOT / "install.sh").read_text().splitlines() if "echo2.pth" in line)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "v")], check=True, timeout=120)
    subprocess.run(["bash", "-c", f'py={tmp_path / "v/bin/python"}; cd {ROOT}; {step}'], check=True, timeout=60)
    out = subprocess.run([str(tmp_path / "v/bin/python"), "-c", "import echo2; print(echo2.__file__)"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str(ROOT / "echo2" / "__init__.py"), out.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_waiting_for_workers_says_so_and_stops_at_the_first_sigterm(tmp_path):
    """pool=static and no worker joins: the learner's first step waits for rollouts that never come. It says what it
    waits for (periodically, with how to join workers), and one SIGTERM ends the run at once with a summary.json."""
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "train.py", "pool=static", "run.steps=2", "run.wandb=disabled",
                                 "rollout.source.wait_log_s=1", f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "0 workers connected" in log.read_text(), timeout_s=300)  # the learner's periodic line
        text = log.read_text()
        assert "16 rollout groups for step 1: 0 workers connected" in text and "pool=static starts no worker" in text, \
            text[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]  # was: ~65 s, then no summary
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["stopped_by"] == "SIGTERM"
    assert summary["rollout_accounting"]["dispatched"] == 0


@pytest.mark.e2e
def test_join_installs_once_when_an_array_starts_together(tmp_path):
    """16 SLURM array tasks in one shared checkout run join.sh at once: one ./install.sh --worker (the worker-only
    environment, .venv-worker), the rest wait for it."""
    (tmp_path / "launchers").mkdir()
    (tmp_path / "launchers" / "join.sh").write_text((ROOT / "launchers" / "join.sh").read_text())
    (tmp_path / "install.sh").write_text(
        "#!/usr/bin/env bash\nset -e\nv=${ECHO2_VENV:-.venv}\n"
        "[ ! -e busy ] || echo overlap >> log\ntouch busy; echo install \"$@\" >> log; sleep 1\n"
        "mkdir -p $v/bin; printf '#!/bin/sh\\necho ran \"$@\"\\n' > $v/bin/python; chmod +x $v/bin/python\n"
        "rm busy; touch $v/.echo2-installed\n")
    os.chmod(tmp_path / "install.sh", 0o755)
    env = {k: v for k, v in os.environ.items() if k != "ECHO2_PYTHON"}
    env.update(ECHO2_TOKEN="t", PATH="/usr/bin:/bin")  # no nvidia-smi on this PATH: the CPU install
    procs = [subprocess.Popen(["bash", "launchers/join.sh", "http://h:1", "--model", "m"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(6)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert (tmp_path / "log").read_text().split() == ["install", "--worker"]
    assert (tmp_path / ".venv-worker" / ".echo2-installed").exists() and not (tmp_path / ".venv").exists()
    assert all("ran -m echo2.worker --coordinator http://h:1 --model m" in o for o in outs), outs
