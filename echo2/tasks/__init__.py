"""Data plane: a task is a dataset of prompts plus TRL-style reward functions, and optionally an environment.

The learner and the rollout plane only see the `Task` interface in `base.py`; which task runs is a config choice
(`task=dataset` for a dataset and reward functions of your own, as TRL takes them: dataset.py, rewards.py;
`task=calculator`, `task=poker` for multi-turn environments: environments/; `task=arith`, `task=arith_chat`,
`task=gsm8k`, `task=kuhn`). docs/tasks.md says how to bring your own.
"""
