"""Rollout sources: where the learner's batches come from, seen from the learner's process.

``async_source``         rollouts from remote workers, at most S versions stale, through the coordinator process
``coordinator_process``  the learner's handle on that process: spawns it, calls it through a pipe, restarts it
``pool``                 the worker agents a run starts itself (local) or is told about (static)
``sync``                 the on-policy source (staleness 0): generate with the live policy, then train
``lagged``               generation with a copy of the policy exactly S versions old (an exact lag, for experiments)

The coordinator process's code is in echo2/coordinator/, the workers' in echo2/worker/; what they share with
the learner is beside them (echo2/records.py, echo2/seams.py, echo2/scoring.py, echo2/broadcast/, echo2/net/).
"""
