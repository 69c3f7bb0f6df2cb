"""Tail batching (Flexes / RollPacker) over the real manager and buffer on simulated engines:
known scenarios, the final-step drain, the deferral bound, save/load, and properties over
random length traces."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.buffers import Place
from rlkit.buffers.buffer import STATE_FORMAT
from rlkit.rollout.policies import TailBatchingPolicy
from rlkit.rollout.rankers.basic import HistoryRanker
from tests.policies.helpers import in_order_buffer, make_trace, rows_of, simulate

LONG = 600


def scenario(row: int, epoch: int, slot: int) -> int:
    """Odd rows are long (every response LONG tokens); even rows are short, except their third
    response (slot 2), which is the speculative one a short round cuts."""
    if row % 2:
        return LONG + slot
    return 200 if slot == 2 else 10 + slot


def test_exactly_the_slow_prompts_are_deferred_and_the_long_round_trains_exactly_them():
    trace = make_trace(scenario, rows=32, epochs=1, slots=4, group_size=2)
    buf = in_order_buffer(trace)
    batches = {}
    policy = TailBatchingPolicy(eta_prompts=2.0, eta_responses=1.5)  # 8 prompts x 3 responses
    steps = simulate(trace, policy, steps=3, batch_size=4, buffer=buf,
                     on_batch=lambda i, groups: batches.setdefault(i, groups))
    short, long, short2 = steps
    # step 0: rows 0..7 launched; the 4 odd (long) rows miss the round and are deferred
    assert short.round == "short" and rows_of(batches[0]) == [(0, 0), (2, 0), (4, 0), (6, 0)]
    assert short.prompts_deferred == 4 and short.long_queue == 4
    assert short.max_response_length < 20  # the short round never waited for a long response
    # every short prompt's third response was speculative: cut once its first two finished
    assert all(len(g.samples) == 2 and {s.slot for s in g.samples} == {0, 1} for g in batches[0])
    assert short.speculative_tokens > 0 and short.tokens_discarded >= short.speculative_tokens
    # restart (the default): the deferred prompts' short-round tokens are forgotten, counted
    assert short.deferred_tokens_discarded > 0
    # step 1: the long queue holds batch_size prompts -> a long round trains exactly them, to
    # their natural lengths, with no speculation, on the long round's weights
    assert long.round == "long" and rows_of(batches[1]) == [(1, 0), (3, 0), (5, 0), (7, 0)]
    assert long.long_queue == 0 and long.prompts_deferred == 0 and long.speculative_tokens == 0
    for g in batches[1]:
        assert sorted(len(s.response_ids) for s in g.samples) == [LONG, LONG + 1]
        assert all(set(s.versions) == {1} for s in g.samples)
    # step 2: short again, on fresh prompts
    assert short2.round == "short" and rows_of(batches[2])[0] == (8, 0)
    assert buf.stats()["balanced"]


def test_an_on_policy_round_completes_exactly_its_target_and_restarts_the_surplus():
    # six identical short prompts finish in the same instant, but the batch is four
    trace = make_trace(lambda r, e, k: 12, rows=32, epochs=1, slots=4, group_size=2)
    buf = in_order_buffer(trace)
    batches = {}
    policy = TailBatchingPolicy(eta_prompts=1.5, eta_responses=1.0)
    first, second = simulate(trace, policy, steps=2, batch_size=4, buffer=buf,
                             on_batch=lambda i, groups: batches.setdefault(i, groups))
    assert first.groups_completed == 4 and first.prompts_deferred == 0
    assert first.tokens_discarded == 2 * 2 * 12  # the two surplus groups, restarted
    # they go back to the partial queue (short prompts, not the long queue), generated anew
    assert rows_of(batches[1])[:2] == [(4, 0), (5, 0)] and second.long_queue == 0
    for step, groups in batches.items():
        assert all(set(s.versions) == {step} for g in groups for s in g.samples)


def test_resume_keeps_the_short_round_tokens_of_deferred_prompts():
    trace = make_trace(scenario, rows=32, epochs=1, slots=4, group_size=2)
    buf = in_order_buffer(trace)
    batches = {}
    policy = TailBatchingPolicy(eta_prompts=2.0, eta_responses=1.5, deferred="resume")
    short, long = simulate(trace, policy, steps=2, batch_size=4, buffer=buf,
                           on_batch=lambda i, groups: batches.setdefault(i, groups))
    assert short.deferred_tokens_discarded == 0
    for g in batches[1]:  # continued from version 0 tokens under version 1
        assert all(s.versions[0] == 0 and s.versions[-1] == 1 for s in g.samples)
        assert sorted(len(s.response_ids) for s in g.samples) == [LONG, LONG + 1]
    assert long.tokens_generated < short.tokens_generated + 4 * 2 * LONG


def test_the_final_step_drains_the_long_queue_oldest_first():
    trace = make_trace(scenario, rows=32, epochs=1, slots=4, group_size=2)
    buf = in_order_buffer(trace)
    batches = {}
    # (the fixed over-launch: adaptive sizing would run this 50%-long trace as sync rounds)
    policy = TailBatchingPolicy(eta_prompts=2.0, eta_responses=1.0, long_round_size=100,
                                adaptive=False)
    steps = simulate(trace, policy, steps=3, batch_size=4, buffer=buf,
                     on_batch=lambda i, groups: batches.setdefault(i, groups))
    # the trigger (100) is never reached, but the run's last step is a long round
    assert [s.round for s in steps] == ["short", "short", "long"]
    assert [s.long_queue for s in steps] == [4, 8, 4]
    assert rows_of(batches[2]) == [(1, 0), (3, 0), (5, 0), (7, 0)]
    # what one step cannot train stays queued (and in the checkpoint), never lost
    assert rows_of(buf.queued(Place.LONG)) == [(9, 0), (11, 0), (13, 0), (15, 0)]
    assert buf.stats()["balanced"]


def test_when_the_data_runs_dry_a_short_round_trains_the_long_queue():
    trace = make_trace(scenario, rows=32, epochs=1, slots=4, group_size=2)
    buf = in_order_buffer(trace)
    policy = TailBatchingPolicy(eta_prompts=2.0, eta_responses=1.0, long_round_size=100)
    simulate(trace, policy, steps=1, batch_size=4, buffer=buf)
    deferred = rows_of(buf.queued(Place.LONG))
    assert len(deferred) == 4
    buf.take_nowait(4)
    buf.source = None  # no fresh prompt left
    batches = {}
    simulate(trace, policy, steps=1, batch_size=4, buffer=buf, first_step=1,
             on_batch=lambda i, groups: batches.setdefault(i, groups))
    assert rows_of(batches[1]) == deferred


def test_a_prompt_deferred_max_deferrals_times_is_waited_for_not_deferred_again():
    trace = make_trace(scenario, rows=32, epochs=1, slots=4, group_size=2)
    buf = in_order_buffer(trace)
    # a long prompt already deferred twice waits in the partial queue (an interrupted round)
    [g] = buf.acquire(1)
    g = buf.acquire(1)[0] if g.prompt.source_index % 2 == 0 else g
    assert g.prompt.source_index % 2 == 1
    g.deferrals = 2
    buf.requeue(g)
    for other in buf.queued(Place.IN_FLIGHT):
        buf.requeue(other)
    batches = {}
    policy = TailBatchingPolicy(eta_prompts=2.0, eta_responses=1.0, long_round_size=100,
                                max_deferrals=2)
    [step] = simulate(trace, policy, steps=1, batch_size=4, buffer=buf,
                      on_batch=lambda i, groups: batches.setdefault(i, groups))
    assert step.round == "short"
    assert g.prompt.source_index in {r for r, _ in rows_of(buf.queued(Place.READY) + batches[0])}
    assert all(x.deferrals <= 2 for x in buf.queued(Place.LONG))
    assert step.max_response_length >= LONG  # the round waited for it


@pytest.mark.parametrize("adaptive,proactive", [(False, False), (True, False), (True, True)],
                         ids=["fixed", "adaptive", "adaptive+proactive+history"])
def test_save_and_load_mid_cycle_continues_exactly_as_the_uninterrupted_run(adaptive, proactive):
    trace = make_trace(lambda r, e, k: 700 if (r * 7 + e) % 5 == 0 else 20 + 3 * k + r % 4,
                       rows=24, epochs=4, slots=4, group_size=2)
    # Adaptive sizing reads the manager's recent lengths and, ranker-fed, its moving long
    # share: a checkpoint holds both (saved with the buffer), so the resumed run launches
    # exactly the rounds of the run that went on.

    def run(buf, steps, first=0, final=True):
        out, launches = [], []
        policy = TailBatchingPolicy(eta_prompts=1.5, eta_responses=1.5, adaptive=adaptive,
                                    proactive=proactive)
        sizes = policy.short_launch
        policy.short_launch = lambda step: launches.append(sizes(step)) or launches[-1]
        simulate(trace, policy, steps=steps, batch_size=4, buffer=buf, first_step=first,
                 ranker=HistoryRanker() if proactive else None, final_step=final,
                 on_batch=lambda i, groups: out.append((i, rows_of(groups))))
        return out, launches, policy

    def resumed(state):
        second = in_order_buffer(trace)
        second.load_state_dict(state)  # before the manager attaches its windows: they wait
        return run(second, 4, first=6)

    whole, whole_launches, _ = run(in_order_buffer(trace), 10)
    first = in_order_buffer(trace)
    head, head_launches, before = run(first, 6, final=False)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint holds it
    assert state["format"] == STATE_FORMAT and state["long"], "the cut must hold deferred prompts"
    tail, tail_launches, after = resumed(state)
    assert head + tail == whole
    assert head_launches + tail_launches == whole_launches
    if adaptive:
        assert set(whole_launches) - {math.ceil(1.5 * 4)}, whole_launches  # the estimate sized
        # ... and from the saved lengths: without them the resumed run launches otherwise
        forgetful = {**state, "attached": {}}
        assert head_launches + resumed(forgetful)[1] != whole_launches
    if proactive:
        assert before.estimator.predicted > 0
        assert after.estimator.predicted is not None


@settings(max_examples=25)
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(2, 4),
    n=st.integers(1, 3),
    eta_p=st.sampled_from([1.25, 1.5, 2.0]),
    eta_r=st.sampled_from([1.0, 1.5]),
    long_round_size=st.integers(0, 6),
    deferred=st.sampled_from(["restart", "resume"]),
    rows=st.integers(5, 12),
    adaptive=st.booleans(),
)
def test_properties_over_random_length_traces(seed, batch, n, eta_p, eta_r, long_round_size,
                                               deferred, rows, adaptive):
    import random

    steps = 8
    epochs = 2 + (steps * 2 * batch) // rows
    rng = random.Random(seed)
    table = {(r, e, k): rng.choice([rng.randint(1, 40), rng.randint(200, 900)])
             for r in range(rows) for e in range(epochs) for k in range(6)}
    trace = make_trace(lambda r, e, k: table[(r, e, k)], rows=rows, epochs=epochs, slots=6,
                       group_size=n)

    def once():
        policy = TailBatchingPolicy(eta_p, eta_r, long_round_size, deferred, max_deferrals=2,
                                    adaptive=adaptive, max_eta_prompts=2.5)
        buf = in_order_buffer(trace)
        drawn = []
        next_prompt = buf.source.next_prompt

        def record():
            p = next_prompt()
            drawn.append((p.source_index, p.epoch))
            return p

        buf.source.next_prompt = record
        trained = []

        def check(step, groups):
            assert len(groups) == batch
            trained.extend(rows_of(groups))
            if deferred == "restart":  # on-policy: every trained token is this step's
                assert all(set(s.versions) == {step} for g in groups for s in g.samples)
            stats = buf.stats()
            assert stats["balanced"], stats
            long_rows = [g.prompt.source_index for g in buf.queued(Place.LONG)]
            assert len(long_rows) == len(set(long_rows)), "a prompt is in the long queue twice"
            live = long_rows + [g.prompt.source_index for g in buf.queued(Place.PARTIAL)]
            assert len(live) == len(set(live)), "a row is out twice at once"
            assert all(g.deferrals <= 2 for g in buf.queued(Place.LONG))

        results = simulate(trace, policy, steps=steps, batch_size=batch, buffer=buf,
                           on_batch=check)
        queued = [(g.prompt.source_index, g.prompt.epoch)
                  for p in (Place.PARTIAL, Place.LONG, Place.READY) for g in buf.queued(p)]
        held = [(p.source_index, p.epoch) for p in buf._held]
        # every prompt drawn is trained exactly once, or still queued or held (nothing dropped)
        assert sorted(drawn) == sorted(trained + queued + held)
        assert len(set(trained)) == len(trained)
        assert buf.stats()["dropped"] == 0
        assert {r.round for r in results} <= {"short", "long", "sync", ""}  # "": batch was ready
        return [r.round for r in results], trained

    assert once() == once()  # the same seed gives the same rounds and batches


# -- adaptive over-launch (issue 22: tail batching must never be a regression) ---------------
def test_cover_launch_sizes_the_short_round_from_the_long_share():
    from rlkit.rollout.policies.tail_batching import cover_launch

    # no long prompts: the configured floor; a margin grows with the share
    assert cover_launch(32, 0.0, eta_min=1.25) == 40
    assert cover_launch(32, 0.1, eta_min=1.0, sigmas=0.0) == 36  # ceil(32 / 0.9)
    assert cover_launch(32, 0.5, eta_min=1.0, sigmas=0.0) == 64
    assert cover_launch(32, 0.5, eta_min=1.25, sigmas=1.0) == 73  # 36.5 - 3.0 >= 32
    # bounded by eta_max while the expected short ones still cover the batch ...
    assert cover_launch(32, 0.6, eta_max=3.0, sigmas=2.0) == 96
    # ... and None (a sync round) once they cannot: share above 1 - 1/eta_max
    assert cover_launch(32, 0.66, eta_max=3.0) == 96
    assert cover_launch(32, 0.67, eta_max=3.0) is None
    assert cover_launch(32, 1.0) is None
    # eta_min = eta_max with a fractional product: the launch is the bound, judged as launched
    assert cover_launch(3, 0.375, eta_min=1.75, eta_max=1.75) == 6


@settings(max_examples=200)
@given(target=st.integers(1, 512), share=st.floats(0.0, 1.0), eta_min=st.floats(1.0, 2.0),
       extra=st.floats(0.0, 4.0), sigmas=st.floats(0.0, 3.0))
def test_cover_launch_properties(target, share, eta_min, extra, sigmas):
    from rlkit.rollout.policies.tail_batching import cover_launch

    eta_max = eta_min + extra
    launch = cover_launch(target, share, eta_min=eta_min, eta_max=eta_max, sigmas=sigmas)
    least = math.ceil(eta_min * target - 1e-9)
    most = max(int(eta_max * target + 1e-9), least)
    if launch is None:  # fallback exactly when the max launch's expected short ones fall short
        assert most * (1 - share) < target
        return
    assert most * (1 - share) >= target
    assert target <= least <= launch <= most
    # the margin holds unless the bound cut it: one prompt fewer would not cover
    cover = launch * (1 - share) - sigmas * (launch * share * (1 - share)) ** 0.5
    assert cover >= target - 1e-6 or launch == most
    # more long prompts never launch fewer
    more = cover_launch(target, min(1.0, share + 0.05), eta_min=eta_min, eta_max=eta_max,
                        sigmas=sigmas)
    assert more is None or more >= launch


class _Window:
    def __init__(self, xs):
        self.xs = list(xs)

    def __len__(self):
        return len(self.xs)

    def quantile(self, q):
        return sorted(self.xs)[min(len(self.xs) - 1, int(q * len(self.xs)))] if self.xs else None

    def count_at_least(self, bar):
        return sum(x >= bar for x in self.xs)


class _Step:
    def __init__(self, groups, responses, queued=0, target=4):
        from types import SimpleNamespace

        self.group_lengths, self.response_lengths, self.target = groups, responses, target
        self.buffer = SimpleNamespace(count=lambda place: queued if place == Place.LONG else 0)


def test_the_long_share_counts_long_groups_and_the_long_queue():
    from types import SimpleNamespace

    from rlkit.rollout.policies.tail_batching import LongShare

    est = LongShare(fraction=0.5)
    responses = _Window([10, 20, 1000])  # the longest recent response: 1000 -> the bar is 500
    assert est.estimate(_Step(_Window([10, 900, 20]), responses)) is None  # < a batch's worth
    step = _Step(_Window([10, 900, 20, 15, 600, 30, 499, 12]), responses)
    assert est.estimate(step) == 2 / 8
    # deferred prompts are long until they finish (right after a short round: exactly them)
    assert est.estimate(_Step(step.group_lengths, responses, queued=2)) == 4 / 10
    # a ranker's predictions of fresh prompts raise it (never lower it)
    fresh = [SimpleNamespace(predicted_length=x, deferrals=0, has_tokens=False)
             for x in (800, 900, 10, 20)]
    old = SimpleNamespace(predicted_length=900, deferrals=1, has_tokens=False)  # not fresh
    est.observe_predictions(step, fresh + [old])
    assert est.predicted == 0.5 and est.estimate(step) == 0.5
    est.observe_predictions(step, fresh[2:])
    assert est.predicted == est.estimate(step) == 0.5 * 0.7  # the larger of the two


def test_on_a_half_long_bimodal_trace_adaptive_tail_batching_is_not_slower_than_sync():
    """The issue's regression, simulated (virtual time, deterministic): with half the prompts
    long, the fixed eta 1.25 is slower than sync (every short round still waits for long
    prompts, and long rounds come on top); the adaptive over-launch is faster than sync."""
    from rlkit.bench.suite import make_policy
    from rlkit.rollout.engines.profile import load_profile
    from rlkit.sim.engine import SimConfig
    from rlkit.sim.simulate import run_simulation
    from rlkit.sim.trace import bimodal_spec, generate_trace

    trace = generate_trace(bimodal_spec(0.5, rows=512, epochs=2, cap=2048, group_size=4,
                                        batch_size=8))
    cluster = SimConfig(2, load_profile("h100-qwen3-4b-tp1"))

    def rollout_s(spec):
        steps = run_simulation(cluster, trace, make_policy(spec), steps=24, batch_size=8,
                               final_step=False)[4:]  # after a warm-up
        return sum(s.rollout_s for s in steps), {s.round for s in steps}

    sync, _ = rollout_s("sync")
    fixed, _ = rollout_s("tail_batching+fixed")
    adaptive, rounds = rollout_s("tail_batching")
    assert fixed > sync  # the regression the adaptive launch removes
    assert adaptive < 0.9 * sync and rounds == {"short", "long"}
