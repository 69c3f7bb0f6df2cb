"""Length rankers: known answers on traces, state through save/load (also inside the buffer's
state), the recall metric, and resolution through the one plugin rule."""

from __future__ import annotations

import math

import pytest

from rlkit.buffers import RolloutBuffer
from rlkit.buffers.buffer import BufferStateError
from rlkit.buffers.group import Group
from rlkit.plugins import PluginNotFound, load_ranker, resolve_plugin
from rlkit.rollout.config import RankerConfig
from rlkit.rollout.rankers import LengthRanker
from rlkit.rollout.rankers.basic import HistoryRanker, PromptLengthRanker
from rlkit.sim.oracle import OracleRanker
from rlkit.rollout.rankers.learned import LearnedRanker
from rlkit.rollout.rankers.recall import recall_at, recalls
from rlkit.sim.harness import trace_source
from rlkit.sim.trace import TraceSpec, generate_trace


def groups_of(trace, epoch: int, rows=None, n=None) -> list[Group]:
    """The trace's groups of one epoch, finished at their traced lengths."""
    n = n or trace.group_size
    prompts = {p.source_index: p for p in trace.prompt_records()}
    out = []
    for row in rows if rows is not None else range(trace.rows):
        p = prompts[row]
        prompt = type(p)(p.ids, p.text, p.label, p.metadata, source_index=row, epoch=epoch)
        g = Group.new(row, prompt, n, row * n, 0)
        for s in g.samples:
            k = trace.length(row, epoch, s.slot)
            s.append([7] * k, [-0.1] * k, 0, finish_reason="stop")
            s.set_reward(1.0)
        out.append(g)
    return out


def means(groups) -> list[float]:
    return [sum(len(s.response_ids) for s in g.samples) / len(g.samples) for g in groups]


def spearman(a, b) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for rank, i in enumerate(order):
            r[i] = rank
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


TRACE = generate_trace(TraceSpec(rows=200, epochs=3, cap=4096, group_size=8, batch_size=20))


def test_recall_known_answers():
    truth = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert recall_at(truth, truth, 0.2) == 1.0
    assert recall_at(truth, [-x for x in truth], 0.2) == 0.0
    assert recall_at(truth, [0, 0, 0, 0, 0, 0, 0, 0, 10, 0], 0.2) == 0.5  # one of the top two
    assert set(recalls(truth, truth)) == {"recall@20", "recall@10", "recall@5"}
    assert math.isnan(recall_at([], [], 0.2))


def test_history_after_one_epoch_ranks_the_prompts_in_their_true_order():
    ranker = HistoryRanker()
    for g in groups_of(TRACE, 0):
        ranker.observe(g)
    second = groups_of(TRACE, 1)
    predicted, actual = ranker.predict(second), means(second)
    # up to within-group noise: the truth of another epoch is as good as the ranker gets
    assert spearman(predicted, actual) > 0.9
    assert recall_at(actual, predicted, 0.2) >= 0.85
    # a prompt never seen falls back to the median of what was seen: mid-pack
    unseen = groups_of(TRACE, 1, rows=[0])[0]
    unseen.prompt = type(unseen.prompt)(unseen.prompt.ids, "", source_index=10_000)
    import statistics

    assert ranker.predict([unseen]) == [pytest.approx(statistics.median(means(groups_of(TRACE, 0))))]


def test_history_takes_a_parked_groups_progress_as_a_lower_bound():
    ranker = HistoryRanker()
    g = groups_of(TRACE, 0, rows=[5])[0]
    parked = Group.new(5, g.prompt, 2, 0, 0)
    for s in parked.samples:
        s.append([1] * 500, [-0.1] * 500, 0)
        s.interrupt()
    ranker.observe(parked)
    assert ranker.predict([parked]) == [500.0]  # nothing else known: at least this long
    ranker.observe(g)  # it finished: the estimate replaces the bound
    assert ranker.predict([parked]) == [means([g])[0]]


def test_oracle_predicts_the_trace_and_prompt_length_the_prompt():
    gs = groups_of(TRACE, 1, rows=range(10))
    assert OracleRanker(TRACE).predict(gs) == means(gs)
    assert PromptLengthRanker().predict(gs) == [float(len(g.prompt.ids)) for g in gs]


@pytest.mark.parametrize("factory", [HistoryRanker, lambda: LearnedRanker(refit_every=50)])
def test_state_survives_save_and_load(factory):
    a = factory()
    for g in groups_of(TRACE, 0):
        a.observe(g)
    b = factory()
    b.load_state_dict(a.state_dict())
    probe = groups_of(TRACE, 1, rows=range(40))
    assert b.predict(probe) == pytest.approx(a.predict(probe))
    assert isinstance(b, LengthRanker)


def test_learned_beats_prompt_length_on_prompts_it_has_never_seen():
    trace = generate_trace(TraceSpec(rows=600, epochs=1, cap=4096, group_size=4, batch_size=20,
                                     prompt_signal=0.5))
    seen, unseen = range(0, 400), range(400, 600)
    learned = LearnedRanker(refit_every=100)
    for g in groups_of(trace, 0, rows=seen):
        learned.observe(g)
    test = groups_of(trace, 0, rows=unseen)
    truth = means(test)
    got = recall_at(truth, learned.predict(test), 0.2)
    baseline = recall_at(truth, PromptLengthRanker().predict(test), 0.2)
    assert got > baseline and got > 0.5, (got, baseline)


def test_rankers_resolve_by_the_one_plugin_rule_and_save_with_the_buffer():
    assert resolve_plugin("ranker", "history") is HistoryRanker
    assert isinstance(load_ranker(RankerConfig(name="history", kwargs={"decay": 0.2})), HistoryRanker)
    assert load_ranker(RankerConfig(name=None)) is None
    with pytest.raises(PluginNotFound, match="ranker 'nope' not found"):
        load_ranker(RankerConfig(name="nope"))
    with pytest.raises(PluginNotFound, match="cannot be built with kwargs"):
        load_ranker(RankerConfig(name="history", kwargs={"bogus": 1}))
    ranker = HistoryRanker()
    for g in groups_of(TRACE, 0, rows=range(30)):
        ranker.observe(g)
    buf = RolloutBuffer(trace_source(TRACE), n_samples_per_prompt=8)
    buf.attach("ranker", ranker)
    state = buf.state_dict()
    fresh, again = HistoryRanker(), RolloutBuffer(trace_source(TRACE), n_samples_per_prompt=8)
    again.attach("ranker", fresh)
    again.load_state_dict(state)
    probe = groups_of(TRACE, 1, rows=range(30))
    assert fresh.predict(probe) == ranker.predict(probe)
    # attached after the load (a restored buffer handed to a new manager): restored then
    late, later = HistoryRanker(), RolloutBuffer(trace_source(TRACE), n_samples_per_prompt=8)
    later.load_state_dict(state)
    later.attach("ranker", late)
    assert late.predict(probe) == ranker.predict(probe)
    other = RolloutBuffer(trace_source(TRACE), n_samples_per_prompt=8)
    other.attach("ranker", PromptLengthRanker())
    with pytest.warns(UserWarning, match="starts fresh"):
        other.load_state_dict(state)
    broken = RolloutBuffer(trace_source(TRACE), n_samples_per_prompt=8)
    broken.load_state_dict({**state, "attached": {"ranker": {"type": "HistoryRanker", "state": {}}}})
    with pytest.raises(BufferStateError, match="the saved ranker is malformed"):
        broken.attach("ranker", HistoryRanker())
