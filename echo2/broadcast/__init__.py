"""Weight dissemination: how snapshot v reaches the rollout workers (docs/design.md §2). What the relay's two ends
share: the coordinator process's origin (echo2/coordinator/broadcaster.py) and each worker's peer
(echo2/worker/peer.py); the learner writes ``snapshot``s.

``snapshot``     serialise a state dict (safetensors, never pickle)
``topology``     who pulls from whom: chain, tree or stripes (the pipelined relay; auto picks chain or stripes) or
                 star (one-to-many); pure
``manifest``     what the learner signs (manifests: chunk digests, root, version, probe, epoch; its orders to
                 workers) and the relay key's MACs on every request for bytes
``store``        the snapshots a node holds: buffers that fill while they are served, checked chunk by chunk
``framing``      the byte stream between relay nodes: JSON frames, then raw bytes
``relay``        the relay node: a server that streams to children, a fetcher that pulls with failover
``delta``        lossless sparse deltas between versions

The lab tools that measure it (WAN testbed, delay line, link emulation, ``python -m echo2.lab.bench``) live in
echo2/lab/, which nothing here imports.
"""
