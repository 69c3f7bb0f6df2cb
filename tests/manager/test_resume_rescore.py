"""rollout.max_resume_log_ratio in the manager: a resumed sample whose parked tokens were
re-scored past the bound is restarted from its prompt in the same step, counted, its tokens
discarded and accounted; within the bound, or unbounded, it continues as before. (The engine's
re-score itself, through HTTP and the built-in engine: tests/rollout/test_engines_integration.)"""

import asyncio

import pytest

from rlkit.buffers import ListPromptSource, Place, RolloutBuffer, Sample, SampleStatus
from rlkit.buffers.sample import SampleError
from rlkit.buffers.source import records_from_token_lists
from rlkit.rollout.config import RolloutConfig, SamplingConfig
from rlkit.rollout.manager import RolloutManager
from rlkit.rollout.policies import PartialPolicy
from rlkit.rollout.reward_scheduler import RewardScheduler
from tests.manager.fakes import FakeEngines, constant_reward


class RescoringEngines(FakeEngines):
    """Fake engines that re-score every resumed sample's parked tokens at `ratio`, and cut the
    request at once past `bound`, as EngineClient does at the first chunk (the real re-score,
    through HTTP and the built-in engine: tests/rollout/test_engines_integration.py)."""

    def __init__(self, ratio: float, bound: float | None) -> None:
        super().__init__(lambda s: 400 if s.group_id in (0, 1) else 8)
        self.ratio, self.bound = ratio, bound
        self.rescored = 0

    async def generate(self, sample, sampling, *, max_new_tokens, version, worker=None):
        if sample.status is not SampleStatus.PARTIAL:
            return await super().generate(sample, sampling, max_new_tokens=max_new_tokens,
                                          version=version, worker=worker)
        self.rescored += 1
        if self.bound is not None and abs(self.ratio) > self.bound:
            sample.start_request()
            sample.resume_log_ratio = self.ratio
            sample.interrupt()
            return worker or "fake0"
        out = await super().generate(sample, sampling, max_new_tokens=max_new_tokens,
                                     version=version, worker=worker)
        sample.resume_log_ratio = self.ratio  # the request's re-score, within the bound
        return out


def make(ratio: float, bound: float | None):
    buf = RolloutBuffer(ListPromptSource(records_from_token_lists([[1, i] for i in range(20)]),
                                         shuffle=False), n_samples_per_prompt=2)
    engines = RescoringEngines(ratio, bound)
    mgr = RolloutManager(buf, engines, PartialPolicy(over_provision=2.0),
                         SamplingConfig(max_new_tokens=1000), RewardScheduler(constant_reward),
                         max_resume_log_ratio=bound)
    return buf, engines, mgr


def long_samples(buf) -> list[Sample]:
    """The samples of the long groups 0 and 1, wherever they are (ready or parked again)."""
    groups = buf.queued(Place.PARTIAL) + buf.queued(Place.READY)
    return [s for g in groups if g.group_id in (0, 1) for s in g.samples]


@pytest.mark.parametrize("ratio, bound, restarted", [
    (0.5, 0.2, True), (-0.5, 0.2, True), (0.1, 0.2, False), (0.5, None, False)])
async def test_a_resumed_sample_past_the_bound_is_restarted_in_the_step(ratio, bound, restarted):
    buf, engines, mgr = make(ratio, bound)
    await asyncio.wait_for(mgr.run_step(target=3, version=0), 20)
    parked = buf.queued(Place.PARTIAL)
    parked_tokens = sum(len(s.response_ids) for g in parked for s in g.samples)
    resumable = sum(1 for g in parked for s in g.samples if s.status is SampleStatus.PARTIAL)
    assert {g.group_id for g in parked} == {0, 1} and resumable == 4 and parked_tokens > 0
    discarded0 = buf.stats()["discarded_tokens"]

    buf.set_version(1)
    r = await asyncio.wait_for(mgr.run_step(target=3, version=1), 20)
    assert engines.rescored == 4
    stats = buf.stats()
    assert stats["balanced"]
    long = long_samples(buf)
    assert len(long) == 4
    if restarted:
        # every resumed sample forgot its parked tokens and was generated again at version 1
        assert r.resume_rescored == 4
        assert r.metrics()["rollout/resume_abs_log_ratio"] == pytest.approx(abs(ratio))
        assert r.mismatch_restarts == stats["mismatch_restarts"] == 4
        assert r.metrics()["rollout/mismatch_restarts"] == 4
        assert r.mismatch_restart_tokens == stats["mismatch_restart_tokens"] == parked_tokens
        assert stats["discarded_tokens"] - discarded0 >= parked_tokens
        assert all(set(s.versions) <= {1} and s.resumes == 0 for s in long)
    else:
        assert r.mismatch_restarts == stats["mismatch_restarts"] == 0
        assert r.mismatch_restart_tokens == 0
        assert all(s.versions[0] == 0 and s.resumes == 1 for s in long)


def test_rescore_is_the_mean_log_ratio_over_model_tokens():
    s = Sample(index=0, group_id=0, prompt_ids=[1])
    s.append([5, 6], [-1.0, -2.0], 0)
    s.append([7], [-9.0], 0, trainable=False)  # a tool's tokens: never the model's
    s.append([8], [float("nan")], 1)
    assert s.rescore([-0.5, -2.5, 0.0, -1.0]) == pytest.approx((0.5 - 0.5) / 2)
    assert s.rescore([-0.5, None]) == pytest.approx(0.5)  # SGLang's None first entry
    assert s.rescore([None]) is None and s.resume_log_ratio is None
    s.rescore([0.0])
    s.interrupt()
    s.start_request()  # a new request: its own re-score or none
    assert s.resume_log_ratio is None
    with pytest.raises(SampleError, match="5 re-scored tokens for a 4-token response"):
        s.rescore([0.0] * 5)


def test_the_bound_is_refused_with_an_episode_generator():
    with pytest.raises(ValueError, match="single-turn"):
        RolloutConfig.model_validate({"max_resume_log_ratio": 0.1,
                                      "episode": {"generator": "multi_turn",
                                                  "environment": "calculator"}})
    with pytest.raises(ValueError, match="greater than 0"):
        RolloutConfig.model_validate({"max_resume_log_ratio": 0})
