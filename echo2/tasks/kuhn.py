"""Kuhn poker against a fixed opponent: a second kind of task through the same adapter (ECHO-2 used poker).

The game: a deck of J < Q < K, each player antes 1 and gets one card; two actions, *pass* (check, or fold to a
bet) and *bet* (bet 1, or call a bet). Player 1 acts first. Histories end at pass-pass (showdown for 1),
bet-pass (the bettor wins 1), bet-bet (showdown for 2), pass-bet-pass (player 1 folds, loses 1) and
pass-bet-bet (showdown for 2).

Each row deals the model a seat and a card and, when the model is player 2, shows the opponent's first action
(drawn from the opponent's policy). The model answers with its **plan**: as player 1 two actions (the first,
and its answer should the opponent bet after a pass), as player 2 one. The reward is the model's payoff against
the fixed opponent policy: exact, in expectation over the opponent's mixed actions, for the cards dealt (the
opponent's card is in the row, never in the prompt). A malformed answer scores -2, the worst payoff.

The opponent (``OPPONENT``) is a simple, exploitable policy: bet or call with K; never bet with Q, call with it
half the time; bluff with J a third of the time, never call with it. ``eval/accuracy`` counts best responses:
plans whose expected payoff, over the opponent cards consistent with what the model saw, is the highest.

Prompt formats: ``digits`` (for the tiny model's digit vocabulary: ``"<card>*<history>="``, card 0/1/2 = J/Q/K,
actions 0 = pass, 1 = bet, e.g. ``"2*="`` or ``"0*1="``) and ``text`` (a sentence for chat models; the answer
is read as the first ``pass``/``bet`` words or p/b letters).
"""

from __future__ import annotations

import random
import re
from typing import Any

from datasets import Dataset

from echo2.tasks.base import RewardFunc, Task

PASS, BET = 0, 1
CARDS = ("J", "Q", "K")
WORST = -2.0

# P(bet) of the opponent at each of its decision points, by its card (0 = J, 1 = Q, 2 = K):
#   "open": first to act (it is player 1);  "after_pass": player 2 after player 1 passed;
#   "facing_bet": it faces a bet (as player 2 after a bet, or as player 1 after pass-bet): P(call).
OPPONENT = {
    "open": (1 / 3, 0.0, 1.0),
    "after_pass": (1 / 3, 0.0, 1.0),
    "facing_bet": (0.0, 0.5, 1.0),
}


def showdown(mine: int, theirs: int, stake: float) -> float:
    return stake if mine > theirs else -stake


def expected_payoff(card: int, opp: int, seat: int, history: tuple[int, ...], plan: tuple[int, ...]) -> float:
    """The model's payoff in expectation over the opponent's policy. ``seat`` 1 or 2; ``history``: the
    opponent's first action when the model is player 2; ``plan``: 2 actions (player 1) or 1 (player 2)."""
    if seat == 1:
        first, answer = plan
        if first == BET:
            call = OPPONENT["facing_bet"][opp]
            return call * showdown(card, opp, 2) + (1 - call) * 1.0
        bet = OPPONENT["after_pass"][opp]
        if_bet = showdown(card, opp, 2) if answer == BET else -1.0
        return bet * if_bet + (1 - bet) * showdown(card, opp, 1)
    (action,) = plan
    if history == (BET,):
        return showdown(card, opp, 2) if action == BET else -1.0
    if action == PASS:
        return showdown(card, opp, 1)
    call = OPPONENT["facing_bet"][opp]  # the opponent, player 1, passed and now faces the model's bet
    return call * showdown(card, opp, 2) + (1 - call) * 1.0


def plans(seat: int) -> list[tuple[int, ...]]:
    return [(a, b) for a in (PASS, BET) for b in (PASS, BET)] if seat == 1 else [(PASS,), (BET,)]


def plan_value(card: int, seat: int, history: tuple[int, ...], plan: tuple[int, ...]) -> float:
    """Expected payoff of ``plan`` given only what the model sees: the opponent's card is one of the other two,
    weighted by how likely the opponent was to act as it did (``history``) with it."""
    weights = {}
    for opp in (c for c in range(3) if c != card):
        w = 1.0
        if seat == 2:
            bet = OPPONENT["open"][opp]
            w = bet if history == (BET,) else 1 - bet
        weights[opp] = w
    total = sum(weights.values())
    if total == 0:
        return 0.0
    return sum(w * expected_payoff(card, opp, seat, history, plan) for opp, w in weights.items()) / total


def best_plans(card: int, seat: int, history: tuple[int, ...]) -> list[tuple[int, ...]]:
    values = {p: plan_value(card, seat, history, p) for p in plans(seat)}
    best = max(values.values())
    # a plan's unused second action (player 1 who bets first) does not change its value: all ties count
    return [p for p, v in values.items() if v >= best - 1e-9]


_DIGITS = re.compile(r"\s*([01])\s*([01])?")
_WORDS = re.compile(r"\b(pass|check|fold|bet|call|p|b)\b", re.IGNORECASE)


class KuhnTask(Task):
    def __init__(self, train_size: int = 10_000, eval_size: int = 300, seed: int = 0, format: str = "digits",
                 max_completion_length: int = 2):
        if format not in ("digits", "text"):
            raise ValueError(f"task.format={format!r}: expected digits or text")
        self.name = "kuhn"
        self.train_size, self.eval_size, self.seed, self.format = train_size, eval_size, seed, format
        self.max_completion_length = max_completion_length

    # ------------------------------------------------------------------ data

    def _deal(self, rng: random.Random) -> dict[str, Any]:
        card, opp = rng.sample(range(3), 2)
        seat = rng.choice((1, 2))
        history = []
        if seat == 2:  # the opponent (player 1) has acted, by its own policy
            history = [BET if rng.random() < OPPONENT["open"][opp] else PASS]
        return {"prompt": self._prompt(card, seat, history), "card": card, "opp_card": opp, "seat": seat,
                "history": history}

    def _prompt(self, card: int, seat: int, history: list[int]) -> str:
        if self.format == "digits":
            return f"{card}*{''.join(map(str, history))}="
        if seat == 1:
            situation = ("You are player 1 and act first. Answer with two words: your action now (pass or bet) "
                         "and your answer if you pass and the opponent then bets (pass = fold, bet = call).")
        else:
            seen = "bet" if history == [BET] else "passed"
            situation = (f"You are player 2; the opponent {seen}. Answer with one word: pass or bet "
                         f"({'fold or call' if history == [BET] else 'check or bet'}).")
        return f"Kuhn poker (cards J < Q < K, ante 1, bets of 1). You hold the {CARDS[card]}. {situation} Answer:"

    def _rows(self, n: int, seed: int) -> Dataset:
        rng = random.Random(seed)
        return Dataset.from_list([self._deal(rng) for _ in range(n)])

    def train_dataset(self) -> Dataset:
        return self._rows(self.train_size, self.seed)

    def eval_dataset(self) -> Dataset:
        return self._rows(self.eval_size, self.seed + 1_000_003)

    # ------------------------------------------------------------------ scoring

    def parse(self, completion: str, seat: int) -> tuple[int, ...] | None:
        """The plan in a completion, or None if it has none."""
        need = 2 if seat == 1 else 1
        if self.format == "digits":
            m = _DIGITS.match(completion)
            acts = [int(g) for g in (m.groups() if m else ()) if g is not None]
        else:
            acts = [BET if w.lower() in ("bet", "call", "b") else PASS for w in _WORDS.findall(completion)]
        if seat == 1 and acts[:1] == [BET]:
            return (BET, acts[1] if len(acts) > 1 else PASS)  # betting first, the second action is never used
        return tuple(acts[:need]) if len(acts) >= need else None

    def payoff(self, completion: str, row: dict[str, Any]) -> float:
        plan = self.parse(completion, row["seat"])
        if plan is None:
            return WORST
        return expected_payoff(row["card"], row["opp_card"], row["seat"], tuple(row["history"]), plan)

    def is_correct(self, completion: str, row: dict[str, Any]) -> bool:
        plan = self.parse(completion, row["seat"])
        return plan is not None and plan in best_plans(row["card"], row["seat"], tuple(row["history"]))

    def reward_funcs(self) -> list[RewardFunc]:
        def payoff(prompts, completions, completion_ids=None, card=None, opp_card=None, seat=None, history=None,
                   **_):
            return [self.payoff(c, {"card": k, "opp_card": o, "seat": s, "history": h})
                    for c, k, o, s, h in zip(completions, card, opp_card, seat, history, strict=True)]

        return [payoff]
