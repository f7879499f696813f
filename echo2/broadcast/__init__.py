"""Peer-assisted pipelined broadcast of weight snapshots (DESIGN §3). Not built yet: nothing here runs.

Until it lands the only rollout source is on-policy and in-process, so no weights travel.
"""
