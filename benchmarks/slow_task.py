"""The copy task with a reward that is slow on one crafted answer, for the hostile soak (benchmarks/soak.py --hostile):
the stand-in for math-verify on ``\\boxed{10^{10^{9}}}``, which runs to its limit per completion (1 s:
echo2/tasks/gsm8k.py) and then scores 0. The copy task's own reward reads a leading integer, which no completion
can make slow, so without this the soak could not exercise a slow-but-valid pusher.

    python train.py task._target_=benchmarks.slow_task.SlowCopyTask ...   (with ECHO2_SLOW_REWARD_S=1.0)

A group is slow when every one of its G completions is one special token twice (``<unk><unk>``, which decodes to
nothing): an honest worker's group is never that (a completion that says nothing scores 0 and is trained away, and
all G of them at once at random init is ~1e-20). A digit twice would not do: a copy model answers ``0=`` with ``00``,
which reads as 0 and is right, so the model keeps it. Each such completion costs ECHO2_SLOW_REWARD_S seconds of a
reward process (read when the task is built, in the learner, and pickled into the reward processes with it) and
scores 0; every other group is scored as the copy task scores it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from echo2.tasks.arith import ArithTask, leading_int


class SlowCopyTask(ArithTask):
    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.slow_s = float(os.environ.get("ECHO2_SLOW_REWARD_S", "1.0"))

    def reward_funcs(self):
        slow_s = self.slow_s

        def correct(prompts, completions, completion_ids=None, answer=None, **_):
            ids = completion_ids or []
            if ids and all(len(c) >= 2 and len(set(c)) == 1 for c in ids) and len({tuple(c) for c in ids}) == 1 \
                    and not any(str(c).strip() for c in completions):
                time.sleep(slow_s * len(ids))  # one crafted completion after another, each to the limit
                return [0.0] * len(ids)
            return [float(leading_int(c) == int(a)) for c, a in zip(completions, answer, strict=True)]

        return [correct]
