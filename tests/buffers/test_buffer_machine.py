"""Property tests of the RolloutBuffer: accounting always balances, every group is in exactly one
place, and nothing handed out violates the staleness bound or the token-lag bound."""

import json

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rlkit.buffers import Place, RolloutBuffer, SampleStatus, StalenessPolicy, staleness
from rlkit.buffers.staleness import lag_counts
from tests.buffers.helpers import make_source


class BufferMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(list(StalenessPolicy)),
        max_staleness=st.integers(0, 2),
        n=st.integers(1, 3),
        max_token_lag=st.one_of(st.none(), st.integers(0, 2)),
    )
    def setup(self, policy, max_staleness, n, max_token_lag):
        self.policy, self.max_staleness, self.n = policy, max_staleness, n
        self.max_token_lag = max_token_lag
        self.buf = self._fresh()
        self.flying = {}  # group_id -> Group, as the producer sees it
        self.trained = set()

    def _fresh(self):
        return RolloutBuffer(
            make_source(5), n_samples_per_prompt=self.n,
            max_staleness=self.max_staleness, staleness_policy=self.policy,
            max_token_lag=self.max_token_lag,
        )

    def _check_handed_out(self, group):
        lag = staleness(group.oldest_version(), self.buf.version)
        assert lag <= self.max_staleness or (
            self.policy is StalenessPolicy.CORRECT and group.stale_corrected
        ), f"group {group.group_id} lags {lag} > {self.max_staleness}"
        if self.max_token_lag is not None:  # per token, whatever the staleness policy
            _, most = lag_counts(group.samples, self.buf.version)
            oldest = [s.versions[0] for s in group.samples if s.versions]
            assert not oldest or self.buf.version - min(oldest) <= self.max_token_lag
            assert most <= self.max_token_lag

    def _take_flying(self, data):
        gid = data.draw(st.sampled_from(sorted(self.flying)))
        return self.flying.pop(gid)

    @rule(k=st.integers(0, 3))
    def acquire(self, k):
        free_rows = 5 - len({g.prompt.source_index for p in (Place.IN_FLIGHT, Place.PARTIAL, Place.LONG)
                             for g in self.buf.queued(p)})
        groups = self.buf.acquire(k)
        # the source never runs dry, but a row is never out twice: fewer when rows are all out
        assert len(groups) == k or len(groups) >= min(k, free_rows)
        for g in groups:
            assert g.group_id not in self.flying and g.group_id not in self.trained
            assert g.n == self.n
            self._check_handed_out(g)
            self.flying[g.group_id] = g

    @rule(k=st.integers(0, 3))
    def acquire_long(self, k):
        long_before = len(self.buf.queued(Place.LONG))
        groups = self.buf.acquire_long(k)
        assert len(groups) <= min(k, long_before)
        for g in groups:
            self._check_handed_out(g)
            self.flying[g.group_id] = g

    @precondition(lambda self: self.flying)
    @rule(data=st.data(), tokens=st.integers(0, 3),
          reason=st.sampled_from([None, "stop", "length", "abort"]))
    def generate(self, data, tokens, reason):
        gid = data.draw(st.sampled_from(sorted(self.flying)))
        todo = self.flying[gid].to_generate()
        if not todo:
            return
        s = data.draw(st.sampled_from(todo))
        s.start_request()
        s.append([3] * tokens, [-0.1] * tokens, self.buf.version, finish_reason=reason)
        if s.status in (SampleStatus.DONE, SampleStatus.TRUNCATED):
            s.set_reward(float(tokens))
            s.finished_at = float(len(self.trained) + tokens)

    @precondition(lambda self: self.flying)
    @rule(data=st.data(), k=st.integers(1, 2))
    def extend(self, data, k):
        gid = data.draw(st.sampled_from(sorted(self.flying)))
        g = self.flying[gid]
        before = len(g.samples)
        self.buf.extend(g, k)
        assert len(g.samples) == before + k

    @precondition(lambda self: self.flying)
    @rule(data=st.data())
    def fail_one(self, data):
        gid = data.draw(st.sampled_from(sorted(self.flying)))
        self.flying[gid].samples[0].fail("reward raised ValueError")

    @precondition(lambda self: any(g.trainable for g in self.flying.values()))
    @rule(data=st.data())
    def complete(self, data):
        done = sorted(gid for gid, g in self.flying.items() if g.trainable)
        g = self.flying.pop(data.draw(st.sampled_from(done)))
        total = len(g.samples)
        surplus = self.buf.complete(g).surplus
        assert len(g.samples) == self.n and len(surplus) == total - self.n
        assert self.buf.place_of(g) in (Place.READY, Place.PARTIAL, None)

    @precondition(lambda self: self.flying)
    @rule(data=st.data())
    def requeue(self, data):
        g = self._take_flying(data)
        if g.failed:
            self.buf.drop(g, "failed")
            return
        self.buf.requeue(g)
        assert all(s.status is not SampleStatus.RUNNING for s in g.samples)
        assert len(g.samples) == self.n  # speculative extras shed

    @precondition(lambda self: self.flying)
    @rule(data=st.data(), restart=st.booleans())
    def defer(self, data, restart):
        g = self._take_flying(data)
        if g.failed:
            self.buf.drop(g, "failed")
            return
        unfinished, deferrals = not g.trainable, g.deferrals
        self.buf.defer(g, restart=restart)
        if unfinished:  # a group that finished meanwhile is completed instead
            assert self.buf.place_of(g) is Place.LONG and g.deferrals == deferrals + 1
            assert len(g.samples) == self.n
            if restart:
                assert g.tokens == 0 and g.birth_version == self.buf.version

    @precondition(lambda self: self.flying)
    @rule(data=st.data(), reason=st.sampled_from(["filtered", "failed"]))
    def drop(self, data, reason):
        g = self._take_flying(data)
        before = self.buf.stats()["dropped_by_reason"].get(reason, 0)
        self.buf.drop(g, reason)
        assert self.buf.stats()["dropped_by_reason"][reason] == before + 1

    @rule(k=st.integers(0, 3))
    def take(self, k):
        for g in self.buf.take_nowait(k):
            assert g.trainable and len(g.samples) == self.n
            assert g.group_id not in self.trained
            self._check_handed_out(g)
            self.trained.add(g.group_id)

    @rule()
    def bump_version(self):
        self.buf.set_version(self.buf.version + 1)

    @rule()
    def save_and_restore(self):
        """A JSON round trip of the state; in-flight groups come back as partial or ready."""
        state = json.loads(json.dumps(self.buf.state_dict()))
        before = self.buf.stats()
        restored = self._fresh()
        restored.load_state_dict(state)
        after = restored.stats()
        assert after["in_flight"] == 0
        expired_on_load = after["dropped"] - before["dropped"]  # the staleness rule, on load
        assert expired_on_load >= 0
        assert after["partial"] + after["ready"] + expired_on_load == (
            before["partial"] + before["ready"] + before["in_flight"]
        )
        for key in ("created", "trained", "long", "version"):
            assert after[key] == before[key]
        self.buf, self.flying = restored, {}

    @invariant()
    def accounting_balances(self):
        if not hasattr(self, "buf"):
            return
        st_ = self.buf.stats()
        assert st_["balanced"], st_
        if self.max_token_lag is None:
            assert st_["lag_restarts"] == 0
        assert st_["lag_restart_tokens"] <= st_["discarded_tokens"]
        assert st_["in_flight"] == len(self.flying)
        assert st_["trained"] >= len(self.trained)
        for g in self.flying.values():
            assert self.buf.place_of(g) is Place.IN_FLIGHT


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
