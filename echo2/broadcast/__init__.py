"""Weight dissemination: how snapshot v reaches the rollout workers (DESIGN §3).

``snapshot``    serialise a state dict (safetensors, never pickle) and sign it with the run's secret
``base``        the ``Broadcaster`` protocol the learner sees
``one_to_many`` the baseline: the learner pushes each snapshot to every worker, one after another
The peer-assisted pipelined relay comes behind the same protocol.
"""
