"""The worker host: what ships to a rented GPU and runs there (``python -m echo2.worker``).

``agent``     the loop: register, pull prompts, generate, push rollouts, apply each new snapshot
``peer``      its end of the relay: receives each snapshot from the origin or other workers and serves it on
``engines/``  generation: ``vllm_server`` (vLLM in a process of its own, ``vllm_ext`` its weight loader,
              ``guard`` the wrapper that keeps the vLLM server from outliving the agent), ``hf`` (transformers)
"""
