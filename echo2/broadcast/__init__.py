"""Weight dissemination: how snapshot v reaches the rollout workers (docs/design.md §2).

``snapshot``     serialise a state dict (safetensors, never pickle)
``base``         the ``Broadcaster`` protocol the coordinator sees
``topology``     who pulls from whom: chain, tree (the pipelined relay) or star (one-to-many); pure
``manifest``     what the learner signs: chunk digests, root, version, probe; the MAC on every request
``store``        the snapshots a node holds: buffers that fill while they are served, checked chunk by chunk
``framing``      the byte stream between relay nodes: JSON frames, then raw bytes
``relay``        the relay node: a server that streams to children, a fetcher that pulls with failover
``link``         the in-process link model (token buckets + latency) for tests without root
``broadcaster``  the learner's end (RelayBroadcaster: rounds over a plan); ``peer`` a worker's end
``delta``        lossless sparse deltas between versions
``testbed``      emulated WAN hosts in network namespaces (``delayline``: the packet delay it uses)
``bench``        the CLI that measures all of it
"""
