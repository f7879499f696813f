"""One rollout's environment, behind the two contracts (contracts.py): started from the dataset row, answering each
model turn with observation messages (or ending the episode), and giving its reward and state at the end.

    start(row) -> the conversation the model starts from
    act(turn)  -> observation messages, or None when the episode is over (turn: the model's parsed message and text);
                  ``done`` set: the episode is over after these (SkyRL's last observations, appended without a
                  generation prompt, as SkyRL's generator appends them)
    finish()   -> the environment's own reward (None: none), then its public state; closes it (``metrics``: what
                  SkyRL's ``get_metrics()`` gave, read first)

Each call into the environment goes through the ``Calls`` the session is handed (the environment's own thread, its
time limit; the episode that opens a session closes it if the session fails to start); an ``EnvironmentFailed`` out
of any of them ends the trajectory. After ``finish`` the episodes (episode.py) keep a TRL environment that ended
cleanly, with its thread, for a later rollout's ``reset`` (TRL pools its instances), and end any other's thread.
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
from typing import Any

from echo2.tasks.environments.contracts import (Calls, EnvironmentFailed, EpisodeSpec, Overran, factory_name,
                                                public_state, tool_names)
from echo2.tasks.rewards import is_async

log = logging.getLogger(__name__)


class TrlSession:
    """TRL's environment_factory contract (or plain tools without an environment), as GRPOTrainer runs it."""

    done = False  # TRL's episode ends when a turn calls no tool (act returns None)
    metrics: dict = {}
    generation = 0  # the event loop generation its environment was made under (episode.py's pool)

    def __init__(self, spec: EpisodeSpec, env_cls: type | None, tools: list[Any], calls: Calls, env: Any = None):
        """``env``: an instance from the pool (made by ``calls``' thread for an earlier rollout), reset for this one."""
        self.spec, self.calls = spec, calls
        if env is None and env_cls is not None:
            env = calls.call(f"{factory_name(env_cls)}()", spec.timeout_s, env_cls)
        self.env = env
        methods = [getattr(self.env, name) for name in tool_names(type(self.env))] if env_cls else []
        self.tools = {t.__name__: t for t in [*tools, *methods]}
        self.tool_calls = self.tool_errors = 0

    def start(self, row: dict[str, Any]) -> list[dict]:
        """The row's prompt, with what ``reset(**row)`` returned appended to its last message (TRL's rule)."""
        prompt = copy.deepcopy(row["prompt"])
        if self.env is None:
            return prompt
        observation = self.calls.call("reset", self.spec.timeout_s, self.env.reset, **row)
        if observation is not None:
            content = prompt[-1]["content"]
            if isinstance(observation, list) and isinstance(content, str):
                content = [{"type": "text", "text": content}]
            if isinstance(observation, str) and isinstance(content, list):
                observation = [{"type": "text", "text": observation}]
            prompt[-1] = {**prompt[-1], "content": content + observation}
        return prompt

    def act(self, message: dict, text: str) -> list[dict] | None:
        """Run the turn's tool calls as TRL runs them: sync tools one after another, then the async ones together;
        one tool message each, the sync tools' first (TRL's order), ``{"error": ...}`` for an unknown tool, an
        unsupported call or a tool that raised; None when the turn called no tool (the episode is over)."""
        calls = message.get("tool_calls")
        if not calls:
            return None
        out, pending = [], []
        for call in calls:
            self.tool_calls += 1
            if call.get("type") != "function":
                self.tool_errors += 1
                out.append(_tool_message(call.get("name", "unknown"),
                                         {"error": f"Unsupported tool call type: {call.get('type')}"}))
                continue
            name, args = call["function"]["name"], call["function"].get("arguments") or {}
            try:
                if name not in self.tools:
                    raise ValueError(f"Tool {name} not found.")
                if is_async(self.tools[name]):
                    pending.append((name, self.tools[name](**args)))  # a coroutine: nothing runs yet
                    continue
                result = self.calls.call(f"tool {name}", self.spec.timeout_s, self.tools[name], **args)
            except Overran:
                for _, coroutine in pending:  # the episode ends here: they are never awaited
                    coroutine.close()
                raise
            except (EnvironmentFailed, ValueError, TypeError) as e:
                self.tool_errors += 1
                result = {"error": str(e.__cause__ if isinstance(e, EnvironmentFailed) and e.__cause__ else e)}
            out.append(_tool_message(name, result))
        if pending:
            names = ", ".join(name for name, _ in pending)
            results = self.calls.gather(f"tools {names}", self.spec.timeout_s, [c for _, c in pending])
            for (name, _), result in zip(pending, results, strict=True):
                if isinstance(result, Exception):
                    self.tool_errors += 1
                    result = {"error": str(result)}
                out.append(_tool_message(name, result))
        return out

    def finish(self) -> tuple[float | None, dict]:
        reward = None
        if self.env is not None and callable(getattr(self.env, "get_reward", None)):
            value = self.calls.call("get_reward", self.spec.timeout_s, self.env.get_reward)
            try:
                reward = None if value is None else float(value)
            except (TypeError, ValueError, OverflowError) as e:
                raise EnvironmentFailed(f"get_reward returned {type(value).__name__}, not a number: {e}") from e
        return reward, public_state(self.env) if self.env is not None else {}

    def reusable(self) -> Any:
        """The instance, for the next rollout's ``reset`` (TRL's pool: construct once, reset often); None: none."""
        return self.env


def _tool_message(name: str, result: Any) -> dict:
    """TRL's tool message: a list result (content blocks) as it is, anything else as text."""
    return {"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}


class SkyrlSession:
    """A SkyRL-gym BaseTextEnv, constructed and stepped as SkyRL's generator does."""

    warned_postprocessed = False
    done = False
    metrics: dict = {}
    generation = 0

    def __init__(self, spec: EpisodeSpec, env_cls: type, row: dict[str, Any], calls: Calls):
        from omegaconf import OmegaConf

        self.spec, self.calls = spec, calls
        extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
        if spec.max_turns is not None:
            extras["max_turns"] = spec.max_turns  # SkyRL's generator hands its max_turns the same way
        config = OmegaConf.create(spec.config_of(spec.environment_of(row)))
        self.env = calls.call(f"{env_cls.__name__}(env_config, extras)", spec.timeout_s, env_cls,
                              env_config=config, extras=extras)
        self.rewards: list[float] = []
        self.metadata: dict = {}
        self.tool_calls = self.tool_errors = 0

    def start(self, row: dict[str, Any]) -> list[dict]:
        conversation, _ = self.calls.call("init", self.spec.timeout_s, self.env.init, copy.deepcopy(row["prompt"]))
        return conversation

    def act(self, message: dict, text: str) -> list[dict] | None:
        out = self.calls.call("step", self.spec.timeout_s, self.env.step, text)
        try:
            reward = None if out.get("reward") is None else float(out["reward"])
            self.metadata = dict(out.get("metadata") or {})
        except (AttributeError, TypeError, ValueError, OverflowError) as e:
            raise EnvironmentFailed(f"step returned what BaseTextEnvStepOutput is not ({type(e).__name__}: {e})") from e
        if reward is not None:
            self.rewards.append(reward)
        if out.get("postprocessed_action") is not None and not SkyrlSession.warned_postprocessed:
            SkyrlSession.warned_postprocessed = True  # token in, token out: the model's own tokens are kept
            log.warning("a SkyRL environment returned postprocessed_action: ignored (the trajectory keeps the tokens "
                        "the model generated)")
        self.done = bool(out.get("done"))
        return list(out.get("observations") or [])

    def finish(self) -> tuple[float | None, dict]:
        # as SkyRL's generator: the episode's metrics, then close; a failure of either leaves the reward standing
        for name in ("get_metrics", "close"):
            if callable(method := getattr(self.env, name, None)):
                try:
                    value = self.calls.call(name, self.spec.timeout_s, method)
                except EnvironmentFailed as e:
                    log.warning("%s", e)
                    continue
                if name == "get_metrics":
                    self.metrics = episode_metrics(value)
        state = public_state(self.env)
        state.pop("tool_groups", None), state.pop("tool_to_toolgroup", None)
        return (sum(self.rewards) if self.rewards else None), state

    def reusable(self) -> None:
        """None: SkyRL's generator makes an environment for every trajectory (``skyrl_gym.make``), closed after it."""
        return None


MAX_METRICS = 32  # an episode's metrics kept (SkyRL's get_metrics): names of at most 64 characters, numbers
METRIC_BOUND = 1e12  # and of at most this magnitude (what the coordinator takes: coordinator/results.py)


def episode_metrics(metrics: Any) -> dict[str, float]:
    """The numeric entries of what ``get_metrics()`` returned (SkyRL's default aggregation averages those alone;
    numpy's numbers too), booleans as 0/1, at most MAX_METRICS of them; one the coordinator would refuse (not finite,
    beyond METRIC_BOUND, a name over 64 characters) is left out, so that an honest environment's odd metric never
    gets its worker's groups refused."""
    out: dict[str, float] = {}
    for name, value in (metrics or {}).items() if isinstance(metrics, dict) else ():
        if len(out) >= MAX_METRICS or not (isinstance(name, str) and len(name) <= 64
                                           and isinstance(value, numbers.Real)):
            continue
        try:
            number = float(value)
        except (OverflowError, ValueError):
            continue
        if math.isfinite(number) and abs(number) <= METRIC_BOUND:
            out[name] = number
    return out


def open_session(spec: EpisodeSpec, env_cls: type | None, tools: list[Any], row: dict[str, Any],
                 calls: Calls, env: Any = None) -> Any:
    """One rollout's environment, called through ``calls``: SkyRL's made new; TRL's ``env`` (a pooled instance, made
    on ``calls``' thread) or a new one. One instance serves one rollout at a time, as in both trainers."""
    if spec.contract == "skyrl":
        return SkyrlSession(spec, env_cls, row, calls)
    return TrlSession(spec, env_cls, tools, calls, env)
