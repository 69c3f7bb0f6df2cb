"""An external Ray cluster of one or more "nodes" on this machine, for tests that join one
(ray.cluster_utils: each node is its own raylet; all share this machine's address)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any, Iterator


@contextlib.contextmanager
def external_cluster(monkeypatch: Any, nodes: list[dict[str, Any]],
                     token: str | None = None) -> Iterator[Any]:
    """`token`: the cluster runs with Ray's token authentication and this token (as an operator
    should start one, docs/reliability.md), which the test process then also has; else none."""
    from ray.cluster_utils import Cluster

    from rlkit.driver.local_ray import reload_ray_auth

    # The head writes its address to <temp>/ray/ray_current_cluster, where any plain ray.init()
    # on this machine would find and join it: keep it in a private folder (short: socket paths).
    tmp = tempfile.mkdtemp(prefix="rk", dir="/tmp")
    auth_before = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    monkeypatch.setenv("RAY_TMPDIR", tmp)
    monkeypatch.setenv("RAY_AUTH_MODE", "token" if token else "disabled")
    if token:
        monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    else:
        monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    reload_ray_auth()
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=nodes[0])
    try:
        for node in nodes[1:]:
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        for k, v in auth_before.items():  # as it was, and Ray's core reads it again
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reload_ray_auth()


def actor_node(actor: Any) -> str:
    """The node id an actor runs on, from Ray's actor table (the driver must be connected)."""
    import ray._private.state

    return ray._private.state.actors(actor._actor_id.hex())["Address"]["NodeID"]
