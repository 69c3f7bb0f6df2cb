"""Joining an existing Ray cluster (RAY_ADDRESS, cluster.address ''): a run that fails to place
its pieces removes its placement groups and leaves the cluster, which keeps running with what
others had on it."""

import pytest

from rlkit.config import load_recipe
from rlkit.driver.cluster import Cluster
from rlkit.driver.placement import PlacementError
from tests.ray_clusters import external_cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Holder:
    def ping(self) -> str:
        return "pong"


def test_a_joined_cluster_keeps_running_after_the_run(monkeypatch, tmp_path):
    import ray

    with external_cluster(monkeypatch, [{"num_cpus": 2}]) as c:
        ray.init(address=c.address, namespace="other")  # another job's actor holds 1 of 2 CPUs
        ray.get(ray.remote(Holder).options(name="holder", lifetime="detached", num_cpus=1)
                .remote().ping.remote())
        ray.shutdown()

        monkeypatch.setenv("RAY_ADDRESS", c.address)
        recipe = load_recipe(None, ["rollout.engine.num_engines=1", "cluster.placement_timeout_s=2"])
        cluster = Cluster(recipe, "no-model-needed", tmp_path)
        # the trainer rank's group is placed on the free CPU; the engine's cannot be. The
        # cluster runs without token authentication: the run says so
        with pytest.raises(PlacementError, match="placement group 'engines'"), \
                pytest.warns(UserWarning, match="accepted this run without a token"):
            cluster.start()
        assert cluster.joined == c.address
        assert not ray.is_initialized()  # the driver left the cluster...

        ray.init(address=c.address, namespace="other")  # ...which still runs, its actor too
        try:
            assert ray.get(ray.get_actor("holder").ping.remote()) == "pong"
            assert [n["Alive"] for n in ray.nodes()] == [True]
            groups = ray.util.placement_group_table().values()
            assert groups and all(g["state"] == "REMOVED" for g in groups)
        finally:
            ray.shutdown()


def test_a_world_larger_than_a_node_is_packed_node_by_node(monkeypatch, tmp_path):
    """TP 2 x DP 2 on two nodes of 2 (fake) GPUs: one STRICT_PACK group per node, each TP pair
    inside one node; the engines' CPU bundles go where CPUs are left."""
    import ray

    nodes = [{"num_cpus": 3, "num_gpus": 2}, {"num_cpus": 3, "num_gpus": 2}]
    with external_cluster(monkeypatch, nodes) as c:
        recipe = load_recipe(None, [
            f"cluster.address={c.address}", "train.device=cuda", "train.parallelism.tensor=2",
            "train.parallelism.data=2", "rollout.engine.device=cpu", "cluster.placement_timeout_s=60",
        ])
        cluster = Cluster(recipe, "no-model-needed", tmp_path)
        cluster._connect()
        try:
            cluster._place()
            assert [(g.strategy, g.bundles) for g in cluster.plan.trainer] == \
                [("STRICT_PACK", ({"CPU": 1.0, "GPU": 1.0},) * 2)] * 2
            where = cluster.placement()
            first, second = where["trainer"][:2], where["trainer"][2:]
            assert len(set(first)) == len(set(second)) == 1 and first[0] != second[0]
            assert len(where["engines"]) == 2
            assert cluster.multi_node
        finally:
            cluster.shutdown()
        assert not ray.is_initialized()
