"""Environments and tools written for TRL and SkyRL-gym, not for echo2 (the tests run them unchanged), and a scripted
policy that calls their tools: importable from every test folder, the worker agents and the reward processes
(tests/ is on their path, as conftest.py is)."""

from __future__ import annotations

import json
import re
import time

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class CounterEnv:
    """TRL's environment_factory contract, as TRL's documentation writes one: reset(**row) may add to the prompt,
    public methods are tools (typed, with an Args: docstring), get_reward() reads the final state."""

    def reset(self, **kwargs) -> str | None:
        self.total = 0
        self.target = int(kwargs["target"])
        self.history: list[int] = []
        return f" Reach {self.target}."

    def increment(self, step: int) -> str:
        """Add a step to the running total.

        Args:
            step: How much to add to the total.

        Returns:
            The new total.
        """
        self.total += step
        self.history.append(step)
        return f"total={self.total}"

    def get_reward(self) -> float:
        return float(self.total == self.target)


class FlakyEnv(CounterEnv):
    """Breaks the way real environments break: reset raises for target 13, a step of 9 hangs, a step of 7 raises."""

    def reset(self, **kwargs) -> str | None:
        if int(kwargs["target"]) == 13:
            raise RuntimeError("no such level")
        return super().reset(**kwargs)

    def increment(self, step: int) -> str:
        """Add a step to the running total.

        Args:
            step: How much to add to the total.
        """
        if step == 9:
            time.sleep(30)
        if step == 7:
            raise ValueError("step 7 is not allowed")
        return super().increment(step)


class LedgerEnv(CounterEnv):
    """A TRL environment that keeps its state in a sqlite3 connection opened in __init__, as environments over a
    database do: sqlite3 refuses a connection used from another thread than the one that made it, so this runs only
    where every call into one instance is on one thread (TRL's trainer thread)."""

    def __init__(self):
        import sqlite3

        self.db = sqlite3.connect(":memory:")
        self.db.execute("create table steps (step integer)")

    def reset(self, **kwargs) -> str | None:
        self.db.execute("delete from steps")  # TRL reuses an instance for later rollouts: reset clears what it holds
        return super().reset(**kwargs)

    def increment(self, step: int) -> str:
        """Add a step to the running total.

        Args:
            step: How much to add to the total.
        """
        self.db.execute("insert into steps values (?)", (step,))
        self.total = self.db.execute("select sum(step) from steps").fetchone()[0]
        self.history.append(step)
        return f"total={self.total}"


LOOPS: list = []  # the event loop each async call ran on (a client bound to one loop needs it to be the same)


class AsyncCounterEnv(CounterEnv):
    """A TRL environment with an async tool beside a sync one: TRL answers a turn's sync calls first, then gathers
    the async ones on its one event loop."""

    async def double(self) -> str:
        """Double the running total."""
        import asyncio

        LOOPS.append(asyncio.get_running_loop())
        await asyncio.sleep(0)
        if self.total > 100:
            raise ValueError("too large to double")
        self.total *= 2
        return f"total={self.total}"


class CountedEnv(FlakyEnv):
    """Counts its instances and the rollouts each served (TRL pools instances: construct once, reset often)."""

    made = 0

    def __init__(self):
        CountedEnv.made += 1
        self.serial, self.rollouts = CountedEnv.made, 0

    def reset(self, **kwargs) -> str | None:
        self.rollouts += 1
        return super().reset(**kwargs)


class DrawEnv(CounterEnv):
    """A TRL environment that owns its data (GRPOTrainer without a train_dataset): reset draws the target itself and
    says it, the row being an empty prompt."""

    draws = __import__("random").Random(0)

    def reset(self, **kwargs) -> str | None:
        return super().reset(target=self.draws.choice((4, 5)))


class SumEnv:
    """A second TRL environment, with a tool of its own (``add``), for a task of several environments by name."""

    def reset(self, **kwargs) -> str | None:
        self.keys, self.total, self.target = sorted(kwargs), 0, int(kwargs["target"])
        return f" Sum to {self.target}."

    def add(self, a: int, b: int) -> str:
        """Add two numbers to the sum.

        Args:
            a: The first number.
            b: The second number.
        """
        self.total += a + b
        return f"sum={self.total}"

    def get_reward(self) -> float:
        return float(self.total == self.target)


class PlainEnv(CounterEnv):
    """A TRL environment without a reward of its own."""

    get_reward = None


def make_counter() -> CounterEnv:
    """An environment_factory that is not a class (TRL takes any callable)."""
    return CounterEnv()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def reach_target(completions, target, environments=None, **kwargs):
    """A reward recomputed from the transcript: the sum of the steps the model called increment with."""
    out = []
    for messages, t in zip(completions, target):
        steps = [c["function"]["arguments"].get("step", 0) for m in messages for c in (m.get("tool_calls") or [])
                 if c["function"]["name"] == "increment"]
        out.append(float(sum(steps) == int(t)))
    return out


def env_history(completions, environments, **kwargs):
    """Reads the environment as TRL hands it: its public attributes (history) and get_reward()."""
    return [float(len(e.history)) + e.get_reward() for e in environments]


class ScriptedPolicy:
    """A deterministic policy over a tokenizer with Qwen3's markup: at turn k of an episode it calls
    ``increment(step)`` with the k-th of ``steps`` (or ``add`` when ``tool="add"``), then answers "done".
    ``generate(ids, params)`` is an engine's: one completion per prompt, logprob -0.5 per token."""

    def __init__(self, tokenizer, steps=(2, 3), tool="increment", stop_after: int | None = None):
        self.tok, self.steps, self.tool, self.stop_after = tokenizer, list(steps), tool, stop_after
        self.calls = 0

    def text(self, context: str) -> str:
        k = context[context.find("<|im_start|>user"):].count("<tool_response>")  # tool answers so far
        if k < len(self.steps) and (self.stop_after is None or k < self.stop_after):
            args = {"step": self.steps[k]} if self.tool == "increment" else {"a": 2, "b": self.steps[k]}
            return f"<tool_call>\n{json.dumps({'name': self.tool, 'arguments': args})}\n</tool_call><|im_end|>"
        return "done<|im_end|>"

    def generate(self, prompt_ids, params):
        from echo2.records import Completion

        self.calls += 1
        out = []
        for ids in prompt_ids:
            text = self.text(self.tok.decode(ids))
            new = self.tok(text, add_special_tokens=False)["input_ids"][:params.max_tokens]
            finish = "stop" if new and new[-1] == self.tok.eos_token_id else "length"
            out.append([Completion(new, [-0.5] * len(new), finish)] * params.n)
        return out


class OddRewardEnv(CounterEnv):
    """get_reward answers what is not a number (for target 13)."""

    def get_reward(self):
        return "full marks" if self.target == 13 else super().get_reward()


class EitherPolicy(ScriptedPolicy):
    """Calls whichever tool its prompt shows: increment(step) or add(a=2, b=step)."""

    def text(self, context: str) -> str:
        self.tool = "increment" if '"name": "increment"' in context else "add"
        return super().text(context)


class SplitPolicy(EitherPolicy):
    """EitherPolicy whose completions of one prompt differ: the first starts with a step of 2, the second with 1 (the
    second of ``n``, or the second time the same prompt comes in one call, as TRL sends a group's copies), each
    then steps 3. So a group's rewards differ and its advantages are not zero. A later turn reads its variant from
    the episode's first tool call."""

    def generate(self, prompt_ids, params):
        from collections import Counter

        from echo2.records import Completion

        self.calls += 1
        seen: Counter = Counter()
        out = []
        for ids in prompt_ids:
            context, group = self.tok.decode(ids), []
            for _ in range(params.n):
                first = re.search(r'"(?:step|b)": (\d+)', context[context.find("<|im_start|>assistant"):])
                variant = int(first.group(1)) if first else (2 if seen[context] % 2 == 0 else 1)
                seen[context] += 1
                self.steps = [variant, 3]
                new = self.tok(self.text(context), add_special_tokens=False)["input_ids"][:params.max_tokens]
                finish = "stop" if new and new[-1] == self.tok.eos_token_id else "length"
                group.append(Completion(new, [-0.5] * len(new), finish))
            out.append(group)
        return out


class StepsEnv(BaseTextEnv):
    """SkyRL-gym's contract, written as SkyRL's documentation writes one: each step answers with a short observation,
    rewards 1 when the model's text is the row's ``reward_spec["ground_truth"]``, and is done after
    ``extras["max_turns"]`` steps (default 3)."""

    def __init__(self, env_config=None, extras={}):
        super().__init__()
        self.ground_truth = extras["reward_spec"]["ground_truth"]
        self.max_turns = int(extras.get("max_turns", 3))
        self.suffix = str((env_config or {}).get("suffix", ""))

    def init(self, prompt):
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        done = self.turns >= self.max_turns
        reward = float(action.strip() == self.ground_truth)
        observations = [] if done else [{"role": "user", "content": f"{self.turns}{self.suffix}"}]
        return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done, metadata={})


class VerdictEnv(StepsEnv):
    """StepsEnv, but its last step answers too (SkyRL appends observations that come with ``done``, without a
    generation prompt), and it reports metrics of its own (SkyRL's ``get_metrics``, read after the episode)."""

    def step(self, action: str) -> BaseTextEnvStepOutput:
        out = super().step(action)
        if out["done"]:
            out["observations"] = [{"role": "user", "content": "final"}]
        return out

    def get_metrics(self):
        return {"steps": self.turns, "solved": self.turns == 3, "note": "not a number", "big": float("inf")}
