"""The real RolloutManager, policies and buffer on simulated engines, in virtual time."""

from __future__ import annotations

import math

import pytest

from rlkit.buffers.sample import SampleStatus
from rlkit.rollout.policies import PartialPolicy, SyncPolicy
from rlkit.sim.engine import SimConfig
from rlkit.sim.simulate import run_simulation
from rlkit.rollout.engines.profile import constant_profile, load_profile
from rlkit.sim.trace import TraceSpec, generate_trace
from rlkit.sim.train_time import TrainTimeModel
from tests.sim.helpers import InvariantChecker

TRACE = generate_trace(TraceSpec(rows=256, epochs=2, cap=2048, group_size=4, batch_size=8))
PROFILE = constant_profile([0.004, 0.005, 0.008], [1, 16, 64], prefill_s_per_token=2e-5,
                           kv_s_per_token=2e-8, max_running_requests=64)


def run(policy, steps=8, **kw):
    cluster = kw.pop("cluster", None) or SimConfig(2, PROFILE)
    return run_simulation(cluster, TRACE, policy, steps=steps, batch_size=8, **kw)


def test_every_token_the_manager_counts_was_decoded_by_an_engine():
    for policy in (SyncPolicy(), PartialPolicy(2.0)):
        for r in run(policy):
            assert r.tokens_generated == r.engine_tokens > 0
            assert r.groups_completed >= 8
            assert 0.0 <= r.idle_share <= 1.0
            assert r.bound_ratio >= 1.0 - 1e-9  # nothing beats the bubble-free bound


def test_same_seed_same_results():
    a = run(PartialPolicy(1.5), steps=5, train=TrainTimeModel(params=1e8, gpus=1))
    b = run(PartialPolicy(1.5), steps=5, train=TrainTimeModel(params=1e8, gpus=1))
    assert [x.to_json() for x in a] == [x.to_json() for x in b]


def test_responses_have_their_traced_lengths_whatever_the_policy():
    """The replay key is (prompt, epoch, slot): sync and partial train the same responses."""
    seen: dict[str, dict[tuple[int, int, int], int]] = {}
    for policy in (SyncPolicy(), PartialPolicy(2.0)):
        lengths = seen.setdefault(policy.name, {})

        def collect(step, groups, lengths=lengths):
            for g in groups:
                for s in g.samples:
                    key = (g.prompt.source_index, g.prompt.epoch, s.slot)
                    natural = TRACE.length(*key)
                    assert len(s.response_ids) == natural
                    if natural < TRACE.cap:
                        assert s.status is SampleStatus.DONE and s.finish_reason == "stop"
                    else:
                        assert s.status is SampleStatus.TRUNCATED
                    lengths[key] = natural

        run(policy, steps=6, on_batch=collect)
    common = set(seen["sync"]) & set(seen["partial"])
    assert len(common) > 40
    assert all(seen["sync"][k] == seen["partial"][k] for k in common)


def test_partial_rollouts_beat_sync_on_a_long_tail():
    sync = run(SyncPolicy(), steps=12)[4:]
    partial = run(PartialPolicy(2.0), steps=12)[4:]

    def tput(rs):
        return sum(r.tokens_generated for r in rs) / sum(r.rollout_s for r in rs)

    assert tput(partial) > 1.1 * tput(sync)
    assert sum(r.rollout_s for r in partial) < sum(r.rollout_s for r in sync)
    assert all(r.groups_resumed > 0 for r in partial)
    assert max(r.max_versions_per_sample for r in partial) >= 2
    assert all(r.resumed_token_share == 0 for r in sync)


def test_kv_capacity_holds_through_whole_steps_with_preemption():
    checker = InvariantChecker()
    cluster = SimConfig(2, PROFILE, kv_capacity_tokens=3500, reserve_ratio=0.0)
    results = run(PartialPolicy(2.0), steps=4, cluster=cluster, observer=checker)
    assert sum(r.preemptions for r in results) > 0
    assert max(checker.max_kv.values()) <= 3500
    assert all(r.tokens_generated == r.engine_tokens for r in results)


def test_end_to_end_step_adds_training_and_sync():
    train = TrainTimeModel(params=1e9, gpus=2)
    [r] = run(SyncPolicy(), steps=1, train=train)
    assert r.train_tokens > 0
    assert r.step_s == pytest.approx(r.rollout_s + r.train_s + train.sync_s())
    # 2 data-parallel replicas: the slowest holds at most one sample more than an even share
    assert train.train_s(r.train_tokens) - 1e-9 <= r.train_s
    assert r.train_s <= train.train_s(r.train_tokens) + 2 * 24_000 / train.tokens_per_s


def test_the_trainer_s_time_counts_the_tail_s_attention_and_its_slowest_replica():
    """TrainTimeModel.batch_s: n + w n^2 token-equivalents per sample, balanced over the
    data-parallel replicas by cost (the trainer's rule), the slowest replica timed."""
    even = TrainTimeModel(params=1e9, gpus=2, overhead_s=0.0)
    assert even.batch_s([100, 100]) == pytest.approx(even.train_s(200) - 0.0)
    assert even.batch_s([300, 100]) == pytest.approx(600 / even.tokens_per_s)  # 300 waits
    one = TrainTimeModel(params=1e9, gpus=2, overhead_s=0.0, model_parallel=2)
    assert one.dp == 1 and one.batch_s([300, 100]) == pytest.approx(one.train_s(400))
    w = TrainTimeModel(params=1e9, gpus=1, overhead_s=0.0, attention_weight=1e-3)
    assert w.batch_s([1000]) == pytest.approx((1000 + 1e-3 * 1000 ** 2) / w.tokens_per_s)
    with pytest.raises(ValueError, match="whole replicas"):
        TrainTimeModel(params=1e9, gpus=3, model_parallel=2)


def test_a_packaged_gpu_profile_runs_a_step_at_scale_quickly():
    """128 engines, 32k cap: one sync step (the slowest policy: a full tail) in virtual time."""
    trace = generate_trace(TraceSpec(rows=600, epochs=1, cap=32768, group_size=8,
                                     batch_size=256))
    cluster = SimConfig(128, load_profile("h100-qwen3-4b-tp1"))
    [r] = run_simulation(cluster, trace, SyncPolicy(), steps=1, batch_size=256)
    assert r.groups_completed == 256 and r.tokens_generated == r.engine_tokens
    assert r.rollout_s > 60 and math.isfinite(r.bound_ratio)



def test_timeline_labels_agree_with_how_trained_samples_ended(tmp_path):
    """A budget larger than the trace's cap: a response at the trace's cap was truncated in
    the trace ('length'), one that ended below it stopped ('stop'), in the timeline as on the
    sample."""
    from rlkit.rollout.timeline import read_timeline

    trace = generate_trace(TraceSpec(rows=64, epochs=2, cap=256, group_size=4, batch_size=4))
    cluster = SimConfig(2, constant_profile([0.005, 0.01], [1, 32], prefill_s_per_token=1e-5))
    ended: dict[tuple[int, int], str] = {}

    def on_batch(step, groups):
        for g in groups:
            for smp in g.samples:
                ended[(g.group_id, smp.index)] = smp.finish_reason

    run_simulation(cluster, trace, SyncPolicy(), steps=3, batch_size=4, max_new_tokens=4096,
                   timeline_path=tmp_path / "timeline.jsonl", on_batch=on_batch)
    last = {(s.group_id, s.sample_index): s.outcome
            for tl in read_timeline(tmp_path) for s in tl.spans}
    assert ended and {k: last[k] for k in ended} == ended
    assert set(ended.values()) == {"stop", "length"}
