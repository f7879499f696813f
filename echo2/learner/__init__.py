"""The learner process: TRL's GRPOTrainer fed by a rollout source.

``trainer``        the GRPOTrainer subclass (``_generate_and_score_completions`` replaced by the source's batches)
``args``           echo2's config onto TRL's GRPOConfig, and the launch checks
``callbacks``      per step: versions and snapshots, signals, evaluation, the step log, the progress bar
``corrections``    the off-policy corrections of the importance ratio (tis, mask, icepop, m2po, seq_mask)
``weights``        the weights it publishes (ZeRO-3 shards gathered one parameter at a time); ``past_policies``
                   the last S versions' weights the rollout checks score with
``distributed``    ZeRO ranks around rank 0's source; ``staleness_lr`` the staleness-aware learning rate
``evaluate``       greedy accuracy on the task's held-out split
``sources/``       where the batches come from: remote workers through the coordinator process, sync, lagged
"""

import trl.import_utils as _trl_imports

# TRL's trainer imports vLLM at import time wherever vLLM is installed, for TRL's own generation path, which echo2
# replaces (the learner never generates with vLLM: its workers do). That import is 3-4 s of every learner
# process's start on a machine that serves workers too; told vLLM is absent, TRL skips it. GRPOConfig(use_vllm=True)
# is refused by echo2's config checks either way.
_trl_imports.is_vllm_available = lambda *args, **kwargs: False
