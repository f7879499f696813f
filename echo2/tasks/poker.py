"""Poker as ECHO-2 trains it: Kuhn and Leduc hold'em from OpenSpiel, played turn by turn against a fixed opponent,
rewarded with the chips won: ``task=poker`` (``task.game=kuhn_poker`` or ``leduc_poker``).

Each row is a hand: a seed (the deal and the opponent's mixed choices are drawn from it), the model's seat, and the
prompt: the rules and the situation at the model's first decision (the cards it holds, what the opponent did). The
environment (``PokerEnv``, SkyRL-gym's text contract: the model answers in words, which any chat template carries)
plays each answer on OpenSpiel's game, then the opponent's moves and the public card, and tells the model what
happened, until the hand is over. An answer is read as the first action word in it; an answer with none is a fold
(or a check where nothing is to call), said so in the next message. Kuhn asks a yes/no question ("Do you bet?", or
"Do you call?" facing a bet; pass, bet, check, call and fold are understood too): SmolLM2-135M-Instruct answers yes
or no to about 3 in 4 such questions at temperature 1, but names an action in fewer than 1 in 10 answers to "pass or
bet?", and an answer that names nothing passes, so that the plays of one hand rarely differed and GRPO had nothing
to compare. Leduc names its actions: fold, call (check), raise (bet).

The reward is the chips won (Kuhn -2..2, Leduc -13..13), recomputed where rewards are scored (``chips_won``): the
hand replayed on OpenSpiel from the row's seed and the model's answers in the transcript, with the same opponent. So
it is a function of the transcript and the row, never the worker's claim (the environment's own step rewards are left
out: ``environment_reward`` is off). A hand cut short (the token budget, ``max_turns``) is scored as a fold there.

The opponent is fixed and exploitable (``task.opponent``). ``mixed``: Kuhn, echo2/tasks/kuhn.py's (bet or call with
the King, never bet the Queen and call with it half the time, bluff the Jack a third of the time and never call with
it); Leduc, raise with a pair or a King, call with a Queen, fold a Jack facing a raise two times in three, and
bluff-raise a Jack one time in four. ``station``, a calling station: it calls every bet and never folds, and bets
(raises) only its best hand (Kuhn: the King; Leduc: a pair), so that every decision of the model changes what it
wins in most hands (against ``mixed``, a Kuhn bet or a pass often ends with the same chips: few of a hand's plays
differ in reward, and GRPO learns from those that do).

The single-shot Kuhn (``task=kuhn``: the whole plan in one answer) stays the tiny model's task.

    python train.py experiment=smollm2_poker                     # SmolLM2-135M on Kuhn, one CPU worker
    python benchmarks/poker_payoff.py                            # its payoff against the opponent, start and end
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from echo2.tasks.dataset import DatasetTask
from echo2.tasks.kuhn import OPPONENT

GAMES = ("kuhn_poker", "leduc_poker")
OPPONENTS = ("mixed", "station")
RANKS = ("Jack", "Queen", "King")
WORDS = {"kuhn_poker": {"pass": 0, "check": 0, "fold": 0, "no": 0, "bet": 1, "call": 1, "yes": 1},
         "leduc_poker": {"fold": 0, "call": 1, "check": 1, "raise": 2, "bet": 2}}
NAMES = {"kuhn_poker": ("pass", "bet"), "leduc_poker": ("fold", "call", "raise")}
RULES = {  # short: a small model reads little of them, and every token of a prompt costs each step
    "kuhn_poker": "Kuhn poker: cards Jack < Queen < King, one each, ante 1 chip. On your turn you bet 1 chip (or "
                  "call a bet), or not (check, or fold to a bet). Higher card wins at showdown.",
    "leduc_poker": "Leduc hold'em: two Jacks, two Queens, two Kings; one private card each, ante 1 chip, one public "
                   "card after the first round. fold, call (or check), raise: 2 chips in round 1, 4 in round 2, two "
                   "raises a round at most. A pair with the public card wins, else the higher card.",
}


def first_action(game: str, text: str, legal) -> int | None:
    """The action the first action word of ``text`` names among ``legal`` (Kuhn's yes means bet or call, no means
    pass or fold), or None when it names none."""
    return next((WORDS[game][w] for w in re.findall(r"[a-z]+", text.lower())
                 if w in WORDS[game] and WORDS[game][w] in legal), None)


def _rng(seed: int, *key: Any) -> random.Random:
    """A random stream of its own for each decision of a hand, so that replaying the hand draws the same."""
    return random.Random(int.from_bytes(hashlib.sha256(repr((seed, *key)).encode()).digest()[:8], "big"))


def opponent_action(state: Any, game: str, seed: int, opponent: str = "mixed") -> int:
    """The fixed opponent's action at ``state`` (module doc), drawn from the hand's seed and history."""
    player, legal = state.current_player(), state.legal_actions()
    rng = _rng(seed, "opponent", tuple(state.history()))
    if game == "kuhn_poker":
        info = state.information_state_string(player)
        card, history = int(info[0]), info[1:]
        if opponent == "station":  # calls every bet, bets only the King
            return 1 if history.endswith("b") or card == 2 else 0
        spot = "facing_bet" if history.endswith("b") else ("after_pass" if history else "open")
        return 1 if rng.random() < OPPONENT[spot][card] else 0
    rank = state.private_card(player) // 2
    public = state.public_card()
    pair = public >= 0 and public // 2 == rank
    if opponent == "station":  # calls (checks) every time, raises only a pair
        return 2 if pair and 2 in legal else 1
    facing = 0 in legal  # fold is legal only facing a raise
    if pair or rank == 2:
        return 2 if 2 in legal else 1
    if rank == 1:
        return 1
    if facing:
        return 0 if rng.random() < 2 / 3 else 1
    return 2 if 2 in legal and rng.random() < 0.25 else 1


class Hand:
    """One hand of ``game`` from ``seed``, the model in ``seat`` (0 or 1): chance and the opponent are played out to
    the model's turn, each step's events kept as text."""

    def __init__(self, game: str, seed: int, seat: int, opponent: str = "mixed"):
        import pyspiel

        if game not in GAMES:
            raise ValueError(f"task.game={game!r}: expected one of {GAMES}")
        if opponent not in OPPONENTS:
            raise ValueError(f"task.opponent={opponent!r}: expected one of {OPPONENTS}")
        self.game, self.seed, self.seat, self.opponent = game, seed, seat, opponent
        self.state = pyspiel.load_game(game).new_initial_state()
        self.events: list[str] = []
        self.advance()

    def _card(self, card: int) -> str:
        return RANKS[card if self.game == "kuhn_poker" else card // 2]

    def advance(self) -> None:
        """Play chance and the opponent until the model's turn or the end; say what happened."""
        s = self.state
        while not s.is_terminal() and (s.is_chance_node() or s.current_player() != self.seat):
            if s.is_chance_node():
                outcomes = [a for a, _ in s.chance_outcomes()]
                k = len(s.history())
                action = _rng(self.seed, "deal", k).choice(outcomes)
                dealt = k >= 2  # the first two outcomes are the private cards
                s.apply_action(action)
                if dealt:
                    self.events.append(f"The public card is a {self._card(action)}.")
            else:
                action = opponent_action(s, self.game, self.seed, self.opponent)
                self.events.append(f"The opponent {self._verb(action)}.")
                s.apply_action(action)

    def _word(self, action: int) -> str:
        """An action's word at the current state (Leduc's call with nothing to call is a check)."""
        name = NAMES[self.game][action]
        return "check" if self.game == "leduc_poker" and name == "call" and 0 not in self.state.legal_actions() \
            else name

    def _verb(self, action: int) -> str:
        return {"pass": "passes", "bet": "bets", "fold": "folds", "call": "calls", "check": "checks",
                "raise": "raises"}[self._word(action)]

    def situation(self) -> str:
        """What the model sees at its turn: the events since its last move, its card, the public card, the pot, the
        actions it may take."""
        s = self.state
        card = s.private_card(self.seat) if self.game == "leduc_poker" else int(
            s.information_state_string(self.seat)[0])
        public = s.public_card() if self.game == "leduc_poker" else -1
        parts = self.events + [f"You hold the {self._card(card)}."]
        if public >= 0:
            parts.append(f"The public card is a {self._card(public)}.")
        if self.game == "kuhn_poker":  # a yes/no question (module doc)
            facing = "b" in s.information_state_string(self.seat)[1:]
            parts.append(f"Do you {'call' if facing else 'bet'}? Answer yes or no.")
        else:
            words = [self._word(a) for a in s.legal_actions()]
            parts.append(f"Your move: {' or '.join(words)}? Answer with one word.")
        self.events = []
        return " ".join(parts)

    def play(self, text: str) -> str:
        """Play the model's answer (the first action word in it; none: fold, or check); returns a note when the
        answer was not an action."""
        legal = self.state.legal_actions()
        action = first_action(self.game, text, legal)
        note = ""
        if action is None:
            action = 0 if 0 in legal else 1
            note = f"(No action in your answer: you {self._word(action)}.) "
        self.state.apply_action(action)
        self.advance()
        return note

    def chips_won(self) -> float:
        """The model's chips won; a hand not over yet is folded (or checked down) first."""
        while not self.state.is_terminal():
            self.play("")
        return float(self.state.returns()[self.seat])


class PokerEnv(BaseTextEnv):
    """The hand as a SkyRL-gym text environment: constructed with the row as ``extras`` (game, seed, seat); the
    row's prompt already shows the model's first decision; each step plays an answer and shows the next one."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] = {}):  # noqa: B006 (SkyRL's signature)
        super().__init__()
        self.hand = Hand(str(extras["game"]), int(extras["seed"]), int(extras["seat"]),
                         str(extras.get("opponent") or "mixed"))
        self.max_turns = int(extras.get("max_turns") or 100)

    def init(self, prompt: list[dict]) -> tuple[list[dict], dict]:
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        note = self.hand.play(action)
        done = self.hand.state.is_terminal()
        reward = float(self.hand.state.returns()[self.hand.seat]) if done else 0.0
        observations = [] if done else [{"role": "user", "content": note + self.hand.situation()}]
        return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done, metadata={})


def replay(game: str, seed: int, seat: int, answers: list[str], opponent: str = "mixed") -> float:
    """The chips the model won with ``answers`` (its turns, in order) in the hand of ``seed``."""
    hand = Hand(game, seed, seat, opponent)
    for text in answers:
        if hand.state.is_terminal():
            break
        hand.play(text)
    return hand.chips_won()


def chips_won(completions: list[list[dict]], game: list[str], seed: list[int], seat: list[int],
              opponent: list[str] | None = None, **kwargs: Any) -> list[float]:
    """The reward: each hand replayed from its row and the model's answers in the transcript (module doc)."""
    out = []
    for messages, g, s, p, o in zip(completions, game, seed, seat, opponent or ["mixed"] * len(completions),
                                    strict=True):
        answers = [m.get("content") or "" for m in messages if m.get("role") == "assistant"]
        out.append(replay(g, int(s), int(p), [a if isinstance(a, str) else "" for a in answers], o))
    return out


class PokerTask(DatasetTask):
    def __init__(self, game: str = "kuhn_poker", train_size: int = 5000, eval_size: int = 200, seed: int = 0,
                 max_completion_length: int = 128, max_turns: int = 8, max_turn_tokens: int | None = None,
                 system_prompt: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 environment_timeout_s: float = 10.0, opponent: str = "mixed"):
        if game not in GAMES:
            raise ValueError(f"task.game={game!r}: expected one of {GAMES}")
        if opponent not in OPPONENTS:
            raise ValueError(f"task.opponent={opponent!r}: expected one of {OPPONENTS}")
        self.game, self.train_size, self.opponent = game, train_size, opponent
        super().__init__(reward_funcs=["echo2.tasks.poker.chips_won"], eval_reward="chips_won", eval_threshold=1e-9,
                         eval_size=eval_size, eval_split="test", system_prompt=system_prompt,
                         chat_template_kwargs=chat_template_kwargs, max_completion_length=max_completion_length,
                         seed=seed, environment="echo2.tasks.poker:PokerEnv", max_turns=max_turns,
                         max_turn_tokens=max_turn_tokens,
                         environment_timeout_s=environment_timeout_s, environment_reward=False)
        self.name = f"poker:{game}" + ("" if opponent == "mixed" else f":{opponent}")

    def _row(self, hand_seed: int) -> dict[str, Any]:
        seat = hand_seed % 2
        hand = Hand(self.game, hand_seed, seat, self.opponent)
        return {"prompt": [{"role": "user", "content": f"{RULES[self.game]} You are player {seat + 1}. "
                                                       f"{hand.situation()}"}],
                "game": self.game, "seed": hand_seed, "seat": seat, "opponent": self.opponent}

    def source(self) -> Any:
        from datasets import Dataset, DatasetDict

        def rows(n: int, start: int) -> Dataset:
            return Dataset.from_list([self._row(start + i) for i in range(n)])

        # hands are numbered: the held-out ones far from any training hand a sweep's seeds would reach
        first = self.seed * self.train_size
        return DatasetDict(train=rows(self.train_size, first), test=rows(self.eval_size, 10**9 + first))
