"""Where worker agents come from (echo2/learner/sources/pool.py), as a config composes them."""

from __future__ import annotations

from hydra.utils import instantiate

from conftest import compose


def test_an_experiment_for_local_agents_runs_with_joining_workers():
    """experiment=smollm2_arith sets pool.workers=1 (pool=local's agent count); with pool=static, as launchers/wan.py
    runs it, that count lists no worker instead of failing at instantiation ('int' object is not iterable)."""
    pool = instantiate(compose(["pool=static", "experiment=smollm2_arith_lora"]).pool)
    assert type(pool).__name__ == "StaticPool" and pool.workers == []
    listed = instantiate(compose(["pool=static", "+pool.workers=[{name: a, usd_per_hour: 1.0}]"]).pool)
    assert [w["name"] for w in listed.workers] == ["a"]
