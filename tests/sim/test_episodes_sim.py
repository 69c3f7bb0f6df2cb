"""Multi-turn traces in the simulator (rlkit.sim.episodes): the generator's shape, the file
format, the prefix cache, and replays through the real manager, policies and episode layer in
virtual time. Every trained episode is exactly its traced episode (tokens, the loss mask at the
observations' positions, its model turns), whatever policy parked it where; accounting
balances; rankers learn turns and their recall is reported."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.buffers.sample import Sample
from rlkit.rollout.episodes import episode_turns
from rlkit.rollout.policies import PartialPolicy, SyncPolicy, TailBatchingPolicy
from rlkit.rollout.rankers.basic import HistoryRanker
from rlkit.sim.clock import run_virtual
from rlkit.sim.engine import SimConfig, SimEngines
from rlkit.sim.episodes import EpisodeTraceSpec, episode_stats, generate_episode_trace
from rlkit.sim.trace import Trace, TraceError, TraceRecord
from tests.policies.helpers import PROFILE, in_order_buffer, simulate
from tests.sim.helpers import SAMPLING, small_profile


def traced(trace: Trace, g, s: Sample) -> tuple:
    return trace.episode(g.prompt.source_index, g.prompt.epoch, s.slot)


def expected_mask(turns, cap: int) -> list[int]:
    """1 over model tokens, 0 over observations, cut at the episode's budget."""
    mask: list[int] = []
    for model, _, observation in turns:
        mask += [1] * model + [0] * observation
    return mask[:cap]


def check_trained(trace: Trace, batches: dict) -> int:
    """Every trained episode is its traced one; returns how many were checked."""
    n, seen = 0, set()
    for groups in batches.values():
        for g in groups:
            key = (g.prompt.source_index, g.prompt.epoch)
            assert key not in seen  # trained once
            seen.add(key)
            for s in g.samples:
                turns = traced(trace, g, s)
                assert s.loss_mask == expected_mask(turns, trace.cap), (g.prompt.source_index, s.slot)
                assert len(s.response_ids) == trace.length(g.prompt.source_index, g.prompt.epoch, s.slot)
                if sum(m + o for m, _, o in turns) < trace.cap:  # played to its answer (at the cap: truncated)
                    assert episode_turns(s) == len(turns) and s.finish_reason == "stop"
                n += 1
    return n


def test_the_generator_makes_agentic_episodes():
    trace = generate_episode_trace(EpisodeTraceSpec(rows=256, epochs=1))
    e = episode_stats(trace)
    assert trace.multi_turn and 1 <= e["turns_mean"] and e["turns_max"] == 10
    assert 2.0 < e["turns_mean"] < 6.0  # 60% of prompts take 2-10 turns, the rest 1 or 2
    assert e["tool_call_s_p99"] > 5 * e["tool_call_s_median"]  # the heavy tail
    for rec in trace.records.values():
        for ep, n in zip(rec.turns, rec.lengths):
            assert ep[-1][1:] == (0.0, 0) and 1 <= len(ep) <= 10  # the answer ends it
            assert n == min(trace.cap, sum(m + o for m, _, o in ep))
    assert generate_episode_trace(EpisodeTraceSpec(rows=256, epochs=1)).records == trace.records


def test_a_multi_turn_trace_survives_its_file_and_bad_turns_are_refused(tmp_path):
    trace = generate_episode_trace(EpisodeTraceSpec(rows=8, epochs=2, group_size=2))
    again = Trace.load(trace.save(tmp_path / "t.jsonl"))
    assert again.multi_turn and again.records == trace.records
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    rec = json.loads(lines[1])
    rec["turns"][0][0][0] += 1  # its turns no longer sum to its length
    with pytest.raises(TraceError, match="summing"):
        Trace.from_lines([lines[0], json.dumps(rec), *lines[2:]])
    del rec["turns"]  # one record single-turn, the others multi-turn
    with pytest.raises(TraceError, match="some records have turns"):
        Trace.from_lines([lines[0], json.dumps(rec), *lines[2:]])
    with pytest.raises(TraceError, match="single-turn"):
        Trace("t", 64, 1, 1, 1, 0, 1, 64, {(0, 0): TraceRecord(0, 0, 8, 0.5, 0, (3,))}).episode(0, 0, 0)


def test_the_prefix_cache_prefills_only_what_the_last_request_did_not_leave():
    """A sample's second request (its next turn) goes to the same worker and prefills only the
    new tokens; after a weight update it prefills everything; without the cache, everything."""

    async def turns(prefix_cache: bool, versions: tuple[int, int]) -> tuple[int, set]:
        engines = SimEngines(SimConfig(2, small_profile(), prefix_cache=prefix_cache))
        s = Sample(index=0, group_id=0, prompt_ids=tuple(range(100)))
        served = {await engines.generate(s, SAMPLING, max_new_tokens=50, version=versions[0])}
        s.relabel_finish("stop")  # the turn's stop (as the replay labels it)
        s.reopen()
        s.append([7] * 30, [0.0] * 30, versions[0], trainable=False)  # an observation
        served.add(await engines.generate(s, SAMPLING, max_new_tokens=20, version=versions[1]))
        await engines.aclose()
        return sum(w.prefill_tokens for w in engines.stats().values()), served

    assert run_virtual(turns(True, (0, 0))) == (100 + 30, {"sim-0"})  # cached: 150 of 180
    assert run_virtual(turns(True, (0, 1)))[0] == 100 + 180  # the update flushed it
    assert run_virtual(turns(False, (0, 0))) == (100 + 180, {"sim-0", "sim-1"})  # round robin


def small_trace(seed: int = 0, cap: int = 4096) -> Trace:
    return generate_episode_trace(EpisodeTraceSpec(
        rows=24, epochs=12, group_size=2, slots=4, cap=cap, seed=seed, batch_size=4,
        turn_median_tokens=40, observation_median_tokens=12, max_turns=6,
        tool_median_s=0.5, prompt_median=16, prompt_max=64, vocab_size=64))


@pytest.mark.parametrize("policy", [SyncPolicy(), PartialPolicy(over_provision=2.0),
                                    TailBatchingPolicy(eta_prompts=1.5, eta_responses=1.5)],
                         ids=["sync", "partial", "tail_batching"])
def test_every_trained_episode_is_its_traced_episode_under_every_policy(policy):
    trace = small_trace(cap=300)  # some episodes end at the budget, some inside an observation
    batches: dict = {}
    steps = simulate(trace, policy, steps=8, batch_size=4, buffer=in_order_buffer(trace),
                     on_batch=lambda i, groups: batches.setdefault(i, groups))
    assert check_trained(trace, batches) == 8 * 4 * 2
    if policy.name != "sync":  # episodes were parked mid-turn or on a tool and resumed
        assert sum(s.groups_carried_over + s.prompts_deferred for s in steps) > 0


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), cap=st.sampled_from([200, 600, 4096]),
       policy=st.sampled_from(["partial", "tail_resume", "tail_restart"]))
def test_random_episodes_parked_anywhere_train_exactly_as_traced_and_balance(seed, cap, policy):
    """Random traces, so the steps' aborts fall at random tokens and tool calls."""
    from rlkit.sim.simulate import run_simulation

    trace = small_trace(seed, cap)
    make = {"partial": lambda: PartialPolicy(over_provision=2.0),
            "tail_resume": lambda: TailBatchingPolicy(eta_prompts=1.5, eta_responses=1.5, deferred="resume"),
            "tail_restart": lambda: TailBatchingPolicy(eta_prompts=1.5, eta_responses=1.5)}[policy]
    batches: dict = {}
    buf = in_order_buffer(trace)
    run_simulation(SimConfig(2, PROFILE, prefix_cache=True), trace, make(), steps=6, batch_size=4,
                   buffer=buf, on_batch=lambda i, groups: batches.setdefault(i, groups))
    assert check_trained(trace, batches) == 6 * 4 * 2
    assert buf.stats()["balanced"]


def test_history_learns_episode_turns_and_their_recall_is_reported():
    trace = small_trace()
    from rlkit.sim.simulate import run_simulation

    ranker = HistoryRanker()
    steps = run_simulation(SimConfig(2, PROFILE), trace, SyncPolicy(), steps=14, batch_size=4,
                           buffer=in_order_buffer(trace), ranker=ranker)
    assert all(0.0 <= s.ranker_turns_recall["recall@20"] <= 1.0 for s in steps)  # reported
    # What it learned per prompt follows each prompt's true turns (over its traced episodes).
    rows = sorted(ranker._turns)
    truth = [np.mean([len(ep) for e in range(trace.epochs) for ep in trace.records[(r, e)].turns[:2]])
             for r in rows]
    assert len(rows) == trace.rows and np.corrcoef(truth, [ranker._turns[r] for r in rows])[0, 1] > 0.8
    state = json.loads(json.dumps(ranker.state_dict()))
    again = HistoryRanker()
    again.load_state_dict(state)
    assert again._turns == ranker._turns and max(ranker._turns.values()) > 1.0
    del state["turns"], state["recent_turns"]  # saved before rankers learned turns
    HistoryRanker().load_state_dict(state)
