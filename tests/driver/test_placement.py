"""The placement plan (no Ray): which placement groups, which bundles, which strategies; how a
recipe's cluster address resolves; which hosts count as loopback."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlkit.config import load_recipe
from rlkit.config.loader import RecipeError
from rlkit.driver.placement import advertised
from rlkit.driver.placement import (
    PlacementError,
    bundle,
    local_num_cpus,
    plan_colocated,
    plan_placement,
    resolve_address,
)

GPU = bundle(1, 1)
CPU = bundle(1, 0)


def plan(nodes, *, tp=1, dp=1, engines=2, engine=CPU, trainer=CPU):
    return plan_placement(num_engines=engines, engine_bundle=engine, tp=tp, dp=dp,
                          trainer_bundle=trainer, nodes=nodes)


def shape(p):
    return [(g.strategy, len(g.bundles)) for g in p.trainer]


def test_bundles_leave_out_zero_resources():
    assert bundle(1, 0) == {"CPU": 1.0}
    assert bundle(2, 4) == {"CPU": 2.0, "GPU": 4.0}


def test_a_world_that_fits_one_node_is_one_strict_pack_group():
    p = plan([{"CPU": 32, "GPU": 8}] * 2, tp=2, dp=2, engines=4, engine=GPU, trainer=GPU)
    assert shape(p) == [("STRICT_PACK", 4)]
    assert p.trainer[0].bundles == ({"CPU": 1.0, "GPU": 1.0},) * 4
    assert (p.engines.strategy, p.engines.bundles) == ("PACK", ({"CPU": 1.0, "GPU": 1.0},) * 4)
    assert p.trainer_slots() == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert p.totals() == {"CPU": 8.0, "GPU": 8.0}


def test_a_world_larger_than_a_node_is_one_strict_pack_group_per_node():
    p = plan([{"CPU": 32, "GPU": 8}] * 3, tp=4, dp=4, engines=8, engine=GPU, trainer=GPU)
    assert shape(p) == [("STRICT_PACK", 8), ("STRICT_PACK", 8)]
    # ranks in order (TP innermost), so each TP group of 4 stays inside one group, one node
    assert p.trainer_slots() == [(g, b) for g in range(2) for b in range(8)]


def test_chunks_are_multiples_of_tp_that_the_nodes_can_hold():
    # world 6 (TP 2) on two 4-GPU nodes: neither 6 nor 4 splits it into chunks two nodes hold
    # (4 does not divide 6); chunks of 2 do (two per node)
    p = plan([{"CPU": 16, "GPU": 4}] * 2, tp=2, dp=3, engines=1, engine=GPU, trainer=GPU)
    assert shape(p) == [("STRICT_PACK", 2)] * 3


def test_tp_larger_than_any_node_falls_back_to_pack():
    p = plan([{"CPU": 16, "GPU": 4}] * 4, tp=8, dp=1, engines=1, engine=GPU, trainer=GPU)
    assert shape(p) == [("PACK", 8)]


def test_cpu_only_two_nodes():
    p = plan([{"CPU": 2}, {"CPU": 2}], tp=1, dp=2, engines=2)
    assert shape(p) == [("STRICT_PACK", 2)]
    assert p.engines.bundles == ({"CPU": 1.0},) * 2
    assert p.totals() == {"CPU": 4.0}


def test_sglang_engine_larger_than_any_node_is_an_error_naming_it():
    with pytest.raises(PlacementError, match=r"an engine needs \{'CPU': 1.0, 'GPU': 16.0\} on one node"):
        plan([{"CPU": 32, "GPU": 8}] * 4, engines=1, engine=bundle(1, 16), trainer=GPU)


def test_more_than_the_cluster_has_is_an_error_with_the_sums():
    with pytest.raises(PlacementError, match=r"needs \{'CPU': 5.0\} in all .* has \{'CPU': 4.0\}"):
        plan([{"CPU": 2}, {"CPU": 2}], tp=1, dp=3, engines=2)


def test_a_local_ray_offers_what_the_plan_reserves():
    assert local_num_cpus(10_000) == 10_000
    assert local_num_cpus(0.5) >= 1


@pytest.mark.parametrize("address,env,expected", [
    ("", {}, "local"),
    ("", {"RAY_ADDRESS": "10.0.0.1:6379"}, "10.0.0.1:6379"),
    ("", {"RAY_ADDRESS": ""}, "local"),
    ("local", {"RAY_ADDRESS": "10.0.0.1:6379"}, "local"),
    ("auto", {}, "auto"),
    ("ray://head:10001", {"RAY_ADDRESS": "10.0.0.1:6379"}, "ray://head:10001"),
])
def test_cluster_address_resolution(address, env, expected):
    assert resolve_address(address, env) == expected


def test_an_engine_bound_to_every_interface_is_reached_at_its_node_address():
    assert advertised("http://0.0.0.0:4321", "10.0.0.7") == "http://10.0.0.7:4321"
    assert advertised("http://10.0.0.7:4321", "10.0.0.8") == "http://10.0.0.7:4321"
    assert advertised("http://[::]:4321", "fd00::7") == "http://[fd00::7]:4321"


def test_cluster_section_is_typed():
    r = load_recipe(None, ["cluster.address=auto", "cluster.cpus_per_engine=2"])
    assert (r.cluster.address, r.cluster.cpus_per_engine) == ("auto", 2.0)
    with pytest.raises(RecipeError, match="cluster.adress"):
        load_recipe(None, ["cluster.adress=auto"])
    with pytest.raises(RecipeError, match="cluster.cpus_per_engine"):
        load_recipe(None, ["cluster.cpus_per_engine=0"])


def test_an_address_where_nothing_listens_fails_at_once_naming_it():
    import socket

    from rlkit.driver.placement import check_reachable

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ConnectionError, match=f"nothing accepts connections at 127.0.0.1:{port}"):
        check_reachable(f"ray://127.0.0.1:{port}")
    with pytest.raises(ConnectionError, match="is not 'host:port'"):
        check_reachable("head-node")
    check_reachable("auto")  # Ray finds it itself


# -- colocated ----------------------------------------------------------------------------------
def colocated(engines=1, tp=1, dp=1, gpus_per_engine=1, on_gpu=True, nodes=({"CPU": 16, "GPU": 1},)):
    return plan_colocated(num_engines=engines, gpus_per_engine=gpus_per_engine, engine_cpus=1,
                          tp=tp, dp=dp, train_cpus=1, on_gpu=on_gpu, nodes=list(nodes))


def test_one_gpu_holds_the_trainer_rank_and_the_engine_each_with_half_of_it():
    p = colocated()
    assert p.colocated and p.engines.bundles == ()
    assert [g.bundles for g in p.trainer] == [({"CPU": 2.0, "GPU": 1.0},)]
    assert p.engine_slots == ((0, 0),) and p.gpu_share == 0.5
    assert p.totals() == {"CPU": 2.0, "GPU": 1.0}


def test_colocated_on_cpu_spreads_engines_over_the_ranks_bundles():
    p = colocated(engines=3, dp=2, on_gpu=False, nodes=({"CPU": 8},))
    assert p.engine_slots == ((0, 0), (0, 1), (0, 0)) and p.gpu_share == 1.0
    assert [g.bundles for g in p.trainer] == [({"CPU": 3.0},) * 2]  # the fullest rank's size


@pytest.mark.parametrize("kwargs, match", [
    (dict(engines=2), r"2 engines x 1 GPU != 1 trainer ranks .*num_engines to 1"),
    (dict(gpus_per_engine=2), "engines of one GPU"),
    (dict(engines=2, dp=2), r"needs \{'CPU': 4.0, 'GPU': 2.0\} in all.*has \{'CPU': 16.0, 'GPU': 1.0\}"),
])
def test_colocated_refuses_at_once_what_it_cannot_place(kwargs, match):
    with pytest.raises(PlacementError, match=match):
        colocated(**kwargs)


@given(tp=st.sampled_from([1, 2, 4]), dp=st.integers(1, 4), per_node=st.sampled_from([1, 2, 4, 8]))
def test_colocated_puts_exactly_one_engine_on_each_rank_s_gpu(tp, dp, per_node):
    world = tp * dp
    nodes = [{"CPU": 64, "GPU": per_node}] * -(-world // per_node)
    p = colocated(engines=world, tp=tp, dp=dp, nodes=nodes)
    assert sorted(p.engine_slots) == sorted(p.trainer_slots())  # one engine per rank's bundle
    assert all(b["GPU"] == 1.0 for g in p.trainer for b in g.bundles)
    assert p.gpu_share * 2 <= 1.0  # the rank and the engine fit the one GPU


def test_the_trainer_takes_the_nodes_cores_only_where_the_engines_wait():
    from rlkit.driver.placement import trainer_threads

    one = dict(train_threads=0, reserved_cpus=1.0, one_node=True, cores=2)
    assert trainer_threads(**one, overlaps=False, ranks=1) == 2  # sync: the engines wait
    assert trainer_threads(**one, overlaps=True, ranks=1) == 1  # stream/async: beside them
    assert trainer_threads(**{**one, "cores": 16}, overlaps=False, ranks=4) == 4
    assert trainer_threads(**{**one, "one_node": False}, overlaps=False, ranks=1) == 1
    assert trainer_threads(**{**one, "train_threads": 3}, overlaps=True, ranks=1) == 3
    assert trainer_threads(**{**one, "reserved_cpus": 4.0}, overlaps=False, ranks=1) == 4


def test_frozen_engines_get_bundles_of_their_own_or_are_refused_with_the_numbers():
    """rollout.frozen_engines: one bundle per frozen engine (its CPUs, and GPUs as the policy's
    engines get them), refused before any placement group is made when the cluster cannot hold
    them beside the trainer and the policy's engines."""
    from pathlib import Path

    from rlkit.config import load_recipe
    from rlkit.driver.cluster import Cluster, check_frozen_fit
    from rlkit.driver.placement import GroupPlan, PlacementError

    root = Path(__file__).resolve().parents[2]
    r = load_recipe(root / "recipes" / "grpo_tiny_ci.yaml", [
        "rollout.frozen_engines={teacher: {role: teacher, model: tiny, engine: {num_engines: 2}}, "
        "judge: {role: judge, model: tiny, engine: {kind: sglang, gpus_per_engine: 2}}}",
        "train.algorithm.distill_coef=1"])
    bundles = Cluster(r, "unused", Path("/tmp/unused"))._frozen_bundles()
    cpus = r.cluster.cpus_per_engine
    assert bundles == [{"CPU": cpus}, {"CPU": cpus}, {"CPU": cpus, "GPU": 2.0}]
    placed = [GroupPlan("trainer", "PACK", ({"CPU": 1.0, "GPU": 1.0},)),
              GroupPlan("engines", "PACK", ({"CPU": 1.0, "GPU": 1.0},) * 2)]
    check_frozen_fit(placed, bundles, [{"CPU": 16.0, "GPU": 5.0}])  # 3 + 2 GPUs: fits
    with pytest.raises(PlacementError, match="need 2 GPUs beside the 3 .* the cluster has 4"):
        check_frozen_fit(placed, bundles, [{"CPU": 16.0, "GPU": 4.0}])
