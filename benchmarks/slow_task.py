"""The copy task with a reward that is slow on one crafted answer, for the hostile soak (benchmarks/soak.py --hostile):
the stand-in for math-verify on ``\\boxed{10^{10^{9}}}``, which runs to its limit per completion (1 s:
echo2/tasks/gsm8k.py) and then scores 0. The copy task's own reward reads a leading integer, which no completion
can make slow, so without this the soak could not exercise a slow-but-valid pusher.

    python train.py task._target_=benchmarks.slow_task.SlowCopyTask ...   (with ECHO2_SLOW_REWARD_S=1.0)
    python train.py experiment=smollm2_arith task._target_=benchmarks.slow_task.SlowChatTask +task.trap_token_id=2

(SlowChatTask: the real model's arithmetic questions, for ``soak.py --hostile --model smollm2_135m``; its trap is
that model's end-of-sequence token.)

A group is slow when every one of its G completions is the end-of-sequence token twice (``trap_token_id``, the tiny
model's ``<eos>``): no honest engine can make that, since generation ends at the first ``<eos>``. (``<unk><unk>`` did
not do: the tiny copy model, trained in the soak, can collapse onto ``<unk>`` for a prompt, a group of G identical
zero-reward completions that GRPO never trains away, and then every honest group of that prompt took the slow path,
measured in the calm phase of 2 of 3 soaks on 2026-12-04. A digit twice would not do either: a copy model answers
``0=`` with ``00``, which reads as 0 and is right.) Each such completion costs ECHO2_SLOW_REWARD_S seconds of a reward
process (read when the task is built, in the learner, and pickled into the reward processes with it) and scores 0;
every other group is scored as the copy task scores it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from echo2.tasks.arith import ArithTask
from echo2.tasks.arith_chat import ArithChatTask


class SlowOnTrap:
    """A task whose reward is slow on a group whose every completion is ``trap_token_id`` twice: ECHO2_SLOW_REWARD_S
    a completion, then 0; every other group is scored as the task scores it."""

    def __init__(self, trap_token_id: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.slow_s = float(os.environ.get("ECHO2_SLOW_REWARD_S", "1.0"))
        self.trap = [trap_token_id] * 2

    def reward_funcs(self):
        return [self._slow_on_trap(f) for f in super().reward_funcs()]

    def _slow_on_trap(self, reward):
        trap, slow_s = self.trap, self.slow_s

        def correct(prompts, completions, completion_ids=None, **kwargs):
            ids = completion_ids or []
            if ids and all(list(c) == trap for c in ids):
                time.sleep(slow_s * len(ids))  # one crafted completion after another, each to the limit
                return [0.0] * len(ids)
            return reward(prompts, completions, completion_ids=completion_ids, **kwargs)

        return correct


class SlowCopyTask(SlowOnTrap, ArithTask):
    def __init__(self, trap_token_id: int = 1, **kwargs: Any):
        """``trap_token_id``: the end-of-sequence token (the tiny model's ``<eos>`` is 1: echo2/models/tiny.py)."""
        super().__init__(trap_token_id, **kwargs)


class SlowChatTask(SlowOnTrap, ArithChatTask):
    """The real model's arithmetic questions; ``trap_token_id``: its end-of-sequence token (SmolLM2's
    ``<|im_end|>``)."""
