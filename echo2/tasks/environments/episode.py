"""Multi-turn episodes, token in and token out: the loop that runs where the tokens are made (a worker's engine, or
the learner's for rollout=sync), and the transcript the scorer reads back from the tokens.

    prompt ids = the chat template over the conversation the environment starts from (with the tools' schemas)
    loop:  generate one turn for every open episode (one batch, n = 1 each; engine-agnostic: ``generate(ids, params)``)
           append its tokens (mask 1, with their behaviour logprobs)
           the environment answers (TRL: the turn's tool calls, parsed with TRL's parse_response; SkyRL: step(text))
           append the answer's tokens as the chat template renders them (mask 0, logprob 0.0): TRL's tool suffix
           (GRPOTrainer._get_tool_suffix_ids, called as is), SkyRL's fixed-base rendering of observations
    until: the environment is done, or max_turns model turns, or the budget (below) is spent
    (each turn at most max_turn_tokens, where set: SkyRL's per-turn max_generate_length)

Nothing is re-tokenized: each turn is generated from the token ids so far, and what an engine returned is kept as it
returned it. The budget is TRL's: ``max_completion_length`` counts every token after the prompt, the model's and the
environment's, over all turns; an answer that would not fit is not appended (the episode ends there, as TRL rolls
it back), and a turn is cut to what is left. ``max_turn_tokens`` caps one turn on top (the answer cut there goes
to the environment, and the episode goes on; only a cut by the budget marks the trajectory truncated). A trajectory
is generated between two weight swaps (the worker applies snapshots between batches; rollout=sync generates inside
one learner step), so its version is the one that made every token.

``transcript`` reads a trajectory back where rewards are scored: the model's segments parsed from its tokens (as TRL
parses them), the environment's messages as the episode reported them, each checked against its tokens by rendering
it again (a mismatch: ``TranscriptMismatch``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Callable

from echo2.records import Completion, SamplingParams
from echo2.tasks.environments.contracts import Calls, EnvironmentFailed, EpisodeSpec, factory_name, import_object
from echo2.tasks.environments.sessions import open_session
from echo2.tasks.rewards import loop_generation

log = logging.getLogger(__name__)

Generate = Callable[[list[list[int]], SamplingParams], list[list[Completion]]]

BASE_CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "I am a user."},
                     {"role": "assistant", "content": "I am an assistant."}]
"""SkyRL's fixed base conversation, which observations are rendered after (skyrl_gym_generator.py)."""


class TranscriptMismatch(ValueError):
    """A trajectory's environment messages do not render to its environment tokens (or its prompt to its prompt
    tokens): what it says the environment answered is not what the model was shown."""


@dataclass
class Trajectory:
    """One rollout's episode: its prompt and every token after it, with a mask (1: the model's, 0: the
    environment's) and the behaviour logprob of each (0.0 where masked)."""

    prompt: list[dict]
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    observations: list[list[dict]] = field(default_factory=list)  # per environment segment, its messages
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None
    error: str | None = None
    state: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)  # the environment's own (SkyRL's get_metrics), numbers by name
    session: Any = None
    environment: str | None = None  # the row's, among several (TRL's dict environment_factory); None: the task's

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.token_ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if logprobs is not None else 0] * len(ids)

    def record(self, with_prompt: bool = True) -> dict[str, Any]:
        """What is reported with the rollout (plain data): the prompt (``with_prompt``), the environment's messages,
        counts, its reward, the error that ended it, its public state."""
        out = {"prompt": self.prompt} if with_prompt else {}
        return {**out, "observations": self.observations, "turns": self.turns, "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors, "reward": self.reward, "error": self.error, "state": self.state,
                **({"metrics": self.metrics} if self.metrics else {})}

    def result(self, dispatched_ids: list[int]) -> dict[str, Any]:
        """The completion a worker pushes (coordinator/results.py): its own prompt only where the environment
        changed the one dispatched."""
        own = list(self.prompt_ids) != list(dispatched_ids)
        out = {"token_ids": self.token_ids, "logprobs": self.logprobs, "finish_reason": self.finish_reason,
               "mask": self.mask, "episode": self.record(with_prompt=own)}
        return {**out, "prompt_ids": self.prompt_ids} if own else out


class Episodes:
    """A task's episodes for one tokenizer: rendering, the loop, and reading transcripts back."""

    def __init__(self, spec: EpisodeSpec, tokenizer: Any):
        """As TRL prepares its tokenizer for tools: the response template it parses tool calls with (for the chat
        templates it knows; else a clear error), and a prefix-preserving training template where the model's is not
        (the same on every process: read from the same tokenizer files)."""
        from trl.chat_template_utils import (add_response_schema, get_training_chat_template,
                                             is_chat_template_prefix_preserving)

        any_tools = spec.tool_schemas or any(spec.environment_tool_schemas.values())
        if spec.contract == "trl" and any_tools and getattr(tokenizer, "response_template", None) is None \
                and getattr(tokenizer, "response_schema", None) is None:
            add_response_schema(tokenizer)
        # Appending an answer's tokens needs a template that renders earlier messages the same whatever follows
        # (Qwen3's drops an earlier turn's think block): TRL's training template where the model's is not one.
        if spec.chat_template is None and not is_chat_template_prefix_preserving(tokenizer):
            try:
                spec = replace(spec, chat_template=get_training_chat_template(tokenizer))
            except ValueError:  # no training template known for it: the model's own (TRL would refuse tools)
                log.warning("the model's chat template is not prefix-preserving and TRL has no training template for "
                            "it: environment answers are rendered with it as it is")
        self.spec, self.tokenizer = spec, tokenizer
        self._base_ids: list[int] | None = None
        self._classes: tuple | None = None
        # TRL's pool: environments that ended cleanly, each with the thread that made it and the event loop
        # generation it was made under, for later rollouts' reset
        self._idle: dict[str | None, list[tuple[Any, Calls, int]]] = {}
        self._idle_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ rendering (as TRL and SkyRL render)

    def _template(self, messages: list[dict], generation: bool, tools: Any = None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.spec.chat_template,
                                                 add_generation_prompt=generation, tokenize=True, return_dict=False,
                                                 **self.spec.chat_template_kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def tools(self, environment: str | None = None) -> list[dict] | None:
        """The tools' schemas a prompt of ``environment`` is rendered with and its turns are parsed with (TRL shows
        each example the plain tools and its own environment's); None: none."""
        return list(self.spec.schemas(environment)) or None

    def prompt_ids(self, prompt: list[dict], environment: str | None = None) -> list[int]:
        """The prompt's token ids: TRL's _tokenize_prompts (the tools' schemas, the training template, the task's
        chat template arguments); SkyRL's generator renders without tools."""
        return self._template(prompt, True, self.tools(environment) if self.spec.contract == "trl" else None)

    def observation_ids(self, messages: list[dict], final: bool = False) -> list[int]:
        """The tokens of the environment's answer, up to the next turn's generation prompt (``final``: the episode
        ends with it, so without one, as SkyRL's generator appends its last observations)."""
        if self.spec.contract == "trl":
            from trl import GRPOTrainer

            host = SimpleNamespace(processing_class=self.tokenizer, _tokenizer=self.tokenizer, _is_vlm=False,
                                   chat_template=self.spec.chat_template,
                                   chat_template_kwargs=self.spec.chat_template_kwargs)
            return list(GRPOTrainer._get_tool_suffix_ids(host, messages))  # TRL's own code, TRL's layout
        if self._base_ids is None:  # SkyRL: the fixed base, cut after its last EOS
            base = self._template(BASE_CONVERSATION, False)
            eos = self.tokenizer.eos_token_id
            self._base_ids = base[:len(base) - base[::-1].index(eos)] if eos in base else base
        if not messages:  # no observation: the next turn's generation prompt only
            bare = self._template(BASE_CONVERSATION, False)
            return [] if final else self._template(BASE_CONVERSATION, True)[len(bare):]
        return self._template([*BASE_CONVERSATION, *messages], not final)[len(self._base_ids):]

    def parse_turn(self, ids: list[int], prefix: list[int], environment: str | None = None) -> dict:
        """A model turn as a chat message: TRL's parse_response (tool calls included) for TRL's contract, the decoded
        text for SkyRL's."""
        tools = self.tools(environment)
        if self.spec.contract == "trl" and tools:
            from trl.chat_template_utils import parse_response

            return parse_response(self.tokenizer, ids, prefix=prefix, tools=tools)
        return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}

    # ------------------------------------------------------------------ the loop

    def imports(self) -> tuple[dict[str | None, Any], list[Any]]:
        """The environment factories by name (None: the task's one; None there: plain tools) and the tools,
        imported where episodes run (a worker, or the learner)."""
        if self._classes is None:
            if self.spec.environments:
                factories = {name: import_object(path) for name, path in self.spec.environments.items()}
            else:
                factories = {None: import_object(self.spec.environment) if self.spec.environment else None}
            self._classes = factories, [import_object(t) for t in self.spec.tools]
        return self._classes

    def run(self, generate: Generate, rows: list[dict], params: SamplingParams, n: int,
            context_tokens: int | None = None) -> list[list[Trajectory]]:
        """``n`` episodes of each row; returns them per row. ``context_tokens``: the engine's context (an answer
        that would reach it ends the episode, as in TRL)."""
        factories, tools = self.imports()
        episodes: list[list[Trajectory]] = []
        try:
            for row in rows:
                name = self.spec.environment_of(row)
                episodes.append([])
                for _ in range(n):
                    episodes[-1].append(self._start(name, factories[name], tools, row))
            self._play(generate, episodes, params, context_tokens)
        finally:  # an error that ends the batch (the engine failing, say) ends every environment it started
            for t in (t for group in episodes for t in group if t.session is not None):
                t.session.calls.close()
        return episodes

    def _play(self, generate: Generate, episodes: list[list[Trajectory]], params: SamplingParams,
              context_tokens: int | None) -> None:
        """Every turn of every open episode, batched by the tokens each may have; then each finished."""
        open_ = [t for group in episodes for t in group if t.error is None]
        while open_:
            # one batch per token allowance: an engine's context must hold each prompt plus the turn it may generate
            by_room: dict[int, list[Trajectory]] = {}
            for t in open_:
                by_room.setdefault(self._room(t, context_tokens), []).append(t)
            open_ = []
            for left, batch in sorted(by_room.items()):
                if left <= 0:  # no room for another token
                    for t in batch:
                        t.finish_reason = "length"
                        if not t.token_ids:  # not even one: the prompt fills the engine's context
                            t.error = "the prompt does not fit the engine's context"
                    continue
                turns = generate([t.prompt_ids + t.token_ids for t in batch], replace(params, n=1, max_tokens=left))
                open_ += [t for t, (turn,) in zip(batch, turns, strict=True)
                          if self._turn(t, turn, left, context_tokens)]
        for t in (t for group in episodes for t in group):
            self._finish(t)

    def _room(self, t: Trajectory, context_tokens: int | None, per_turn: bool = True) -> int:
        """Tokens the next turn may have: what is left of the budget, and of the engine's context, and (``per_turn``)
        at most ``max_turn_tokens``."""
        left = self.spec.max_completion_length - len(t.token_ids)
        if context_tokens is not None:
            left = min(left, context_tokens - len(t.prompt_ids) - len(t.token_ids))
        if per_turn and self.spec.max_turn_tokens is not None:
            left = min(left, self.spec.max_turn_tokens)
        return left

    def _start(self, name: str | None, env_cls: Any, tools: list[Any], row: dict) -> Trajectory:
        env, calls, generation = self._take(name) if env_cls is not None and self.spec.contract == "trl" else (
            None, None, loop_generation())
        calls = calls or Calls(factory_name(env_cls))
        if self.spec.environments and self.spec.contract == "trl":  # TRL's control field: not handed to reset
            row = {k: v for k, v in row.items() if k != "environment"}
        try:
            session = open_session(self.spec, env_cls, tools, row, calls, env)
            session.generation = generation
            prompt = session.start(row)
            t = Trajectory(prompt=prompt, prompt_ids=self.prompt_ids(prompt, name), session=session,
                           environment=name)
        except BaseException as e:
            calls.close()
            if not isinstance(e, EnvironmentFailed):
                raise
            t = Trajectory(prompt=row["prompt"], prompt_ids=self.prompt_ids(row["prompt"], name), error=str(e),
                           environment=name)
        return t

    def _turn(self, t: Trajectory, turn: Completion, left: int, context_tokens: int | None) -> bool:
        """Append one model turn and the environment's answer; whether the episode goes on."""
        context = t.prompt_ids + t.token_ids
        room = self._room(t, context_tokens, per_turn=False)
        ids, logprobs = turn.token_ids[:left], turn.logprobs[:left]
        cut = len(turn.token_ids) > left or turn.finish_reason == "length"
        t.add(ids, logprobs)
        t.turns += 1
        # truncated only where the episode's budget (or the context) cut it; a turn cut at max_turn_tokens goes on
        t.finish_reason = "length" if cut and len(ids) >= room else "stop"
        last = self.spec.max_turns is not None and t.turns >= self.spec.max_turns
        if last and self.spec.contract == "trl":
            return False  # TRL's max_tool_calling_iterations: the last turn's tool calls are not run
        try:
            answer = t.session.act(self.parse_turn(ids, context, t.environment) if ids else {}, self._text(ids))
        except EnvironmentFailed as e:
            t.error = str(e)
            return False
        finally:
            t.tool_calls, t.tool_errors = t.session.tool_calls, t.session.tool_errors
        final = t.session.done  # SkyRL's done with observations: they are appended, then the episode ends
        if answer is None or (last and not final) or (final and not answer):
            return False
        answer_ids = self.observation_ids(answer, final)
        total = len(t.prompt_ids) + len(t.token_ids) + len(answer_ids)
        if len(t.token_ids) + len(answer_ids) > self.spec.max_completion_length or (
                context_tokens is not None and total >= context_tokens + final):
            return False  # it would not fit: not appended, the episode ends (TRL rolls the answer back)
        t.add(answer_ids, None)
        t.observations.append(answer)
        if final:
            return False
        if len(t.token_ids) >= self.spec.max_completion_length:
            t.finish_reason = "length"  # no room for another turn
            return False
        return True

    # ------------------------------------------------------------------ TRL's pool of environments

    def _take(self, name: str | None) -> tuple[Any, Calls | None, int]:
        """An idle environment of ``name``, its thread and its loop generation, or (None, None, now's generation):
        the rollout makes one. Those made before the event loop was replaced are let go (their clients are bound to
        the abandoned loop)."""
        now = loop_generation()
        while True:
            with self._idle_lock:
                idle = self._idle.get(name)
                env, calls, generation = idle.pop() if idle else (None, None, now)
            if generation == now:
                return env, calls, generation
            calls.close()

    def _release(self, name: str | None, session: Any, clean: bool) -> None:
        """After an episode: TRL's environment back to the pool if the episode ended cleanly (TRL reuses every
        instance; one that raised or overran is not trusted with another rollout here), else its thread ended."""
        env = session.reusable() if clean and session.calls.stuck is None else None
        with self._idle_lock:
            if env is not None and not self._closed:
                self._idle.setdefault(name, []).append((env, session.calls, session.generation))
                return
        session.calls.close()

    def close(self) -> None:
        """End the pooled environments' threads, and every later one's with its episode (the process's episodes are
        over: the worker leaving, the learner's run ending)."""
        with self._idle_lock:
            idle, self._idle, self._closed = self._idle, {}, True
        for _, calls, _ in (entry for entries in idle.values() for entry in entries):
            calls.close()

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _finish(self, t: Trajectory) -> None:
        if t.session is not None:
            session, t.session = t.session, None
            try:
                t.reward, t.state = session.finish()
            except EnvironmentFailed as e:
                t.error = t.error or str(e)
            except BaseException:
                session.calls.close()
                raise
            t.metrics = session.metrics
            self._release(t.environment, session, t.error is None)
        if t.error is not None:
            log.warning("an episode ended early: %s", t.error)
        if not t.token_ids:  # it failed before the model's first turn: one masked token stands for it
            t.add([self.tokenizer.eos_token_id], None)

    # ------------------------------------------------------------------ reading a trajectory back

    def transcript(self, prompt_ids: list[int], token_ids: list[int], mask: list[int], record: dict,
                   row_prompt: Any = None, environment: str | None = None) -> list[dict]:
        """The completion as TRL hands it to reward functions: the model's turns parsed from its tokens, the
        environment's messages between them; each environment segment (and a prompt the environment changed) checked
        against its tokens (TranscriptMismatch). ``environment``: the row's, among several."""
        prompt = record.get("prompt")
        if prompt is not None and prompt != row_prompt:
            if self.prompt_ids(prompt, environment) != list(prompt_ids):
                raise TranscriptMismatch("the prompt the episode reports does not render to its prompt tokens")
            if self.spec.contract == "trl" and row_prompt is not None and not _extends(prompt, row_prompt):
                raise TranscriptMismatch("the prompt is not the row's with an observation appended (TRL's reset)")
        observations = list(record.get("observations") or [])
        messages, context, k, i = [], list(prompt_ids), 0, 0
        while i < len(token_ids):
            j = i
            while j < len(token_ids) and mask[j] == mask[i]:
                j += 1
            ids = list(token_ids[i:j])
            if mask[i]:
                messages.append(self.parse_turn(ids, context, environment))
            elif k < len(observations):
                # the last segment may be SkyRL's final observations, rendered without a generation prompt
                final = j == len(token_ids) and self.spec.contract == "skyrl"
                if ids != self.observation_ids(observations[k]) and not (
                        final and ids == self.observation_ids(observations[k], final=True)):
                    raise TranscriptMismatch(f"environment answer {k + 1} does not render to its tokens")
                messages += observations[k]
                k += 1
            elif not (record.get("error") and i == 0 and j == len(token_ids)):  # a failed episode's stand-in token
                raise TranscriptMismatch("environment tokens without the messages they render")
            context += ids
            i = j
        if k != len(observations):
            raise TranscriptMismatch(f"{len(observations)} environment answers reported, {k} found in the tokens")
        return messages


def _extends(prompt: list[dict], row_prompt: Any) -> bool:
    """Whether ``prompt`` is ``row_prompt`` with an observation appended to its last message (what TRL's reset may
    do: text to text, or content blocks, the text made a text block first)."""
    if not isinstance(row_prompt, list) or len(prompt) != len(row_prompt) or prompt[:-1] != row_prompt[:-1]:
        return False
    before, after = row_prompt[-1].get("content"), prompt[-1].get("content")
    if isinstance(before, str) and isinstance(after, str):
        return after.startswith(before)
    if isinstance(before, str):  # a list observation turns the text into a text block first
        before = [{"type": "text", "text": before}]
    return isinstance(before, list) and isinstance(after, list) and after[:len(before)] == before
