"""The weight sync's choice of transport by topology (train/weight_sync/topology.py), property-tested
over random placements: NCCL never gets two ranks on one GPU, SGLang's rank layout, same-device
engines in memory, a requested disk or distributed honoured."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.train.weight_sync.topology import Place, TopologyError, plan_weight_sync

NODES = ["n0", "n1"]
DEVICES = ["cpu", "cuda:0", "cuda:1", "cuda:2"]

places = st.builds(Place, st.sampled_from(NODES), st.sampled_from(DEVICES))
engines = st.lists(st.lists(places, min_size=1, max_size=3), min_size=1, max_size=5)
methods = st.sampled_from(["auto", "distributed", "disk"])


def group_ranks(plan, engine_places):
    """(rank, place) of every member of the broadcast group, the trainer as rank 0."""
    members = [(0, plan.trainer)]
    for e in plan.engines:
        if e.method == "distributed":
            members += [(e.rank_offset + r, p) for r, p in enumerate(engine_places[e.index])]
    return members


@settings(max_examples=400, deadline=None)
@given(trainer=places, engine_places=engines, method=methods)
def test_plan_invariants_over_random_placements(trainer, engine_places, method):
    plan = plan_weight_sync(trainer, engine_places, method=method)
    assert [e.index for e in plan.engines] == list(range(len(engine_places)))
    assert [e.tp_size for e in plan.engines] == [len(r) for r in engine_places]
    members = group_ranks(plan, engine_places)
    ranks = [r for r, _ in members]
    # ranks unique and contiguous from 0 (the trainer), each engine's TP ranks at rank_offset + tp_rank
    assert sorted(ranks) == list(range(plan.world_size))
    assert plan.world_size == 1 + sum(e.tp_size for e in plan.engines if e.method == "distributed")
    offsets = [e.rank_offset for e in plan.engines if e.method == "distributed"]
    assert offsets == sorted(offsets)  # in engine order, as SGLang's callers give them
    assert all(e.rank_offset == 0 for e in plan.engines if e.method != "distributed")
    assert plan.backend == ("" if plan.world_size == 1 else "nccl" if trainer.on_gpu else "gloo")
    if plan.backend == "nccl":
        devices = [(p.node, p.device) for _, p in members]
        assert len(devices) == len(set(devices)), "two NCCL ranks on one GPU"
        assert all(p.on_gpu for _, p in members), "a CPU rank in an NCCL group"
    for e in plan.engines:
        ranks_at = engine_places[e.index]
        same_place = all(p.node == trainer.node and p.device in (trainer.device, "cpu") for p in ranks_at)
        if method == "disk":
            assert e.method == "disk"
        elif method == "distributed":
            assert e.method != "tensor"
        elif same_place and (all(p.device == "cpu" for p in ranks_at)
                             or all(p.device == trainer.device for p in ranks_at)):
            assert e.method == "tensor"  # auto: same node and device always in memory
        if e.method == "tensor":
            assert same_place
            assert e.memory == ("shared_memory" if all(p.device == "cpu" for p in ranks_at) else "cuda_ipc")
            if e.memory == "cuda_ipc":
                assert trainer.on_gpu and all(p.device == trainer.device for p in ranks_at)
        else:
            assert e.memory == ""
        # an engine sharing the trainer's GPU can never be in the NCCL group
        if trainer.on_gpu and any((p.node, p.device) == (trainer.node, trainer.device) for p in ranks_at):
            assert e.method != "distributed"
        if trainer.device == "cpu" and method != "disk":
            assert e.method != "disk"  # gloo takes anything the memory path does not
    assert plan.describe().count("\n") == len(plan.engines)


@settings(max_examples=200, deadline=None)
@given(trainer=places, engine_places=engines)
def test_tensor_is_all_or_an_error_naming_the_engines(trainer, engine_places):
    auto = plan_weight_sync(trainer, engine_places, method="auto")
    if all(e.method == "tensor" for e in auto.engines):
        strict = plan_weight_sync(trainer, engine_places, method="tensor")
        assert strict == auto and strict.world_size == 1 and strict.backend == ""
    else:
        with pytest.raises(TopologyError) as err:
            plan_weight_sync(trainer, engine_places, method="tensor")
        for e in auto.engines:
            assert (f"engine {e.index} (" in str(err.value)) == (e.method != "tensor")


def test_one_gpu_colocated_goes_in_memory_and_never_to_nccl():
    t = Place("n0", 0)
    plan = plan_weight_sync(t, [[Place("n0", 0)], [Place("n0", 0)]])
    assert [e.method for e in plan.engines] == ["tensor", "tensor"]
    assert {e.memory for e in plan.engines} == {"cuda_ipc"}
    assert (plan.backend, plan.world_size) == ("", 1)
    forced = plan_weight_sync(t, [[Place("n0", 0)]], method="distributed")
    assert forced.engines[0].method == "disk" and "NCCL refuses" in forced.engines[0].reason


def test_sglang_rank_layout_with_tp_engines_and_a_shared_gpu():
    t = Place("n0", "cuda:0")
    plan = plan_weight_sync(t, [
        [Place("n0", 1), Place("n0", 2)],      # TP 2 on GPUs 1, 2: ranks 1, 2
        [Place("n1", 0), Place("n1", 1)],      # TP 2 on the other node: ranks 3, 4
        [Place("n0", 2)],                      # shares GPU 2 with engine 0: disk
        [Place("n0", 0), Place("n0", 0)],      # TP 2 on the trainer's GPU: in memory
        [Place("n0", "cpu")],                  # this node's CPU: shared memory
        [Place("n1", "cpu")],                  # another node's CPU: no NCCL rank on a CPU
    ])
    got = [(e.method, e.rank_offset, e.memory) for e in plan.engines]
    assert got == [("distributed", 1, ""), ("distributed", 3, ""), ("disk", 0, ""),
                   ("tensor", 0, "cuda_ipc"), ("tensor", 0, "shared_memory"), ("disk", 0, "")]
    assert (plan.backend, plan.world_size) == ("nccl", 5)
    assert list(plan.engines[1].ranks) == [3, 4]
    assert plan.indices("disk") == (2, 5)
    text = plan.describe()
    assert "nccl group of 5 ranks" in text and "engine 1: distributed, ranks 3..4, tp 2" in text


def test_cpu_trainer_uses_gloo_and_shared_memory():
    t = Place("n0")
    plan = plan_weight_sync(t, [[Place("n0")], [Place("n1")], [Place("n0", 0)]])
    assert [(e.method, e.memory) for e in plan.engines] == [
        ("tensor", "shared_memory"), ("distributed", ""), ("distributed", "")]
    assert (plan.backend, plan.world_size, plan.engines[2].rank_offset) == ("gloo", 3, 2)


def test_bad_input_is_refused():
    with pytest.raises(TopologyError, match="no TP rank"):
        plan_weight_sync(Place("n0"), [[]])
    with pytest.raises(TopologyError, match="method must be"):
        plan_weight_sync(Place("n0"), [[Place("n0")]], method="nccl")  # type: ignore[arg-type]
    assert Place("n0", "CPU").device == "cpu" and Place("n0", 3).device == "cuda:3"
