"""Leaf code that both sides of a run import: the engine server's HTTP API as rlkit calls it
(rlkit.common.engine_http). It imports no other rlkit package, so `rollout` (which owns the
engines) and `train` (which publishes weights into them) can share it as siblings.
"""
