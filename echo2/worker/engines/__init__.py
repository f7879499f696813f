"""A worker's generation engines: ``vllm_server`` (vLLM) and ``hf`` (transformers)."""
