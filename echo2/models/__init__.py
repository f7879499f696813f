"""Models: where the policy's weights come from.

`tiny.build_tiny` builds a tiny random-init model locally (no hub); `hub.from_hub` names a hub model
(Qwen3-0.6B/4B/8B) for GPU runs. Both return something `from_pretrained` accepts.
"""
