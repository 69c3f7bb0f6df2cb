"""An external Ray cluster of one or more "nodes" on this machine, for tests that join one
(ray.cluster_utils: each node is its own raylet; all share this machine's address)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from typing import Any, Iterator


@contextlib.contextmanager
def external_cluster(monkeypatch: Any, nodes: list[dict[str, Any]]) -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    # The head writes its address to <temp>/ray/ray_current_cluster, where any plain ray.init()
    # on this machine would find and join it: keep it in a private folder (short: socket paths).
    tmp = tempfile.mkdtemp(prefix="rk", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", tmp)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=nodes[0])
    try:
        for node in nodes[1:]:
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def actor_node(actor: Any) -> str:
    """The node id an actor runs on, from Ray's actor table (the driver must be connected)."""
    import ray._private.state

    return ray._private.state.actors(actor._actor_id.hex())["Address"]["NodeID"]
