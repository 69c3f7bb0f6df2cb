"""rollout.max_token_lag in the buffer: a parked sample whose oldest token would lag more than the
bound when trained is restarted from its prompt (counted), its group and siblings kept; a ready
group swept past the bound goes back to be finished; the trained tokens' lag counts
(buffers.staleness.lag_counts) match a token-by-token count."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rlkit.buffers import Place, Sample, SampleStatus
from rlkit.buffers.staleness import LAG_BUCKETS, lag_counts
from tests.buffers.helpers import finish, make_buffer


def park_with_tokens(buf, spans_of_sample):
    """Acquire one group and give each sample its (version, tokens) spans, then park it
    (requeue). A sample whose spans end with 'stop' finishes and is rewarded."""
    (g,) = buf.acquire(1)
    for s, spans in zip(g.samples, spans_of_sample):
        s.start_request()
        for version, tokens, *end in spans:
            s.append([7] * tokens, [-0.5] * tokens, version, finish_reason=end[0] if end else None)
        if s.status is SampleStatus.DONE:
            s.set_reward(1.0)
    buf.requeue(g)
    return g


def test_a_parked_sample_past_the_bound_is_restarted_and_counted_its_sibling_kept():
    buf = make_buffer(n=3, max_staleness=100, max_token_lag=2)
    # sample 0: tokens of versions 0 and 1; sample 1: of version 1 only; sample 2: finished at 0
    g = park_with_tokens(buf, [[(0, 4), (1, 2)], [(1, 5)], [(0, 3, "stop")]])
    buf.set_version(2)
    buf.set_producer_version(2)
    buf.begin_production(3)  # resumed now, trained at 3: version 0 would lag 3, version 1 lags 2
    (again,) = buf.acquire(1)
    assert again is g and buf.place_of(g) is Place.IN_FLIGHT
    s0, s1, s2 = g.samples
    assert (s0.response_ids, s0.status, s0.resumes) == ([], SampleStatus.PENDING, 0)
    assert s2.response_ids == [] and s2.reward is None  # finished, but it would lag 3 as well
    assert s1.versions == [1] * 5 and s1.status is SampleStatus.PARTIAL  # within the bound: kept
    stats = buf.stats()
    assert (stats["lag_restarts"], stats["lag_restart_tokens"]) == (2, 9)
    assert stats["discarded_tokens"] == 9 and stats["dropped"] == 0 and stats["balanced"]


def test_within_the_bound_nothing_is_restarted_and_without_one_nothing_ever_is():
    for bound, restarts in ((3, 0), (None, 0), (0, 1)):
        buf = make_buffer(n=1, max_staleness=100, max_token_lag=bound)
        park_with_tokens(buf, [[(0, 4)]])
        buf.set_version(3)
        buf.set_producer_version(3)
        (g,) = buf.acquire(1)
        assert buf.stats()["lag_restarts"] == restarts
        assert len(g.samples[0].response_ids) == 4 * (1 - restarts)


def test_a_ready_group_past_the_bound_goes_back_with_its_lagging_samples_restarted():
    buf = make_buffer(n=2, max_staleness=100, max_token_lag=1)
    (g,) = buf.acquire(1)
    finish(g, version=0, tokens=3)
    assert buf.complete(g).queued
    buf.set_version(1)  # lag 1: still ready
    assert buf.place_of(g) is Place.READY
    buf.set_version(2)  # lag 2 > 1: the group goes back to be generated again, not dropped
    assert buf.place_of(g) is Place.PARTIAL and buf.take_nowait(1) == []
    assert all(s.status is SampleStatus.PENDING for s in g.samples)
    stats = buf.stats()
    assert (stats["lag_restarts"], stats["lag_restart_tokens"], stats["dropped"]) == (2, 6, 0)
    (again,) = buf.acquire(1)
    finish(again, version=2)
    buf.complete(again)
    (trained,) = buf.take_nowait(1)
    assert trained is g and {v for s in g.samples for v in s.versions} == {2}


def test_a_group_completed_for_the_next_version_is_checked_against_it():
    """Async mode: a step produces for the consumer's version + 1 and its groups are trained
    there, so a group it completes is checked against that version (not the consumer's): it is
    never counted ready and then restarted when the weights move mid-step. Leftover ready
    groups are checked again when the next production begins, before it counts them."""
    buf = make_buffer(n=1, max_staleness=100, max_token_lag=2)
    park_with_tokens(buf, [[(0, 4)]])
    buf.set_version(1)
    buf.set_producer_version(1)
    buf.begin_production(2)  # lag 2 at 2: resumed with its tokens
    (g,) = buf.acquire(1)
    assert len(g.samples[0].response_ids) == 4
    buf.set_version(2)  # (a production for 3 starts below; the group completes during it)
    buf.set_producer_version(2)
    buf.begin_production(3)
    finish(g, version=2)
    assert not buf.complete(g).queued  # version 0 would lag 3 at version 3: not ready
    assert buf.place_of(g) is Place.PARTIAL and buf.stats()["lag_restarts"] == 1
    (h,) = buf.acquire(1)
    finish(h, version=2)
    assert buf.complete(h).queued  # a leftover: ready for 3
    assert buf.count(Place.READY) == 1
    buf.set_version(3)
    buf.set_producer_version(3)
    buf.begin_production(4)  # lags 2 at 4: still ready
    assert buf.count(Place.READY) == 1
    buf.set_version(4)
    buf.set_producer_version(4)
    buf.begin_production(5)  # lags 3 at 5: back to partial before the step counts it
    assert buf.count(Place.READY) == 0 and buf.stats()["lag_restarts"] == 2


def test_must_finish_says_which_groups_cannot_be_resumed_next_step():
    buf = make_buffer(n=1, rows=9, max_staleness=100, max_token_lag=2)
    assert not make_buffer(n=1).must_finish(make_buffer(n=1).acquire(1)[0])  # no bound: never
    park_with_tokens(buf, [[(0, 3)]])
    buf.set_version(1)
    buf.set_producer_version(1)
    (g,) = buf.acquire(1)
    (fresh,) = buf.acquire(1)
    assert not buf.must_finish(g)  # version 0 lags 2 at version 2: it may be resumed once more
    assert not buf.must_finish(fresh)  # its tokens get version 1
    buf.begin_production(2)  # async: a step for version 2 with the engines at 1
    assert buf.must_finish(g)  # 3 at version 3: this step is its last
    assert not buf.must_finish(fresh)  # tokens of version 1 lag 2 at 3


def test_under_the_bound_the_trainer_takes_the_oldest_tokens_first():
    for bound, order in ((None, [0, 1, 2]), (5, [1, 2, 0])):
        buf = make_buffer(n=1, max_staleness=100, max_token_lag=bound)
        groups = buf.acquire(3)
        finish(groups[1], version=0)
        finish(groups[2], version=0)
        buf.set_version(2)
        buf.set_producer_version(2)
        finish(groups[0], version=2)
        # completed in the order 0 (versions 2), 1 (0), 2 (0)
        for g in groups:
            buf.complete(g)
        taken = buf.take_nowait(3)
        assert [groups.index(g) for g in taken] == order


def test_async_admission_respects_the_token_bound():
    buf = make_buffer(n=1, max_staleness=4, max_token_lag=0)
    assert buf.max_ahead == 0 and buf.admits(0) and not buf.admits(1)
    assert make_buffer(n=1, max_staleness=4, max_token_lag=2).max_ahead == 2
    assert make_buffer(n=1, max_staleness=1, max_token_lag=3).max_ahead == 1
    assert make_buffer(n=1, max_staleness=4).max_ahead == 4
    with pytest.raises(ValueError, match="max_token_lag must be >= 0"):
        make_buffer(max_token_lag=-1)


def test_the_counters_survive_a_save_and_load():
    buf = make_buffer(n=1, max_staleness=100, max_token_lag=0)
    park_with_tokens(buf, [[(0, 4)]])
    buf.set_version(1)
    buf.acquire(1)
    restored = make_buffer(n=1, max_staleness=100, max_token_lag=0)
    restored.load_state_dict(buf.state_dict())
    assert (restored.stats()["lag_restarts"], restored.stats()["lag_restart_tokens"]) == (1, 4)


def test_lag_counts_known_answer_for_a_sample_spanning_three_versions():
    s = Sample(0, 0, (1,))
    s.append([1] * 3, [-0.1] * 3, 4)  # lag 3 at 7
    s.append([1] * 2, [-0.1] * 2, 5, trainable=False)  # an observation: not trained
    s.append([1] * 5, [-0.1] * 5, 6)  # lag 1
    s.append([1] * 1, [-0.1] * 1, 7)  # lag 0
    assert lag_counts([s], 7) == ([1, 5, 0, 3], 3)
    assert lag_counts([s], 9) == ([0, 0, 1, 8], 5)  # version 7 lags 2, the rest 3+
    assert lag_counts([], 3) == ([0] * LAG_BUCKETS, 0)


@st.composite
def samples(draw):
    out = []
    for i in range(draw(st.integers(0, 4))):
        s = Sample(i, 0, (1,))
        version = draw(st.integers(0, 3))
        for _ in range(draw(st.integers(0, 4))):
            version += draw(st.integers(0, 2))
            n = draw(st.integers(0, 5))
            s.append([2] * n, [-0.1] * n, version, trainable=draw(st.booleans()))
        out.append(s)
    return out


@settings(max_examples=200, deadline=None)
@given(samples(), st.integers(0, 15))
def test_lag_counts_equal_a_token_by_token_count(batch, consumer):
    counts, most = [0] * LAG_BUCKETS, 0
    for s in batch:
        for v, m in zip(s.versions, s.loss_mask):
            if m:
                lag = max(0, consumer - v)
                counts[min(lag, LAG_BUCKETS - 1)] += 1
                most = max(most, lag)
    assert lag_counts(batch, consumer) == (counts, most)


class LagMachine(RuleBasedStateMachine):
    """Groups generated across version moves (sync-like: the engines follow the trainer; or a
    producer one version ahead, as async): whatever happens, no sample handed out for
    resumption lags more than the bound against the version it is produced for, no trained
    token lags more than it, and every generated token is live, trained or counted discarded."""

    @initialize(bound=st.integers(0, 2), n=st.integers(1, 3), ahead=st.booleans())
    def setup(self, bound, n, ahead):
        self.bound, self.ahead = bound, ahead and bound >= 1
        self.buf = make_buffer(n=n, rows=6, max_staleness=1000, max_token_lag=bound)
        self.flying, self.generated, self.trained_tokens = {}, 0, 0
        if self.ahead:
            self.buf.begin_production(1)

    @rule(k=st.integers(1, 3))
    def acquire(self, k):
        for g in self.buf.acquire(k):
            for s in g.samples:
                if s.versions:
                    assert self.buf._producing_for - s.versions[0] <= self.bound
            self.flying[g.group_id] = g

    @precondition(lambda self: self.flying)
    @rule(data=st.data(), tokens=st.integers(1, 4), stop=st.booleans())
    def generate(self, data, tokens, stop):
        g = self.flying[data.draw(st.sampled_from(sorted(self.flying)))]
        for s in g.to_generate():
            s.start_request()
            s.append([3] * tokens, [-0.1] * tokens, self.buf.producer_version,
                     finish_reason="stop" if stop else None)
            self.generated += tokens
            if stop:
                s.set_reward(1.0)

    @precondition(lambda self: self.flying)
    @rule(data=st.data())
    def park_or_complete(self, data):
        g = self.flying.pop(data.draw(st.sampled_from(sorted(self.flying))))
        if g.trainable:
            self.buf.complete(g)
        else:
            self.buf.requeue(g)

    @rule()
    def bump(self):
        v = self.buf.version + 1
        ready = self.buf.count(Place.READY)
        self.buf.set_version(v)
        if self.ahead:  # what a running step counted as ready stays ready when the weights move
            assert self.buf.count(Place.READY) == ready
        self.buf.set_producer_version(v)
        if self.ahead:
            self.buf.begin_production(v + 1)

    @rule(k=st.integers(1, 2))
    def take(self, k):
        for g in self.buf.take_nowait(k):
            counts, most = lag_counts(g.samples, self.buf.version)
            assert most <= self.bound
            self.trained_tokens += sum(counts)

    @invariant()
    def ready_groups_fit_the_version_they_are_trained_at(self):
        for g in self.buf.queued(Place.READY):
            assert lag_counts(g.samples, self.buf._producing_for)[1] <= self.bound

    @invariant()
    def every_token_is_accounted_for(self):
        stats = self.buf.stats()
        live = sum(g.tokens for place in (Place.PARTIAL, Place.LONG, Place.READY)
                   for g in self.buf.queued(place)) + sum(g.tokens for g in self.flying.values())
        assert self.generated == live + self.trained_tokens + stats["discarded_tokens"]
        assert stats["lag_restart_tokens"] <= stats["discarded_tokens"] and stats["balanced"]


TestLagMachine = LagMachine.TestCase
TestLagMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


def test_acquire_hands_out_no_more_last_chance_groups_than_its_limit():
    buf = make_buffer(n=1, rows=9, max_staleness=100, max_token_lag=1)
    older = buf.acquire(3)
    for g in older:
        g.samples[0].start_request()
        g.samples[0].append([7] * 3, [-0.5] * 3, 0)
        buf.requeue(g)
    buf.set_version(1)
    buf.set_producer_version(1)
    buf.begin_production(1)  # the parked tokens (version 0) lag 2 at version 2: last chance
    got = buf.acquire(5, must_limit=2)
    # two last-chance groups, oldest first, then fresh ones (they may wait a step); the third
    # stays parked where it was
    assert got[:2] == older[:2] and len(got) == 5
    assert [buf.must_finish(g) for g in got] == [True, True, False, False, False]
    assert buf.queued(Place.PARTIAL) == [older[2]]
    buf.begin_production(2)  # one version ahead: fresh groups are on their last chance too
    assert buf.acquire(5, must_limit=0) == []  # the parked one stays, no prompt is drawn
    again = buf.acquire(5, must_limit=2)
    assert again[0] is older[2] and len(again) == 2
    # its version-0 tokens would lag 2 at version 2: restarted as it left the queue (counted)
    assert buf.stats()["lag_restarts"] == 1 and buf.stats()["balanced"]


def test_unfinished_versions_counts_the_responses_of_live_groups_by_their_first_token():
    """What LoRA's resume 'own' keeps adapters for: unfinished responses in flight or parked,
    by the version they began under; finished and empty ones do not count."""
    from rlkit.buffers import ListPromptSource, RolloutBuffer
    from rlkit.buffers.source import records_from_token_lists

    buf = RolloutBuffer(ListPromptSource(records_from_token_lists([[1, i] for i in range(4)]),
                                         shuffle=False), n_samples_per_prompt=2)
    a, b = buf.acquire(2)
    a.samples[0].append([5, 6], [-0.1, -0.2], 1)
    a.samples[0].append([7], [-0.3], 2)
    a.samples[0].interrupt()  # parked: began under v1
    a.samples[1].append([5], [-0.1], 2, finish_reason="stop")  # finished: not counted
    b.samples[0].append([8], [-0.1], 2)  # running under v2
    assert buf.unfinished_versions() == {1: 1, 2: 1}
    buf.requeue(a)  # parked in the partial queue: still counted
    assert buf.unfinished_versions() == {1: 1, 2: 1}
