"""Reward functions as TRL takes them: named by import path, called with everything TRL's GRPOTrainer hands them.

A reward function is named in a task's config by its import path (``trl.rewards.accuracy_reward``, or
``my_pkg.rewards:length_bonus``), or by a Hydra node: a factory with its arguments
(``{_target_: trl.rewards.get_soft_overlong_punishment, max_completion_len: 64, soft_punish_cache: 16}``) or a
function with arguments bound (``{_target_: my_pkg.rewards.bonus, _partial_: true, scale: 0.5}``). Its name (the
``reward/<name>`` metric) is TRL's: the function's ``__name__``, through partials, or the class name of a callable
object.

Each is called as TRL's ``_calculate_rewards`` calls it::

    f(prompts=[...], completions=[...], completion_ids=[[...]], trainer_state=..., log_extra=..., log_metric=...,
      environments=[...] (tasks with an environment only), **the dataset row's other columns, one value per completion)

and may be ``async`` (awaited, the async ones of a task concurrently, as TRL gathers them). ``None`` in its answer
means "cannot score this one": NaN, left out of the mean (TRL's semantics).

How it differs from TRL, and why:

* ``trainer_state`` is a ``TrainerStateView``, not the learner's ``TrainerState``: remote rollouts are scored in the
  coordinator's process, which holds no trainer. It has the fields reward schedules read (``global_step``,
  ``max_steps``, ``epoch``), as the coordinator knows them when it scores (the learner's version then).
* ``log_metric(name, value)`` and ``log_extra(column, values)`` are collected where the function runs and travel
  back with the scored group to the learner, which logs them as TRL does (``train/<name>``, averaged over the step;
  the extra columns beside the step's completions).
* Each call scores one group (one prompt's G completions) as it comes back from a worker, not a whole generation
  batch as TRL's one call per batch does: a function comparing completions across prompts sees one prompt's.
* A function that raises, or returns the wrong number of values, abstains for that group (NaN for each of its
  completions) and its error is booked with the group (``reward/errors``, and a warning naming it) instead of
  stopping the run; the group is dropped (``reward_error``) only when every function failed on it. TRL raises.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

EXCLUDED_COLUMNS = ("prompt", "completion", "completion_ids")
"""Dataset columns TRL does not forward to reward functions as keyword arguments."""


@dataclass(frozen=True)
class TrainerStateView:
    """What a reward function gets as ``trainer_state``: the fields of TRL's ``TrainerState`` that reward schedules read,
    as known where the function runs. ``global_step`` is the learner's version when the group was scored (the policy
    version a consumed group trains at, up to its staleness); ``epoch`` counts passes over the training rows."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


def import_object(path: str) -> Any:
    """The object an import path names: ``pkg.mod.name`` or ``pkg.mod:name`` (a class attribute too:
    ``pkg.mod:Class.name``)."""
    from hydra.utils import get_object

    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"expected an import path such as pkg.module.name, got {path!r}")
    try:
        return get_object(path.strip().replace(":", "."))
    except Exception as e:
        raise ImportError(f"cannot import {path!r}: {e}") from e


def resolve(spec: Any) -> Callable:
    """A reward function from its config: an import path, a Hydra node (``_target_``; see the module doc), or a
    callable already."""
    if isinstance(spec, str):
        func = import_object(spec)
    elif isinstance(spec, Mapping) or hasattr(spec, "_target_"):
        from hydra.utils import instantiate
        from omegaconf import DictConfig, OmegaConf

        node = OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig) else dict(spec)
        if "_target_" not in node:
            raise ValueError(f"a reward function given as a mapping needs a _target_, got {sorted(node)}")
        func = instantiate(node)
    else:
        func = spec
    if not callable(func):
        raise TypeError(f"reward function {spec!r} is a {type(func).__name__}, not a callable (a factory named without "
                        "its arguments? give it as {_target_: ..., arg: value})")
    return func


def callable_name(func: Callable) -> str:
    """TRL's name for a reward function (trl.trainer.utils.get_callable_name): through partials, then ``__name__``,
    else the class name."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def is_async(func: Callable) -> bool:
    """Whether calling ``func`` returns a coroutine (a function, a partial of one, or an object with an async
    ``__call__``), as TRL's is_async_callable decides."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


def unique_names(funcs: list[Callable]) -> list[str]:
    """One name per function; a repeated name gets ``_2``, ``_3``... (two partials of one function stay apart in the
    metrics and in each rollout's rewards)."""
    seen: dict[str, int] = {}
    out = []
    for f in funcs:
        name = callable_name(f)
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


class RewardLog:
    """What reward functions log while scoring one group: TRL's ``log_metric`` and ``log_extra``, and the errors of
    the functions that failed. Plain data (it travels back to the learner with the group)."""

    def __init__(self):
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.extra: dict[str, list] = defaultdict(list)
        self.errors: dict[str, str] = {}

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[str(name)].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extra[str(column)].extend(_loggable(v) for v in values)

    def as_dict(self) -> dict[str, Any]:
        return {"metrics": dict(self.metrics), "extra": dict(self.extra), "errors": dict(self.errors)}


def _loggable(value: Any) -> Any:
    """A logged extra value as the learner's logs can hold it: JSON scalars as they are, anything else as text."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None
_loop_lock = threading.Lock()
_loop_generation = 0


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for reward and environment coroutines, running forever on a daemon thread (TRL's
    ``start_event_loop_in_daemon``, written here: a slim worker install, where environments run, has no TRL);
    started on first use, and again in a forked child."""
    global _loop, _loop_thread
    with _loop_lock:
        if _loop_thread is None or not _loop_thread.is_alive():  # a forked child has no thread
            loop, ready = asyncio.new_event_loop(), threading.Event()

            def run():
                asyncio.set_event_loop(loop)
                ready.set()
                loop.run_forever()  # until abandoned (replace_if_wedged) and idle
                loop.close()

            _loop_thread = threading.Thread(target=run, name="echo2-async-loop", daemon=True)
            _loop_thread.start()
            ready.wait()
            _loop = loop
        return _loop


WEDGE_PROBE_S = 1.0
"""How long a loop may take to run a no-op, once one of its coroutines has overrun, before it counts as wedged (a
coroutine calling blocking code, ``time.sleep`` for ``asyncio.sleep``, holds the loop, and every coroutine of every
other environment with it). A second lets a loop that is merely busy answer."""


def replace_if_wedged(loop: asyncio.AbstractEventLoop, probe_s: float = WEDGE_PROBE_S) -> bool:
    """After a coroutine on ``loop`` overran its time limit: whether the loop still runs a no-op within ``probe_s``;
    if not, it is wedged and the process's loop is replaced, so that later coroutines run on a fresh one (True).

    TRL runs every async tool and reward on one daemon loop, and one coroutine that blocks it stalls every rollout's
    tools until it returns; here only the rollout whose coroutine overran fails. The old loop's thread cannot be
    stopped while it is blocked: once the blocking call returns it finishes what it holds (``_stop_when_idle``) and
    ends; it is given nothing new."""
    global _loop, _loop_thread, _loop_generation
    ran = threading.Event()
    try:
        loop.call_soon_threadsafe(ran.set)
    except RuntimeError:  # closed
        return False
    if ran.wait(probe_s):
        return False
    with _loop_lock:
        if _loop is not loop:  # another caller replaced it already
            return True
        _loop, _loop_thread = None, None  # event_loop() starts a new one
        _loop_generation += 1
    asyncio.run_coroutine_threadsafe(_stop_when_idle(), loop)
    log.warning("a coroutine blocked the process's event loop for over %g s (blocking code in an async tool or "
                "reward: time.sleep, a blocking client); later coroutines run on a new loop", probe_s)
    return True


def loop_generation() -> int:
    """How many times the process's loop was replaced: what an object bound to the loop of its time (an environment
    kept for later rollouts, with its clients) compares, to know it is bound to an abandoned one."""
    return _loop_generation


STOP_GRACE_S = 30.0
"""How long an abandoned loop, unblocked, lets the tasks it holds finish before it cancels them (a client's
keep-alive task never would) and stops."""


async def _stop_when_idle(poll_s: float = 0.1) -> None:
    """On an abandoned loop, once it runs again: let its other tasks finish for up to STOP_GRACE_S, cancel what is
    left, then stop it (its thread then closes it and ends)."""
    me, deadline = asyncio.current_task(), time.monotonic() + STOP_GRACE_S
    while (others := [t for t in asyncio.all_tasks() if t is not me]) and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
    for t in others:
        t.cancel()
    if others:
        await asyncio.wait(others, timeout=poll_s * 10)
    asyncio.get_running_loop().stop()


def call_rewards(funcs: list[Callable], names: list[str], n: int, kwargs: dict[str, Any],
                 logs: RewardLog) -> dict[str, list[float]]:
    """Call every reward function on one group's ``n`` completions with TRL's keyword arguments (``kwargs`` holds
    prompts, completions, completion_ids, the columns and, if any, environments); sync ones in order, async ones
    together. Returns ``{name: [value or NaN] * n}``; a function that fails gets NaN throughout and its error in
    ``logs.errors``."""
    kwargs = {**kwargs, "log_metric": logs.log_metric, "log_extra": logs.log_extra}
    out: dict[str, list[float]] = {}
    pending = []
    for f, name in zip(funcs, names, strict=True):
        if is_async(f):
            pending.append((f, name))
            continue
        try:
            out[name] = _values(name, f(**kwargs), n)
        except Exception as e:
            out[name] = _failed(name, e, n, logs)
    if pending:
        async def gather():
            return await asyncio.gather(*(f(**kwargs) for f, _ in pending), return_exceptions=True)

        # on the process's one loop, as TRL awaits them on its daemon thread's loop: a client made at import time
        # (an AsyncOpenAI judge) is bound to the first loop it ran on, and asyncio.run makes a new one each call
        results = asyncio.run_coroutine_threadsafe(gather(), event_loop()).result()
        for (f, name), result in zip(pending, results, strict=True):
            try:
                if isinstance(result, BaseException):
                    raise result
                out[name] = _values(name, result, n)
            except Exception as e:
                out[name] = _failed(name, e, n, logs)
    return {name: out[name] for name in names}


def _values(name: str, values: Any, n: int) -> list[float]:
    values = list(values)
    if len(values) != n:
        raise ValueError(f"returned {len(values)} rewards for {n} completions (one per completion expected)")
    return [math.nan if v is None else float(v) for v in values]


def _failed(name: str, e: Exception, n: int, logs: RewardLog) -> list[float]:
    logs.errors[name] = f"{type(e).__name__}: {e}"[:500]
    return [math.nan] * n


def environment_reward(environments: list[Any], **kwargs: Any) -> list[float | None]:
    """The environments' own rewards (``get_reward()``), as TRL adds them as a reward function."""
    return [e.get_reward() for e in environments]
