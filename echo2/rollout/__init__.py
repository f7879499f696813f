"""Rollout plane: where completions come from.

``types``      the records that cross the plane (a rollout carries its tokens, behaviour logprobs, version)
``protocols``  the seams the learner sees: ``RolloutSource`` and ``Engine``
``engines/``   generation backends behind ``Engine`` (``hf``: transformers ``generate``)
``scoring``    rewards, computed on the learner's side through the task adapter
``sync``       the on-policy source (staleness 0): generate with the live policy, then train
``evaluate``   greedy accuracy on the task's held-out split
"""
