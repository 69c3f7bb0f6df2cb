"""Rankers on multi-turn episodes: `history` and `learned` predict each group's model turns
(besides its tokens) from the episodes they observe, and keep what they learned in their state;
states saved before rankers learned turns still load."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlkit.buffers.group import Group
from rlkit.rollout.episodes import STATE_KEY
from rlkit.rollout.rankers import TurnRanker, mean_turns
from rlkit.rollout.rankers.basic import HistoryRanker
from rlkit.rollout.rankers.learned import LearnedRanker
from rlkit.sim.episodes import EpisodeTraceSpec, generate_episode_trace


def played(trace, epoch: int) -> list[Group]:
    """The trace's groups of one epoch, each episode finished as traced (its turns counted in
    its state as the episode layer counts them)."""
    out = []
    for p in trace.prompt_records():
        row = p.source_index
        prompt = type(p)(p.ids, p.text, p.label, p.metadata, source_index=row, epoch=epoch)
        g = Group.new(row, prompt, trace.group_size, row * trace.group_size, 0)
        for s in g.samples:
            k = trace.length(row, epoch, s.slot)
            s.append([7] * k, [-0.1] * k, 0, finish_reason="stop")
            s.metadata[STATE_KEY] = {"turns": len(trace.episode(row, epoch, s.slot))}
            s.set_reward(1.0)
        out.append(g)
    return out


@pytest.mark.parametrize("make,correlation", [
    (HistoryRanker, 0.6),  # per prompt, from its earlier episodes
    (lambda: LearnedRanker(min_samples=16, refit_every=64), 0.4),  # from prompt tokens only
], ids=["history", "learned"])
def test_a_ranker_learns_episode_turns_and_keeps_them_in_its_state(make, correlation):
    trace = generate_episode_trace(EpisodeTraceSpec(rows=64, epochs=2, group_size=4, prompt_signal=1.0))
    ranker = make()
    assert isinstance(ranker, TurnRanker)
    assert ranker.predict_turns(played(trace, 0)[:3]) == [1.0] * 3  # nothing learned yet
    for g in played(trace, 0):
        ranker.observe(g)
    second = played(trace, 1)
    predicted = ranker.predict_turns(second)
    truth = [mean_turns(g) for g in second]
    assert min(predicted) >= 1.0 and np.corrcoef(truth, predicted)[0, 1] > correlation
    again = make()
    again.load_state_dict(json.loads(json.dumps(ranker.state_dict())))
    assert again.predict_turns(second) == pytest.approx(predicted)
    old = json.loads(json.dumps(ranker.state_dict()))
    for key in ("turns", "recent_turns"):  # saved before rankers learned turns
        old.pop(key, None)
    make().load_state_dict(old)
