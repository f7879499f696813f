"""Kuhn poker: the payoffs against an independent game-tree walk, best responses, parsing, and learning through
the unchanged learner and rollout plane (sync here; async with remote workers below)."""

from __future__ import annotations

import json
import itertools

import pytest

from conftest import balanced, read_jsonl, run_train, train
from echo2.tasks.kuhn import BET, OPPONENT, PASS, WORST, KuhnTask, best_plans, expected_payoff, plan_value, plans


def walk(card, opp, seat, history, plan):
    """The model's expected payoff by playing the game out action by action (independent of kuhn.py's formulas)."""
    def value(h, prob):  # h: the full action history so far, player 1 first
        cards = (card, opp) if seat == 1 else (opp, card)
        me = 0 if seat == 1 else 1
        sign = 1 if me == 0 else -1  # payoffs below are player 1's
        terminal = {(PASS, PASS): ("show", 1), (BET, PASS): ("p1", 1), (BET, BET): ("show", 2),
                    (PASS, BET, PASS): ("p2", 1), (PASS, BET, BET): ("show", 2)}
        if tuple(h) in terminal:
            kind, stake = terminal[tuple(h)]
            p1 = (stake if cards[0] > cards[1] else -stake) if kind == "show" else (stake if kind == "p1" else -stake)
            return prob * sign * p1
        actor = len(h) % 2
        if actor == me:
            mine = [i for i, _ in enumerate(h) if i % 2 == me]
            return value(h + [plan[len(mine)]], prob)
        if not h:
            p_bet = OPPONENT["open"][opp]
        elif h[-1] == BET:
            p_bet = OPPONENT["facing_bet"][opp]
        else:
            p_bet = OPPONENT["after_pass"][opp]
        return value(h + [BET], prob * p_bet) + value(h + [PASS], prob * (1 - p_bet))

    if seat == 2:  # the opponent's first action is given: condition on it
        return value(list(history), 1.0)
    return value([], 1.0)


@pytest.mark.parametrize("card, opp, seat", [(c, o, s) for c, o in itertools.permutations(range(3), 2)
                                             for s in (1, 2)])
def test_expected_payoff_matches_a_walk_of_the_game_tree(card, opp, seat):
    for history in ([()] if seat == 1 else [(PASS,), (BET,)]):
        for plan in plans(seat):
            assert expected_payoff(card, opp, seat, history, plan) == pytest.approx(walk(card, opp, seat, history, plan))


def test_best_responses_exploit_the_opponent():
    assert best_plans(2, 1, ()) == [(BET, PASS), (BET, BET)]  # K opens with a bet (the second action unused)
    assert best_plans(0, 1, ()) == [(PASS, PASS)]  # J checks and folds
    assert best_plans(0, 2, (PASS,)) == [(BET,)]  # J bluffs after a check: the checker holds Q, folds half
    assert best_plans(2, 2, (BET,)) == [(BET,)]  # K calls
    assert plan_value(0, 2, (BET,), (BET,)) == -2.0  # J calling a bet only ever meets a K


def test_parsing_and_a_malformed_answer_scores_the_worst_payoff():
    t = KuhnTask(train_size=10, eval_size=10)
    row = {"card": 2, "opp_card": 0, "seat": 1, "history": []}
    assert t.parse("10", 1) == (BET, PASS) and t.parse("1", 1) == (BET, PASS) and t.parse("01", 1) == (PASS, BET)
    assert t.parse("0", 1) is None and t.parse("=", 2) is None and t.payoff("+", row) == WORST
    assert t.is_correct("1", row) and not t.is_correct("00", row)
    text = KuhnTask(train_size=10, eval_size=10, format="text")
    assert text.parse(" I bet, and if raised I fold.", 1) == (BET, PASS) and text.parse("Call.", 2) == (BET,)
    assert "You hold the" in text.train_dataset()[0]["prompt"]


def test_the_rows_follow_the_opponent_policy():
    rows = KuhnTask(train_size=6000, eval_size=10).train_dataset()
    seen = [r for r in rows if r["seat"] == 2 and r["opp_card"] == 0]  # the opponent holds J: bluffs 1/3
    assert abs(sum(r["history"] == [BET] for r in seen) / len(seen) - 1 / 3) < 0.05
    assert all(r["card"] != r["opp_card"] for r in rows)


@pytest.mark.e2e
@pytest.mark.slow
def test_the_tiny_model_learns_to_exploit_the_opponent(tmp_path):
    """The same train.py, learner and source; only task=kuhn. Payoff rises, and best responses go from no hand (the
    untrained model answers nothing parseable) to most hands. Where it ends depends on the seed and on float noise: at
    150 steps, seeds 0-4 ended at 0.76, 0.83, 0.57, 0.57 and 0.83 of the hands (seed 0 at 0.86 before the learner's
    LM head scored only completion tokens, the same values to 1e-7 for 20 steps, then a different trajectory)."""
    out = run_train(["task=kuhn", "rollout=sync", "run.steps=150", "run.eval_every_steps=75", "run.wandb=disabled",
                     f"hydra.run.dir={tmp_path}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rewards = [r["reward/mean"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert sum(rewards[-20:]) / 20 > sum(rewards[:10]) / 10 + 0.5
    evals = json.loads((tmp_path / "summary.json").read_text())["eval_accuracy_by_step"]
    assert evals["0"] == 0.0 and evals["150"] > 0.5, evals


@pytest.mark.e2e
@pytest.mark.slow
def test_kuhn_through_remote_workers(tmp_path):
    """The asynchronous plane serves the poker task unchanged: the coordinator scores payoffs, books balance."""
    _, trainer, _, acc, records = train(tmp_path, ["task=kuhn", "pool.engine=hf", "run.steps=40"])
    assert len(records) == 40 and balanced(acc), acc
    assert all(WORST <= r["reward/mean"] <= 2 for r in records)
