"""Reward functions "of a user's own module", named by import path in the tests (``own_rewards.exact``): each uses a
part of what TRL hands a reward function. Importable from every test folder and in the coordinator's reward
processes (tests/ is on their path, as conftest.py is)."""

from __future__ import annotations

import asyncio
import re


def _text(completion) -> str:
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def exact(prompts, completions, answer, **kwargs):
    """1 when the completion starts with the answer, 0 otherwise; None (cannot score) when the row has no answer."""
    return [None if a in (None, "") else float(_text(c).strip().startswith(str(a))) for c, a in zip(completions, answer)]


def schedule(completions, trainer_state, log_metric, log_extra, difficulty=None, **kwargs):
    """Uses TRL's extras: the step (trainer_state.global_step) as the reward, a logged metric and an extra column."""
    log_metric("schedule_step", float(trainer_state.global_step))
    log_extra("seen_step", [trainer_state.global_step] * len(completions))
    return [float(trainer_state.global_step)] * len(completions)


class _Client:
    """A client made at import time that, like httpx.AsyncClient or AsyncOpenAI's pool, is bound to the first event
    loop it runs on and fails on any other."""

    loop = None

    async def ask(self, text: str) -> float:
        loop = asyncio.get_running_loop()
        if self.loop is not None and self.loop is not loop:
            raise RuntimeError("Event loop is closed")  # what a pooled connection of the first loop says
        self.loop = loop
        await asyncio.sleep(0)
        return float(len(text))


CLIENT = _Client()


async def llm_judge(completions, **kwargs):
    """An LLM judge as TRL users write one: a module-level async client, called once per batch."""
    return [await CLIENT.ask(c) for c in completions]


async def judge(completions, **kwargs):
    """An async reward (a judge over the network, say)."""
    await asyncio.sleep(0)
    return [float(len(re.findall(r"\d", _text(c)))) for c in completions]


def broken(completions, **kwargs):
    raise ZeroDivisionError("a bug in a reward function")


def too_few(completions, **kwargs):
    return [1.0]


def scaled(completions, scale: float = 1.0, **kwargs):
    """A function with an argument bound in the config ({_target_: own_rewards.scaled, _partial_: true, scale: ...})."""
    return [scale] * len(completions)
