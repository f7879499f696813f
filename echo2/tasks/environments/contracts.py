"""The two environment contracts, each driven as its own trainer drives it, and the plain-data spec a run ships.

* TRL's (``GRPOTrainer(environment_factory=...)``): a class, or any factory, called with no argument, one instance per
  rollout at a time, kept after a clean episode and reset for a later one (TRL's pool: construct once, reset often;
  a factory that is not a class is probed once, as TRL probes it, to read its instances' class);
  ``reset(**row)`` returns ``None`` or text appended to the prompt's last message; every public method (not ``reset``,
  not ``get_reward``, not ``_private``) is a tool, its schema read from its type hints and docstring; an optional
  ``get_reward()`` is the environment's own reward, read once the episode is over. Plain ``tools`` (functions) work
  the same way without an environment. A tool that raises is answered ``{"error": "..."}``, as TRL answers it.
* SkyRL-gym's ``BaseTextEnv``: constructed as SkyRL's generator constructs it, ``Env(env_config=..., extras=row)`` with
  the dataset row (its prompt aside) as ``extras`` and ``extras["max_turns"]``; ``init(prompt)`` gives the first
  conversation, ``step(text)`` the observations (chat messages), a reward, ``done`` and metadata; ``close()`` at the end.

They are told apart by the class: a ``skyrl_gym`` ``BaseTextEnv`` subclass (or any class with ``init`` and ``step``
and no ``reset``) is SkyRL's; one with ``reset`` is TRL's.

Every call into an environment runs with a time limit (``timeout_s``) on the environment's own thread (``Calls``:
one thread an environment, as TRL calls an environment on one thread), its coroutines on the process's one event
loop: a call that raises or overruns ends its trajectory with the reason (``EnvironmentFailed``); a thread that never
returns is abandoned (Python cannot stop it), and so is its environment.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import queue
import threading
import time
import types
from dataclasses import asdict, dataclass, field
from typing import Any

from echo2.tasks.rewards import event_loop, import_object, replace_if_wedged

MAX_STATE_VALUE_CHARS = 4096
"""An environment attribute longer than this (as JSON) is not reported to the reward functions."""
MAX_STATE_CHARS = 65536
"""All the attributes of one environment reported to the reward functions, as JSON."""


class EnvironmentFailed(RuntimeError):
    """An environment raised, or overran its time limit: its trajectory ends here (the reason is booked)."""


class Overran(EnvironmentFailed):
    """A call into an environment did not return within its time limit (a tool that raises is answered with its error,
    as TRL does; one that hangs ends the trajectory)."""


@dataclass(frozen=True)
class EpisodeSpec:
    """What a run's workers (and the learner, for rollout=sync) need to run its episodes: plain data, sent to each
    worker when it registers. ``environment`` and ``tools`` are import paths (installed where the episodes run);
    ``tool_schemas`` what the chat template renders (read once, in the learner); ``chat_template`` the prefix-preserving
    template TRL trains with when the model's own is not (None: the model's)."""

    contract: str  # "trl" (an environment_factory class, or plain tools) or "skyrl"
    environment: str | None
    tools: tuple[str, ...]
    tool_schemas: tuple[dict, ...]
    max_completion_length: int  # the token budget of a whole episode: model and environment tokens, all turns
    max_turns: int | None = None  # model turns per episode (TRL: max_tool_calling_iterations + 1); None: no limit
    max_turn_tokens: int | None = None  # tokens one model turn may have (SkyRL: max_generate_length); None: the budget's
    timeout_s: float = 60.0  # each call into the environment or a tool
    environment_config: dict = field(default_factory=dict)  # SkyRL's env_config
    chat_template: str | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    environment_reward: str | None = None  # the reward column of the environment's own reward (its class name)
    # several environments, {name: import path}: each row's ``selector`` column picks one (TRL's dict
    # environment_factory, SkyRL's env_class); then ``environment`` is None, ``tool_schemas`` the plain tools' alone,
    # ``environment_reward`` None
    environments: dict = field(default_factory=dict)
    environment_tool_schemas: dict = field(default_factory=dict)  # {name: the plain tools' schemas and its tools'}
    environment_rewards: dict = field(default_factory=dict)  # {name: its reward column (class name), or None}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EpisodeSpec":
        d = dict(d)
        d["tools"], d["tool_schemas"] = tuple(d.get("tools") or ()), tuple(d.get("tool_schemas") or ())
        d["environment_tool_schemas"] = {k: tuple(v) for k, v in (d.get("environment_tool_schemas") or {}).items()}
        return cls(**d)

    # Each row's environment: the task's one, or, with several, the one its column names (TRL's dict
    # environment_factory: ``environment``; SkyRL: ``env_class``); None names the task's one.

    @property
    def selector(self) -> str:
        """The column a row names its environment in, among several: TRL's ``environment``, SkyRL's ``env_class``."""
        return "env_class" if self.contract == "skyrl" else "environment"

    def environment_of(self, row: dict[str, Any] | None) -> str | None:
        """The name of ``row``'s environment (None: the task's one environment, or plain tools). ValueError if the
        row names none of the task's several."""
        if not self.environments:
            return None
        name = (row or {}).get(self.selector)
        name = None if name is None else str(name)  # as the load check compares them (config keys are strings)
        if name not in self.environments:
            raise ValueError(f"a row's {self.selector} column is {name!r}: the task's environments are "
                             f"{', '.join(sorted(self.environments))} (task.environment)")
        return name

    def config_of(self, name: str | None) -> dict:
        """SkyRL's env_config of environment ``name``: among several, ``environment_config``'s entry by that name
        (SkyRL's ``skyrl_gym[env_class]``), else the task's one."""
        return dict(self.environment_config.get(name) or {}) if name is not None else dict(self.environment_config)

    def path(self, name: str | None) -> str | None:
        return self.environments[name] if name is not None else self.environment

    def schemas(self, name: str | None) -> tuple[dict, ...]:
        """The tools a prompt of environment ``name`` is rendered with (TRL shows each example its own)."""
        return tuple(self.environment_tool_schemas[name]) if name is not None else self.tool_schemas

    def reward_column(self, name: str | None) -> str | None:
        """The reward column of environment ``name``'s own reward (None: it has none, or it is not scored)."""
        return self.environment_rewards.get(name) if name is not None else self.environment_reward

    def reward_columns(self) -> list[str]:
        """Every environment's reward column, once each (two names of one class share one, as in TRL)."""
        columns = [self.environment_reward] + list(self.environment_rewards.values())
        return list(dict.fromkeys(c for c in columns if c))


def contract_of(cls: type) -> str:
    """``skyrl`` or ``trl``, by the class (module doc)."""
    try:
        from skyrl_gym.envs.base_text_env import BaseTextEnv

        if isinstance(cls, type) and issubclass(cls, BaseTextEnv):
            return "skyrl"
    except ImportError:
        pass
    if callable(getattr(cls, "reset", None)):
        return "trl"
    if callable(getattr(cls, "init", None)) and callable(getattr(cls, "step", None)):
        return "skyrl"
    raise TypeError(f"{cls.__module__}.{cls.__qualname__} is neither a TRL environment (a class with reset(**row) and "
                    "tool methods) nor a SkyRL-gym BaseTextEnv (init(prompt), step(action))")


def tool_names(cls: type) -> list[str]:
    """TRL's tools of an environment class: its public functions but ``reset`` and ``get_reward``, in name order
    (TRL lists them with inspect.getmembers on the class)."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def tool_schema(func: Any) -> dict:
    """The JSON schema the chat template renders for a tool, as transformers derives it from the type hints and the
    docstring's ``Args:`` (what TRL hands apply_chat_template). An unbound method is read as bound (no ``self``)."""
    from transformers.utils import get_json_schema

    params = list(inspect.signature(func).parameters)
    if params[:1] == ["self"]:
        func = types.MethodType(func, object())
    return get_json_schema(func)


def environment_path(name: str) -> str:
    """An environment's import path: ``name`` itself, or, for a bare SkyRL-gym id (``gsm8k``, as SkyRL names an
    environment in its config and in a row's ``env_class``), the entry point SkyRL-gym registered it under."""
    if ":" in name or "." in name:
        return name
    try:
        from skyrl_gym.envs.registration import registry
    except ImportError:
        raise ValueError(f"task.environment={name!r}: not an import path (package.module:Class), and skyrl-gym, "
                         "whose registered environments a bare name would be, is not installed") from None
    if name not in registry:
        raise ValueError(f"task.environment={name!r}: not an import path (package.module:Class) nor an environment "
                         f"SkyRL-gym registers ({', '.join(sorted(registry))})")
    entry = registry[name].entry_point
    return entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"


def spec_for(environment: str | dict[str, str] | None, tools: list[str], max_completion_length: int,
             **options: Any) -> EpisodeSpec:
    """The spec of a task's episodes: the contract and tool schemas read from the classes and functions named.
    ``environment``: an import path, or several, ``{name: import path}``, all of one contract: TRL's dict
    ``environment_factory`` (each row's ``environment`` column picks one) or SkyRL's environments by the ``env_class``
    its rows name (a name may be a SkyRL-gym registered id)."""
    standalone = [import_object(t) for t in tools]
    schemas = [tool_schema(t) for t in standalone]
    timeout_s = options.get("timeout_s", EpisodeSpec.timeout_s)
    if isinstance(environment, dict):
        if not environment:
            raise ValueError("task.environment={}: name at least one environment (name: package.module:Class)")
        paths, own_schemas, rewards, contracts = {}, {}, {}, {}
        for name, path in environment.items():
            name, path = str(name), environment_path(str(path))
            cls = _environment_class(path, timeout_s)
            contracts[name], paths[name] = contract_of(cls), path
            if contracts[name] == "trl":
                own_schemas[name] = tuple(schemas + [tool_schema(getattr(cls, n)) for n in tool_names(cls)])
                rewards[name] = cls.__name__ if callable(getattr(cls, "get_reward", None)) else None
            else:
                own_schemas[name], rewards[name] = (), cls.__name__  # its step rewards
        contract = next(iter(contracts.values()))
        if set(contracts.values()) != {contract}:
            raise TypeError("task.environment mixes the two contracts (" + ", ".join(
                f"{n}: {c}" for n, c in contracts.items()) + "): several environments are TRL's dict "
                "environment_factory (rows pick by their environment column) or SkyRL's (rows pick by env_class)")
        if contract == "skyrl" and tools:
            raise ValueError("task.tools are TRL's: a SkyRL-gym environment parses its own tool calls in step()")
        return EpisodeSpec(contract=contract, environment=None, tools=tuple(tools), tool_schemas=tuple(schemas),
                           max_completion_length=max_completion_length, environments=paths,
                           environment_tool_schemas=own_schemas, environment_rewards=rewards, **options)
    contract, reward = "trl", None
    if environment is not None:
        environment = environment_path(environment)
        cls = _environment_class(environment, timeout_s)
        contract = contract_of(cls)
        if contract == "trl":
            schemas += [tool_schema(getattr(cls, name)) for name in tool_names(cls)]
            reward = cls.__name__ if callable(getattr(cls, "get_reward", None)) else None
        else:
            if tools:
                raise ValueError("task.tools are TRL's: a SkyRL-gym environment parses its own tool calls in step()")
            reward = cls.__name__  # its step rewards
    return EpisodeSpec(contract=contract, environment=environment, tools=tuple(tools), tool_schemas=tuple(schemas),
                       max_completion_length=max_completion_length, environment_reward=reward, **options)


def _environment_class(path: str, timeout_s: float) -> type:
    """The class of the environments ``path`` makes: the class itself, or, for a factory that is not one (TRL takes
    any callable), the class of one instance it makes (probed once, as TRL probes it)."""
    cls = import_object(path)
    if not isinstance(cls, type) and callable(cls):
        probe = Calls(factory_name(cls))
        try:
            cls = type(probe.call(f"{path}()", timeout_s, cls))
        finally:
            probe.close()
        if contract_of(cls) != "trl":
            raise TypeError(f"{path} made a {cls.__qualname__}: a factory function is TRL's contract (a "
                            "SkyRL-gym environment is named by its class, which echo2 constructs as SkyRL does)")
    return cls


# ---------------------------------------------------------------------- calls with a time limit


class Calls:
    """Every call into one rollout's environment and tools, on one thread of its own, each within its time limit.

    One thread per environment, not one per call: TRL calls an environment's constructor, ``reset`` and tools on one
    thread (the trainer's), so what an environment makes in ``__init__`` and uses in its tools (a sqlite3 connection,
    thread-local state) must keep working. Coroutines (async tools, an async ``get_reward``) run on the process's one
    event loop (``event_loop``), as TRL runs them on its daemon thread's loop, so that a client bound to that loop works
    from one call to the next; a coroutine that overruns because it blocks that loop gets the loop replaced
    (``replace_if_wedged``), so that the other rollouts' coroutines go on. A call that overruns leaves the thread in
    it (Python cannot stop a thread): the environment is abandoned, and every later call into it fails at once."""

    def __init__(self, name: str):
        self.name, self.jobs, self.stuck = name, None, None
        self.thread: threading.Thread | None = None

    def call(self, what: str, timeout_s: float, func: Any, *args: Any, **kwargs: Any) -> Any:
        """``func(*args, **kwargs)`` on the environment's thread (awaited on the event loop if it returns a coroutine),
        within ``timeout_s``; EnvironmentFailed naming ``what`` if it raises or overruns."""
        if self.stuck is not None:
            raise EnvironmentFailed(f"{what} not called: {self.stuck} is still running past its time limit")
        if self.thread is None:
            self.jobs = queue.SimpleQueue()
            self.thread = threading.Thread(target=self._serve, args=(self.jobs,), name=f"env:{self.name}",
                                           daemon=True)
            try:
                self.thread.start()
            except RuntimeError as e:  # no thread to be had (a limit on threads): this episode cannot run
                self.jobs = None
                raise EnvironmentFailed(f"{what} not called: no thread for the environment ({e})") from e
        elif self.jobs is None:
            raise EnvironmentFailed(f"{what} not called: the environment is closed")
        done, out = threading.Event(), {}
        deadline = time.monotonic() + timeout_s
        self.jobs.put((func, args, kwargs, out, done))
        if not done.wait(timeout_s):
            self.stuck = what
            raise _overran(what, timeout_s)
        if "error" in out:
            e = out["error"]
            raise EnvironmentFailed(f"{what} raised {type(e).__name__}: {e}") from e
        value = out.get("value")
        if inspect.iscoroutine(value):
            (value,) = self.gather(what, max(deadline - time.monotonic(), 0.0), [value])
            if isinstance(value, BaseException):
                raise EnvironmentFailed(f"{what} raised {type(value).__name__}: {value}") from value
        return value

    def gather(self, what: str, timeout_s: float, coroutines: list[Any]) -> list[Any]:
        """Await ``coroutines`` together on the event loop (TRL's ``asyncio.gather`` for one turn's async tools),
        within ``timeout_s``; each result, or the exception it raised (``return_exceptions``)."""
        async def together():
            return await asyncio.gather(*coroutines, return_exceptions=True)

        loop = event_loop()
        future = asyncio.run_coroutine_threadsafe(together(), loop)
        try:
            results = future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            if replace_if_wedged(loop):
                self.stuck = what  # its coroutine still runs the environment's code, on the old loop: let it go
                raise Overran(f"{what} did not return within {timeout_s:g} s (task.environment_timeout_s) and "
                              "blocked the event loop (blocking code in a coroutine)") from None
            raise _overran(what, timeout_s) from None
        return results

    def close(self) -> None:
        """End the thread after its last call (one still running past its limit included), once, and let go of
        the environment it holds."""
        if self.thread is not None and self.jobs is not None:
            self.jobs.put(None)
            self.jobs = None

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            func, args, kwargs, out, done = job
            del job  # the environment's bound methods go with the call, not with the idle thread
            try:
                out["value"] = func(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread, with its reason)
                out["error"] = e
            finally:
                del func, args, kwargs
            done.set()


def _overran(what: str, timeout_s: float) -> Overran:
    return Overran(f"{what} did not return within {timeout_s:g} s (task.environment_timeout_s)")


def factory_name(factory: Any) -> str:
    """An environment factory's name in messages and thread names: a class's, or a function's (TRL takes any
    callable); ``tools`` when there is none (plain tools)."""
    if factory is None:
        return "tools"
    return getattr(factory, "__qualname__", None) or getattr(factory, "__name__", None) or repr(factory)


def public_state(env: Any) -> dict[str, Any]:
    """The environment's public attributes that are JSON values (each at most MAX_STATE_VALUE_CHARS as JSON, all at
    most MAX_STATE_CHARS): what reward functions may read of it where rewards are scored (module doc of
    echo2/tasks/environments/__init__.py)."""
    out, total = {}, 0
    for name, value in sorted(vars(env).items()) if hasattr(env, "__dict__") else ():
        if name.startswith("_"):
            continue
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            continue
        if len(text) <= MAX_STATE_VALUE_CHARS and total + len(text) <= MAX_STATE_CHARS:
            out[name], total = json.loads(text), total + len(text)
    return out


class EnvironmentView:
    """What a reward function finds in ``environments`` (TRL hands the live instances): the instance's public JSON
    attributes as the episode left them, and ``get_reward()``, the environment's own reward. Environments run where the
    tokens are made (a worker), not where rewards are scored, so anything else of an instance is not there; reading it
    says so."""

    def __init__(self, name: str, state: dict[str, Any], reward: float | None, error: str | None = None):
        self._name, self._state, self._reward, self.error = name, dict(state), reward, error

    def __getattr__(self, attr: str) -> Any:
        state = self.__dict__.get("_state", {})
        if attr in state:
            return state[attr]
        raise AttributeError(f"{self.__dict__.get('_name')}.{attr} is not available where rewards are scored: the "
                             "environment ran on a worker, and only its public JSON attributes (as the episode left "
                             "them) and get_reward() come back; compute the reward from the transcript, or keep what it "
                             "needs in a plain attribute")

    def get_reward(self) -> float | None:
        return self._reward
