"""Capacity model and activation: table-driven checks of the model, exact against brute force."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from echo2 import capacity
from echo2.activation.solve import System, Worker, _better, all_on, evaluate, exact, greedy, solve


# ---------------------------------------------------------------------- capacity model

@pytest.mark.parametrize("S, kappa, L, mu, step", [
    (0, 1, 2.0, 100.0, 10 + 2 + 1.28),    # synchronous: train, disseminate, generate, in turn
    (2, 1, 2.0, 100.0, 10.0),             # window 2 steps: 20 - 2 >= R/mu = 1.28: the learner never waits
    (2, 1, 2.0, 10.0, 12.8),              # rollout-bound: R/mu > T_train
    (1, 2, 2.0, 100.0, 10 + (1.28 + 2) / 2),  # κ = S + 1: a synchronous wait, but once per 2 steps
    (4, 3, 25.0, 100.0, 10 + (1.28 + 25 - 20) / 3),  # window 2 steps, L = 25 s: one wait per κ = 3 steps
])
def test_step_time_table(S, kappa, L, mu, step):
    p = capacity.predict(128, 10.0, S, kappa, L, 0.0, [mu])
    assert p.step_s == pytest.approx(step) and p.utilization == pytest.approx(10.0 / step)


def test_required_rate_falls_with_S_to_rate_matching_and_beats_no_one():
    R, T, L = 512, 60.0, 50.0
    req = [capacity.predict(R, T, S, 1, L, 0, [1.0]).required_rollouts_per_s for S in range(0, 12)]
    assert req[0] == math.inf and all(a >= b for a, b in zip(req, req[1:])) and req[-1] == pytest.approx(R / T)
    for S in range(1, 12):  # at exactly the required rate, the predicted utilization is 1; below it, not
        need = capacity.predict(R, T, S, 1, L, 0, [1.0]).required_rollouts_per_s
        if math.isfinite(need):
            assert capacity.predict(R, T, S, 1, L, 0, [need]).utilization == pytest.approx(1.0)
            assert capacity.predict(R, T, S, 1, L, 0, [0.9 * need]).utilization < 1.0


def test_paper_rule_where_it_differs():
    # docs/design.md §3's worked example: R = 512, T = 60 s, T_bcast = 120 s.
    assert capacity.paper_required_rate(512, 60, 3, 120) == pytest.approx(25.6)
    assert not capacity.predict(512, 60, 4, 3, 120, 0, [25.6]).feasible  # κ = S−1 = 3 consumes lag 5 > S there
    assert capacity.predict(512, 60, 4, 1, 120, 0, [512 / 60]).utilization == pytest.approx(1.0)  # κ = 1 is fine


def test_broadcast_time_models():
    t = {m: [capacity.bcast_time_s(m, 50e6, 100, n, 100, 100, 40) for n in (1, 2, 4, 8)]
         for m in ("one_to_many", "pipelined", "tree")}
    assert t["one_to_many"][3] / t["one_to_many"][0] == pytest.approx(8, rel=0.02)  # linear in N
    assert t["pipelined"][3] / t["pipelined"][0] < 1.1  # nearly flat
    assert t["tree"][0] > t["pipelined"][0]  # inner nodes upload twice


def test_round_map_is_the_closed_form_where_rounds_keep_up():
    """The round map (rounds explicit) and the closed form derive T_step from the same assumptions; where rounds
    do not queue they must agree, except for κ > 1 with R/μ > T_train, where the closed form undercounts."""
    rng, checked = random.Random(5), 0
    for _ in range(400):
        S = rng.randint(0, 8)
        kappa, R, T = rng.randint(1, S + 1), rng.choice([64, 512]), rng.uniform(5, 60)
        bcast, after, mu = rng.uniform(0.1, 3 * T), rng.uniform(0, 20), rng.uniform(1, 200)
        closed = float(capacity.step_time_s(R, T, S - kappa + 1, bcast + after, mu, kappa))
        if bcast > kappa * closed or (kappa > 1 and R / mu > T):
            continue
        checked += 1
        assert capacity.queued_step_time_s(R, T, S, kappa, bcast, after, [mu])[0] == pytest.approx(closed, rel=0.03)
    assert checked > 200


@pytest.mark.parametrize("S, T, steps_per_round", [
    (1, 30.0, 1.0), (2, 30.0, 4 / 3), (4, 30.0, 2.0),  # bursts outlast c = 1 step: (S + 1 + c)/3 per round
    (2, 10.0, 1.5), (4, 10.0, 2.5),                   # bursts fit: (S + 1)/2 per round
    (8, 30.0, 67.3 / 30),                             # never more than T_bcast / T_train: the learner is busy
])
def test_round_map_steps_per_round_when_rounds_queue(S, T, steps_per_round):
    """κ = 1, T_bcast = 67.3 s, T_load + T_batch = 9 s, R/μ = 6 s, so c = ⌊(67.3 − 9 − 6)/T⌋ (module doc)."""
    p = capacity.predict(512, T, S, 1, 67.3, 9.0, [512 / 6])
    assert p.queued and 67.3 / p.step_s == pytest.approx(steps_per_round, rel=0.02)


def test_round_map_counts_every_window_generation_when_kappa_exceeds_the_window():
    """S = 1, κ = 2 (window 0), R/μ = 43 s > T_train: both steps' rollouts follow the version, so a 2-step cycle is
    L + 2·R/μ + T_train (the closed form counts R/μ once)."""
    R, T, bcast, after, mu = 512, 8.0, 20.0, 5.0, 512 / 43
    p = capacity.predict(R, T, 1, 2, bcast, after, [mu])
    assert p.step_s == pytest.approx((bcast + after + 2 * 43 + T) / 2, rel=0.02)
    assert p.step_s > float(capacity.step_time_s(R, T, 0, bcast + after, mu, 2)) * 1.3


# ---------------------------------------------------------------------- activation

def random_instance(rng: random.Random, n: int, classes: bool = True):
    pick = (lambda xs: rng.choice(xs)) if classes else (lambda xs: rng.uniform(min(xs), max(xs)))
    workers = [Worker(f"w{i}", round(rng.uniform(0.1, 3.0), 2), round(rng.uniform(5, 120), 1),
                      down_mbit=pick([100, 500, 1000]), up_mbit=pick([100, 500, 1000]), rtt_ms=pick([20, 80, 150]))
               for i in range(n)]
    system = System(rollouts_per_step=rng.choice([256, 512, 1024]), train_step_s=rng.uniform(5, 60),
                    staleness=rng.choice([0, 1, 2, 4]), interval=1, snapshot_bytes=rng.choice([1e9, 8e9]),
                    learner_usd_per_hour=rng.choice([2.0, 8.0, 30.0]), learner_uplink_mbit=rng.choice([1000, 10000]),
                    broadcast=rng.choice(["pipelined", "one_to_many"]), load_s=2.0,
                    min_utilization=rng.choice([0.0, 0.0, 0.9]))
    return system, workers


def brute_force(system, workers):
    best = None
    for k in range(1, len(workers) + 1):
        for subset in itertools.combinations(workers, k):
            plan = evaluate(system, list(subset))
            if _better(plan, best):
                best = plan
    return best


@pytest.mark.parametrize("seed", range(40))
def test_exact_equals_brute_force(seed):
    rng = random.Random(seed)
    # up to 10 workers (1,023 subsets for the brute force; 12 took 4x as long for no other case)
    system, workers = random_instance(rng, rng.randint(1, 10 if seed % 4 else 7), classes=bool(seed % 4))
    bf, ex = brute_force(system, workers), exact(system, workers)
    assert ex.meets_min_utilization == bf.meets_min_utilization
    assert ex.usd_per_step == pytest.approx(bf.usd_per_step, rel=1e-9)
    for other in (greedy(system, workers), all_on(system, workers)):  # never better than the optimum
        assert (not other.meets_min_utilization, other.usd_per_step) >= (
            not ex.meets_min_utilization, ex.usd_per_step - 1e-12)


def test_cost_aware_beats_all_on_when_cheap_workers_suffice():
    system = System(512, 30.0, 2, 1, 1e9, learner_usd_per_hour=10.0, learner_uplink_mbit=10000)
    workers = [Worker(f"cheap{i}", 0.5, 10.0) for i in range(4)] + [Worker(f"dear{i}", 4.0, 12.0) for i in range(4)]
    plan = solve(system, workers, "exact")
    assert plan.prediction.utilization == pytest.approx(1.0) and set(plan.active) == {"cheap0", "cheap1"}
    assert plan.usd_per_step < all_on(system, workers).usd_per_step


def test_bad_requests_get_clear_errors():
    system = System(512, 30.0, 2, 1, 8e9, 10.0, 10000)
    with pytest.raises(ValueError, match="expected one of"):
        solve(system, [Worker("a", 1, 1)], "magic")
    rng = random.Random(0)
    many = [Worker(f"w{i}", 3.0, 10.0, down_mbit=rng.uniform(1, 1e4), up_mbit=rng.uniform(1, 1e4),
                   rtt_ms=rng.uniform(1, 200)) for i in range(300)]
    with pytest.raises(ValueError, match="use greedy"):
        exact(system, many)
    with pytest.raises(ValueError, match="1 <= κ <= S"):
        capacity.predict(1, 1, 0, 2, 0, 0, [1])


def test_online_replanning_has_hysteresis():
    from dataclasses import replace

    from echo2.activation.online import OnlineActivation

    system = System(512, 30.0, 2, 1, 1e9, learner_usd_per_hour=10.0, learner_uplink_mbit=10000)
    workers = [Worker("a", 1.0, 10.0), Worker("b", 1.0, 10.0), Worker("c", 3.0, 10.0)]
    online = OnlineActivation("exact", hysteresis=0.1)
    assert online.update(system, workers) == frozenset({"a", "b"}) and online.replans == 1
    drifted = [replace(w, rollouts_per_s=w.rollouts_per_s * 0.98) for w in workers]  # small drift: keep
    assert online.update(system, drifted) is None
    slow = [replace(workers[0], rollouts_per_s=2.0), workers[1], workers[2]]  # a slowed 5x: 18 % dearer, re-plan
    assert online.update(system, slow) == frozenset({"b", "c"}) and online.replans == 2
    joined = slow + [Worker("d", 0.5, 10.0)]  # a join re-plans at once
    assert online.update(system, joined) == frozenset({"b", "d"})
    assert online.update(system, joined) is None and online.replans == 3
    # a 5 % saving is within the hysteresis: no flapping
    online2 = OnlineActivation("exact", hysteresis=0.1)
    online2.update(system, workers)
    assert online2.update(system, [replace(workers[0], rollouts_per_s=4.0), *workers[1:]]) is None



def test_under_all_on_every_joiner_works():
    """all_on (the default) keeps no plan to protect: a worker that joins is switched on at the next re-plan,
    whatever it costs (the hysteresis is for the cost-aware solvers; with it, joiners got no work at all)."""
    from echo2.activation.online import OnlineActivation

    system = System(512, 30.0, 2, 1, 1e9, learner_usd_per_hour=10.0, learner_uplink_mbit=10000)
    workers = [Worker("a", 1.0, 10.0), Worker("b", 1.0, 10.0)]
    online = OnlineActivation("all_on", hysteresis=0.1)
    assert online.update(system, workers) == frozenset({"a", "b"})
    assert online.update(system, workers + [Worker("c", 9.0, 1.0)]) == frozenset({"a", "b", "c"})
    assert online.update(system, workers + [Worker("c", 9.0, 1.0)]) is None


# ---------------------------------------------------------------------- the coordinator's planner


def test_the_capacity_model_takes_the_relays_topology_names():
    args = (8e9, 10000, 6, 500, 200, 40)
    assert capacity.bcast_time_s("auto", *args) == capacity.bcast_time_s("pipelined", *args)  # what it runs
    assert capacity.bcast_time_s("stripes", *args) <= capacity.bcast_time_s("chain", *args)
    assert capacity.bcast_time_s("star", *args) == capacity.bcast_time_s("one_to_many", *args)
    assert capacity.bcast_time_s("tree", *args, fanout=3) != capacity.bcast_time_s("tree", *args, fanout=2)
    with pytest.raises(ValueError, match="expected one of"):
        capacity.bcast_time_s("ring", *args)


def test_a_tree_relay_with_fanout_3_is_planned_with_fanout_3(tiny_model_dir):
    """broadcast.sender.topology=tree, fanout=3 reaches the coordinator's planner as composed (the relay's own
    names, no translation), and the plan's dissemination time is the capacity model's for a fan-out-3 tree."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from conftest import compose
    from echo2.activation.settings import BroadcastShape
    from echo2.coordinator.coordinator import Coordinator
    from echo2.settings import CoordinatorSettings
    from echo2.scoring import Scorer
    from echo2.tasks.arith import ArithTask

    cfg = compose(["broadcast.sender.topology=tree", "broadcast.sender.fanout=3", "activation.solver=all_on"])
    shape = BroadcastShape.of(cfg.broadcast)
    assert shape == BroadcastShape(topology="tree", fanout=3, interval=1)
    task, tok = ArithTask(level="copy", train_size=20), AutoTokenizer.from_pretrained(tiny_model_dir)
    coord = Coordinator(task.train_dataset(), Scorer(task, tok), tok, CoordinatorSettings(
        token="t", staleness=2, prompts_per_step=2, group_size=2, vocab_size=len(tok), sampling={"max_tokens": 2},
        activation=OmegaConf.to_object(cfg.activation), broadcast_shape=shape))  # not started: only its planner is used
    planner = coord.activation
    system = planner.system(snapshot_bytes=8e9)
    assert (system.broadcast, system.fanout, system.interval) == ("tree", 3, 1)

    workers = [SimpleNamespace(worker_id=f"w{i}", usd_per_hour=0.0, rollouts_per_s=5.0, down_mbit=500.0,
                               up_mbit=200.0, rtt_ms=40.0) for i in range(9)]
    planner.took(0.0)
    planner.step_done({}, 10.0)  # T_train measured: 10 s
    change = planner.replan(workers, 8e9, now=10.0)
    assert change is not None and change.active == {w.worker_id for w in workers}
    uplink = cfg.activation.learner_uplink_mbit
    tree3 = capacity.bcast_time_s("tree", 8e9, uplink, 9, 500.0, 200.0, 40.0, fanout=3)
    assert planner.online.last.bcast_s == pytest.approx(tree3)
    assert tree3 != pytest.approx(capacity.bcast_time_s("tree", 8e9, uplink, 9, 500.0, 200.0, 40.0, fanout=2))


@pytest.mark.e2e
def test_train_hands_the_relay_shape_to_the_coordinator_process(tmp_path, caplog):
    """The same through train.build and the coordinator's own process (settings cross a process boundary)."""
    import logging

    from conftest import build_run

    caplog.set_level(logging.INFO)  # the coordinator process logs at the learner's level, as train.py sets it
    _, _, source, _ = build_run(tmp_path, ["rollout=async", "pool=static", "broadcast.sender.topology=tree",
                                           "broadcast.sender.fanout=3"])
    try:
        assert source.coordinator.status()["registered"] == 0  # it answers: it started with these settings
    finally:
        source.close()
    assert "planned for a tree relay (fanout 3)" in (tmp_path / "coordinator.log").read_text()


@pytest.mark.e2e
def test_on_change_runs_from_where_train_py_was_started(tmp_path, monkeypatch):
    """``activation.on_change='sh stop_or_start.sh'`` as the README writes it: a path relative to the directory
    the user started train.py in (not the run dir; the coordinator's process inherits that directory), told the
    run dir and who was switched off."""
    from types import SimpleNamespace

    from echo2.activation.planner import Change
    from echo2.coordinator.on_change import OnChangeHook

    launch, run_dir = tmp_path / "launch", tmp_path / "run"
    launch.mkdir()
    run_dir.mkdir()
    (launch / "stop_or_start.sh").write_text('echo "$ECHO2_DEACTIVATED $ECHO2_RUN_DIR" > "$ECHO2_RUN_DIR/hook.out"\n')
    monkeypatch.chdir(launch)
    hook = OnChangeHook("sh stop_or_start.sh", run_dir=str(run_dir))
    workers = [SimpleNamespace(worker_id=w, snapshot_url=None, relay=None, usd_per_hour=1.0) for w in ("w1", "w2")]
    hook(Change(active=frozenset({"w1"}), on=frozenset(), off=frozenset({"w2"}), replan=1), workers, "exact")
    hook.running[0].wait(timeout=30)
    assert hook.running[0].returncode == 0, (run_dir / "activation_hook.log").read_text()
    assert (run_dir / "hook.out").read_text().split() == ["w2", str(run_dir)]
