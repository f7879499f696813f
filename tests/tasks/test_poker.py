"""task=poker: OpenSpiel's Kuhn and Leduc hold'em against a fixed opponent, turn by turn: the environment, the
replay that scores the transcript (the same chips), and the opponent checked against echo2's closed-form Kuhn."""

from __future__ import annotations

import random
import statistics

import pytest

from echo2.tasks.kuhn import best_plans, plan_value
from echo2.tasks.poker import Hand, PokerEnv, PokerTask, chips_won, replay

WORDS = ["pass", "bet", "fold", "call", "raise", "check", "hmm", "I bet!", "Raise it"]


@pytest.mark.parametrize("opponent", ["mixed", "station"])
@pytest.mark.parametrize("game", ["kuhn_poker", "leduc_poker"])
def test_the_environment_and_the_replay_of_its_transcript_agree(game, opponent):
    rng = random.Random(0)
    for seed in range(60):
        seat = seed % 2
        env = PokerEnv(extras={"game": game, "seed": seed, "seat": seat, "opponent": opponent})
        messages, done, reward = [], False, None
        while not done:
            answer = rng.choice(WORDS)
            out = env.step(answer)
            messages += [{"role": "assistant", "content": answer}, *out["observations"]]
            done, reward = out["done"], out["reward"]
        assert replay(game, seed, seat, [m["content"] for m in messages if m["role"] == "assistant"],
                      opponent) == reward
        assert chips_won([messages], [game], [seed], [seat], [opponent]) == [reward]
        assert -13 <= reward <= 13 and (game != "kuhn_poker" or -2 <= reward <= 2)


def test_a_hand_is_the_same_hand_from_its_seed_and_a_cut_hand_is_a_fold():
    a, b = Hand("leduc_poker", 7, 0), Hand("leduc_poker", 7, 0)
    assert a.situation() == b.situation() and a.state.history() == b.state.history()
    assert replay("kuhn_poker", 3, 0, []) == -1.0  # no answer at all: the ante is lost (a fold, or checked down)
    hand = Hand("kuhn_poker", 1, 1)
    note = hand.play("hmm, what now")
    assert note.startswith("(No action in your answer: you pass.)")


def test_kuhn_asks_yes_or_no_and_reads_the_answer_as_the_action():
    opens = Hand("kuhn_poker", 0, 0)  # player 1: nothing to call
    assert opens.situation().endswith("Do you bet? Answer yes or no.")
    opens.play("Yes.")
    assert opens.state.history()[2] == 1  # after the two cards dealt, our bet
    facing = next(h for h in (Hand("kuhn_poker", s, 1) for s in range(1, 40, 2)) if h.state.history()[-1] == 1)
    question = facing.situation()
    assert "The opponent bets." in question and question.endswith("Do you call? Answer yes or no.")
    folded = Hand("kuhn_poker", facing.seed, 1)
    folded.play("No, I fold")
    assert folded.state.is_terminal() and folded.chips_won() == -1.0  # no: a fold facing the bet


def test_the_kuhn_opponent_is_echo2s_closed_form_one():
    """Playing the best response that echo2/tasks/kuhn.py computes against its opponent, on OpenSpiel's game with this
    opponent, wins what kuhn.py says it is worth (within the sampling error of 6000 hands)."""
    won, expected = [], []
    for seed in range(6000):
        seat = seed % 2
        hand = Hand("kuhn_poker", seed, seat)
        info = hand.state.information_state_string(seat)
        card, history = int(info[0]), tuple(1 if c == "b" else 0 for c in info[1:])
        plan = best_plans(card, seat + 1, history)[0]
        expected.append(plan_value(card, seat + 1, history, plan))
        won.append(replay("kuhn_poker", seed, seat, ["bet" if a else "pass" for a in plan]))
    assert abs(statistics.mean(won) - statistics.mean(expected)) < 0.05
    always_bet = statistics.mean(replay("kuhn_poker", s, s % 2, ["bet"] * 2) for s in range(6000))
    assert statistics.mean(won) > always_bet + 0.1  # worth learning: the best response wins what betting loses


def test_rows_show_the_first_decision_and_held_out_hands_are_apart():
    task = PokerTask(game="leduc_poker", train_size=20, eval_size=10)
    train, held_out = task.train_dataset(), task.eval_dataset()
    assert {r["seat"] for r in train} == {0, 1} and set(train["seed"]).isdisjoint(held_out["seed"])
    first = train[1]["prompt"][0]["content"]
    assert "You are player 2. The opponent" in first and first.endswith("Answer with one word.")
    assert task.episode_spec().contract == "skyrl" and task.episode_spec().environment_reward is None
    assert task.correct_when() == ("chips_won", 1e-9)
    with pytest.raises(ValueError, match="task.game='go'"):
        PokerTask(game="go")


@pytest.mark.parametrize("game", ["kuhn_poker", "leduc_poker"])
def test_the_calling_station_calls_every_bet_and_bets_only_its_best_hand(game):
    for seed in range(200):
        hand = Hand(game, seed, seed % 2, "station")
        while not hand.state.is_terminal():
            hand.play("bet" if game == "kuhn_poker" else "raise")  # the model bets (raises) whenever it may
        opp = 1 - seed % 2
        acts = [a.action for a in hand.state.full_history() if a.player == opp]
        if game == "kuhn_poker":
            assert abs(hand.state.returns()[opp]) == 2  # every bet called: to the showdown
            if opp == 0:  # it acted first: a bet with the King only
                assert acts[0] == (1 if hand.state.history()[opp] == 2 else 0)
        else:
            assert 0 not in acts  # never a fold
    with pytest.raises(ValueError, match="task.opponent='shark'"):
        PokerTask(opponent="shark")
