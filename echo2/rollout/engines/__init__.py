"""Generation backends behind the ``Engine`` protocol (``hf`` here; vLLM workers in the rollout plane)."""
