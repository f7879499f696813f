"""benchmarks/coordinator_crowd.py --quick: a learner trains while its coordinator (TLS on) serves 16 simulated
workers, each with its own credential, and 200 idle or half-open connections; every row of the run is sane."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from conftest import ROOT
from echo2.net.httpd import Limits


@pytest.mark.e2e
@pytest.mark.slow
def test_a_quick_crowd_run_is_served_whole_and_its_books_balance(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "benchmarks/coordinator_crowd.py", "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [row] = json.loads(out.read_text())
    assert row["error"] is None, row["error"]
    assert row["books_balanced"], row["accounting"]
    for phase, workers in (("calm", row["calm_workers"]), ("crowd", row["workers"])):
        p = row[phase]
        codes = sum((Counter(c) for c in p["codes"].values()), Counter())
        assert set(codes) == {"200"}, (phase, p["codes"])  # no 4xx, no 5xx, no connection errors
        assert p["workers_answered"] == workers and p["min_answers"] > 0, (phase, p["workers_answered"])
        assert not p["refused"] and p["reregistered"] == 0, (phase, p["refused"])  # every pushed result accepted
        assert p["steps"] > 0 and p["accepted_per_s"] > 0, phase
        assert {"register", "heartbeat", "pull (work)", "push"} <= set(p["routes"]), (phase, p["routes"])
    crowd = row["crowd"]
    # every idle connection was held until the server's header (or handshake) timeout, then dropped, and no more
    assert crowd["idle_drops"] >= row["half_open"] // 2, crowd["idle_drops"]
    assert abs(crowd["idle_dropped_after_s"] - Limits().header_timeout_s) < 3, crowd["idle_dropped_after_s"]
    assert set(row["accounting"]["requests_rejected"]) <= {"HeaderTimeout", "HandshakeTimeout"}, row["accounting"]
    assert "| 16 | 200 |" in proc.stdout, proc.stdout
