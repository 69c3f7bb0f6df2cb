"""A real run on a two-node Ray cluster made on this machine (ray.cluster_utils), joined through
cluster.address: the trainer ranks are packed on one node, the engines sit on the node their
bundles say, bind that node's address (the URLs the router and the trainer use), a per-run
control token reaches the actors and the engine servers but no file of the run nor Ray's logs,
steps train and push weights across the nodes, and the joined cluster keeps running afterwards
with nothing of the run left on it."""

import os
import secrets
import warnings
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from rlkit.config import load_recipe
from rlkit.driver.cluster import Cluster
from rlkit.driver.run import train
from tests.e2e.test_train_tiny import processes_with, rows
from tests.netprobe import environ_of
from tests.ray_clusters import actor_node, external_cluster

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")


def test_two_nodes_placement_addresses_and_steps(tmp_path, monkeypatch):
    import ray

    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "runs"
    seen: dict = {}
    real_start = Cluster.start

    def start_and_look(self: Cluster) -> Cluster:
        real_start(self)
        seen.update(
            where=self.placement(), urls=list(self.engine_urls), token=self._control_token,
            trainer_groups=[(g.strategy, len(g.bundles)) for g in self.plan.trainer],
            engine_nodes=[actor_node(a) for a in self.engines],
            trainer_nodes=[actor_node(w) for w in self.trainer.workers],
            actor_tokens=ray.get([a.__ray_call__.remote(lambda _: os.environ.get("RLKIT_CONTROL_TOKEN"))
                                  for a in [*self.engines, self.rollout_actor, *self.trainer.workers]]),
            server_tokens=[environ_of(pid).get("RLKIT_CONTROL_TOKEN")
                           for pid in processes_with(str(Path(self.model_path)))
                           if "rlkit.rollout.engines.builtin.hf_server" in _cmdline(pid)],
            labels={n["NodeID"]: next(k for k in ("node_a", "node_b") if k in n["Resources"])
                    for n in ray.nodes() if n["Alive"]},
        )
        return self

    monkeypatch.setattr(Cluster, "start", start_and_look)
    # 2 + 2 CPUs: the trainer's STRICT_PACK group (2 x 1 CPU) fills one node, so both engine
    # bundles (1 CPU each) must go to the other
    nodes = [{"num_cpus": 2, "resources": {"node_a": 1}}, {"num_cpus": 2, "resources": {"node_b": 1}}]
    # the cluster as an operator should start one: Ray's token authentication, one token
    with external_cluster(monkeypatch, nodes, token=secrets.token_urlsafe(32)) as c:
        recipe = load_recipe(ROOT / "recipes" / "grpo_tiny_ci.yaml", [
            f"run.output_dir={out}", "tracking.progress=false", "run.num_steps=2",
            f"cluster.address={c.address}", "train.parallelism.data=2",
        ])
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            state = train(recipe)
        assert not [w for w in said if "without a token" in str(w.message)]  # it has one

        where = seen["where"]
        print("landed:", {"trainer": [seen["labels"][n] for n in seen["trainer_nodes"]],
                          "engines": [seen["labels"][n] for n in seen["engine_nodes"]],
                          "urls": seen["urls"]})
        assert seen["trainer_groups"] == [("STRICT_PACK", 2)]
        assert seen["trainer_nodes"] == where["trainer"] and len(set(where["trainer"])) == 1
        assert seen["engine_nodes"] == where["engines"]
        assert set(where["engines"]).isdisjoint(where["trainer"])  # the run spans both nodes
        for url, node in zip(seen["urls"], where["engines"]):
            assert urlsplit(url).hostname == where["addresses"][node]  # as Ray reports the node

        # the control token was made and written nowhere: not in the run's folder
        # (recipe.yaml, logs), not in Ray's logs of the cluster
        token = seen["token"]
        assert token
        assert seen["actor_tokens"] == [token] * 5  # 2 engines, the rollout actor, 2 ranks
        assert seen["server_tokens"] == [token] * 2  # the engine servers inherit it
        run_dir = out / recipe.run.name
        for f in [*run_dir.rglob("*"), *Path(os.environ["RAY_TMPDIR"]).rglob("*")]:
            if f.is_file() and not f.is_symlink():
                assert token.encode() not in f.read_bytes(), f

        assert (state.step, state.version) == (2, 2)  # weights reached the engines' node twice
        assert [r["version"] for r in rows(run_dir)] == [1, 2]
        assert processes_with(str(Path(os.environ["RLKIT_CACHE"]) / "models" / "tiny")) == []

        ray.init(address=c.address)  # the joined cluster still runs, with nothing of the run
        try:
            assert sorted(n["Alive"] for n in ray.nodes()) == [True, True]
            assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
            alive = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
            assert alive == []
        finally:
            ray.shutdown()
