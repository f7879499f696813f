"""echo2: RL post-training of LLMs with a central learner and remote rollouts (ECHO-2, arXiv 2602.02192)."""

__version__ = "0.1.0"
