"""The coordinator process: what runs there, one per run, spawned by the learner
(echo2/learner/sources/coordinator_process.py).

``process``      its entry point: builds the parts below and answers the learner's calls through a pipe
``heap``         the process's malloc arenas capped, and freed memory handed back to the system on a period
``coordinator``  the workers' HTTP routes (register, pull, push, heartbeat...), the reaper, take() for the learner
``gate``         who may call: run secret, worker credentials, TLS certificates, revocation
``schemas``      the routes' request bodies, checked field by field; ``results`` the pushed rollouts
``intake``       a push: validate, score (``reward_pool``: task rewards in processes of their own), book, buffer
``registry``     the live workers and what each holds in flight; ``liveness`` deadlines, shares and strikes
``trust``        the rollout checks: the learner's logprobs against a worker's, per credential
``buffer``       scored groups awaiting the learner, each at most S versions stale
``ledger``       every rollout's fate (consumed, dropped or lost, with a reason), journalled for restarts
``on_change``    runs ``activation.on_change``, the operator's hook, when the active set changes (echo2/activation/
                 decides the set)
``broadcaster``  the relay's origin: orders every worker's copy of each snapshot (echo2/broadcast/ holds the relay)
"""
