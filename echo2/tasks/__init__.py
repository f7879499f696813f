"""Data plane: a task is a dataset of prompts plus TRL-style reward functions.

The learner and the rollout plane only see the `Task` interface in `base.py`; which task runs is a
config choice (`task=arith`, `task=gsm8k`).
"""
