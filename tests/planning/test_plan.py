"""``python -m echo2.plan`` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

ARGS = ["--pool", "conf/pool/demo_market.yaml", "--rollouts-per-step", "512", "--train-step-s", "30",
        "--staleness", "2", "--snapshot-mb", "8000", "--learner-usd-per-hour", "20", "--learner-uplink-mbit", "10000"]


def plan(*extra):
    out = subprocess.run([sys.executable, "-m", "echo2.plan", *ARGS, *extra], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    return out


@pytest.mark.e2e
def test_plan_json_and_plot(tmp_path):
    out = plan("--json", "--plot", str(tmp_path / "plan.png"))
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert {"feasible", "required_rollouts_per_s", "active", "usd_per_hour", "predicted_utilization", "step_s"} <= set(r)
    assert r["feasible"] and r["predicted_utilization"] == 1.0 and r["active"]
    assert r["usd_per_hour"] >= 20 and r["required_rollouts_per_s"] <= r["aggregate_rollouts_per_s"]
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    greedy = json.loads(plan("--json", "--solver", "greedy").stdout)
    assert greedy["usd_per_step"] >= r["usd_per_step"]


@pytest.mark.e2e
def test_plan_rejects_bad_input(tmp_path):
    bad = tmp_path / "pool.yaml"
    bad.write_text("workers:\n  - {id: a, usd_per_hour: cheap, rollouts_per_s: 1}\n")
    out = subprocess.run([sys.executable, "-m", "echo2.plan", *ARGS[2:], "--pool", str(bad)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "worker #0" in out.stderr
    out = plan("--interval", "5")
    assert out.returncode == 2 and "1 <= κ <= S+1" in out.stderr


def test_plan_explains_a_pool_file_without_prices_or_rates(capsys):
    """conf/pool/local.yaml counts the workers a run starts (workers: 2): the planner says what it needs instead of
    a raw TypeError; a negative S names --staleness."""
    import pytest

    from echo2 import plan as planner

    with pytest.raises(SystemExit, match=r"'workers' is 2, not a list of workers.*conf/pool/demo_market\.yaml"):
        planner.main([*ARGS[2:], "--pool", str(ROOT / "conf" / "pool" / "local.yaml")])
    with pytest.raises(SystemExit):
        planner.main([*ARGS[:6], "--staleness", "-1", *ARGS[8:]])
    assert "--staleness -1: S must be >= 0" in capsys.readouterr().err
