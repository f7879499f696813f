"""Multi-turn environments: TRL's ``environment_factory`` / ``tools`` contract and SkyRL-gym's ``BaseTextEnv``, each
running unchanged, on the dataset task (``task.environment=pkg.module:Class``, or TRL's several by name
``{name: pkg.module:Class}`` picked by each row's ``environment`` column; ``task.tools=[pkg.module:function]``;
docs/tasks.md).

What runs where:

* The episode loop (episode.py) runs where the tokens are made: in each worker agent, around its engine (vLLM or
  transformers), for remote rollouts; in the learner's process for ``rollout=sync``. Environments and tools run
  there too, one instance per rollout at a time (TRL's instances pooled and reset for later rollouts, as TRL pools
  them; SkyRL's made for each), each call with a time limit (``task.environment_timeout_s``); never in the
  coordinator's process.
* A worker is sent each group's dataset row (``reset(**row)`` and SkyRL's ``extras`` need it) with its prompt ids,
  and returns per rollout: the token ids after the prompt with a mask (1: the model's, 0: the environment's), the
  behaviour logprob of each model token (0.0 for the environment's), and the episode's record (the prompt it
  started from if the environment changed it, the environment's messages, turn and tool-call counts, its own
  reward, the error that ended it, its public state).
* The coordinator checks the record against the tokens (every environment message renders to exactly its tokens;
  a changed prompt to its prompt tokens and, under TRL's contract, extends the row's), parses the model's turns from
  its own tokens, and scores with the task's reward functions in its reward processes.
* The learner trains on the model's tokens only (TRL's ``tool_mask``); the environment's are attended to, never
  learned from, and the rollout checks compare logprobs on the model's tokens only.

Trust. The model's tokens are what the rollout checks verify (the learner's logprobs against the worker's). What the
environment said (observations, tool results) and its own reward (``get_reward()``, SkyRL's step rewards) are the
worker's claims: the coordinator can check that the messages match the tokens the model was shown, not that a real
environment produced them, since no environment runs there. The environment's own reward is scored as a reward
column named after its class (weight 1, as TRL adds it) unless ``task.environment_reward=false``; with untrusted
workers, prefer reward functions that recompute the reward from the transcript in the coordinator (the poker task
does: chips won, replayed with OpenSpiel from the model's actions and the row's deal), and keep the environment's
claim out. ``environments`` in a reward function's arguments are views of each instance as the episode left it
(its public JSON attributes, and ``get_reward()``), not the instances (contracts.EnvironmentView).

Versions. A trajectory never spans a weight swap: a worker applies a snapshot only between two batches, and every
turn of an episode is in one batch; ``rollout=sync`` generates a whole batch inside one learner step. So a
multi-turn rollout's version is the one that made all of its tokens, judged by S like any other.

Failures. An environment that raises or overruns its time limit ends its trajectory: what was generated is kept,
the error goes with it (``rollout/env_errors``), and the rollout abstains from every reward (NaN: no advantage, as
TRL treats an unscorable completion). A tool that raises is answered with its error, as TRL does
(``rollout/tool_errors``).
"""

from echo2.tasks.environments.contracts import EnvironmentView, EpisodeSpec, contract_of, spec_for
from echo2.tasks.environments.episode import Episodes, TranscriptMismatch, Trajectory

__all__ = ["EnvironmentView", "EpisodeSpec", "Episodes", "TranscriptMismatch", "Trajectory", "contract_of", "spec_for"]
